"""Publishes the library makes to a broker count only once the broker has the message:
the outbox's FastStream destination on RabbitMQ, NATS JetStream, Redis and Kafka, and the
inbox's own quarantine and dead-letter publishes. A queue that does not exist, a subject no
stream captures, a publish nobody confirmed: a failed attempt, never ``dispatched``, never
an acknowledged source message."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from inbox_middleware import outbox
from inbox_middleware._core import headers
from inbox_middleware._core.exceptions import ConfigurationError, PermanentError
from inbox_middleware.faststream import FastStreamInbox, InboxSession, identity_headers
from inbox_middleware.outbox import Backoff, Dispatcher
from inbox_middleware.outbox.destinations.faststream import FastStreamDestination

from ..apps.domain import apply_credit_async, effects
from ..support import servers, services
from ..support.faststream_brokers import Harness, Seen, eventually, recorder

EFFECT = "notify-account-7"
QUICK = Backoff(base=0.01, cap=0.01, jitter=0)


def record_effect(engine: Engine, effect_id: str = EFFECT) -> None:
    with Session(engine) as session, session.begin():
        outbox.add(session, destination="notify", payload={"account_id": 7}, effect_id=effect_id)


async def dispatch(engine: Engine, destination: Any, max_attempts: int = 10) -> Dispatcher:
    """Dispatch until the effect is dispatched or failed (retries are due at once)."""
    dispatcher = Dispatcher(
        engine,
        {"notify": destination},
        lease=10.0,
        delivery_timeout=5.0,
        max_attempts=max_attempts,
        backoff=QUICK,
    )
    for _ in range(max_attempts * 20):
        await dispatcher.run(burst=True)
        if effect_row(engine)["status"] != "pending":
            break
        await asyncio.sleep(0.02)
    await destination.aclose()
    return dispatcher


def effect_row(engine: Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT status, attempts, last_error, remote_result FROM message_outbox")
        ).one()
    return dict(row._mapping)


def name() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


# -- RabbitMQ ------------------------------------------------------------------------------


async def rabbit_queue(queue: str, *, declare: bool = False, delete: bool = False) -> Any:
    """Declare, read (every message, consumed) or delete ``queue`` on a connection of its
    own; the messages read, when reading."""
    import aio_pika

    connection = await aio_pika.connect(services.RABBITMQ)
    async with connection:
        channel = await connection.channel()
        if delete:
            await channel.queue_delete(queue)
            return None
        declared = await channel.declare_queue(queue, durable=True, passive=not declare)
        if declare:
            return None
        found = []
        while (message := await declared.get(no_ack=True, fail=False)) is not None:
            found.append(message)
        return found


async def test_faststream_destination__rabbitmq_queue_that_does_not_exist_is_a_failed_attempt(
    pg_engine,
):
    from faststream.rabbit import RabbitBroker

    services.require(services.RABBITMQ, "RabbitMQ")
    # Given an effect for a queue nobody declared (RabbitMQ drops what it cannot route)
    destination = FastStreamDestination(
        RabbitBroker(services.RABBITMQ, logger=None), producer="orders-outbox", queue=name()
    )
    record_effect(pg_engine)
    # When it is dispatched, with three attempts allowed
    dispatcher = await dispatch(pg_engine, destination, max_attempts=3)
    # Then every attempt failed, and the effect is failed (poison), never dispatched
    row = effect_row(pg_engine)
    assert (dispatcher.stats.dispatched, dispatcher.stats.retried) == (0, 2)
    assert (row["status"], row["attempts"]) == ("failed", 3)
    assert "returned the message" in row["last_error"]
    assert "NO_ROUTE" in row["last_error"]


@pytest.fixture
async def durable_queue() -> Any:
    """A durable RabbitMQ queue of the test's own, deleted after it."""
    services.require(services.RABBITMQ, "RabbitMQ")
    queue = name()
    await rabbit_queue(queue, declare=True)
    yield queue
    await rabbit_queue(queue, delete=True)


async def test_faststream_destination__rabbitmq_message_is_persistent_and_survives_a_restart(
    pg_engine, durable_queue
):
    from faststream.rabbit import RabbitBroker

    # Given a durable queue, and a destination given no persist option
    destination = FastStreamDestination(
        RabbitBroker(services.RABBITMQ, logger=None), producer="orders-outbox", queue=durable_queue
    )
    record_effect(pg_engine)
    # When the effect is dispatched, and RabbitMQ restarts before anyone reads it
    dispatcher = await dispatch(pg_engine, destination)
    assert dispatcher.stats.dispatched == 1
    await asyncio.to_thread(servers.restart_rabbitmq)
    found = await rabbit_queue(durable_queue)
    # Then the message is still there: it was published persistent, and confirmed
    (message,) = found
    assert message.delivery_mode == 2
    assert json.loads(message.body) == {"account_id": 7}
    assert message.headers[headers.MESSAGE_ID] == EFFECT
    assert effect_row(pg_engine)["status"] == "dispatched"


async def test_faststream_destination__rabbitmq_channel_without_confirms_is_a_failed_attempt(
    pg_engine, durable_queue
):
    from faststream.rabbit import Channel, RabbitBroker

    # Given a broker whose channel has no publisher confirms, and a queue that exists
    broker = RabbitBroker(
        services.RABBITMQ, logger=None, default_channel=Channel(publisher_confirms=False)
    )
    destination = FastStreamDestination(broker, producer="orders-outbox", queue=durable_queue)
    record_effect(pg_engine)
    dispatcher = await dispatch(pg_engine, destination, max_attempts=1)
    # Then nothing said RabbitMQ had it: not dispatched
    row = effect_row(pg_engine)
    assert (dispatcher.stats.dispatched, row["status"]) == (0, "failed")
    assert "no publisher confirms" in row["last_error"]


def test_faststream_destination__rabbitmq_refuses_options_that_would_lose_messages():
    from faststream.rabbit import RabbitBroker

    broker = RabbitBroker(services.RABBITMQ, logger=None)
    for option in ({"persist": False}, {"mandatory": False}, {"immediate": True}):
        with pytest.raises(ConfigurationError, match=next(iter(option))):
            FastStreamDestination(broker, producer="p", queue="q", **option)


# -- NATS ----------------------------------------------------------------------------------


async def test_faststream_destination__nats_subject_no_stream_captures_is_a_failed_attempt(
    pg_engine,
):
    from faststream.nats import NatsBroker

    services.require(services.NATS, "NATS")
    # Given an effect for a subject no JetStream stream captures (core NATS drops it)
    destination = FastStreamDestination(
        NatsBroker(services.NATS, logger=None), producer="orders-outbox", subject=name()
    )
    record_effect(pg_engine)
    # When it is dispatched, with two attempts allowed
    dispatcher = await dispatch(pg_engine, destination, max_attempts=2)
    # Then both attempts failed, and the effect is failed, never dispatched
    row = effect_row(pg_engine)
    assert (dispatcher.stats.dispatched, row["status"], row["attempts"]) == (0, "failed", 2)
    assert "no JetStream stream" in row["last_error"]


async def test_faststream_destination__nats_publishes_through_jetstream_with_its_ack(pg_engine):
    import nats
    from faststream.nats import NatsBroker

    services.require(services.NATS, "NATS")
    # Given a stream that captures the subject
    subject, stream = name(), name().upper()
    client = await nats.connect(services.NATS)
    js = client.jetstream()
    await js.add_stream(name=stream, subjects=[subject])
    destination = FastStreamDestination(
        NatsBroker(services.NATS, logger=None), producer="orders-outbox", subject=subject
    )
    record_effect(pg_engine)
    try:
        # When the effect is dispatched
        dispatcher = await dispatch(pg_engine, destination)
        stored = await js.get_msg(stream, 1)
    finally:
        await js.delete_stream(stream)
        await client.close()
    # Then the stream stored it, and its acknowledgement is the recorded result
    assert dispatcher.stats.dispatched == 1
    assert json.loads(stored.data or b"") == {"account_id": 7}
    assert (stored.headers or {})[headers.MESSAGE_ID] == EFFECT
    assert effect_row(pg_engine)["remote_result"] == {"stream": stream, "seq": 1}


# -- Redis and Kafka -----------------------------------------------------------------------


async def test_faststream_destination__redis_publishes_to_a_stream(pg_engine):
    from faststream.redis import RedisBroker
    from faststream.redis.parser import BinaryMessageFormatV1
    from redis.asyncio import Redis

    services.require(services.REDIS, "Redis")
    broker = RedisBroker(services.REDIS, logger=None)
    # A channel forgets a message nobody listens to; a list cannot hand one back
    for option in ({"channel": "c"}, {"list": "l"}, {}):
        with pytest.raises(ConfigurationError, match="stream="):
            FastStreamDestination(broker, producer="orders-outbox", **option)
    # Given a destination that publishes to a stream
    stream = name()
    destination = FastStreamDestination(broker, producer="orders-outbox", stream=stream)
    record_effect(pg_engine)
    client = Redis.from_url(services.REDIS)
    try:
        # When the effect is dispatched
        dispatcher = await dispatch(pg_engine, destination)
        entries = await client.xrange(stream)
        await client.delete(stream)
    finally:
        await client.aclose()
    # Then the stream has it, with the entry id as the recorded result
    assert dispatcher.stats.dispatched == 1
    ((entry_id, data),) = entries
    body, message_headers = BinaryMessageFormatV1.parse(data[b"__data__"])
    assert json.loads(body) == {"account_id": 7}
    assert message_headers[headers.MESSAGE_ID] == EFFECT
    assert effect_row(pg_engine)["remote_result"] == {"stream": stream, "id": entry_id.decode()}


def test_faststream_destination__kafka_waits_for_the_producers_ack():
    from faststream.kafka import KafkaBroker

    with pytest.raises(ConfigurationError, match="no_confirm"):
        FastStreamDestination(
            KafkaBroker(services.KAFKA, logger=None), producer="p", topic="t", no_confirm=True
        )


# -- the inbox's own publishes -------------------------------------------------------------


@pytest.fixture
async def rabbit(pg_async_engine: Any) -> Any:
    inbox = FastStreamInbox(pg_async_engine, lock_timeout=10, retry_backoff=(0.05, 0.1))
    seen = Seen()
    harness = Harness("rabbit", [recorder(seen), inbox.middleware])
    inbox.guard(harness.broker)
    yield harness, inbox, seen
    await harness.cleanup()


def ident(message_id: str = "ord-1") -> dict[str, str]:
    return identity_headers(producer="orders", message_id=message_id)


async def test_faststream__unroutable_quarantine_publish_keeps_the_message(rabbit, pg_engine):
    h, inbox, seen = rabbit

    @h.subscribe(inbox.consumer("billing"))
    async def handle(body: dict[str, Any], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    async with h.broker:
        await h.broker.start()
        await h.publish({"account": 7, "delta": 10}, ident())
        await eventually(lambda: seen.count("processed") == 1, what="the first delivery")
        # Given a quarantine queue deleted under the running consumer
        await rabbit_queue(f"{h.source}.quarantine", delete=True)
        # When a conflicting message arrives
        await h.publish({"account": 7, "delta": 99}, ident())
        await eventually(lambda: seen.count("Skipped") == 1, what="the settled conflict")
    published = await rabbit_queue(f"{h.source}.quarantine")
    # Then the unroutable publish handed it back instead of acking it, and its
    # redelivery was published to the quarantine queue, declared again
    assert seen.count("NackForRedelivery") == 1
    assert [message.delivery_mode for message in published] == [2]
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 1
        assert conn.scalar(text("SELECT attempts FROM inbox_quarantine")) == 2
    assert await h.leftover() == 0


async def test_faststream__unroutable_dead_letter_publish_keeps_the_message(rabbit, pg_engine):
    h, inbox, seen = rabbit
    dead_letter = f"{h.source}.dead-letter"

    @h.subscribe(inbox.consumer("billing", dead_letter=dead_letter))
    async def handle(body: dict[str, Any], session: InboxSession) -> None:
        raise PermanentError("never")

    async with h.broker:
        await h.broker.start()
        # Given a dead-letter queue deleted under the running consumer
        await rabbit_queue(dead_letter, delete=True)
        # When a message is rejected for good
        await h.publish({"account": 7, "delta": 10}, ident())
        await eventually(lambda: seen.count("Skipped") == 1, what="the settled rejection")
    published = await rabbit_queue(dead_letter)
    # Then the unroutable publish kept the message, and its redelivery was dead-lettered
    assert seen.count("NackForRedelivery") == 1
    assert [message.delivery_mode for message in published] == [2]
    assert await h.leftover() == 0


# -- Dramatiq ------------------------------------------------------------------------------


def refuse_every_publish(queue: str) -> Any:
    """A RabbitMQ policy under which ``queue`` refuses every message (max-length 0,
    reject-publish): nacked to a publisher with confirms, dropped silently otherwise."""
    import contextlib
    import subprocess

    @contextlib.contextmanager
    def policy() -> Any:
        rule = json.dumps({"max-length": 0, "overflow": "reject-publish"})
        ctl = ["rabbitmqctl", "--quiet"]
        subprocess.run(
            [*ctl, "set_policy", "--apply-to", "queues", queue, f"^{queue}$", rule],
            check=True,
            capture_output=True,
            timeout=60,
        )
        try:
            yield
        finally:
            subprocess.run([*ctl, "clear_policy", queue], capture_output=True, timeout=60)

    return policy()


def quarantine_attempts(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(text("SELECT max(attempts) FROM inbox_quarantine")) or 0)


def test_dramatiq__quarantine_publish_is_confirmed_without_confirm_delivery(queue, pg_engine):
    import dramatiq
    from dramatiq.brokers.rabbitmq import RabbitmqBroker
    from dramatiq.middleware import AsyncIO

    from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity

    from ..apps.domain import apply_credit
    from ..support.dramatiq_worker import drain, running_worker
    from ..support.workers import wait_for

    services.require(services.RABBITMQ, "RabbitMQ")
    # Given Dramatiq's default RabbitMQ broker (no confirm_delivery), and a quarantine
    # queue that refuses what is published to it
    broker = RabbitmqBroker(url=services.RABBITMQ)
    broker.add_middleware(AsyncIO())
    broker.add_middleware(InboxMiddleware(pg_engine, lock_timeout=10))
    broker.emit_after("process_boot")

    @dramatiq.actor(
        queue_name=queue, inbox_consumer="billing", broker=broker, min_backoff=50, max_backoff=500
    )
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    def send(delta: int) -> None:
        add_credit.send_with_options(
            args=(7, delta), **identity(producer="orders", message_id="ord-1")
        )

    quarantine = f"{queue}.quarantine"
    try:
        with running_worker(broker) as worker:
            send(10)
            drain(broker, queue, worker)
            with refuse_every_publish(quarantine):
                # When a conflicting message is quarantined while the queue refuses it
                send(99)
                wait_for(lambda: quarantine_attempts(pg_engine) >= 2, timeout=10, what="the retry")
            drain(broker, queue, worker)
        depth = broker.channel.queue_declare(quarantine, passive=True).method.message_count
    finally:
        for name in (queue, f"{queue}.DQ", f"{queue}.XQ", quarantine):
            broker.channel.queue_delete(name)
        broker.close()
    # Then the refused publish handed the message back instead of acknowledging it,
    # and once the queue took messages again it was quarantined
    assert depth == 1


def test_dramatiq_destination__refuses_a_rabbitmq_broker_without_confirm_delivery():
    import dramatiq
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    from inbox_middleware.outbox.destinations.dramatiq import DramatiqDestination

    broker = RabbitmqBroker(url=services.RABBITMQ)
    actor = dramatiq.actor(lambda: None, broker=broker, actor_name="noop")
    with pytest.raises(ConfigurationError, match="confirm_delivery=True"):
        DramatiqDestination(actor, producer="orders-outbox")
    broker.close()
