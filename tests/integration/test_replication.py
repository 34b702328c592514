"""The start-up check on a server that replicates: it warns when a failover to a standby
could lose effects whose messages were already acknowledged (the standbys replicate
asynchronously, or ``synchronous_commit`` is ``local``), and is quiet when every commit
waits for the synchronous standby. On the failover pair of ``scripts/services``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from inbox_middleware import AsyncInbox, Inbox
from inbox_middleware._storage.base import DatabaseSettings

from ..support import database, servers, services
from ..support.engines import sync_engine

ASYNCHRONOUS = "streams its WAL to 1 standby(s) asynchronously"
LOCAL = "synchronous_commit is local"


def _primary(name: str = "postgres") -> str:
    host, port = services.pair_addresses()[0]
    return f"postgresql://postgres@{host}:{port}/{name}"


@pytest.fixture(scope="module")
def pair_database() -> Iterator[str]:
    for host, port in services.pair_addresses():
        services.require(f"postgresql://{host}:{port}", "The failover pair")
    name = database.create_run_database(_primary())
    yield name
    database.drop_database(name, _primary())


def _warnings(url: str, caplog: pytest.LogCaptureFixture) -> str:
    caplog.clear()
    engine = sync_engine(url)
    try:
        with caplog.at_level(logging.WARNING, logger="inbox_middleware"):
            Inbox(engine).check()
    finally:
        engine.dispose()
    return caplog.text


@contextlib.contextmanager
def _asynchronous() -> Iterator[None]:
    with servers.failover_pair_locked(), psycopg.connect(_primary(), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET synchronous_standby_names = ''")
        conn.execute("SELECT pg_reload_conf()")
        try:
            yield
        finally:
            conn.execute("ALTER SYSTEM RESET synchronous_standby_names")
            conn.execute("SELECT pg_reload_conf()")


def test_check__synchronous_standby_is_quiet(pair_database, caplog):
    text = _warnings(services.pair_url(pair_database, "psycopg"), caplog)
    assert ASYNCHRONOUS not in text and LOCAL not in text


def test_check__warns_when_the_standby_replicates_asynchronously(pair_database, caplog):
    with _asynchronous():
        text = _warnings(services.pair_url(pair_database, "psycopg"), caplog)

        async def check() -> None:
            engine = create_async_engine(services.pair_url(pair_database, "asyncpg"))
            try:
                await AsyncInbox(engine).check()
            finally:
                await engine.dispose()

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="inbox_middleware"):
            asyncio.run(check())
    assert ASYNCHRONOUS in text
    assert ASYNCHRONOUS in caplog.text


def test_check__warns_when_synchronous_commit_is_local(pair_database, caplog):
    with psycopg.connect(_primary(), autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{pair_database}" SET synchronous_commit = local')
    try:
        text = _warnings(services.pair_url(pair_database, "psycopg"), caplog)
    finally:
        with psycopg.connect(_primary(), autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{pair_database}" RESET synchronous_commit')
    assert LOCAL in text and ASYNCHRONOUS not in text


def test_replication_warnings__local_without_standbys_changes_nothing():
    # On a lone server, local is on: nothing to warn about.
    assert DatabaseSettings("local", "", 0).replication_warnings() == []
    assert DatabaseSettings("on", "", 0).replication_warnings() == []
    assert len(DatabaseSettings("local", "s1", 0).replication_warnings()) == 1
    assert len(DatabaseSettings("remote_apply", "", 2).replication_warnings()) == 1
