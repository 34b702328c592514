"""Engines for the connections the library opens itself (the command line, ``inbox-middleware
outbox run``, the metrics collector given a URL), with whichever PostgreSQL driver the
installation has, and safe behind a transaction pooler.

A URL naming no driver, or a driver that is not installed, is served by the first of
psycopg, psycopg2 and asyncpg that is: ``inbox-middleware[faststream-rabbit]`` brings
asyncpg only, ``inbox-middleware[dramatiq]`` psycopg. asyncpg has no synchronous API, so
an engine over it (SQLAlchemy's async engine, seen through its ``sync_engine``) must be
used under `run_sync`, which gives it the greenlet and event loop it needs.

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

import asyncio
import importlib.util
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from sqlalchemy import URL, Engine, create_engine, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.pool import NullPool

from .._core.exceptions import ConfigurationError
from .._core.logs import refuse_start

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = [
    "DEFAULT_CONNECTIONS",
    "async_engine",
    "engine_from_url",
    "parse_url",
    "pooler_connect_args",
    "postgresql_driver",
    "run_sync",
    "sync_engine",
    "uses_asyncio",
]

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


DEFAULT_CONNECTIONS = 8
"""A worker's pool size by default: Dramatiq's default of eight worker threads, each
holding one connection while it processes a message."""

# The driver each kind of engine is built on, and how to get it.
_USERS_DRIVERS = {
    False: ("psycopg", "pip install 'psycopg[binary]' (the dramatiq extra brings it)"),
    True: ("asyncpg", "pip install asyncpg (the faststream-* extras bring it)"),
}


@overload
def engine_from_url(
    database_url: str | URL,
    *,
    asynchronous: Literal[False] = False,
    connections: int = DEFAULT_CONNECTIONS,
    **options: Any,
) -> Engine: ...


@overload
def engine_from_url(
    database_url: str | URL,
    *,
    asynchronous: Literal[True],
    connections: int = DEFAULT_CONNECTIONS,
    **options: Any,
) -> AsyncEngine: ...


def engine_from_url(
    database_url: str | URL,
    *,
    asynchronous: bool = False,
    connections: int = DEFAULT_CONNECTIONS,
    **options: Any,
) -> Engine | AsyncEngine:
    """The engine for your workers, from the same ``DATABASE_URL`` the command line takes.

    ``postgres://`` and ``postgresql://``, with any driver or none, give a synchronous
    engine over psycopg (a Dramatiq actor), or with ``asynchronous=True`` an `AsyncEngine`
    over asyncpg (FastStream, an ``async def`` actor): the driver is named here, whatever
    the URL says, since SQLAlchemy reads a bare ``postgresql://`` as psycopg2 (2.0) or
    psycopg (2.1), neither of them asynchronous. ``sqlite:///path`` gives a synchronous
    SQLite engine.

    ``connections``: the pool size, one per message processed at once: the worker's
    threads (Dramatiq, 8 by default) or the subscriber's prefetch (FastStream), as the
    worker's start-up check recommends. ``options`` go to SQLAlchemy's `create_engine` or
    `create_async_engine` (``connect_args``, ``echo``, ``pool_size`` itself).

    A URL or an option that cannot make an engine raises `ConfigurationError`, one line
    naming the fix; in a worker of the ``dramatiq`` command, that line is logged as
    CRITICAL and the worker exits with status 3, as when its database cannot be reached.
    """
    try:
        return _users_engine(database_url, asynchronous, connections, options)
    except ConfigurationError as exc:
        reason = f"the inbox cannot build its database engine, so the worker does not start: {exc}"
        refuse_start(reason)
        raise ConfigurationError(reason) from None


def _users_engine(
    database_url: str | URL, asynchronous: bool, connections: int, options: dict[str, Any]
) -> Engine | AsyncEngine:
    if isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
        raise ConfigurationError(f"connections must be a positive number, not {connections!r}")
    url = parse_url(database_url)
    if url.get_backend_name() == "sqlite":
        if asynchronous:
            raise ConfigurationError(
                "an asynchronous engine needs PostgreSQL; SQLite is served synchronously"
            )
        return _create(create_engine, url, options)
    driver, install = _USERS_DRIVERS[asynchronous]
    if not _installed(driver):
        raise ConfigurationError(f"the {driver} driver is not installed: {install}")
    url = url.set(drivername=f"postgresql+{driver}")
    options.setdefault("pool_size", connections)
    if not asynchronous:
        return _create(create_engine, url, options)
    from sqlalchemy.ext.asyncio import create_async_engine

    return _create(create_async_engine, url, options)


def _create(factory: Callable[..., T], url: URL, options: dict[str, Any]) -> T:
    try:
        return factory(url, **options)
    except (ArgumentError, TypeError) as exc:  # an option SQLAlchemy or the pool refuses
        raise ConfigurationError(f"{url.drivername} refuses these options: {exc}") from None


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
        return create_async_engine(url, connect_args=_merged(url, options), **options).sync_engine
    options.setdefault("pool_size", 1)
    return create_engine(url, connect_args=_merged(url, options), **options)


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
