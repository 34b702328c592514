"""A later copy of a poisoned message (found by the explorer, "finding A"): the copy that
commits marks the earlier copy's pending poison row recovered, in its own transaction, so
that no operator redrives an intent that is already applied."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import dramatiq
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import select, text

from inbox_middleware._core.consumption import (
    Arrival,
    CountRedelivery,
    Duplicate,
    Op,
    Publish,
    RecordPoison,
    drive,
    settle_steps,
)
from inbox_middleware._core.exceptions import PermanentError
from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.policy import ConsumerPolicy
from inbox_middleware._core.protocol import Decision, Delivery
from inbox_middleware._operate.repair import redrive
from inbox_middleware._storage import AsyncInbox, Inbox, InboxSchema
from inbox_middleware._storage.failures import FailureRecorder
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity

from ..apps.domain import apply_credit, balance, effects
from ..support.dramatiq_worker import drain, running_worker
from .test_repair_dramatiq import broker_args, cli

TABLES = InboxSchema().tables
RECOVERED = {"consumer": "billing", "source": "poison"}


def poison_rows(engine) -> list[dict]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(select(TABLES.poison)).mappings()]


@pytest.fixture
def app(broker, queue, pg_engine):
    """An actor that refuses credits to accounts that are not open, and fails (retried)
    on accounts marked flaky."""
    broker.add_middleware(InboxMiddleware(pg_engine))
    with pg_engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS open_accounts (id integer PRIMARY KEY)"))
        conn.execute(text("DELETE FROM open_accounts"))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=0)
    def add_credit(account_id: int, delta: int) -> None:
        session = current_session()
        if not session.execute(
            text("SELECT 1 FROM open_accounts WHERE id = :a"), {"a": account_id}
        ).first():
            raise PermanentError("account_not_open")
        apply_credit(session, "billing", account_id, delta)

    return add_credit


def test_a_later_copy_that_commits_marks_the_pending_poison_row_recovered(
    broker, queue, pg_url, pg_engine, app
):
    with running_worker(broker) as worker:
        # Given a copy of o-1 poisoned (its account was not open yet)
        app.send_with_options(args=(7, 10), **identity(producer="orders", message_id="o-1"))
        drain(broker, queue, worker)
        [poisoned] = poison_rows(pg_engine)
        assert poisoned["decision"] == "pending"
        # When the account opens and the producer sends o-1 again, with the same payload
        with pg_engine.begin() as conn:
            conn.execute(text("INSERT INTO open_accounts VALUES (7)"))
        app.send_with_options(args=(7, 10), **identity(producer="orders", message_id="o-1"))
        drain(broker, queue, worker)
        # Then it is applied once, and the poison row no longer waits for an operator
        with pg_engine.connect() as conn:
            assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
        [row] = poison_rows(pg_engine)
        assert (row["id"], row["decision"]) == (poisoned["id"], "recovered")
        assert row["recovered_at"] is not None and row["decided_by"] is None
        # And an operator's redrive of it is refused: it cannot become a second effect
        redrive = cli(pg_url, "poison", "redrive", str(row["id"]), *broker_args(broker, queue))
        assert redrive.returncode == 1
        assert "is already recovered" in redrive.stderr
        drain(broker, queue, worker)
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 1


def test_a_redriven_copy_and_a_later_copy_queued_together_apply_once_and_recover_the_row(
    broker, queue, pg_url, pg_engine, app
):
    def send_o3() -> None:
        app.send_with_options(args=(9, 10), **identity(producer="orders", message_id="o-3"))

    # Given a copy of o-3 poisoned (its account was not open yet)
    with running_worker(broker) as worker:
        send_o3()
        drain(broker, queue, worker)
    [poisoned] = poison_rows(pg_engine)
    recovered = REGISTRY.get_sample_value("inbox_recovered_total", RECOVERED) or 0.0
    # When, while no worker runs, the producer sends o-3 again, the account opens and an
    # operator redrives the row: two copies queued, the producer's first
    send_o3()
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO open_accounts VALUES (9)"))
    redrive = cli(pg_url, "poison", "redrive", str(poisoned["id"]), *broker_args(broker, queue))
    assert redrive.returncode == 0, redrive.stderr
    with running_worker(broker) as worker:
        drain(broker, queue, worker)
    # Then o-3 is applied once, whichever copy claimed it, and its row says so (counted
    # once when the redriven copy claimed it, not when the producer's copy did: its claim
    # marks the row as it marks a pending one, uncounted)
    with pg_engine.connect() as conn:
        assert (effects(conn, 9), balance(conn, 9)) == (1, 10)
    [row] = poison_rows(pg_engine)
    assert (row["decision"], row["decided_by"] is not None) == ("recovered", True)
    counted = (REGISTRY.get_sample_value("inbox_recovered_total", RECOVERED) or 0.0) - recovered
    assert counted in (0, 1)


def test_a_later_copy_that_fails_or_carries_another_payload_leaves_the_row_pending(
    broker, queue, pg_engine, app
):
    with running_worker(broker) as worker:
        # Given a copy of o-2 poisoned
        app.send_with_options(args=(8, 10), **identity(producer="orders", message_id="o-2"))
        drain(broker, queue, worker)
        # When a later copy fails again (rolled back), the row is still pending
        app.send_with_options(args=(8, 10), **identity(producer="orders", message_id="o-2"))
        drain(broker, queue, worker)
        assert [r["decision"] for r in poison_rows(pg_engine)] == ["pending"]
        # And a later copy with another payload that commits is not the poisoned message:
        # the row stays for the operator to look at
        with pg_engine.begin() as conn:
            conn.execute(text("INSERT INTO open_accounts VALUES (8)"))
        app.send_with_options(args=(8, 99), **identity(producer="orders", message_id="o-2"))
        drain(broker, queue, worker)
    with pg_engine.connect() as conn:
        assert (effects(conn, 8), balance(conn, 8)) == (1, 99)
    assert [r["decision"] for r in poison_rows(pg_engine)] == ["pending"]


# -- every claim path: one delivery, a batch, and the asyncpg driver -----------------------


def _delivery(message_id: str, delta: int) -> Delivery:
    payload = {"account": 1, "delta": delta}
    return Delivery(
        "billing",
        MessageIdentity("orders", message_id),
        hash_json(payload, "json.v1"),
        handler_version="1",
        source="accounts",
        payload=repr(payload).encode(),
    )


def _poison(engine, *deliveries: Delivery) -> None:
    recorder = FailureRecorder(InboxSchema(), engine.dialect.name)
    with engine.begin() as conn:
        for d in deliveries:
            recorder.record_poison(conn, d, reason_code="boom", error="boom", attempts=1)


def _decisions(engine) -> dict[str, str]:
    return {r["message_id"]: r["decision"] for r in poison_rows(engine)}


@pytest.mark.parametrize("path", ["one", "batch"])
def test_every_sync_claim_path_marks_the_same_payloads_row_recovered(pg_engine, path):
    # Given m-1 and m-2 poisoned with delta 10
    _poison(pg_engine, _delivery("m-1", 10), _delivery("m-2", 10))
    inbox = Inbox(pg_engine)
    # When later copies commit: m-1 with the same payload, m-2 with another
    later = [_delivery("m-1", 10), _delivery("m-2", 99)]
    if path == "one":
        for d in later:
            inbox.process(d, lambda session: None)
    else:
        inbox.process_batch(later, lambda session, verdicts: None)
    # Then only the row of the same payload is recovered
    assert _decisions(pg_engine) == {"m-1": "recovered", "m-2": "pending"}


async def test_the_async_claim_marks_the_row_recovered_and_a_rollback_does_not(
    pg_engine, pg_async_engine
):
    _poison(pg_engine, _delivery("m-1", 10), _delivery("m-2", 10))
    inbox = AsyncInbox(pg_async_engine)

    async def nothing(session):
        return None

    async def fails(session):
        raise RuntimeError("again")

    await inbox.process(_delivery("m-1", 10), nothing)
    with pytest.raises(RuntimeError):
        await inbox.process(_delivery("m-2", 10), fails)
    assert _decisions(pg_engine) == {"m-1": "recovered", "m-2": "pending"}


def test_a_copy_poisoned_after_a_later_copy_committed_is_written_recovered(engine):
    # Given copies of m-1 and m-2 in flight together: the later copies commit first
    inbox = Inbox(engine)
    inbox.process(_delivery("m-1", 10), lambda session: None)
    inbox.process(_delivery("m-2", 99), lambda session: None)
    # When the earlier copies' failures are recorded after that (m-2's with another payload)
    records = [
        inbox.bookkeep(RecordPoison(d, "boom", "boom", 1))
        for d in (_delivery("m-1", 10), _delivery("m-2", 10))
    ]
    # Then the applied one is no operator's business; the other payload's row is
    assert _decisions(engine) == {"m-1": "recovered", "m-2": "pending"}
    assert [record.recovered for record in records] == [True, False]


@pytest.mark.parametrize("order", ["claim_then_poison", "poison_then_copy"])
def test_outputs_that_could_not_be_sent_stay_pending_beside_their_own_claim(pg_engine, order):
    # Given m-1 applied, its outputs never sent: its row (outputs_undeliverable) waits for
    # the redrive that sends them, beside the message's own committed claim
    inbox = Inbox(pg_engine)
    inbox.process(_delivery("m-1", 10), lambda session: None)
    inbox.bookkeep(RecordPoison(_delivery("m-1", 10), "outputs_undeliverable", "x", 2))
    if order == "poison_then_copy":
        # When a copy of it arrives (a duplicate: its claim exists)
        inbox.process(_delivery("m-1", 10), lambda session: None)
    # Then the row is still the operator's
    assert _decisions(pg_engine) == {"m-1": "pending"}


@pytest.mark.parametrize("claims", ["library", "compact"])
def test_a_requeued_copy_poisoned_while_the_other_copy_commits_is_a_duplicate(pg_engine, claims):
    # Given two copies of m-1 in flight (a broker requeued it while a worker held it): the
    # requeued one over the redelivery limit, the other one committing just after that
    # copy's redelivery was counted, before its poison row is written
    inbox = Inbox(pg_engine, claims=claims)
    copy = _delivery("m-1", 10)
    for counted in (2, 3):  # its earlier redeliveries, each ended without an outcome
        inbox.bookkeep(CountRedelivery(copy, counted))
    arrival = Arrival(copy, deliveries=4, redelivered=True)
    published: list[Op] = []

    def perform(op: Op) -> object:
        if isinstance(op, RecordPoison):
            inbox.process(_delivery("m-1", 10), lambda session: None)  # the other copy
        if isinstance(op, Publish):
            published.append(op)
            return None
        return inbox.bookkeep(op)

    # When the requeued copy is settled
    settled = drive(settle_steps(arrival, ConsumerPolicy(redelivery_limit=1)), perform)
    # Then it is the duplicate of the copy that applied: acked, nothing dead-lettered, and
    # its row says the intent is applied
    assert isinstance(settled, Duplicate)
    assert published == []
    assert _decisions(pg_engine) == {"m-1": "recovered"}


# -- a copy that commits after the operator's redrive, before the redriven copy ------------


class _Published:
    """The redrive's publisher: keeps what it was asked to publish (the broker's part is
    the adapters' tests'; here only the row and the claim matter)."""

    formats = ("json",)

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def republish(self, message: Any, *, message_id: str) -> None:
        self.messages.append(message)


def _redrive(engine, message_id: str) -> str:
    """The operator redrives ``message_id``'s poison row; return the copy's marker."""
    [row] = [r for r in poison_rows(engine) if r["message_id"] == message_id]
    published = _Published()
    with engine.connect() as conn:
        redrive(conn, InboxSchema(), "poison", row["id"], by="ops", publisher=published)
    [message] = published.messages
    return message.marker


@pytest.mark.parametrize("path", ["one", "batch", "async"])
async def test_a_copy_that_commits_before_the_redriven_one_marks_the_redriven_row_recovered(
    pg_engine, pg_async_engine, path
):
    # Found by the FastStream failures test on Redis under load: the poisoned copy, still
    # pending in its stream, was reclaimed and applied after the operator's redrive; the
    # redriven copy was then a duplicate, and the row said redriven for good.
    # Given m-1 poisoned and redriven by an operator (its copy not yet consumed)
    stored = replace(_delivery("m-1", 10), payload_format="json")
    _poison(pg_engine, stored, _delivery("m-2", 10))
    marker = _redrive(pg_engine, "m-1")
    assert _decisions(pg_engine)["m-1"] == "redriven"
    # When a copy without the repair's marker (the earlier one, redelivered) commits first
    copy = _delivery("m-1", 10)
    if path == "one":
        Inbox(pg_engine).process(copy, lambda session: None)
    elif path == "batch":
        Inbox(pg_engine).process_batch([copy], lambda session, verdicts: None)
    else:

        async def nothing(session):
            return None

        await AsyncInbox(pg_async_engine).process(copy, nothing)
    # Then the row says the message is applied, and no operator waits on it
    assert _decisions(pg_engine) == {"m-1": "recovered", "m-2": "pending"}
    # And the redriven copy, when it arrives, is a duplicate that changes nothing
    committed = Inbox(pg_engine).process(
        _delivery("m-1", 10), lambda session: None, repair_marker=marker
    )
    assert (committed.verdict.decision, committed.recovered) == (Decision.DUPLICATE, None)
    assert _decisions(pg_engine) == {"m-1": "recovered", "m-2": "pending"}


@pytest.mark.parametrize("path", ["one", "batch"])
def test_a_redriven_copy_that_meets_the_claim_another_copy_committed_marks_its_row_recovered(
    engine, path
):
    # Given m-1 poisoned beside a copy that applied it, its row still pending: on
    # PostgreSQL the copies were in flight together (the applying copy's claim ran before
    # the row was written, and committed after it), on SQLite any later copy
    inbox = Inbox(engine)
    stored = replace(_delivery("m-1", 10), payload_format="json")
    if engine.dialect.name == "sqlite":
        _poison(engine, stored)
        inbox.process(_delivery("m-1", 10), lambda session: None)
    else:
        claimed, written = threading.Event(), threading.Event()

        def in_flight(session):
            claimed.set()
            assert written.wait(10)

        copy = threading.Thread(target=inbox.process, args=(_delivery("m-1", 10), in_flight))
        copy.start()
        assert claimed.wait(10)
        _poison(engine, stored)
        written.set()
        copy.join(10)
    assert _decisions(engine) == {"m-1": "pending"}
    # When an operator redrives it, and its copy meets the committed claim: a duplicate
    marker = _redrive(engine, "m-1")
    redriven = _delivery("m-1", 10)
    if path == "one":
        committed = inbox.process(redriven, lambda session: None, repair_marker=marker)
        assert (committed.verdict.decision, committed.recovered) == (
            Decision.DUPLICATE,
            "poison",
        )
    else:
        verdicts = inbox.process_batch(
            [redriven], lambda session, verdicts: None, repair_markers=[marker]
        ).verdicts
        assert [v.decision for v in verdicts] == [Decision.DUPLICATE]
    # Then the row says the repair's effect is there: nothing waits on it
    assert _decisions(engine) == {"m-1": "recovered"}
    # And the copy delivered again (its ack lost) is a duplicate that counts nothing more
    again = inbox.process(_delivery("m-1", 10), lambda session: None, repair_marker=marker)
    assert (again.verdict.decision, again.recovered) == (Decision.DUPLICATE, None)
    with engine.connect() as conn:
        assert len(conn.execute(select(TABLES.inbox)).all()) == 1  # applied once


def test_a_redriven_copy_of_outputs_that_could_not_be_sent_leaves_its_row_to_the_send(
    pg_engine,
):
    # Given m-1 applied, its outputs never sent, its row redriven
    inbox = Inbox(pg_engine)
    stored = replace(_delivery("m-1", 10), payload_format="json")
    inbox.process(stored, lambda session: None)
    inbox.bookkeep(RecordPoison(stored, "outputs_undeliverable", "x", 2))
    marker = _redrive(pg_engine, "m-1")
    # When its copy arrives: a duplicate of the claim that committed with the row
    committed = inbox.process(_delivery("m-1", 10), lambda session: None, repair_marker=marker)
    # Then the row is not recovered by the COMMIT: its repair is the send that follows
    assert (committed.verdict.decision, committed.recovered) == (Decision.DUPLICATE, None)
    assert _decisions(pg_engine) == {"m-1": "redriven"}
