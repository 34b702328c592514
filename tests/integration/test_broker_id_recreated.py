"""``missing_identity="broker_id"`` names a JetStream message by its stream sequence and
the time the stream stored it, a Kafka record by its partition, offset and timestamp:
stable across redeliveries of one stored message, distinct after the stream or topic is
deleted and created again (its sequences and offsets restart). During a
rolling deploy, a message an earlier worker claimed under the earlier form (the sequence
alone) is a duplicate for a new worker when that claim was made after the message was
stored; a claim of that form made before belongs to another message. Real NATS JetStream,
Kafka (tansu) and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats
import pytest
from sqlalchemy import Engine, text

from inbox_middleware._core.identity import MessageIdentity
from inbox_middleware.faststream import FastStreamInbox, InboxSession
from inbox_middleware.faststream._payload import delivery

from ..apps.domain import apply_credit_async, balance, effects
from ..support import kafka, services
from ..support.faststream_brokers import Harness, Seen, eventually, recorder


def _ledger(engine: Engine) -> tuple[int, int, int]:
    with engine.connect() as conn:
        quarantined = conn.scalar(text("SELECT count(*) FROM inbox_quarantine"))
        return effects(conn, 7), balance(conn, 7), int(quarantined or 0)


def _inbox_harness(
    inbox: FastStreamInbox, seen: Seen, name: str | None = None, kind: str = "nats"
) -> Harness:
    h = Harness(kind, [recorder(seen), inbox.middleware])
    h.partition = 0  # Kafka: every record on one partition, offsets from 0
    if name is not None:
        h.name, h.stream = name, name.upper()
        h.group = f"g2{name}"  # Kafka: a new deployment's group, reading from the start
    inbox.guard(h.broker)

    @h.subscribe(inbox.consumer("billing", missing_identity="broker_id"))
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    return h


async def _run(h: Harness, seen: Seen, deltas: list[int], settled: int) -> None:
    if h.kind == "kafka":
        await h.prepare_source()
    async with h.broker:
        await h.broker.start()
        for delta in deltas:
            await h.publish({"account": 7, "delta": delta})  # no identity headers
        await eventually(lambda: len(seen.outcomes) >= settled, what="the messages settled")
        await asyncio.sleep(0.5)  # a redelivery settled twice would show up here


async def _delete_source(h: Harness) -> None:
    if h.kind == "kafka":
        await kafka.delete_topics([h.name])
        await asyncio.sleep(0.5)
        return
    client = await nats.connect(services.NATS)
    try:
        await client.jetstream().delete_stream(h.stream)
    finally:
        await client.close()


@pytest.mark.parametrize("kind", ["nats", "kafka"])
async def test_broker_id__a_recreated_stream_or_topic_names_its_messages_anew(
    kind, pg_async_engine, pg_engine
):
    inbox = FastStreamInbox(pg_async_engine, lock_timeout=10, retry_backoff=(0.05, 0.5))
    seen = Seen()
    # Given a stream (topic) whose two messages were processed
    first = _inbox_harness(inbox, seen, kind=kind)
    try:
        await _run(first, seen, [10, 20], settled=2)
        assert _ledger(pg_engine) == (2, 30, 0)
        # When it is deleted and created again, and two messages sent: the first with the
        # body of the old first (its sequence or offset comes back), the second another
        await _delete_source(first)
        fresh = FastStreamInbox(pg_async_engine, lock_timeout=10)
        again = _inbox_harness(fresh, seen, first.name, kind=kind)
        await _run(again, seen, [10, 5], settled=4)
    finally:
        await first.cleanup()
    # Then both are processed: neither skipped as a duplicate nor quarantined
    assert seen.outcomes.count("processed") == 4, seen.outcomes
    assert _ledger(pg_engine) == (4, 45, 0)


async def _claim_as_an_earlier_worker(
    inbox: FastStreamInbox, stream: str, source: str, sequence: int, delta: int
) -> None:
    """What a worker of the earlier version did with the message it named by its stream
    sequence alone: claim it and apply it, in one transaction."""
    body = {"account": 7, "delta": delta}
    claim = delivery(
        consumer="billing",
        identity=MessageIdentity(f"nats-stream:{stream}", str(sequence)),
        body=json.dumps(body).encode(),
        headers={},
        handler_version="",
        source=source,
        canonical=None,
        content_type="application/json",
    )

    async def handler(session: Any) -> None:
        await apply_credit_async(session, "billing", 7, delta)

    await inbox.storage.process(claim, handler)


async def test_broker_id__a_claim_of_the_earlier_form_is_a_duplicate_once_the_message_was_stored(
    pg_async_engine, pg_engine
):
    inbox = FastStreamInbox(pg_async_engine, lock_timeout=10, retry_backoff=(0.05, 0.5))
    seen = Seen()
    h = _inbox_harness(inbox, seen)
    try:
        await h.prepare_source()
        # Given message 1, stored, then processed by an earlier worker (a rolling deploy:
        # its redelivery reaches a new worker), and a claim of sequence 2 an earlier worker
        # made before message 2 was stored (a stream re-created since)
        async with Harness("nats", []).broker as producer:
            await producer.publish({"account": 7, "delta": 10}, h.name)
            await asyncio.sleep(0.05)
            await _claim_as_an_earlier_worker(inbox, h.stream, h.name, 1, 10)
            await _claim_as_an_earlier_worker(inbox, h.stream, h.name, 2, 100)
            await asyncio.sleep(0.05)
            await producer.publish({"account": 7, "delta": 20}, h.name)
        assert _ledger(pg_engine) == (2, 110, 0)
        # When a new worker receives both
        await _run(h, seen, [], settled=2)
    finally:
        await h.cleanup()
    # Then message 1 is a duplicate of the earlier worker's claim, message 2 is processed
    assert seen.outcomes.count("processed") == 1, seen.outcomes
    assert _ledger(pg_engine) == (3, 130, 0)
