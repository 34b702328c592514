"""Engines for the connections the library opens itself (the command line, the metrics
server given a URL), with whichever PostgreSQL driver the installation has.

A URL naming no driver, or a driver that is not installed, is served by the first of
psycopg, psycopg2 and asyncpg that is: ``inbox-middleware[faststream-rabbit]`` brings
asyncpg only, ``inbox-middleware[dramatiq]`` psycopg. asyncpg has no synchronous API, so
an engine over it (SQLAlchemy's async engine, seen through its ``sync_engine``) must be
used under `run_sync`, which gives it the greenlet and event loop it needs.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import URL, Engine, create_engine, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.pool import NullPool

from ..exceptions import ConfigurationError

__all__ = ["parse_url", "postgresql_driver", "run_sync", "sync_engine", "uses_asyncio"]

T = TypeVar("T")

# In order of preference; the value is the module the driver needs.
_DRIVERS = {"psycopg": "psycopg", "psycopg2": "psycopg2", "asyncpg": "asyncpg"}
_BACKENDS = {"postgresql": "postgresql", "postgres": "postgresql", "sqlite": "sqlite"}
_HINT = "a URL like postgresql://user:password@host:5432/dbname"


def parse_url(value: str | URL) -> URL:
    """``value`` parsed, ``postgres://`` read as ``postgresql://``; refused with one line
    naming the fix when it is not a PostgreSQL or SQLite URL."""
    try:
        url = make_url(value)
    except ArgumentError:
        raise ConfigurationError(f"{str(value)!r} is not a database URL; give {_HINT}") from None
    backend, _, driver = url.drivername.partition("+")
    if backend not in _BACKENDS:
        raise ConfigurationError(
            f"inbox-middleware supports PostgreSQL and SQLite, not {backend!r}; give {_HINT}"
        )
    name = _BACKENDS[backend] + (f"+{driver}" if driver else "")
    return url.set(drivername=name)


def postgresql_driver(url: URL) -> str:
    """The driver a PostgreSQL ``url`` is used through here: the one it names when that
    one is installed (and synchronous, or the only one), else the first installed."""
    _, _, named = url.drivername.partition("+")
    installed = [name for name, module in _DRIVERS.items() if _installed(module)]
    if named in installed and (named != "asyncpg" or installed == ["asyncpg"]):
        return named
    if not installed:
        raise ConfigurationError(
            "no PostgreSQL driver is installed; run `pip install 'psycopg[binary]'`, or "
            "install inbox-middleware with your broker's extra "
            "(`pip install 'inbox-middleware[dramatiq]'`)"
        )
    return installed[0]


def sync_engine(database_url: str | URL, **options: Any) -> Engine:
    """A synchronous engine for a PostgreSQL or SQLite URL (one connection unless
    ``options`` say otherwise). Over asyncpg, use it under `run_sync`."""
    url = parse_url(database_url)
    if url.get_backend_name() == "sqlite":
        return create_engine(url, **options)
    driver = postgresql_driver(url)
    url = url.set(drivername=f"postgresql+{driver}")
    if driver == "asyncpg":
        from sqlalchemy.ext.asyncio import create_async_engine

        # Each run_sync has an event loop of its own, and an asyncpg connection belongs
        # to the loop that opened it: pool none.
        options.setdefault("poolclass", NullPool)
        return create_async_engine(url, **options).sync_engine
    options.setdefault("pool_size", 1)
    return create_engine(url, **options)


def uses_asyncio(database_url: str | URL) -> bool:
    """Whether `sync_engine` serves this URL through asyncpg (so under `run_sync`)."""
    url = parse_url(database_url)
    return url.get_backend_name() == "postgresql" and postgresql_driver(url) == "asyncpg"


def run_sync(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call ``function`` in a greenlet on a fresh event loop, where an engine over an
    asyncio driver works as a synchronous one (what ``AsyncConnection.run_sync`` does for
    one connection, here for a whole command that opens engines and transactions)."""
    from sqlalchemy.util.concurrency import greenlet_spawn

    return asyncio.run(greenlet_spawn(function, *args, **kwargs))


def _installed(module: str) -> bool:
    if importlib.util.find_spec(module) is None:
        return False
    # SQLAlchemy drives asyncpg through greenlet (its asyncio extra).
    return module != "asyncpg" or importlib.util.find_spec("greenlet") is not None
