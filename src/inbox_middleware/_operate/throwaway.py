"""Throwaway PostgreSQL databases for tests: one per test, cloned from a template that
holds the migrated schema (PostgreSQL's ``CREATE DATABASE ... TEMPLATE``), dropped after.

The pytest plugin's ``inbox_database`` fixture uses it (`inbox_middleware.testing`); the
template is built once per test session, by the ``inbox_database_setup`` callable (the
inbox tables by default; override the fixture to add your own tables), and dropped when
the session ends. Cloning a template takes tens of milliseconds where migrating takes
seconds, and no test sees another's rows.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import URL, make_url

from .._core.exceptions import ConfigurationError
from .._storage.databases import create_database, drop_database
from .._storage.migrate import migrate

__all__ = ["DEFAULT_SERVER", "SERVER_VARIABLE", "Setup", "Template", "ThrowawayDatabase"]

SERVER_VARIABLE = "INBOX_PYTEST_DATABASE_URL"
"""The environment variable naming the PostgreSQL server for throwaway databases."""
DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"

Setup = Callable[[Connection], None]
"""Builds the schema in the template, on a connection in a transaction."""


@dataclass(frozen=True)
class ThrowawayDatabase:
    """One test's database: gone after the test."""

    name: str
    url: str
    """SQLAlchemy URL with a synchronous driver (psycopg, else psycopg2)."""
    async_url: str
    """The same database through asyncpg."""


def _driver(kind: str) -> str:
    if kind == "async":
        return "asyncpg"
    for module, driver in (("psycopg", "psycopg"), ("psycopg2", "psycopg2")):
        if importlib.util.find_spec(module) is not None:
            return driver
    return "asyncpg"


def _url(server: URL, database: str, kind: str) -> str:
    return server.set(drivername=f"postgresql+{_driver(kind)}", database=database).render_as_string(
        hide_password=False
    )


class Template:
    """The session's template database, built on first use, and the clones made of it."""

    def __init__(self, server: str, setup: Setup) -> None:
        url = make_url(server.replace("postgres://", "postgresql://", 1))
        if not url.drivername.startswith("postgresql"):
            raise ConfigurationError(
                f"throwaway databases need PostgreSQL, not {url.drivername}: set "
                f"{SERVER_VARIABLE} to a postgresql:// URL of a role that may create databases"
            )
        self.server, self.setup = url, setup
        self.name = f"inbox_throwaway_tpl_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.built = False

    def clone(self) -> ThrowawayDatabase:
        if not self.built:
            self._build()
        name = f"inbox_throwaway_{uuid.uuid4().hex[:12]}"
        self._admin(create_database(name, template=self.name))
        return ThrowawayDatabase(
            name, _url(self.server, name, "sync"), _url(self.server, name, "async")
        )

    def drop(self, database: ThrowawayDatabase | str) -> None:
        name = database if isinstance(database, str) else database.name
        self._admin(drop_database(name))

    def close(self) -> None:
        if self.built:
            self.drop(self.name)

    def _build(self) -> None:
        self._admin(create_database(self.name))
        self.built = True
        url = _url(self.server, self.name, "sync")
        if url.startswith("postgresql+asyncpg"):
            asyncio.run(self._build_async(url))
            return
        engine = create_engine(url, poolclass=None)
        try:
            with engine.begin() as conn:
                self.setup(conn)
        finally:
            engine.dispose()

    async def _build_async(self, url: str) -> None:
        from sqlalchemy.ext.asyncio import create_async_engine

        engine = create_async_engine(url)
        try:
            async with engine.begin() as conn:
                await conn.run_sync(self.setup)
        finally:
            await engine.dispose()

    def _admin(self, statement: str) -> None:
        url = _url(self.server, self.server.database or "postgres", "sync")
        if url.startswith("postgresql+asyncpg"):
            asyncio.run(_admin_async(url, statement))
            return
        engine = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=None)
        try:
            with engine.connect() as conn:
                conn.execute(text(statement))
        except Exception as exc:
            raise ConfigurationError(_admin_error(self.server, exc)) from exc
        finally:
            engine.dispose()


async def _admin_async(url: str, statement: str) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            await conn.execute(text(statement))
    except Exception as exc:
        raise ConfigurationError(_admin_error(make_url(url), exc)) from exc
    finally:
        await engine.dispose()


def _admin_error(server: URL, exc: Exception) -> str:
    reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return (
        f"cannot create or drop a throwaway database on {server.render_as_string()}: "
        f"{reason[0] if reason else type(exc).__name__} (set {SERVER_VARIABLE} or the "
        "inbox_database_url ini option to a server whose role may create databases)"
    )


def migrate_inbox(conn: Connection) -> None:
    """The default setup: the inbox tables, as ``inbox-middleware migrate`` makes them."""
    migrate(conn)


def server_from(option: Any, ini: Any) -> str:
    return str(option or os.environ.get(SERVER_VARIABLE) or ini or DEFAULT_SERVER)
