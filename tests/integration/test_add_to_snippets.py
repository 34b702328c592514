"""The "add the inbox to an existing service" guides' code, run on RabbitMQ and PostgreSQL:
during the roll-out a message without identity still runs (unprotected), a message with
one runs once however often it is sent, and the start-up checks see what the guides say."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import dramatiq
import pytest
from dramatiq.middleware import Retries
from faststream.middlewares import AckPolicy
from sqlalchemy import Engine, text

from inbox_middleware import ConfigurationError
from inbox_middleware.faststream import FastStreamInbox, InboxSession, identity_headers

from ..apps.domain import balance
from ..support import services
from ..support.dramatiq_worker import drain, running_worker
from ..support.faststream_brokers import eventually

DOCS = Path(__file__).resolve().parents[2] / "docs"
SNIPPETS = DOCS / "snippets"
GUIDE = (DOCS / "how-to" / "add-to-faststream.md").read_text()


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_snippet_{name}", SNIPPETS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def guide_broker(queue: str) -> Iterator[dramatiq.Broker]:
    """The guide's RabbitMQ broker, with retries fast enough for a test."""
    services.require(services.RABBITMQ, "RabbitMQ")
    broker = load("add_to_dramatiq").make_broker(services.RABBITMQ)
    for middleware in broker.middleware:
        if isinstance(middleware, Retries):
            middleware.min_backoff, middleware.max_backoff = 50, 500
    dramatiq.set_broker(broker)
    yield broker
    with contextlib.suppress(Exception):
        for name in (queue, f"{queue}.DQ", f"{queue}.XQ", f"{queue}.quarantine"):
            broker.channel.queue_delete(name)
    broker.close()


def as_the_cli_takes_it(url: str) -> str:
    """``postgres://``, no driver: the form a platform gives in ``DATABASE_URL``."""
    return "postgres://" + url.split("://", 1)[1]


def test_add_to_dramatiq_snippet__unidentified_runs_identified_runs_once(
    guide_broker: dramatiq.Broker,
    pg_engine: Engine,
    pg_url: str,
    queue: str,
    caplog: pytest.LogCaptureFixture,
):
    snippet = load("add_to_dramatiq")
    # Given the guide's engine (pool and statement_timeout), from the URL the command
    # line takes, the guide's middleware and actor
    engine = snippet.make_engine(as_the_cli_takes_it(pg_url), worker_threads=2)
    assert engine.url.drivername == "postgresql+psycopg"
    with engine.connect() as conn:
        assert conn.scalar(text("SHOW statement_timeout")) == "30s"
    assert engine.pool.size() == 2
    snippet.protect(guide_broker, engine)
    add_credit = snippet.declare(queue)
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (7, 0)"))

    # When an old producer sends without identity, and a migrated one sends an order twice
    caplog.set_level(logging.WARNING, logger="inbox_middleware.dramatiq")
    try:
        with running_worker(guide_broker, threads=2) as worker:  # boots: the checks pass
            add_credit.send(7, 5)
            snippet.send(add_credit, "o-1", 7, 10)
            snippet.send(add_credit, "o-1", 7, 10)
            drain(guide_broker, queue, worker)
    finally:
        engine.dispose()

    # Then the unidentified message ran, with a warning, and the order once
    with pg_engine.connect() as conn:
        assert balance(conn, 7) == 15
        assert conn.scalar(text("SELECT count(*) FROM consumer_inbox")) == 1
    assert "WITHOUT deduplication" in caplog.text


async def test_add_to_faststream_snippet__unidentified_runs_identified_runs_once(
    pg_async_url: str, pg_engine: Engine
):
    services.require(services.RABBITMQ, "RabbitMQ")
    queue = f"t{uuid.uuid4().hex[:12]}"
    # The same URL as the command line's (postgres://): an AsyncEngine over asyncpg
    _, broker = load("add_to_faststream").build(
        as_the_cli_takes_it(pg_async_url), services.RABBITMQ, queue
    )
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (7, 0)"))
    headers = identity_headers(producer="orders", message_id="o-1")
    order = {"account_id": 7, "amount": 10}
    try:
        async with broker:
            await broker.start()  # guarded: the start-up check accepts the subscriber
            await broker.publish({"account_id": 7, "amount": 5}, queue, persist=True)
            await broker.publish(order, queue, headers=headers, persist=True)
            await broker.publish(order, queue, headers=headers, persist=True)
            await eventually(lambda: _balance(pg_engine) == 15, what="the credits")
            await asyncio.sleep(0.5)  # a second credit of the order would land now
    finally:
        async with broker:
            channel = await broker._connection.channel()
            for name in (queue, f"{queue}.quarantine", f"{queue}.dead-letter"):
                await channel.queue_delete(name)
    assert _balance(pg_engine) == 15


async def test_add_to_faststream_guide__the_refusal_it_quotes_is_the_real_one(pg_async_engine):
    from faststream.rabbit import RabbitBroker

    inbox = FastStreamInbox(pg_async_engine)
    broker = inbox.guard(RabbitBroker(services.RABBITMQ, middlewares=[inbox.middleware]))

    @broker.subscriber(
        "orders", ack_policy=AckPolicy.ACK_FIRST, dependencies=[inbox.consumer("billing")]
    )
    async def add_credit(order: dict[str, Any], session: InboxSession) -> None:
        raise AssertionError("never consumed")

    with pytest.raises(ConfigurationError) as refused:
        await inbox.check(broker)
    for line in str(refused.value).splitlines():
        assert line.strip() in GUIDE, f"the guide does not quote {line!r}"


def _balance(engine: Engine) -> int:
    with engine.connect() as conn:
        return balance(conn, 7)
