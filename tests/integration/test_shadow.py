"""Shadow mode: claims recorded, duplicates and conflicts processed and counted, nothing
skipped; then enforcement on the same tables, with no migration, skips what shadow mode
would have skipped."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import dramatiq
from sqlalchemy import select, text

from inbox_middleware._core.identity import MessageIdentity, PayloadHash
from inbox_middleware._core.protocol import (
    Claim,
    Decision,
    Delivery,
    LookUp,
    StoredClaim,
    claim_steps,
)
from inbox_middleware._storage import InboxSchema
from inbox_middleware._storage.executors import shadow_verdict
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity
from inbox_middleware.faststream import FastStreamInbox, InboxSession, identity_headers

from ..apps.domain import apply_credit, apply_credit_async, effects
from ..support.dramatiq_worker import drain, running_worker
from ..support.faststream_brokers import Harness, eventually

TABLES = InboxSchema().tables


def counted(consumer: str, producer: str, decision: str, *, shadow: bool = False) -> float:
    """A counter's value straight from the registry this process exports."""
    from prometheus_client import REGISTRY

    name = "inbox_shadow_would_skip_total" if shadow else "inbox_messages_total"
    labels = {"consumer": consumer, "producer": producer, "decision": decision}
    return REGISTRY.get_sample_value(name, labels) or 0.0


def claims(engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(select(TABLES.inbox)).mappings()]


def quarantined(engine) -> int:
    with engine.connect() as conn:
        return len(conn.execute(select(TABLES.quarantine)).all())


def test_protocol__shadow_conflict_is_decided_but_not_recorded():
    delivery = Delivery(
        "billing", MessageIdentity("orders", "m-1"), PayloadHash("json.v1", "b" * 64), shadow=True
    )
    steps = claim_steps(delivery)
    assert isinstance(next(steps), Claim)
    assert isinstance(steps.send(False), LookUp)
    try:
        steps.send(StoredClaim("a" * 64, "json.v1", "1", datetime.now(UTC)))
    except StopIteration as done:
        verdict = done.value
    else:
        raise AssertionError("a shadow conflict must not ask to record a quarantine row")
    assert (verdict.decision, verdict.shadow, verdict.runs_handler) == (
        Decision.CONFLICT,
        True,
        True,
    )
    assert verdict.quarantine is None


def test_shadow__dramatiq_processes_everything_then_enforcement_skips(
    rabbitmq_broker, redis_broker, queue, pg_engine
):
    consumer = f"billing-{uuid.uuid4().hex[:6]}"
    seen: list[tuple[int, bool]] = []

    def declare(broker: dramatiq.Broker, **options: Any) -> Any:
        @dramatiq.actor(
            broker=broker,
            actor_name="add_credit",
            queue_name=queue,
            inbox_consumer=consumer,
            **options,
        )
        def add_credit(account_id: int, delta: int) -> None:
            session = current_session()
            seen.append((delta, shadow_verdict(session) is not None))
            apply_credit(session, consumer, account_id, delta)

        return add_credit

    def send(actor: Any, delta: int, message_id: str = "ord-1") -> None:
        actor.send_with_options(
            args=(7, delta), **identity(producer="orders", message_id=message_id)
        )

    # Given a consumer in shadow mode (the middleware's default here, on RabbitMQ)
    rabbitmq_broker.add_middleware(InboxMiddleware(pg_engine, shadow=True))
    shadowed = declare(rabbitmq_broker)
    with running_worker(rabbitmq_broker) as worker:
        send(shadowed, 10)
        drain(rabbitmq_broker, queue, worker)
        # When a duplicate, a conflict and a message without identity arrive
        send(shadowed, 10)
        drain(rabbitmq_broker, queue, worker)
        send(shadowed, 99)
        shadowed.send_with_options(args=(7, 1))
        drain(rabbitmq_broker, queue, worker)

    # Then every one was processed, the would-be skips were flagged to the handler and
    # counted, and the claim row is the first processing's, as enforcement writes it
    assert sorted(seen) == [(1, False), (10, False), (10, True), (99, True)]
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 4
    (claim,) = claims(pg_engine)
    assert (claim["consumer_name"], claim["message_id"]) == (consumer, "ord-1")
    assert quarantined(pg_engine) == 0  # a shadow conflict is counted, not recorded
    for decision in ("first", "duplicate", "conflict"):
        assert counted(consumer, "orders", decision) == 1
    assert counted(consumer, "orders", "duplicate", shadow=True) == 1
    assert counted(consumer, "orders", "conflict", shadow=True) == 1
    assert counted(consumer, "orders", "first", shadow=True) == 0

    # When the same consumer enforces (on Redis here), with the same tables
    seen.clear()
    redis_broker.add_middleware(InboxMiddleware(pg_engine))
    enforced = declare(redis_broker)
    with running_worker(redis_broker) as worker:
        send(enforced, 10)  # the intent shadow mode processed first
        send(enforced, 99)  # the conflicting payload
        send(enforced, 5, message_id="ord-2")
        drain(redis_broker, queue, worker)

    # Then the duplicate is skipped, the conflict quarantined, a new intent processed
    assert seen == [(5, False)]
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 5
    assert quarantined(pg_engine) == 1
    assert {c["message_id"] for c in claims(pg_engine)} == {"ord-1", "ord-2"}


async def test_shadow__faststream_processes_duplicates_and_counts_them(pg_async_engine, pg_engine):
    consumer = f"ledger-{uuid.uuid4().hex[:6]}"
    inbox = FastStreamInbox(pg_async_engine, lock_timeout=10, retry_backoff=(0.05, 0.5))
    seen: list[tuple[int, bool]] = []

    def declare(h: Harness, **options: Any) -> None:
        @h.subscribe(inbox.consumer(consumer, **options))
        async def handle(body: dict[str, int], session: InboxSession) -> None:
            seen.append((body["delta"], shadow_verdict(session.sync_session) is not None))
            await apply_credit_async(session, consumer, body["account"], body["delta"])

    def applied() -> int:
        with pg_engine.connect() as conn:
            return effects(conn, 3)

    ident = identity_headers(producer="shop", message_id="o-1")
    # Given a subscriber in shadow mode (this one only), on a Redis stream
    shadow = Harness("redis", [inbox.middleware])
    inbox.guard(shadow.broker)
    declare(shadow, shadow=True)
    before = counted(consumer, "shop", "duplicate", shadow=True)
    try:
        async with shadow.broker:
            await shadow.broker.start()
            await shadow.publish({"account": 3, "delta": 4}, ident)
            await eventually(lambda: applied() == 1, what="the first effect")
            await shadow.publish({"account": 3, "delta": 4}, ident)
            await shadow.publish({"account": 3, "delta": 8}, ident)
            await shadow.publish({"account": 3, "delta": 1}, {"x-inbox-producer": "shop"})
            await eventually(lambda: applied() == 4, what="every message processed")
    finally:
        await shadow.cleanup()
    assert sorted(seen) == [(1, False), (4, False), (4, True), (8, True)]
    assert counted(consumer, "shop", "duplicate", shadow=True) - before == 1
    assert counted(consumer, "shop", "conflict", shadow=True) == 1
    assert quarantined(pg_engine) == 0

    # When the same consumer enforces, on a RabbitMQ queue
    seen.clear()
    enforcing = Harness("rabbit", [inbox.middleware])
    inbox.guard(enforcing.broker)
    declare(enforcing)
    try:
        async with enforcing.broker:
            await enforcing.broker.start()
            await enforcing.publish({"account": 3, "delta": 4}, ident)
            await enforcing.publish({"account": 3, "delta": 8}, ident)
            await eventually(lambda: quarantined(pg_engine) == 1, what="the conflict quarantined")
            await eventually(
                lambda: counted(consumer, "shop", "duplicate") == 2, what="the duplicate skipped"
            )
    finally:
        await enforcing.cleanup()
    assert seen == []
    assert applied() == 4
    with pg_engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM consumer_inbox")) == 1
