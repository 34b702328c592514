"""Engines for the connections the library opens itself: the command line, ``inbox-middleware
outbox run``, the metrics collector given a URL. They work behind a transaction pooler.

PgBouncer in transaction mode (``pool_mode = transaction``) lends each transaction whichever
server connection is free. A prepared statement lives in one server session, so a driver
that prepares a statement and then runs it by name breaks as soon as two transactions land
on different server connections::

    client (psycopg)                 PgBouncer          server session A    server session B
    5th execution: PREPARE _pg3_0  ───────────────────> _pg3_0 created
    next transaction: EXECUTE _pg3_0  ─────────────────────────────────────> does not exist
    another client: PREPARE _pg3_0  ───────────────────> already exists

So the library's own engines never run a statement by a name a server session must
remember, pooler or not (on a direct connection this costs one parse per statement, for
statements that run a few times a second at most):

- psycopg: ``prepare_threshold=None``: never prepare.
- asyncpg, as SQLAlchemy's asyncpg dialect documents for PgBouncer: asyncpg's statement
  cache off (``statement_cache_size=0``), the dialect's own cache off
  (``prepared_statement_cache_size=0``), and a unique name for each statement the dialect
  still prepares (``prepared_statement_name_func``), so that no two clients collide in one
  server session.

Users' own engines need the same settings; docs/how-to/pgbouncer.md shows them.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from sqlalchemy import URL, Engine, create_engine, make_url

from ..exceptions import ConfigurationError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["async_engine", "pooler_connect_args", "sync_engine"]

_SYNC_DRIVERS = {"postgresql": "postgresql+psycopg", "sqlite": "sqlite"}


def pooler_connect_args(driver: str) -> dict[str, Any]:
    """The ``connect_args`` that keep ``driver``'s statements unnamed (empty for drivers
    that never name them, such as SQLite's)."""
    if driver == "psycopg":
        return {"prepare_threshold": None}
    if driver == "asyncpg":
        return {
            "statement_cache_size": 0,
            "prepared_statement_cache_size": 0,
            "prepared_statement_name_func": _statement_name,
        }
    return {}


def sync_engine(database_url: str | URL, **options: Any) -> Engine:
    """A synchronous engine for ``database_url``, whatever driver the URL names: a
    PostgreSQL URL is used through psycopg (an asyncpg URL too), with one connection
    unless ``options`` say otherwise."""
    url = make_url(database_url)
    backend = url.get_backend_name()
    driver = _SYNC_DRIVERS.get(backend)
    if driver is None:
        raise ConfigurationError(f"inbox-middleware supports PostgreSQL and SQLite, not {backend}")
    if backend == "sqlite":
        return create_engine(url, **options)
    if url.get_driver_name() != "psycopg":
        url = url.set(drivername=driver)
    options.setdefault("pool_size", 1)
    return create_engine(url, connect_args=_merged(url, options), **options)


def async_engine(database_url: str | URL, **options: Any) -> AsyncEngine:
    """An `AsyncEngine` for ``database_url`` (PostgreSQL through asyncpg or psycopg)."""
    from sqlalchemy.ext.asyncio import create_async_engine

    url = make_url(database_url)
    if url.get_backend_name() != "postgresql":
        raise ConfigurationError(
            f"an asynchronous engine needs PostgreSQL, not {url.get_backend_name()}"
        )
    return create_async_engine(url, connect_args=_merged(url, options), **options)


def _merged(url: URL, options: dict[str, Any]) -> dict[str, Any]:
    """The pooler-safe arguments, under whatever the caller passed itself."""
    own: dict[str, Any] = options.pop("connect_args", {})
    return pooler_connect_args(url.get_driver_name()) | own


def _statement_name() -> str:
    return f"__asyncpg_{uuid.uuid4()}__"
