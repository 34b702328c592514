"""The FastStream adapter on the real PostgreSQL and real RabbitMQ, Redis streams, NATS
JetStream and Kafka: one in-process broker per test, on its own queue, stream, subject or
topic."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from faststream import AckPolicy
from sqlalchemy import Engine, select, text

from inbox_middleware._core.exceptions import ConfigurationError
from inbox_middleware._core.identity import MissingIdentity
from inbox_middleware._storage import InboxSchema
from inbox_middleware.faststream import (
    FastStreamInbox,
    InboxSession,
    StampIdentity,
    identity_headers,
)
from inbox_middleware.faststream._consumer import InboxConsumer

from ..apps.domain import apply_credit_async, balance, effects
from ..support import services
from ..support.engines import async_engine
from ..support.faststream_brokers import KINDS, Harness, Seen, eventually, recorder
from ..support.proxy import Proxy

ORDER = {"account": 7, "delta": 10}


def ident(message_id: str = "ord-1", **extra: str) -> dict[str, str]:
    """Identity headers, plus any other headers given."""
    return identity_headers(producer="orders", message_id=message_id) | extra


def applied(engine: Engine, account: int = 7) -> int:
    with engine.connect() as conn:
        return effects(conn, account)


def claims(engine: Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(text("SELECT * FROM consumer_inbox")).mappings()]


def quarantine_rows(engine: Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(select(InboxSchema().tables.quarantine)).mappings()
        return [dict(r) for r in rows]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def seen() -> Seen:
    return Seen()


@pytest.fixture
def inbox(pg_async_engine: Any) -> FastStreamInbox:
    return FastStreamInbox(pg_async_engine, lock_timeout=10, retry_backoff=(0.05, 0.5))


@pytest.fixture
async def h(kind: str, inbox: FastStreamInbox, seen: Seen) -> Any:
    harness = Harness(kind, [recorder(seen), inbox.middleware])
    inbox.guard(harness.broker)
    yield harness
    await harness.cleanup()


def credit(h: Harness, inbox: FastStreamInbox, **options: Any) -> Any:
    """The protected handler most tests use: credit the account named in the body."""

    @h.subscribe(inbox.consumer("billing", handler_version="3"), **options)
    async def handle(body: dict[str, Any], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    return handle


# -- duplicates --------------------------------------------------------------------------


async def test_faststream__sequential_duplicate_has_one_effect(h, inbox, pg_engine, seen):
    credit(h, inbox)
    async with h.broker:
        await h.broker.start()
        await h.publish(ORDER, ident())
        await eventually(lambda: applied(pg_engine) == 1, what="the effect")
        # The same intent again, once as sent and once with its keys in another order
        await h.publish(ORDER, ident())
        await h.publish({"delta": 10, "account": 7}, ident())
        await eventually(lambda: seen.count("Skipped") == 2, what="two skipped duplicates")
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
    (row,) = claims(pg_engine)
    assert (row["consumer_name"], row["producer_name"], row["tenant"], row["message_id"]) == (
        "billing",
        "orders",
        "",
        "ord-1",
    )
    assert (row["handler_version"], row["hash_scheme"]) == ("3", "faststream-json.v2")
    assert await h.leftover() == 0


@pytest.mark.parametrize("kind", ["rabbit"])
async def test_faststream__the_consumer_dependency_checks_until_the_middleware_settles_it(
    h, inbox, pg_engine, seen, monkeypatch
):
    # Given the consumer dependency's own check counted, and one handler subscribed
    # on a broker the inbox's middleware runs and on one without it
    resolved: list[str] = []
    check = InboxConsumer.__call__

    async def counted(self: InboxConsumer) -> None:
        resolved.append(self.name)
        await check(self)

    monkeypatch.setattr(InboxConsumer, "__call__", counted)
    handle = credit(h, inbox)
    bare = Harness("rabbit", [])
    bare.broker.subscriber(bare.source, dependencies=[inbox.consumer("billing")])(handle)
    async with h.broker:
        await h.broker.start()
        # When three messages run through the inbox
        for n in range(3):
            await h.publish(ORDER, ident(f"ord-{n}"))
        await eventually(lambda: applied(pg_engine) == 3, what="three effects")
    # Then each applied once, and the dependency never resolved: the middleware settles
    # every message of this subscriber, and took it off the subscriber's calls first
    assert seen.count("processed") == 3
    assert resolved == []
    # And on the broker without the middleware the same handler resolves it, and refuses
    from faststream.rabbit import TestRabbitBroker

    async with TestRabbitBroker(bare.broker) as broker:
        with pytest.raises(ConfigurationError, match="not running under the inbox middleware"):
            await broker.publish(ORDER, bare.source, headers=ident("ord-9"))
    assert resolved == ["billing"]
    assert applied(pg_engine) == 3


# Kafka reads each partition one message at a time: its concurrent duplicates are two
# group members on two partitions (test_faststream_kafka_broker.py).
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "kafka"])
async def test_faststream__concurrent_duplicates_have_one_effect(h, inbox, pg_engine, seen):
    # Given a handler that holds its claim for a second, and consumers that take up to
    # sixteen messages at once (RabbitMQ: one task per delivery; Redis, NATS: max_workers)
    @h.subscribe(inbox.consumer("billing"), max_workers=None if h.kind == "rabbit" else 16)
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])
        await asyncio.sleep(1)

    async with h.broker:
        await h.broker.start()
        # When one intent is delivered sixteen times at once
        await asyncio.gather(*(h.publish(ORDER, ident()) for _ in range(16)))
        await eventually(lambda: len(seen.outcomes) >= 16, timeout=30, what="16 outcomes")
    # Then all sixteen were in flight together, and the effect was applied once
    first_sixteen = sorted(seen.arrivals)[:16]
    assert first_sixteen[-1] - first_sixteen[0] < 1, "the deliveries should have overlapped"
    assert seen.count("processed") == 1
    assert seen.count("Skipped") == len(seen.outcomes) - 1
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
    assert await h.leftover() == 0


async def test_faststream__exception_after_claim_is_retried_and_applied_once(
    h, inbox, pg_engine, seen
):
    attempts: list[int] = []

    @h.subscribe(inbox.consumer("billing"))
    async def flaky(body: dict[str, int], session: InboxSession) -> None:
        attempts.append(1)
        await apply_credit_async(session, "billing", body["account"], body["delta"])
        if len(attempts) == 1:
            raise RuntimeError("payment gateway timed out")

    async with h.broker:
        await h.broker.start()
        await h.publish(ORDER, ident())
        await eventually(lambda: applied(pg_engine) == 1, what="the retried effect")
        await eventually(lambda: seen.count("processed") == 1, what="the ack")
    assert len(attempts) == 2
    assert seen.outcomes == ["RuntimeError", "processed"]
    assert len(claims(pg_engine)) == 1
    assert await h.leftover() == 0


async def test_faststream__handler_commit_is_refused_and_the_message_kept_as_poison(
    h, inbox, pg_engine, seen
):
    @h.subscribe(inbox.consumer("billing"))
    async def commits(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])
        await session.commit()

    async with h.broker:
        await h.broker.start()
        await h.publish(ORDER, ident())
        await eventually(lambda: seen.count("Skipped") == 1, what="the poisoned message")
        dead = await h.read(f"{h.source}.dead-letter")
    # A programming error that fails the same way every time: kept as poison at its first
    # attempt with the reason, dead-lettered, nothing applied
    with pg_engine.connect() as conn:
        (row,) = conn.execute(select(InboxSchema().tables.poison)).mappings()
    assert (row["reason_code"], row["attempts"]) == ("handler_transaction", 1)
    assert (
        "the handler called commit(); the inbox commits when the handler returns" in (row["error"])
    )
    assert len(dead) == 1
    assert (applied(pg_engine), claims(pg_engine)) == (0, [])


# -- conflicts and unusable messages -----------------------------------------------------


async def test_faststream__conflict_is_quarantined_published_and_acked(h, inbox, pg_engine, seen):
    credit(h, inbox)
    async with h.broker:
        await h.broker.start()
        await h.publish(ORDER, ident())
        await eventually(lambda: applied(pg_engine) == 1, what="the effect")
        # When the producer reuses its id for another payload
        await h.publish({"account": 7, "delta": 99}, ident(trace="t-2"))
        await eventually(lambda: seen.count("Skipped") == 1, what="the skipped conflict")
        published = await h.read(f"{h.source}.quarantine")
    # Then the body did not run, the conflict is recorded with its payload, published to
    # the quarantine destination with its headers and the details, and the original acked
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
    (row,) = quarantine_rows(pg_engine)
    assert (row["message_id"], row["decision"], row["attempts"]) == ("ord-1", "pending", 1)
    assert (row["source"], row["handler_version"]) == (h.source, "3")
    assert json.loads(bytes(row["payload"])) == {"account": 7, "delta": 99}
    assert row["headers"]["x-inbox-message-id"] == "ord-1"
    ((body, headers),) = published
    assert json.loads(body) == {"account": 7, "delta": 99}
    assert (headers["x-inbox-producer"], headers["trace"]) == ("orders", "t-2")
    conflict = json.loads(headers["x-inbox-conflict"])
    assert conflict["quarantine_id"] == row["id"]
    assert (conflict["stored_sha256"], conflict["conflicting_sha256"]) == (
        row["stored_sha256"],
        row["conflicting_sha256"],
    )
    assert (conflict["consumer"], conflict["source"]) == ("billing", h.source)
    assert await h.leftover() == 0


UNUSABLE = [
    pytest.param({}, "has no x-inbox-producer and no x-inbox-message-id", id="none"),
    pytest.param({"x-inbox-producer": "orders"}, "has no x-inbox-message-id", id="no-id"),
    pytest.param(
        {"x-inbox-producer": "orders", "x-inbox-message-id": ""},
        "x-inbox-message-id is empty",
        id="empty",
    ),
    pytest.param(
        {"x-inbox-producer": "orders", "x-inbox-message-id": "x" * 300},
        "x-inbox-message-id is 300 characters long",
        id="too-long",
    ),
    pytest.param(
        {"x-inbox-producer": "o\x01", "x-inbox-message-id": "m"},
        "x-inbox-producer contains U+0001",
        id="control-character",
    ),
    pytest.param(
        {"x-inbox-producer": "o", "x-inbox-message-id": "m", "x-inbox-produced-at": "today"},
        "x-inbox-produced-at is not an ISO 8601 timestamp",
        id="bad-timestamp",
    ),
]


@pytest.mark.parametrize(("headers", "reason"), UNUSABLE)
async def test_faststream__unusable_identity_is_dead_lettered_with_a_clear_log(
    h, inbox, pg_engine, seen, caplog, headers, reason
):
    caplog.set_level(logging.ERROR, logger="inbox_middleware")
    credit(h, inbox)
    async with h.broker:
        await h.broker.start()
        await h.publish(ORDER, headers)
        await eventually(lambda: seen.outcomes, what="the rejection")
        dead = await h.read(f"{h.source}.dead-letter")
    # Then nothing ran, the reason names the header, and the message is kept, with the
    # reason, in the dead-letter destination (and acked at its source)
    assert seen.outcomes == ["Skipped"]
    assert "rejecting a message for inbox consumer billing" in caplog.text
    assert reason in caplog.text
    ((body, dead_headers),) = dead
    assert json.loads(body) == ORDER
    rejected = json.loads(dead_headers["x-inbox-rejected"])
    assert reason in rejected["detail"]
    assert rejected["reason"] in ("MissingIdentity", "InvalidIdentity")
    # The consumer and the source are known though the message's identity is not
    assert (rejected["consumer"], rejected["source"]) == ("billing", h.source)
    assert (applied(pg_engine), claims(pg_engine)) == (0, [])
    assert await h.leftover() == 0


async def test_faststream__body_that_does_not_fit_the_handler_is_dead_lettered(
    inbox, pg_engine, seen, caplog
):
    caplog.set_level(logging.ERROR, logger="inbox_middleware")
    h = Harness("rabbit", [recorder(seen), inbox.middleware])
    inbox.guard(h.broker)

    @h.subscribe(inbox.consumer("billing"))
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    try:
        async with h.broker:
            await h.broker.start()
            await h.publish({"account": "seven", "delta": 10}, ident())
            await eventually(lambda: seen.outcomes, what="the rejection")
            dead = await h.read(f"{h.source}.dead-letter")
    finally:
        await h.cleanup()
    assert seen.outcomes == ["Skipped"]
    assert "the message does not fit the handler" in caplog.text
    assert "Unfit" in json.loads(dead[0][1]["x-inbox-rejected"])["reason"]
    assert (applied(pg_engine), claims(pg_engine)) == (0, [])


# -- the database is down ----------------------------------------------------------------


async def test_faststream__database_down_at_claim_time_hands_back_and_loses_nothing(
    h, pg_async_url, pg_engine, seen
):
    # Given an inbox whose database connection runs through a proxy we can break, and a
    # retry backoff from 0.2 s doubling up to 1 s
    proxy = Proxy(services.postgres_address())
    engine = async_engine(services.via_port(pg_async_url, proxy.port), pool_pre_ping=True)
    inbox = FastStreamInbox(engine, retry_backoff=(0.2, 1.0))
    h.broker.add_middleware(inbox.middleware)
    inbox.guard(h.broker)
    credit(h, inbox)
    try:
        async with h.broker:
            await h.broker.start()
            proxy.down()
            await h.publish(ORDER, ident())
            # When the claim cannot reach the database: handed back, redelivered, again...
            await eventually(lambda: seen.count("NackForRedelivery") >= 2, what="two hand-backs")
            await asyncio.sleep(2)
            during_outage = seen.count("NackForRedelivery")
            assert applied(pg_engine) == 0
            # Then, once the database is back, it is applied exactly once
            proxy.up()
            await eventually(lambda: applied(pg_engine) == 1, timeout=20, what="the effect")
            await eventually(lambda: seen.count("processed") == 1, what="the ack")
    finally:
        await engine.dispose()
        proxy.close()
    # ... and the outage was not a hot redelivery loop: a few attempts in ~3 s, not hundreds
    assert 2 <= during_outage <= 10
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
    assert await h.leftover() == 0


# -- the start-up guard ------------------------------------------------------------------


REFUSED_POLICIES = [
    pytest.param(AckPolicy.ACK_FIRST, "AckPolicy.ACK_FIRST", id="ack-first"),
    pytest.param(AckPolicy.MANUAL, "AckPolicy.MANUAL", id="manual"),
]


@pytest.mark.parametrize(("policy", "reason"), REFUSED_POLICIES)
async def test_faststream__guard_refuses_an_ack_policy_before_consuming(
    h, inbox, pg_engine, seen, policy, reason
):
    # Given a message waiting at the source, and an inbox subscriber with a policy under
    # which the inbox cannot decide the outcome (NATS: ACK_FIRST is a push consumer's)
    await h.prepare_source()
    if h.kind == "nats" and policy is AckPolicy.ACK_FIRST:
        from faststream.nats import JStream

        @h.broker.subscriber(
            h.source,
            stream=JStream(h.stream, subjects=[h.source]),
            queue=f"d{h.source}",
            ack_policy=policy,
            dependencies=[inbox.consumer("billing")],
        )
        async def handle(body: dict[str, int], session: InboxSession) -> None: ...

    else:
        credit(h, inbox, ack_policy=policy)
    # When the guarded broker starts, it refuses, saying what to change
    async with h.broker:
        await h.publish(ORDER, ident())
        with pytest.raises(ConfigurationError, match=reason) as refused:
            await h.broker.start()
    assert "the inbox refuses to start these subscribers" in str(refused.value)
    # (Kafka: without ack_policy a subscriber is ACK_FIRST, so it needs one that commits)
    change = "Pass ack_policy=AckPolicy.ACK" if h.kind == "kafka" else "Remove ack_policy"
    assert change in str(refused.value)
    # Then nothing was consumed: the message still waits, unacknowledged
    assert seen.outcomes == []
    assert applied(pg_engine) == 0
    assert await h.leftover() == 1


def _redis_refusals(broker: Any, inbox: FastStreamInbox, name: str) -> dict[str, Any]:
    from faststream.redis import ListSub, PubSub, StreamSub

    billing = [inbox.consumer("billing")]
    return {
        "a Redis list cannot hand a message back": {"list": ListSub(name)},
        "Redis pub/sub delivers at most once": {"channel": PubSub(name)},
        "is read without a consumer group": {"stream": StreamSub(name)},
        "nothing reclaims the pending messages": {
            "stream": StreamSub(name, group="billing", consumer="c1")
        },
        "is read with no_ack=True": {
            "stream": StreamSub(name, group="billing", consumer="c1", no_ack=True)
        },
    } | {"_": billing}


@pytest.mark.parametrize(
    "reason",
    [
        "a Redis list cannot hand a message back",
        "Redis pub/sub delivers at most once",
        "is read without a consumer group",
        "nothing reclaims the pending messages",
        "is read with no_ack=True",
    ],
)
async def test_faststream__guard_refuses_redis_subscribers_that_cannot_redeliver(
    inbox, seen, reason
):
    h = Harness("redis", [inbox.middleware])
    source = _redis_refusals(h.broker, inbox, h.source)[reason]

    @h.broker.subscriber(**source, dependencies=[inbox.consumer("billing")])
    async def handle(body: dict[str, int], session: InboxSession) -> None: ...

    with pytest.raises(ConfigurationError, match=reason) as refused:
        await inbox.check(h.broker)
    assert f"Redis subscriber {h.source!r} (inbox consumer 'billing')" in str(refused.value)
    await h.cleanup()


async def test_faststream__guard_accepts_a_redis_stream_with_its_reclaimer(inbox, caplog):
    caplog.set_level(logging.INFO, logger="inbox_middleware")
    h = Harness("redis", [inbox.middleware])
    credit(h, inbox)  # a reading and a reclaiming subscriber, one handler, one consumer
    try:
        await inbox.check(h.broker)
    finally:
        await h.broker.stop()
        await h.cleanup()
    # Each twin says which one it is
    protects = sorted(r.getMessage() for r in caplog.records if "protects" in r.getMessage())
    assert protects == [
        f"inbox consumer billing protects Redis subscriber {h.source!r} (group 'billing', "
        f"consumer 'c1', reading new messages) (quarantine {h.source}.quarantine, dead "
        f"letters {h.source}.dead-letter)",
        f"inbox consumer billing protects Redis subscriber {h.source!r} (group 'billing', "
        "consumer 'c1-reclaim', reclaiming messages pending over 1000 ms) (quarantine "
        f"{h.source}.quarantine, dead letters {h.source}.dead-letter)",
    ]


async def test_faststream__guard_refuses_core_nats(inbox):
    h = Harness("nats", [inbox.middleware])

    @h.broker.subscriber(h.source, dependencies=[inbox.consumer("billing")])
    async def handle(body: dict[str, int], session: InboxSession) -> None: ...

    with pytest.raises(ConfigurationError, match="delivers at most once and keeps nothing"):
        await inbox.check(h.broker)


async def test_faststream__guard_refuses_a_missing_middleware_and_shared_consumer_names(
    pg_async_engine,
):
    inbox = FastStreamInbox(pg_async_engine)
    h = Harness("rabbit", [])  # the broker lacks inbox.middleware

    @h.broker.subscriber(f"{h.source}-a", dependencies=[inbox.consumer("billing")])
    async def first(body: dict[str, int], session: InboxSession) -> None: ...

    @h.broker.subscriber(f"{h.source}-b", dependencies=[inbox.consumer("billing")])
    async def second(body: dict[str, int], session: InboxSession) -> None: ...

    with pytest.raises(ConfigurationError) as refused:
        await inbox.check(h.broker)
    assert "create the broker with middlewares=[inbox.middleware]" in str(refused.value)
    h.broker.add_middleware(inbox.middleware)
    with pytest.raises(ConfigurationError, match="is declared by several handlers"):
        await inbox.check(h.broker)


async def test_faststream__guard_checks_the_schema(pg_async_engine, pg_engine):
    inbox = FastStreamInbox(pg_async_engine, naming=InboxSchema(schema="never_migrated"))
    h = Harness("rabbit", [inbox.middleware])
    credit(h, inbox)
    with pytest.raises(Exception, match="do not exist; run `inbox-middleware migrate`"):
        await inbox.check(h.broker)


def test_faststream__consumer_names_and_policies_are_validated(pg_async_engine):
    inbox = FastStreamInbox(pg_async_engine)
    with pytest.raises(ConfigurationError, match="consumer name is empty"):
        inbox.consumer("")
    with pytest.raises(ConfigurationError, match="missing_identity must be"):
        inbox.consumer("billing", missing_identity="ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="retry_backoff"):
        FastStreamInbox(pg_async_engine, retry_backoff=(2, 1))


# -- options -------------------------------------------------------------------------------


async def test_faststream__broker_id_opt_in_claims_what_the_broker_keeps(
    h, inbox, pg_engine, seen, caplog
):
    @h.subscribe(inbox.consumer("billing", missing_identity="broker_id"))
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    async with h.broker:
        await h.broker.start()
        await h.publish(ORDER)  # no identity headers at all
        await eventually(lambda: seen.count("processed") == 1, what="the ack")
    (row,) = claims(pg_engine)
    expected = {
        "rabbit": "rabbitmq.message_id",
        "redis": "redis-stream:",
        "nats": "nats-stream:",
        "kafka": "kafka:",
    }
    assert row["producer_name"].startswith(expected[h.kind])
    assert row["message_id"]


async def test_faststream__process_policy_runs_without_a_claim_and_warns(
    inbox, pg_engine, seen, caplog
):
    caplog.set_level(logging.WARNING, logger="inbox_middleware")
    h = Harness("rabbit", [recorder(seen), inbox.middleware])
    inbox.guard(h.broker)

    @h.subscribe(inbox.consumer("billing", missing_identity="process"))
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    try:
        async with h.broker:
            await h.broker.start()
            await h.publish(ORDER)
            await h.publish(ORDER)
            await eventually(lambda: seen.count("processed") == 2, what="two acks")
    finally:
        await h.cleanup()
    assert (applied(pg_engine), claims(pg_engine)) == (2, [])
    assert "WITHOUT deduplication" in caplog.text


async def test_faststream__reject_from_the_handler_rolls_back_and_dead_letters(
    inbox, pg_engine, seen
):
    from faststream.exceptions import RejectMessage

    h = Harness("rabbit", [recorder(seen), inbox.middleware])
    inbox.guard(h.broker)

    @h.subscribe(inbox.consumer("billing"))
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])
        raise RejectMessage()

    try:
        async with h.broker:
            await h.broker.start()
            await h.publish(ORDER, ident())
            await eventually(lambda: seen.outcomes, what="the rejection")
            dead = await h.read(f"{h.source}.dead-letter")
    finally:
        await h.cleanup()
    assert seen.outcomes == ["Skipped"]
    assert len(dead) == 1
    assert (applied(pg_engine), claims(pg_engine)) == (0, [])


async def test_faststream__binary_bodies_are_compared_byte_for_byte(inbox, pg_engine, seen):
    h = Harness("rabbit", [recorder(seen), inbox.middleware])
    inbox.guard(h.broker)
    bodies: list[bytes] = []

    @h.subscribe(inbox.consumer("billing"))
    async def handle(body: bytes, session: InboxSession) -> None:
        bodies.append(body)

    try:
        async with h.broker:
            await h.broker.start()
            # One at a time: a subscriber runs its prefetch window's deliveries at once,
            # and the copy that claims first is the one applied.
            for number, body in enumerate([b"\x00\xff payload", b"\x00\xff payload"]):
                await h.publish(body, ident("bin-1"))
                await eventually(lambda n=number: len(seen.outcomes) > n, what="its outcome")
            await h.publish(b"\x00\xfe payload", ident("bin-1"))
            await eventually(lambda: len(seen.outcomes) == 3, what="three outcomes")
    finally:
        await h.cleanup()
    assert bodies == [b"\x00\xff payload"]
    assert claims(pg_engine)[0]["hash_scheme"] == "faststream-raw.v1"
    assert len(quarantine_rows(pg_engine)) == 1


async def test_faststream__stamp_identity_sets_headers_and_refuses_messages_without_an_id(
    inbox, pg_engine, seen
):
    h = Harness("rabbit", [recorder(seen), inbox.middleware])
    stamp = StampIdentity("shop", lambda body: body.get("order_id"), destinations={h.source})
    h.broker.add_middleware(stamp)
    inbox.guard(h.broker)
    credit(h, inbox)
    try:
        async with h.broker:
            await h.broker.start()
            # One at a time: a subscriber runs its prefetch window's deliveries at once.
            await h.broker.publish({"order_id": "o-1", **ORDER}, h.source)
            await eventually(lambda: len(seen.outcomes) == 1, what="the first outcome")
            await h.broker.publish({"order_id": "o-1", **ORDER}, h.source)
            with pytest.raises(MissingIdentity, match="has no x-inbox-message-id"):
                await h.broker.publish(ORDER, h.source)
            await h.broker.publish(ORDER, f"{h.source}.other")  # not stamped: not a source
            await eventually(lambda: len(seen.outcomes) == 2, what="two outcomes")
    finally:
        await h.cleanup()
    assert seen.outcomes == ["processed", "Skipped"]
    (row,) = claims(pg_engine)
    assert (row["producer_name"], row["message_id"]) == ("shop", "o-1")


async def test_faststream__inbox_session_outside_the_inbox_is_refused(seen):
    from faststream.rabbit import TestRabbitBroker

    h = Harness("rabbit", [recorder(seen)])

    @h.broker.subscriber(h.source)
    async def handle(body: dict[str, int], session: InboxSession) -> None: ...

    async with TestRabbitBroker(h.broker) as broker:
        with pytest.raises(ConfigurationError, match="InboxSession is available only"):
            await broker.publish(ORDER, h.source)
