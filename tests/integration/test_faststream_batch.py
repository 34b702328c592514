"""Batch subscribers (Redis streams, NATS pull, Kafka) on the real brokers: one claim statement
for the batch, the handler given the first-seen messages, each duplicate and conflict
settled on its own, one commit."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.ext.asyncio import create_async_engine

from inbox_middleware._core.protocol import Decision
from inbox_middleware._operate.tally import tally
from inbox_middleware._storage import Inbox
from inbox_middleware.faststream import (
    FastStreamInbox,
    InboxBatch,
    InboxSession,
    identity_headers,
)
from inbox_middleware.faststream._payload import delivery, headers_identity

from ..apps.domain import apply_credit_async, effects
from ..support import services
from ..support.faststream_brokers import Harness, Seen, eventually, recorder
from ..support.proxy import Proxy


def order(message_id: str, delta: int) -> tuple[dict[str, Any], dict[str, str]]:
    return {"account": 7, "delta": delta, "id": message_id}, identity_headers(
        producer="orders", message_id=message_id
    )


def claim_directly(engine: Engine, body: dict[str, Any], headers: dict[str, str]) -> None:
    """Record a claim as if an earlier delivery of this message had been processed."""
    claim = delivery(
        consumer="billing",
        identity=headers_identity(headers),
        body=json.dumps(body).encode(),
        headers=headers,
        handler_version="",
        source="earlier",
        canonical=None,
    )
    Inbox(engine).process(claim, lambda session: None)


@pytest.fixture(params=["redis", "nats", "kafka"])
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
    harness.partition = 0  # Kafka: one partition keeps the batch in publishing order
    inbox.guard(harness.broker)
    yield harness
    await harness.cleanup()


async def test_faststream_batch__one_claim_first_seen_to_the_handler_each_settled(
    h, inbox, pg_engine, pg_async_engine, seen
):
    # Given o-2 processed before, and o-3 processed before with another amount
    claim_directly(pg_engine, *order("o-2", 20))
    claim_directly(pg_engine, *order("o-3", 30))
    before = tally.totals()
    calls: list[tuple[list[dict[str, Any]], list[tuple[Decision | None, str | None]]]] = []

    @h.subscribe(inbox.consumer("billing"), batch=True)
    async def handle(
        bodies: list[dict[str, Any]], session: InboxSession, batch: InboxBatch
    ) -> None:
        calls.append((bodies, [(item.decision, item.rejected) for item in batch]))
        for body in bodies:
            await apply_credit_async(session, "billing", body["account"], body["delta"])

    claim_statements: list[str] = []

    @event.listens_for(pg_async_engine.sync_engine, "before_cursor_execute")
    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # The claim (led by its CTE that marks a poisoned earlier copy recovered)
        if "INSERT INTO consumer_inbox" in statement:
            claim_statements.append(statement)

    # When one batch brings a new order, o-2 again, o-3 with yet another amount, a message
    # without identity, another new order and the first one again
    await h.prepare_source()
    async with h.broker:
        for body, headers in [
            order("o-1", 10),
            order("o-2", 20),
            order("o-3", 99),
            ({"account": 7, "delta": 5}, {}),
            order("o-4", 40),
            order("o-1", 10),
        ]:
            await h.publish(body, headers)
        await h.broker.start()
        await eventually(lambda: seen.outcomes, what="the batch")
        quarantined = await h.read_at_least(f"{h.source}.quarantine", 1)
        dead = await h.read_at_least(f"{h.source}.dead-letter", 1)
    event.remove(pg_async_engine.sync_engine, "before_cursor_execute", count)

    # Then the handler ran once, with the first-seen orders, and knew every decision
    ((bodies, decisions),) = calls
    assert [b["id"] for b in bodies] == ["o-1", "o-4"]
    assert decisions == [
        (Decision.FIRST, None),
        (Decision.DUPLICATE, None),
        (Decision.CONFLICT, None),
        (None, "the message has no x-inbox-producer and no x-inbox-message-id"),
        (Decision.FIRST, None),
        (Decision.DUPLICATE, None),
    ]
    # ... one claim statement for the batch; the conflict and the rejection each settled
    assert len(claim_statements) == 1
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 2
        assert conn.scalar(text("SELECT count(*) FROM consumer_inbox")) == 4
        assert conn.scalar(text("SELECT count(*) FROM inbox_quarantine")) == 1
    ((body, headers),) = quarantined
    assert json.loads(body)["delta"] == 99
    assert json.loads(headers["x-inbox-conflict"])["message_id"] == "o-3"
    ((body, _),) = dead
    assert json.loads(body) == {"account": 7, "delta": 5}
    assert seen.outcomes == ["processed"]
    assert await h.leftover() == 0
    # ... and each message counted for inbox_counts, as a single delivery's settlement is
    counted = {
        outcome: count - before.get((consumer, outcome), 0)
        for (consumer, outcome), count in tally.totals().items()
        if consumer == "billing" and count != before.get((consumer, outcome), 0)
    }
    assert counted == {"processed": 2, "duplicate": 2, "quarantined": 1, "no_identity": 1}


async def test_faststream_batch__failure_hands_back_the_batch_then_applies_each_once(
    h, inbox, pg_engine, seen
):
    calls: list[int] = []

    @h.subscribe(inbox.consumer("billing"), batch=True)
    async def handle(bodies: list[dict[str, Any]], session: InboxSession) -> None:
        calls.append(len(bodies))
        for body in bodies:
            await apply_credit_async(session, "billing", body["account"], body["delta"])
        if len(calls) == 1:
            raise RuntimeError("the ledger service is down")

    await h.prepare_source()
    async with h.broker:
        for n in range(5):
            await h.publish(*order(f"o-{n}", 1))
        await h.broker.start()
        await eventually(lambda: seen.count("processed") >= 1, timeout=20, what="a retry")
        await eventually(lambda: effects_now(pg_engine) == 5, timeout=20, what="every order once")
    # Then the first attempt rolled back as a whole, and the retries applied each once
    assert seen.outcomes[0] == "RuntimeError"
    assert calls[0] == 5
    assert effects_now(pg_engine) == 5
    assert await h.leftover() == 0


def effects_now(engine: Engine) -> int:
    with engine.connect() as conn:
        return effects(conn, 7)


async def test_faststream_batch__a_batch_that_always_fails_ends_in_poison_not_a_loop(
    h, pg_async_engine, pg_engine, seen
):
    # Given a batch handler that fails every time, and max_attempts=2
    from sqlalchemy import select

    from inbox_middleware._storage import InboxSchema

    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.1), max_attempts=2)
    h.broker.add_middleware(inbox.middleware)
    inbox.guard(h.broker)

    @h.subscribe(inbox.consumer("billing"), batch=True)
    async def handle(bodies: list[dict[str, Any]], session: InboxSession) -> None:
        raise RuntimeError("the ledger service is broken")

    poison = InboxSchema().tables.poison

    def poisoned() -> list[str]:
        with pg_engine.connect() as conn:
            return [row.message_id for row in conn.execute(select(poison))]

    # When a batch of three arrives
    await h.prepare_source()
    async with h.broker:
        for number in range(3):
            await h.publish(*order(f"p-{number}", 1))
        await h.broker.start()
        await eventually(lambda: len(poisoned()) == 3, timeout=30, what="three poison rows")
        dead = await h.read_at_least(f"{h.source}.dead-letter", 3)
    # Then after its attempts each message is kept as poison and dead-lettered, not looped
    assert sorted(poisoned()) == ["p-0", "p-1", "p-2"]
    assert len(dead) == 3


async def test_faststream_batch__a_copy_applied_before_is_a_duplicate_when_its_batch_fails(
    h, pg_async_engine, pg_engine, seen
):
    # Found by the explorer (seed 3114): a message applied, its ack lost to a kill, came
    # back in a batch that then failed for good, and was kept as poison with it.
    from sqlalchemy import select

    from inbox_middleware._storage import InboxSchema

    # Given p-0 applied before, and a batch handler that fails every time
    claim_directly(pg_engine, *order("p-0", 1))
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.1), max_attempts=2)
    h.broker.add_middleware(inbox.middleware)
    inbox.guard(h.broker)

    @h.subscribe(inbox.consumer("billing"), batch=True)
    async def handle(bodies: list[dict[str, Any]], session: InboxSession) -> None:
        raise RuntimeError("the ledger service is broken")

    poison = InboxSchema().tables.poison

    def poisoned() -> list[str]:
        with pg_engine.connect() as conn:
            return sorted(row.message_id for row in conn.execute(select(poison)))

    # When p-0 comes back in a batch with two new messages
    await h.prepare_source()
    async with h.broker:
        for number in range(3):
            await h.publish(*order(f"p-{number}", 1))
        await h.broker.start()
        await eventually(lambda: len(poisoned()) >= 2, timeout=30, what="the poison rows")
        await asyncio.sleep(1)  # a third dead letter, were there one, would be there now
        dead = await h.read_at_least(f"{h.source}.dead-letter", 2)
    # Then the two new ones are kept as poison and dead-lettered, the copy is a duplicate
    assert poisoned() == ["p-1", "p-2"]
    assert len(dead) == 2


async def test_faststream_batch__a_conflict_is_quarantined_when_its_batch_fails(
    h, pg_async_engine, pg_engine, seen
):
    # Found by the explorer (seed 993452): a conflicting copy in a batch that failed for
    # good was kept as poison with the batch's reason, and never quarantined.
    from sqlalchemy import select

    from inbox_middleware._storage import InboxSchema

    # Given p-0 applied before with another payload, and a batch handler that always fails
    claim_directly(pg_engine, *order("p-0", 5))
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.1), max_attempts=2)
    h.broker.add_middleware(inbox.middleware)
    inbox.guard(h.broker)

    @h.subscribe(inbox.consumer("billing"), batch=True)
    async def handle(bodies: list[dict[str, Any]], session: InboxSession) -> None:
        raise RuntimeError("the ledger service is broken")

    tables = InboxSchema().tables

    def rows(table: Any) -> list[tuple[str, str]]:
        with pg_engine.connect() as conn:
            return sorted((r.message_id, r.reason_code) for r in conn.execute(select(table)))

    # When p-0 comes back, with a payload of its own, in a batch with two new messages
    await h.prepare_source()
    async with h.broker:
        for number in range(3):
            await h.publish(*order(f"p-{number}", 1))
        await h.broker.start()
        await eventually(lambda: len(rows(tables.poison)) >= 2, timeout=30, what="poison rows")
        quarantined = await h.read_at_least(f"{h.source}.quarantine", 1)
        await asyncio.sleep(1)  # a third dead letter, were there one, would be there now
        dead = await h.read_at_least(f"{h.source}.dead-letter", 2)
    # Then the conflict is quarantined as it would be alone: its row, the quarantine
    # destination; the two new ones are kept as poison and dead-lettered
    assert rows(tables.quarantine) == [("p-0", "identity_conflict")]
    assert len(quarantined) == 1
    assert rows(tables.poison) == [("p-1", "retries_exhausted"), ("p-2", "retries_exhausted")]
    assert len(dead) == 2


async def test_faststream_batch__a_handler_ending_the_transaction_commits_nothing_of_the_batch(
    h, pg_async_engine, pg_engine, seen
):
    # Asked after seed 29195: a batch handler that writes every message's effect, then
    # calls commit() itself, must not have committed the batch's effects by that commit.
    from sqlalchemy import select

    from inbox_middleware._storage import InboxSchema

    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.1))
    h.broker.add_middleware(inbox.middleware)
    inbox.guard(h.broker)

    @h.subscribe(inbox.consumer("billing"), batch=True)
    async def handle(bodies: list[dict[str, Any]], session: InboxSession) -> None:
        for body in bodies:
            await apply_credit_async(session, "billing", body["account"], body["delta"])
        await session.commit()

    poison = InboxSchema().tables.poison

    def rows() -> list[tuple[str, str]]:
        with pg_engine.connect() as conn:
            return sorted((r.message_id, r.reason_code) for r in conn.execute(select(poison)))

    await h.prepare_source()
    async with h.broker:
        for number in range(3):
            await h.publish(*order(f"p-{number}", 1))
        await h.broker.start()
        await eventually(lambda: len(rows()) == 3, timeout=30, what="three poison rows")
        dead = await h.read_at_least(f"{h.source}.dead-letter", 3)
    # Then the commit was refused before it reached the server: nothing of the batch is
    # applied, and each message is kept as poison (handler_transaction), dead-lettered
    assert effects_now(pg_engine) == 0
    assert rows() == [(f"p-{n}", "handler_transaction") for n in range(3)]
    assert len(dead) == 3
    claims = InboxSchema().tables.inbox
    with pg_engine.connect() as conn:
        assert conn.execute(select(claims)).first() is None


async def test_faststream_batch__an_expired_message_is_kept_as_poison_alone_the_rest_applied(
    h, pg_async_engine, pg_engine, seen
):
    # Given a batch subscriber whose retention window is a week, and a batch of three of
    # which one was produced a year ago (its claim may have been purged: never seen here)
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import select

    from inbox_middleware._storage import InboxSchema

    inbox = FastStreamInbox(
        pg_async_engine, retry_backoff=(0.05, 0.1), retention_window=timedelta(days=7)
    )
    h.broker.add_middleware(inbox.middleware)
    inbox.guard(h.broker)
    handled: list[list[str]] = []

    @h.subscribe(inbox.consumer("billing"), batch=True)
    async def handle(bodies: list[dict[str, Any]], session: InboxSession) -> None:
        handled.append([body["id"] for body in bodies])
        for body in bodies:
            await apply_credit_async(session, "billing", body["account"], body["delta"])

    poison = InboxSchema().tables.poison
    before = effects_now(pg_engine)
    year_ago = datetime.now(UTC) - timedelta(days=365)

    # When the batch arrives
    await h.prepare_source()
    async with h.broker:
        for number in range(3):
            body, headers = order(f"x-{number}", 1)
            if number == 1:
                headers = identity_headers(
                    producer="orders", message_id="x-1", produced_at=year_ago
                )
            await h.publish(body, headers)
        await h.broker.start()
        dead = await h.read_at_least(f"{h.source}.dead-letter", 1)
        await eventually(
            lambda: effects_now(pg_engine) == before + 2, timeout=30, what="two effects"
        )

    # Then the expired message alone is kept as poison (expired_redelivery) and
    # dead-lettered, and the other two are applied once, the handler never given it
    with pg_engine.connect() as conn:
        rows = [(row.message_id, row.reason_code) for row in conn.execute(select(poison))]
    assert rows == [("x-1", "expired_redelivery")]
    assert len(dead) == 1
    assert all("x-1" not in ids for ids in handled)
    assert sorted(ident for ids in handled for ident in ids) == ["x-0", "x-2"]
    assert effects_now(pg_engine) == before + 2


async def test_faststream_batch__held_at_start_up_is_counted_as_handed_back_not_poisoned(
    pg_async_url: str, pg_engine: Engine, seen: Seen
) -> None:
    # Given a NATS batch subscriber without guard, a redelivery limit of 1, and its
    # database down when the app starts
    services.require(services.NATS, "nats")
    proxy = Proxy(("127.0.0.1", 5432))
    engine = create_async_engine(
        pg_async_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"), pool_pre_ping=True
    )
    inbox = FastStreamInbox(engine, retry_backoff=(0.05, 0.2), redelivery_limit=1)
    harness = Harness("nats", [recorder(seen), inbox.middleware])
    before = tally.totals().get(("billing", "handed_back"), 0)
    try:

        @harness.subscribe(inbox.consumer("billing"), batch=True)
        async def handle(bodies: list[dict[str, Any]], session: InboxSession) -> None:
            for body in bodies:
                await apply_credit_async(session, "billing", body["account"], body["delta"])

        await harness.prepare_source()
        proxy.down()
        async with harness.broker:
            for body, headers in [order("h-1", 10), order("h-2", 20)]:
                await harness.publish(body, headers)
            await harness.broker.start()
            # When the first batch meets the failing start-up check, again and again
            await eventually(lambda: seen.count("NackForRedelivery") >= 3, what="hold-backs")
            assert effects_now(pg_engine) == 0
            # ... each hold a hand-back of each of its messages, counted as one message's
            # is (the counts `status` shows)
            held = tally.totals().get(("billing", "handed_back"), 0) - before
            assert held >= 2 * 3
            # Then, once the database is back, each message is applied once: the holds
            # were hand-backs, not crashes over the limit
            proxy.up()
            await eventually(lambda: effects_now(pg_engine) == 2, timeout=20, what="effects")
    finally:
        await harness.cleanup()
        await engine.dispose()
        proxy.close()
    with pg_engine.connect() as conn:
        poison = conn.execute(text("SELECT count(*) FROM inbox_poison")).scalar_one()
    assert poison == 0
