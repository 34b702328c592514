"""The batch claim the FastStream batch subscribers use: one statement for the batch, keys
in order, one commit; on the real PostgreSQL (sync and async) and on SQLite."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from inbox_middleware._core.exceptions import ClaimInProgress, TransactionConflict
from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import (
    ClaimBatch,
    Decision,
    Delivery,
    LookUpBatch,
    RecordConflict,
    StoredClaim,
    Verdict,
    claim_batch_steps,
)
from inbox_middleware._storage import AsyncInbox, Inbox

from ..apps.domain import apply_credit, apply_credit_async, effects


def item(message_id: str, delta: int = 10, account: int = 1) -> Delivery:
    return Delivery(
        "billing",
        MessageIdentity("orders", message_id),
        hash_json({"account": account, "delta": delta}, "json.v1"),
        handler_version="2",
        source="accounts",
        payload=f"{account}:{delta}".encode(),
    )


def credit_first(seen: list[tuple[Decision, ...]]):
    """A batch handler: credits account 1 once per first-seen delivery."""

    def handler(session: Session, verdicts: tuple[Verdict, ...]) -> int:
        seen.append(tuple(v.decision for v in verdicts))
        first = [v for v in verdicts if v.decision is Decision.FIRST]
        for _ in first:
            apply_credit(session, "billing", 1, 10)
        return len(first)

    return handler


def claimed_ids(engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.scalars(text("SELECT message_id FROM consumer_inbox ORDER BY 1")))


# -- the step machine, without storage ----------------------------------------------------


def test_batch_steps__claims_in_key_order_and_decides_repeats_against_the_first():
    # Given a batch with an id repeated (same payload) and reused (other payload)
    batch = [item("m-3"), item("m-1"), item("m-3"), item("m-1", delta=99)]
    steps = claim_batch_steps(batch)
    # When storage claims both keys
    claim = next(steps)
    assert isinstance(claim, ClaimBatch)
    assert [d.identity.message_id for d in claim.deliveries] == ["m-1", "m-3"]
    record = steps.send({item("m-1").key, item("m-3").key})
    # Then the reuse is a conflict with the first appearance, recorded individually
    assert isinstance(record, RecordConflict)
    assert record.delivery is batch[3]
    assert record.stored.payload_sha256 == item("m-1").payload_hash.sha256
    with pytest.raises(StopIteration) as done:
        steps.send(None)
    decisions = [v.decision for v in done.value.value]
    assert decisions == [Decision.FIRST, Decision.FIRST, Decision.DUPLICATE, Decision.CONFLICT]


def test_batch_steps__looks_up_every_unclaimed_key_in_one_step():
    batch = [item("m-1"), item("m-2"), item("m-3")]
    steps = claim_batch_steps(batch)
    next(steps)
    look_up = steps.send({item("m-2").key})
    assert isinstance(look_up, LookUpBatch)
    assert [d.identity.message_id for d in look_up.deliveries] == ["m-1", "m-3"]
    stored = StoredClaim(item("m-1").payload_hash.sha256, "json.v1", "2", None)
    with pytest.raises(StopIteration) as done:
        steps.send({item("m-1").key: stored, item("m-3").key: stored})
    assert [v.decision for v in done.value.value] == [
        Decision.DUPLICATE,
        Decision.FIRST,
        Decision.DUPLICATE,
    ]


def test_batch_steps__gives_up_when_claimed_rows_keep_vanishing():
    steps = claim_batch_steps([item("m-1")])
    next(steps)

    def vanish_every_time() -> None:
        for _ in range(10):
            steps.send(set())  # not claimed ...
            steps.send({})  # ... and not found either

    with pytest.raises(TransactionConflict, match="kept conflicting"):
        vanish_every_time()


# -- sequential cases: PostgreSQL and SQLite ----------------------------------------------


def test_batch_claim__first_duplicates_and_conflicts_commit_once(engine):
    inbox = Inbox(engine)
    seen: list[tuple[Decision, ...]] = []
    # Given a batch of three, all first seen
    first = inbox.process_batch([item("m-2"), item("m-1"), item("m-3")], credit_first(seen))
    assert first.decisions == (Decision.FIRST,) * 3
    assert first.result == 3
    # When a second batch repeats two of them (one with another payload) and adds one
    again = inbox.process_batch(
        [item("m-1"), item("m-4"), item("m-3", delta=50)], credit_first(seen)
    )
    # Then only the new one runs; the reuse is quarantined in the same commit
    assert again.decisions == (Decision.DUPLICATE, Decision.FIRST, Decision.CONFLICT)
    assert again.verdicts[2].quarantine is not None
    assert again.result == 1
    with engine.connect() as conn:
        assert effects(conn, 1) == 4
        assert conn.scalar(text("SELECT count(*) FROM inbox_quarantine")) == 1
    assert claimed_ids(engine) == ["m-1", "m-2", "m-3", "m-4"]


def test_batch_claim__all_seen_skips_the_handler(engine):
    inbox = Inbox(engine)
    seen: list[tuple[Decision, ...]] = []
    inbox.process_batch([item("m-1"), item("m-2")], credit_first(seen))
    outcome = inbox.process_batch([item("m-2"), item("m-1")], credit_first(seen))
    assert outcome.decisions == (Decision.DUPLICATE, Decision.DUPLICATE)
    assert outcome.result is None
    assert len(seen) == 1


def test_batch_claim__exception_rolls_back_every_claim(engine):
    inbox = Inbox(engine)

    def fails(session: Session, verdicts: tuple[Verdict, ...]) -> None:
        apply_credit(session, "billing", 1, 10)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        inbox.process_batch([item("m-1"), item("m-2")], fails)
    assert claimed_ids(engine) == []
    outcome = inbox.process_batch([item("m-1"), item("m-2")], credit_first([]))
    assert outcome.decisions == (Decision.FIRST, Decision.FIRST)


def test_batch_claim__single_claims_see_batch_claims(engine):
    inbox = Inbox(engine)
    inbox.process_batch([item("m-1")], credit_first([]))
    assert inbox.process(item("m-1"), lambda s: None).decision is Decision.DUPLICATE
    inbox.process(item("m-2"), lambda s: None)
    outcome = inbox.process_batch([item("m-2"), item("m-3")], credit_first([]))
    assert outcome.decisions == (Decision.DUPLICATE, Decision.FIRST)


# -- concurrency: PostgreSQL ----------------------------------------------------------------


def test_batch_claim__overlapping_batches_in_opposite_order_do_not_deadlock(pg_engine):
    # Given a delivery holding m-9, batch A [m-1, m-9, m-2] waiting on it, and batch B
    # [m-2, m-1] started next. Claimed in listed order, A would hold m-1 and B m-2, and
    # once m-9 is released A would wait for B's m-2 while B waits for A's m-1: a deadlock.
    inbox = Inbox(pg_engine, lock_timeout=10, serialization_retries=0)
    release = threading.Event()

    def hold(session: Session) -> None:
        release.wait(10)
        raise RuntimeError("rolled back: m-9 is free again")

    with ThreadPoolExecutor(3) as pool:
        holder = pool.submit(inbox.process, item("m-9"), hold)
        time.sleep(0.3)
        a = pool.submit(
            inbox.process_batch, [item("m-1"), item("m-9"), item("m-2")], credit_first([])
        )
        time.sleep(0.3)
        b = pool.submit(inbox.process_batch, [item("m-2"), item("m-1")], credit_first([]))
        time.sleep(0.3)
        # When m-9 is released
        release.set()
        with pytest.raises(RuntimeError, match="m-9 is free"):
            holder.result(timeout=20)
        # Then both batches complete: claims in key order never wait in a cycle
        assert a.result(timeout=20).decisions == (Decision.FIRST,) * 3
        assert b.result(timeout=20).decisions == (Decision.DUPLICATE,) * 2
    with pg_engine.connect() as conn:
        assert effects(conn, 1) == 3


def test_batch_claim__waits_lock_timeout_on_a_concurrent_claim(pg_engine):
    inbox = Inbox(pg_engine, lock_timeout=0.5)
    claimed = threading.Event()

    def hold(session: Session) -> None:
        claimed.set()
        time.sleep(2)

    with ThreadPoolExecutor(1) as pool:
        single = pool.submit(inbox.process, item("m-2"), hold)
        assert claimed.wait(10)
        started = time.monotonic()
        with pytest.raises(ClaimInProgress):
            inbox.process_batch([item("m-1"), item("m-2")], credit_first([]))
        assert time.monotonic() - started < 1.8
        single.result(timeout=10)
    assert claimed_ids(pg_engine) == ["m-2"]


async def test_async_batch_claim__first_duplicate_conflict(pg_async_engine, pg_engine):
    inbox = AsyncInbox(pg_async_engine)

    async def handler(session, verdicts):
        for verdict in verdicts:
            if verdict.decision is Decision.FIRST:
                await apply_credit_async(session, "billing", 1, 10)
        return "done"

    first = await inbox.process_batch([item("m-1"), item("m-2")], handler)
    again = await inbox.process_batch([item("m-2", delta=5), item("m-1"), item("m-3")], handler)
    assert first.decisions == (Decision.FIRST, Decision.FIRST)
    assert again.decisions == (Decision.CONFLICT, Decision.DUPLICATE, Decision.FIRST)
    with pg_engine.connect() as conn:
        assert effects(conn, 1) == 3
