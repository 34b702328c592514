"""The tests' own engines: plain SQLAlchemy engines on a direct connection, and through a
transaction pooler (``services.THROUGH_POOLER``) configured exactly as the PgBouncer guide
tells users to (its code, docs/snippets/pgbouncer.py, builds them)."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from . import services

__all__ = ["async_engine", "pgbouncer_snippet", "sync_engine"]

SNIPPET = Path(__file__).resolve().parents[2] / "docs" / "snippets" / "pgbouncer.py"


@cache
def pgbouncer_snippet() -> Any:
    spec = importlib.util.spec_from_file_location("snippet_pgbouncer", SNIPPET)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sync_engine(url: str, **options: Any) -> Engine:
    if services.THROUGH_POOLER and url.startswith("postgresql"):
        return pgbouncer_snippet().psycopg_engine(url, **_without_connect_args(options))
    return create_engine(url, **options)


def async_engine(url: str, **options: Any) -> AsyncEngine:
    if services.THROUGH_POOLER:
        return pgbouncer_snippet().asyncpg_engine(url, **_without_connect_args(options))
    return create_async_engine(url, **options)


def _without_connect_args(options: dict[str, Any]) -> dict[str, Any]:
    # The snippet owns connect_args; a test that sets its own (a server setting) adds it.
    extra = options.pop("connect_args", None)
    if extra:
        raise AssertionError(f"through the pooler, set {extra} another way")
    return options
