"""Kafka on FastStream's TestKafkaBroker (in memory) with the real PostgreSQL: unit-level
checks of the inbox's decisions and the guard, as an app's own tests would run them. The
proof on a real broker (tansu) is in test_faststream_kafka_broker.py and the tests shared
with the other brokers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from faststream import AckPolicy
from faststream.kafka import KafkaBroker, TestKafkaBroker
from faststream.kafka.annotations import KafkaMessage
from sqlalchemy import text

from inbox_middleware._core.exceptions import ConfigurationError
from inbox_middleware._core.protocol import Decision
from inbox_middleware.faststream import (
    FastStreamInbox,
    InboxBatch,
    InboxSession,
    identity_headers,
)

from ..apps.domain import apply_credit_async, effects
from ..support.faststream_brokers import Seen, recorder

ORDER = {"account": 7, "delta": 10}


def ident(message_id: str = "ord-1") -> dict[str, str]:
    return identity_headers(producer="orders", message_id=message_id)


@pytest.fixture
def inbox(pg_async_engine: Any) -> FastStreamInbox:
    return FastStreamInbox(pg_async_engine, retry_backoff=(0.01, 0.05))


async def test_faststream_kafka__guard_refuses_the_default_ack_first(inbox):
    broker = KafkaBroker(middlewares=[inbox.middleware])

    @broker.subscriber("orders", dependencies=[inbox.consumer("billing")])
    async def handle(body: dict[str, int], session: InboxSession) -> None: ...

    async with TestKafkaBroker(broker):
        with pytest.raises(ConfigurationError, match="default to AckPolicy.ACK_FIRST"):
            await inbox.check(broker)


async def test_faststream_kafka__duplicates_skipped_conflicts_quarantined(inbox, pg_engine):
    seen = Seen()
    broker = KafkaBroker(middlewares=[recorder(seen), inbox.middleware])
    quarantined: list[tuple[dict[str, Any], dict[str, Any]]] = []

    @broker.subscriber(
        "orders",
        group_id="billing",
        ack_policy=AckPolicy.ACK,
        dependencies=[inbox.consumer("billing")],
    )
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    @broker.subscriber("orders.quarantine")
    async def people(body: dict[str, int], message: KafkaMessage) -> None:
        quarantined.append((body, message.headers))

    async with TestKafkaBroker(broker):
        await inbox.check(broker)
        await broker.publish(ORDER, "orders", headers=ident())
        await broker.publish(ORDER, "orders", headers=ident())
        await broker.publish({"account": 7, "delta": 99}, "orders", headers=ident())
    # (the quarantine topic's subscriber is a plain one, seen by the recorder too)
    assert seen.outcomes == ["processed", "Skipped", "processed", "Skipped"]
    ((body, headers),) = quarantined
    assert body == {"account": 7, "delta": 99}
    assert headers["x-inbox-message-id"] == "ord-1"
    assert json.loads(headers["x-inbox-conflict"])["reason"] == "identity_conflict"
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 1
        assert conn.scalar(text("SELECT count(*) FROM inbox_quarantine")) == 1


async def test_faststream_kafka__failure_rolls_back_and_hands_back(inbox, pg_engine):
    seen = Seen()
    broker = KafkaBroker(middlewares=[recorder(seen), inbox.middleware])

    @broker.subscriber(
        "orders",
        group_id="billing",
        ack_policy=AckPolicy.NACK_ON_ERROR,
        dependencies=[inbox.consumer("billing")],
    )
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])
        raise RuntimeError("boom")

    async with TestKafkaBroker(broker):
        await inbox.check(broker)
        with pytest.raises(RuntimeError, match="boom"):
            await broker.publish(ORDER, "orders", headers=ident())
    assert seen.outcomes == ["RuntimeError"]
    with pg_engine.connect() as conn:
        assert effects(conn) == 0
        assert conn.scalar(text("SELECT count(*) FROM consumer_inbox")) == 0


async def test_faststream_kafka__batch_claims_once_and_reports_each_decision(inbox, pg_engine):
    broker = KafkaBroker(middlewares=[inbox.middleware])
    calls: list[tuple[list[Any], list[Decision | None]]] = []

    @broker.subscriber(
        "orders",
        batch=True,
        group_id="billing",
        ack_policy=AckPolicy.ACK,
        dependencies=[inbox.consumer("billing")],
    )
    async def handle(
        bodies: list[dict[str, int]], session: InboxSession, batch: InboxBatch
    ) -> None:
        calls.append((bodies, [item.decision for item in batch]))
        for body in bodies:
            await apply_credit_async(session, "billing", body["account"], body["delta"])

    async with TestKafkaBroker(broker):
        await inbox.check(broker)
        await broker.publish(ORDER, "orders", headers=ident("o-1"))
        # (the test broker's publish_batch gives every message of a batch the same headers)
        await broker.publish_batch(
            ORDER, ORDER, {"account": 7, "delta": 20}, topic="orders", headers=ident("o-1")
        )
        await broker.publish_batch(
            {"account": 7, "delta": 30},
            {"account": 7, "delta": 30},
            topic="orders",
            headers=ident("o-2"),
        )
    assert calls == [
        ([ORDER], [Decision.FIRST]),
        # o-1 twice, then o-1 with another amount: nothing first seen, the handler skipped
        ([{"account": 7, "delta": 30}], [Decision.FIRST, Decision.DUPLICATE]),
    ]
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 2
        rows = conn.execute(text("SELECT message_id, payload FROM inbox_quarantine")).all()
    assert [(r.message_id, json.loads(r.payload)) for r in rows] == [
        ("o-1", {"account": 7, "delta": 20})
    ]


@pytest.mark.parametrize(
    ("declare", "reason"),
    [
        pytest.param({"pattern": "orders.*"}, "reads one named topic, not a pattern", id="pattern"),
        pytest.param({"consumer_only": True}, "the inbox needs its producer", id="consumer-only"),
        pytest.param({"ack_policy": AckPolicy.MANUAL}, "AckPolicy.MANUAL", id="manual"),
    ],
)
async def test_faststream_kafka__guard_refuses_what_it_cannot_settle(inbox, declare, reason):
    options = dict(declare)
    broker = KafkaBroker(
        middlewares=[inbox.middleware], consumer_only=options.pop("consumer_only", False)
    )
    topic = {} if "pattern" in options else {"topic": "orders"}
    options.setdefault("ack_policy", AckPolicy.ACK)

    @broker.subscriber(
        *topic.values(), group_id="billing", dependencies=[inbox.consumer("billing")], **options
    )
    async def handle(body: dict[str, int], session: InboxSession) -> None: ...

    async with TestKafkaBroker(broker):
        with pytest.raises(ConfigurationError, match=reason):
            await inbox.check(broker)
