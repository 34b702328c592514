"""The tests' own engines: plain SQLAlchemy engines on a direct connection, and through a
transaction pooler (``services.THROUGH_POOLER``) configured exactly as the PgBouncer guide
tells users to (its code, docs/snippets/pgbouncer.py, builds them)."""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, create_engine, event

from . import services
from .snippets import load_snippet

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["async_engine", "pgbouncer_snippet", "sync_engine"]


@cache
def pgbouncer_snippet() -> Any:
    return load_snippet("pgbouncer")


def sync_engine(url: str, **options: Any) -> Engine:
    if not (services.THROUGH_POOLER and url.startswith("postgresql")):
        return create_engine(url, **options)
    extra = options.pop("connect_args", {})
    return _connecting_with(pgbouncer_snippet().psycopg_engine(url, **options), extra)


def async_engine(url: str, **options: Any) -> AsyncEngine:
    if not services.THROUGH_POOLER:
        from sqlalchemy.ext.asyncio import create_async_engine

        return create_async_engine(url, **options)
    extra = options.pop("connect_args", {})
    engine = pgbouncer_snippet().asyncpg_engine(url, **options)
    _connecting_with(engine.sync_engine, extra)
    return engine


def _connecting_with(engine: Engine, extra: dict[str, Any]) -> Engine:
    """The snippet's engine, with a test's own connect arguments (an application name)
    added to the snippet's."""
    if extra:

        @event.listens_for(engine, "do_connect")
        def _add(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
            cparams.update(extra)

    return engine
