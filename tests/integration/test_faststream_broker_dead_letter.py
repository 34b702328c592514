"""``dead_letter=None``: what the inbox rejects goes to the broker's own dead-letter path.

RabbitMQ rejects without requeue, to the queue's dead-letter exchange; JetStream
terminates the message (one of a batch alone); Redis streams and Kafka have no such path,
so the setting is refused there before anything is consumed. A message with no usable
identity has no record of the inbox's own: a queue with no dead-letter exchange, or a
work-queue stream, would drop it, which the start-up check says.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import Engine, select

from inbox_middleware._core.exceptions import ConfigurationError, PermanentError
from inbox_middleware._storage import InboxSchema
from inbox_middleware.faststream import FastStreamInbox, InboxSession, identity_headers

from ..apps.domain import apply_credit_async, effects
from ..support import services
from ..support.faststream_brokers import NATS_ACK_WAIT, Harness, Seen, eventually, recorder
from ..support.snippets import load_snippet

NO_ID = {"x-inbox-producer": "orders"}  # a producer, no message id: no usable identity


def ident(message_id: str) -> dict[str, str]:
    return identity_headers(producer="orders", message_id=message_id)


@pytest.fixture
def inbox(pg_async_engine: Any) -> FastStreamInbox:
    return FastStreamInbox(pg_async_engine, lock_timeout=10, retry_backoff=(0.05, 0.1))


def poisoned(engine: Engine) -> list[str]:
    poison = InboxSchema().tables.poison
    with engine.connect() as conn:
        return [row.message_id for row in conn.execute(select(poison))]


def crediting(kind: str, inbox: FastStreamInbox) -> tuple[Harness, Seen]:
    """A guarded broker of ``kind`` whose inbox subscriber (``dead_letter=None``) credits
    an account, and the outcomes it records."""
    seen = Seen()
    h = Harness(kind, [recorder(seen), inbox.middleware])
    inbox.guard(h.broker)

    @h.subscribe(inbox.consumer("billing", dead_letter=None))
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    return h, seen


async def rabbit(queue: str, *, declare: bool = False, delete: bool = False) -> list[Any]:
    """Declare, delete or read (every message, consumed) ``queue``; None when reading a
    queue that does not exist."""
    import aio_pika
    from aiormq.exceptions import ChannelNotFoundEntity

    connection = await aio_pika.connect(services.RABBITMQ)
    async with connection:
        channel = await connection.channel()
        if delete:
            await channel.queue_delete(queue)
            return []
        try:
            declared = await channel.declare_queue(queue, durable=True, passive=not declare)
        except ChannelNotFoundEntity:
            return None  # type: ignore[return-value]
        found = []
        while (message := await declared.get(no_ack=True, fail=False)) is not None:
            found.append(message)
        return found


async def test_dead_letter_none__rabbitmq_rejects_to_the_queue_s_dead_letter_exchange(
    inbox, pg_engine, caplog
):
    caplog.set_level(logging.WARNING, logger="inbox_middleware")
    seen = Seen()
    h = Harness("rabbit", [recorder(seen), inbox.middleware])
    inbox.guard(h.broker)
    dead = f"{h.source}.rejected"
    # Given a queue whose dead-letter exchange routes to a queue of its own (the guide's)
    queue = load_snippet("faststream_dead_letter_exchange").rejecting_to_a_queue(h.source)

    @h.broker.subscriber(queue, dependencies=[inbox.consumer("billing", dead_letter=None)])
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        if body["delta"] < 0:
            raise PermanentError("negative_credit", "a negative credit")
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    try:
        await rabbit(dead, declare=True)
        async with h.broker:
            await h.broker.start()
            # When an order, a message with no id and one that fails for good arrive
            await h.publish({"account": 7, "delta": 10}, ident("o-1"))
            await h.publish({"account": 7, "delta": 5}, NO_ID)
            await h.publish({"account": 7, "delta": -1}, ident("o-2"))
            await eventually(lambda: len(seen.outcomes) == 3, what="three outcomes")
        rejected = await rabbit(dead)
        published = await rabbit(f"{h.source}.dead-letter")
        # Then the two rejected went to the queue's dead-letter exchange, with their bodies
        assert sorted(json.loads(message.body)["delta"] for message in rejected) == [-1, 5]
        assert published is None  # the inbox published nothing of its own
        # The one that failed is kept as poison too; the order applied once
        assert poisoned(pg_engine) == ["o-2"]
        with pg_engine.connect() as conn:
            assert effects(conn, 7) == 1
        assert await h.leftover() == 0
        assert "would be lost" not in caplog.text  # the queue has a dead-letter exchange
    finally:
        await rabbit(dead, delete=True)
        await h.cleanup()


async def test_dead_letter_none__a_rabbitmq_queue_without_a_dead_letter_exchange_is_told(
    inbox, caplog
):
    caplog.set_level(logging.WARNING, logger="inbox_middleware")
    h, _ = crediting("rabbit", inbox)

    try:
        async with h.broker:
            await h.broker.start()
            # Then the start-up check says what a rejection would do there, and how to keep it
            assert f"queue {h.source!r} is declared without x-dead-letter-exchange" in caplog.text
            assert "would be lost; keep a dead_letter destination" in caplog.text
    finally:
        await h.cleanup()


async def test_dead_letter_none__jetstream_terminates_the_message_and_never_redelivers_it(
    inbox, pg_engine, caplog
):
    caplog.set_level(logging.WARNING, logger="inbox_middleware")
    h, seen = crediting("nats", inbox)

    try:
        async with h.broker, _terminated(h) as terminated:
            await h.broker.start()
            await h.publish({"account": 7, "delta": 5}, NO_ID)
            await h.publish({"account": 7, "delta": 10}, ident("o-1"))
            await eventually(lambda: len(seen.outcomes) == 2, what="both outcomes")
            assert "would be lost" not in caplog.text  # the stream keeps what is terminated
            # Then the message with no id was terminated (JetStream's advisory says so),
            # and is not delivered again, past the ack wait too
            await eventually(lambda: terminated, what="the termination advisory")
            await asyncio.sleep(NATS_ACK_WAIT + 1)
            info = await _consumer_info(h)
        assert sorted(seen.outcomes) == ["Skipped", "processed"]
        assert [advisory["stream_seq"] for advisory in terminated] == [1]
        assert info.num_redelivered == 0
        assert await h.leftover() == 0
        with pg_engine.connect() as conn:
            assert effects(conn, 7) == 1
    finally:
        await h.cleanup()


@pytest.mark.parametrize("where", ["declared", "on_the_server"])
async def test_dead_letter_none__a_jetstream_work_queue_stream_is_told(inbox, caplog, where):
    import nats
    from faststream.nats import JStream, PullSub
    from nats.js.api import RetentionPolicy

    caplog.set_level(logging.WARNING, logger="inbox_middleware")
    h = Harness("nats", [inbox.middleware])
    inbox.guard(h.broker)
    # Given a work-queue stream, which removes a terminated message as an acknowledged one:
    # declared by the subscriber, or made before and only named by it
    if where == "declared":
        stream = JStream(h.stream, subjects=[h.name], retention=RetentionPolicy.WORK_QUEUE)
    else:
        client = await nats.connect(services.NATS)
        try:
            await client.jetstream().add_stream(
                name=h.stream, subjects=[h.name], retention=RetentionPolicy.WORK_QUEUE
            )
        finally:
            await client.close()
        stream = JStream(h.stream, subjects=[h.name], declare=False)

    @h.broker.subscriber(
        h.name,
        stream=stream,
        durable=f"d{h.name}",
        pull_sub=PullSub(batch_size=16, timeout=0.2),
        dependencies=[inbox.consumer("billing", dead_letter=None)],
    )
    async def handle(body: dict[str, int], session: InboxSession) -> None: ...

    try:
        async with h.broker:
            await h.broker.start()
            # Then the start-up check says what a termination would do there
            assert f"stream {h.stream!r} has workqueue retention" in caplog.text
            assert "would be lost; keep a dead_letter destination" in caplog.text
    finally:
        await h.cleanup()


async def test_dead_letter_none__jetstream_terminates_one_message_of_a_batch(inbox, pg_engine):
    seen = Seen()
    h = Harness("nats", [recorder(seen), inbox.middleware])
    inbox.guard(h.broker)
    batches: list[int] = []

    @h.subscribe(inbox.consumer("billing", dead_letter=None), batch=True)
    async def handle(bodies: list[dict[str, int]], session: InboxSession) -> None:
        batches.append(len(bodies))
        for body in bodies:
            await apply_credit_async(session, "billing", body["account"], body["delta"])

    try:
        await h.prepare_source()
        # Given a batch of two orders and a message with no id between them
        async with h.broker, _terminated(h) as terminated:
            await h.publish({"account": 7, "delta": 10}, ident("o-1"))
            await h.publish({"account": 7, "delta": 5}, NO_ID)
            await h.publish({"account": 8, "delta": 20}, ident("o-2"))
            await h.broker.start()
            await eventually(lambda: sum(batches) == 2, what="the two orders")
            await eventually(lambda: _settled(h), what="the batch settled")
            await eventually(lambda: terminated, what="the termination advisory")
        # Then the orders applied, the message with no id (the stream's second) was
        # terminated alone, and nothing waits for a redelivery
        assert batches == [2]
        assert [advisory["stream_seq"] for advisory in terminated] == [2]
        with pg_engine.connect() as conn:
            assert (effects(conn, 7), effects(conn, 8)) == (1, 1)
        assert await h.leftover() == 0
        assert (await _consumer_info(h)).num_redelivered == 0
    finally:
        await h.cleanup()


@pytest.mark.parametrize("kind", ["redis", "kafka"])
async def test_dead_letter_none__refused_where_the_broker_has_no_dead_letter_path(inbox, kind):
    h = Harness(kind, [inbox.middleware])
    inbox.guard(h.broker)

    @h.subscribe(inbox.consumer("billing", dead_letter=None))
    async def handle(body: dict[str, int], session: InboxSession) -> None: ...

    with pytest.raises(ConfigurationError, match="has no dead-letter path of its own") as refused:
        await inbox.check(h.broker)
    assert "dead_letter=None" in str(refused.value)


async def _consumer_info(h: Harness) -> Any:
    import nats

    client = await nats.connect(services.NATS)
    try:
        return await client.jetstream().consumer_info(h.stream, f"d{h.name}")
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def _terminated(h: Harness) -> AsyncIterator[list[dict[str, Any]]]:
    """The MSG_TERMINATED advisories JetStream publishes for the harness's consumer (a
    message its subscriber terminated), collected while the block runs."""
    import nats

    advisories: list[dict[str, Any]] = []

    async def collect(msg: Any) -> None:
        advisories.append(json.loads(msg.data))

    client = await nats.connect(services.NATS)
    try:
        subject = f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{h.stream}.d{h.name}"
        await client.subscribe(subject, cb=collect)
        await client.flush()
        yield advisories
    finally:
        await client.close()


async def _settled(h: Harness) -> bool:
    return await h.leftover() == 0
