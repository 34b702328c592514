"""The start-up check sees every subscriber before it consumes: those added to a running
broker, a Kafka subscriber without a consumer group, an engine the inbox cannot drive; and
a refusal under ``faststream run`` (one worker or several), FastStream's ASGI app and a
FastAPI lifespan under uvicorn is one block and exit status 3, never a respawn loop.
Real PostgreSQL, RabbitMQ, Redis and Kafka (tansu), real server processes."""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import subprocess
import sys
import uuid
from typing import Any

import pytest
from faststream import AckPolicy
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import create_async_engine

from inbox_middleware._core import faults
from inbox_middleware._core.exceptions import ConfigurationError
from inbox_middleware.dramatiq import InboxMiddleware
from inbox_middleware.faststream import FastStreamInbox, InboxSession, identity_headers

from ..apps.domain import apply_credit_async, effects
from ..support import services
from ..support.faststream_brokers import Harness, Seen, eventually, recorder
from ..support.faststream_worker import ROOT

ORDER = {"account": 7, "delta": 10}


def applied(engine: Engine) -> int:
    with engine.connect() as conn:
        return effects(conn, 7)


@pytest.fixture
def inbox(pg_async_engine: Any) -> FastStreamInbox:
    return FastStreamInbox(pg_async_engine, lock_timeout=10, retry_backoff=(0.05, 0.5))


async def test_startup__an_ack_first_subscriber_added_to_a_running_broker_is_refused_before_it_consumes(  # noqa: E501
    inbox, pg_engine
):
    # Given a guarded RabbitMQ broker, started, and a message waiting in a queue
    seen = Seen()
    h = Harness("rabbit", [recorder(seen), inbox.middleware])
    inbox.guard(h.broker)
    try:
        async with h.broker:
            await h.broker.start()
            await h.prepare_source()
            await h.publish(ORDER, identity_headers(producer="orders", message_id="o-1"))
            # When an inbox subscriber with ACK_FIRST is added and started
            subscriber = h.subscribe(
                inbox.consumer("billing"), ack_policy=AckPolicy.ACK_FIRST, persistent=False
            )

            @subscriber
            async def handle(body: dict[str, int], session: InboxSession) -> None:
                await apply_credit_async(session, "billing", body["account"], body["delta"])

            # Then it is refused as it starts, saying what to change
            with pytest.raises(ConfigurationError, match="AckPolicy.ACK_FIRST") as refused:
                await subscriber.start()
            assert "Remove ack_policy" in str(refused.value)
        # And it consumed nothing: the message still waits, unacknowledged
        assert seen.outcomes == []
        assert applied(pg_engine) == 0
        assert await h.leftover() == 1
    finally:
        await h.cleanup()


async def test_startup__a_refused_subscriber_left_declared_does_not_stop_the_next_one(
    inbox, pg_engine
):
    from faststream.rabbit import RabbitQueue

    # Given a guarded, running broker, and an added subscriber it refused, still declared
    h = Harness("rabbit", [inbox.middleware])
    other = Harness("rabbit", [])  # names the second queue, and deletes it
    inbox.guard(h.broker)
    try:
        async with h.broker:
            await h.broker.start()
            refused = h.subscribe(inbox.consumer("billing"), ack_policy=AckPolicy.ACK_FIRST)

            @refused
            async def first(body: dict[str, int], session: InboxSession) -> None: ...

            with pytest.raises(ConfigurationError, match="AckPolicy.ACK_FIRST"):
                await refused.start()
            # When a correct one is added and started
            fixed = h.broker.subscriber(
                RabbitQueue(other.source, durable=True),
                dependencies=[inbox.consumer("billing-fixed")],
            )

            @fixed
            async def second(body: dict[str, int], session: InboxSession) -> None:
                await apply_credit_async(session, "billing", body["account"], body["delta"])

            await fixed.start()
            # Then it starts, and consumes under the inbox
            headers = identity_headers(producer="orders", message_id="o-1")
            await h.broker.publish(ORDER, other.source, headers=headers, persist=True)
            await eventually(lambda: applied(pg_engine) == 1, what="the effect")
    finally:
        await h.cleanup()
        await other.cleanup()


async def test_startup__an_inbox_subscriber_added_to_a_running_broker_is_protected(
    inbox, pg_engine
):
    # Given a guarded, running broker, a plain subscriber added to it, which consumed a
    # message (the inbox's verdict on it: not an inbox subscriber), stopped and dropped
    seen = Seen()
    h = Harness("rabbit", [recorder(seen), inbox.middleware])
    inbox.guard(h.broker)
    try:
        async with h.broker:
            await h.broker.start()
            await h.prepare_source()
            # When an inbox subscriber is added at the dropped one's address, and started
            # (CPython hands freed memory out again, though not always to the next object
            # of that size: a few rounds find one)
            subscriber = None
            for rounds in range(1, 6):
                dropped = await _used_and_dropped(h, seen, rounds)
                subscriber = _reusing(h, inbox, dropped)
                if subscriber is not None:
                    break
            if subscriber is None:
                pytest.fail("no new subscriber reused a dropped one's id: the case is not shown")
            await subscriber.start()
            # One at a time: a subscriber runs its prefetch window's deliveries at once.
            await h.publish(ORDER, identity_headers(producer="orders", message_id="o-1"))
            await eventually(lambda: len(seen.outcomes) == rounds + 1, what="the first outcome")
            await h.publish(ORDER, identity_headers(producer="orders", message_id="o-1"))
            await eventually(lambda: len(seen.outcomes) == rounds + 2, what="both deliveries")
            await subscriber.stop()
        # Then its messages went through the inbox: one effect, the duplicate skipped
        assert seen.outcomes == ["processed"] * rounds + ["processed", "Skipped"]
        assert applied(pg_engine) == 1
    finally:
        await h.cleanup()
        await _delete_queue(f"{h.source}-plain")


async def _delete_queue(name: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(services.RABBITMQ)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(name)


async def _used_and_dropped(h: Harness, seen: Seen, rounds: int) -> int:
    """The id of a plain subscriber that consumed one message and is gone (made in a
    function of its own: a frame still running would keep it alive); the ``rounds``-th
    such subscriber of the test, which has seen one message each."""
    gc.collect()  # earlier tests' garbage freed now, not just after the subscriber
    plain = h.broker.subscriber(f"{h.source}-plain", persistent=False)

    @plain
    async def ignore(body: Any) -> None: ...

    await plain.start()
    await h.broker.publish("hello", f"{h.source}-plain")
    await eventually(lambda: seen.outcomes == ["processed"] * rounds, what="the plain message")
    await plain.stop()
    return id(plain)


def _reusing(h: Harness, inbox: FastStreamInbox, dropped: int) -> Any:
    """A new inbox subscriber at the address (id) of a dropped one, or None: CPython
    reuses freed memory, so a few tries usually find one (the misses are kept meanwhile,
    so that each try takes fresh memory; they never start, and go with this function)."""
    gc.collect()
    misses = []
    for number in range(300):
        subscriber = _inbox_subscriber(h, inbox, f"billing{number}")
        if id(subscriber) == dropped:
            return subscriber
        misses.append(subscriber)
    return None


def _inbox_subscriber(h: Harness, inbox: FastStreamInbox, name: str) -> Any:
    subscriber = h.subscribe(inbox.consumer(name), persistent=False)

    @subscriber
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    return subscriber


async def test_startup__a_kafka_subscriber_without_a_group_is_refused(inbox):
    h = Harness("kafka", [inbox.middleware])
    inbox.guard(h.broker)

    @h.broker.subscriber(
        h.source, ack_policy=AckPolicy.ACK, dependencies=[inbox.consumer("billing")]
    )
    async def handle(body: dict[str, int], session: InboxSession) -> None: ...

    with pytest.raises(ConfigurationError, match="group_id") as refused:
        await inbox.check(h.broker)
    assert "Kafka commits no offsets" in str(refused.value)


async def test_startup__kafkas_default_ack_policy_is_refused_with_the_group_missing_too(inbox):
    h = Harness("kafka", [inbox.middleware])

    @h.broker.subscriber(h.source, dependencies=[inbox.consumer("billing")])
    async def handle(body: dict[str, int], session: InboxSession) -> None: ...

    with pytest.raises(ConfigurationError) as refused:
        await inbox.check(h.broker)
    assert "AckPolicy.ACK_FIRST" in str(refused.value)
    assert "group_id" in str(refused.value)


@pytest.mark.parametrize("scheme", ["postgresql+psycopg", "postgresql"])
async def test_startup__an_async_engine_over_psycopg_is_refused_when_the_inbox_is_built(
    database_name, scheme
):
    # SQLAlchemy 2.1 reads postgresql:// as psycopg
    url = services.with_database(services.POSTGRES, database_name, driver="psycopg")
    engine = create_async_engine(url.replace("postgresql+psycopg", scheme, 1))
    try:
        if engine.dialect.driver != "psycopg":
            pytest.fail(f"{scheme}:// is {engine.dialect.driver} here; the case is not shown")
        with pytest.raises(ConfigurationError, match=r"postgresql\+asyncpg://"):
            FastStreamInbox(engine)
        with pytest.raises(ConfigurationError, match=r"postgresql\+asyncpg://"):
            InboxMiddleware(async_engine=engine)  # Dramatiq's async actors: the same inbox
    finally:
        await engine.dispose()


async def test_startup__without_guard_a_failed_check_hands_back_through_the_core(
    pg_async_engine, pg_engine, caplog
):
    # Given an unguarded NATS broker whose start-up check, run at the first message, fails
    # four times before it passes, and a redelivery limit of 1
    caplog.set_level(logging.INFO, logger="inbox_middleware")
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.1), redelivery_limit=1)
    seen = Seen()
    h = Harness("nats", [recorder(seen), inbox.middleware])

    @h.subscribe(inbox.consumer("billing"))
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    failures = iter(range(4))

    def check_fails(point: str, message_id: str | None) -> None:
        if point == "check" and next(failures, None) is not None:
            raise ConnectionRefusedError(111, "the database is restarting")

    faults.hook = check_fails
    try:
        async with h.broker:
            await h.broker.start()
            await h.publish(ORDER, identity_headers(producer="orders", message_id="o-1"))
            await eventually(lambda: "processed" in seen.outcomes, what="the message applied")
    finally:
        faults.hook = None
        await h.cleanup()
    # Then each delivery was handed back through the core (counted as a hand-back, so the
    # redeliveries it caused are no crash), and the message applied once, not poisoned
    handed = [r for r in caplog.records if "handed a message back" in r.getMessage()]
    assert len(handed) == 4, caplog.text
    assert "holds a message back" not in caplog.text
    assert seen.outcomes == ["NackForRedelivery"] * 4 + ["processed"], seen.outcomes
    assert applied(pg_engine) == 1


# -- a refusal under a server command --------------------------------------------------------

TRACEBACK = ("Traceback", "╭")  # Python's, and the rich one of FastStream's command


def _serve(command: list[str], env: dict[str, str], timeout: float = 60) -> tuple[int, str]:
    """Run a server command on the test apps until it exits (killed, with its workers,
    if it is still running after ``timeout`` seconds); its status and output."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *command],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{command} still ran after {timeout}s:\n{output[-3000:]}")
    output = re.sub(r"\x1b\[[0-9;]*m", "", output)  # FastStream's colours
    print(output)
    return proc.returncode, output


def _refusals(output: str, reason: str) -> list[str]:
    """Each CRITICAL block of ``output``, asserted to name ``reason``."""
    lines = output.splitlines()
    blocks = []
    for number, line in enumerate(lines):
        if "CRITICAL" in line:
            assert line.endswith("the inbox refuses to start this app (exit status 3):"), output
            blocks.append("\n".join(lines[number : number + 3]))
    assert blocks, output
    assert all(reason in block for block in blocks), output
    return blocks


@pytest.fixture
def unmigrated(pg_async_url: str) -> dict[str, str]:
    """A RabbitMQ app whose inbox tables were never created (``migrate`` not run)."""
    return {
        "INBOX_TEST_DATABASE_URL": pg_async_url,
        "INBOX_TEST_BROKER": "rabbit",
        "INBOX_TEST_BROKER_URL": services.RABBITMQ,
        "INBOX_TEST_SOURCE": f"t{uuid.uuid4().hex[:10]}",
        "INBOX_TEST_INBOX_SCHEMA": "never_migrated",
        "INBOX_TEST_STARTUP_PATIENCE": "0",  # refused at once, not waited out
    }


MIGRATE = '("never_migrated"."consumer_inbox") do not exist; run `inbox-middleware migrate`'


def test_startup__faststream_run_before_migrate_exits_3_with_one_block(unmigrated):
    status, output = _serve(["faststream", "run", "tests.apps.faststream_app:app"], unmigrated)
    # Then one block names the cause and the fix, with no traceback, and the status is 3
    assert status == 3, output
    assert len(_refusals(output, MIGRATE)) == 1
    assert not any(mark in output for mark in TRACEBACK), output
    assert len(output.splitlines()) < 6, output
    assert "started successfully" not in output


def test_startup__faststream_run_with_an_unreachable_database_exits_3_with_one_block(
    unmigrated,
):
    env = unmigrated | {"INBOX_TEST_DATABASE_URL": "postgresql+asyncpg://postgres@127.0.0.1:9/x"}
    status, output = _serve(["faststream", "run", "tests.apps.faststream_app:app"], env)
    assert status == 3, output
    (block,) = _refusals(output, "the inbox cannot reach its database: ")
    assert "127.0.0.1" in block, output
    assert "check the engine's URL and that PostgreSQL is up" in block
    assert not any(mark in output for mark in TRACEBACK), output


def test_startup__the_traceback_follows_at_debug_level(unmigrated):
    command = ["faststream", "run", "tests.apps.faststream_app:app", "--log-level", "debug"]
    status, output = _serve(command, unmigrated)
    assert status == 3, output
    assert len(_refusals(output, MIGRATE)) == 1
    assert "Traceback (most recent call last)" in output


def test_startup__a_refused_worker_is_not_respawned_under_workers(pg_async_url):
    services.require(services.REDIS, "Redis")
    # Given an app with a Redis list subscriber, which the inbox refuses, run by 2 workers
    env = {
        "INBOX_TEST_DATABASE_URL": pg_async_url,
        "INBOX_TEST_BROKER": "redis",
        "INBOX_TEST_BROKER_URL": services.REDIS,
        "INBOX_TEST_SOURCE": f"t{uuid.uuid4().hex[:10]}",
        "INBOX_TEST_REDIS_LIST": "1",
    }
    command = ["faststream", "run", "tests.apps.faststream_app:app", "--workers", "2"]
    status, output = _serve(command, env)
    # Then the supervisor stops instead of respawning, and exits with status 3
    assert status == 3, output
    assert output.count("Started child process") == 2, output
    assert "exited with code" not in output, output
    assert 1 <= len(_refusals(output, "a Redis list cannot hand a message back")) <= 2
    assert not any(mark in output for mark in TRACEBACK), output


def test_startup__asgi_faststream_refusal_is_one_block(unmigrated):
    command = ["faststream", "run", "tests.apps.faststream_asgi:asgi", "--port", "0"]
    status, output = _serve(command, unmigrated)
    assert status == 3, output
    assert len(_refusals(output, MIGRATE)) == 1
    assert not any(mark in output for mark in TRACEBACK), output


def test_startup__asgi_faststream_under_workers_stops_instead_of_respawning(unmigrated):
    command = ["faststream", "run", "tests.apps.faststream_asgi:asgi", "--port", "0"]
    _, output = _serve([*command, "--workers", "2"], unmigrated)
    # Then uvicorn's supervisor stops at the first refusal (status 3: a startup failure)
    assert output.count("Started server process") <= 2, output
    assert 1 <= len(_refusals(output, MIGRATE)) <= 2
    assert not any(mark in output for mark in TRACEBACK), output


def test_startup__fastapi_lifespan_refusal_is_one_block(unmigrated):
    command = ["uvicorn", "tests.apps.faststream_asgi:fastapi", "--port", "0"]
    status, output = _serve(command, unmigrated)
    assert status == 3, output
    assert len(_refusals(output, MIGRATE)) == 1
    assert not any(mark in output for mark in TRACEBACK), output
    assert "Application startup complete" not in output
