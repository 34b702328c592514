"""The settlement core's table for batches: one row per decision of `settle_batch_steps`.

A batch subscriber's messages are claimed, handled and committed as a whole; each row is
a batch (items with an identity, items without one), the consumer's settings and a
script of answers, and says which operations the core performs, in order, and which
settlement comes out. No database, no broker.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inbox_middleware._core.consumption import (
    EXPIRED_REDELIVERY,
    HANDLER_REJECTED,
    HANDLER_TRANSACTION,
    INBOX_ERROR,
    REDELIVERY_LIMIT,
    RETRIES_EXHAUSTED,
    BatchArrival,
    BatchProcessed,
    BatchRejected,
    CountFailure,
    CountHandBack,
    CountRedelivery,
    HandBackRequested,
    HandedBack,
    LookUpClaim,
    ProcessBatch,
    Publish,
    QuarantineConflict,
    RecordPoison,
    RedeliveryCount,
    RejectRequested,
    Route,
    Unfit,
    drive,
    settle_batch_steps,
)
from inbox_middleware._core.exceptions import (
    ClaimNotCommitted,
    DatabaseUnavailable,
    HandlerTransactionError,
    InboxError,
    MissingIdentity,
    SchemaError,
)
from inbox_middleware._core.identity import MessageIdentity, PayloadHash
from inbox_middleware._core.policy import ConsumerPolicy
from inbox_middleware._core.protocol import (
    Decision,
    Delivery,
    QuarantineRecord,
    StoredClaim,
    Verdict,
)
from inbox_middleware._storage.base import BatchCommitted

from .script import Poison, Script

STORED = StoredClaim("ab" * 32, "v1", "", datetime(2026, 1, 1, tzinfo=UTC))
FIRST = Verdict(Decision.FIRST)
DUPLICATE = Verdict(Decision.DUPLICATE, STORED)
CONFLICT = Verdict(Decision.CONFLICT, STORED, quarantine=QuarantineRecord(7, 2))
SHADOW_CONFLICT = Verdict(Decision.CONFLICT, STORED, shadow=True)
POISON = Poison(12, 3)
CONFIRMED = None


class Boom(Exception):
    """An ordinary handler failure."""


LONG_AGO = datetime(2020, 1, 1, tzinfo=UTC)
WINDOW = {"retention_window": timedelta(days=7)}


def _delivery(message_id: str, produced_at: datetime | None = None) -> Delivery:
    return Delivery(
        consumer="billing",
        identity=MessageIdentity("orders", message_id, produced_at=produced_at),
        payload_hash=PayloadHash("v1", "cd" * 32),
        source="orders.q",
        received_at=datetime(2026, 1, 1, tzinfo=UTC),
    )


def batch(
    claimed: int = 2,
    missing: tuple[int, ...] = (),
    *,
    old: tuple[int, ...] = (),
    delivered: tuple[tuple[int, int], ...] = (),
) -> BatchArrival:
    """A batch of ``claimed`` items with an identity, plus those at ``missing`` without;
    those at ``old`` produced long before the retention window; ``delivered``: the
    broker's delivery count of some items (JetStream's)."""
    size = claimed + len(missing)
    indexes = [index for index in range(size) if index not in missing]
    return BatchArrival(
        tuple(
            (index, _delivery(f"ord-{index}", LONG_AGO if index in old else None))
            for index in indexes
        ),
        tuple((index, MissingIdentity("no producer")) for index in missing),
        size,
        declared_consumer="billing",
        source="orders.q",
        delivered=delivered,
    )


@dataclass
class Row:
    arrival: BatchArrival
    answers: dict[type, list[Any]]
    ops: list[str]
    settled: type
    policy: dict[str, Any] = field(default_factory=dict)
    expect: dict[str, Any] = field(default_factory=dict)


def outcome(*verdicts: Verdict) -> BatchCommitted[Any]:
    return BatchCommitted(verdicts, "batch result")


ROWS: dict[str, Row] = {
    "all first seen: committed, the handler's result": Row(
        batch(),
        {ProcessBatch: [outcome(FIRST, FIRST)]},
        ["ProcessBatch"],
        BatchProcessed,
        expect={"ran": True, "result": "batch result", "dead_lettered": ()},
    ),
    "all duplicates: committed, the handler skipped": Row(
        batch(),
        {ProcessBatch: [BatchCommitted((DUPLICATE, DUPLICATE))]},
        ["ProcessBatch"],
        BatchProcessed,
        expect={"ran": False},
    ),
    "a redriven and an accepted message in the batch: the rows they marked told": Row(
        batch(3),
        {
            ProcessBatch: [
                BatchCommitted((FIRST, FIRST, DUPLICATE), None, 1, ("poison", None, "quarantine"))
            ]
        },
        ["ProcessBatch"],
        BatchProcessed,
        expect={"ran": True, "recovered": ("poison", "quarantine")},
    ),
    "a conflict in the batch: quarantined after the commit": Row(
        batch(),
        {ProcessBatch: [outcome(FIRST, CONFLICT)], Publish: [CONFIRMED]},
        ["ProcessBatch", "Publish"],
        BatchProcessed,
        expect={"ran": True},
    ),
    "a conflict in shadow mode: not quarantined": Row(
        batch(),
        {ProcessBatch: [outcome(FIRST, SHADOW_CONFLICT)]},
        ["ProcessBatch"],
        BatchProcessed,
    ),
    "an item without an identity: dead-lettered after the commit": Row(
        batch(2, missing=(1,)),
        {ProcessBatch: [outcome(FIRST, FIRST)], Publish: [CONFIRMED]},
        ["ProcessBatch", "Publish"],
        BatchProcessed,
        expect={"dead_lettered": (1,)},
    ),
    "nothing with an identity: no claim, each dead-lettered": Row(
        batch(0, missing=(0, 1)),
        {Publish: [CONFIRMED]},
        ["Publish", "Publish"],
        BatchProcessed,
        expect={"dead_lettered": (0, 1), "ran": False, "result": None},
    ),
    "a transient failure: handed back, a hand-back counted for each message": Row(
        batch(),
        {ProcessBatch: [DatabaseUnavailable()], CountHandBack: [None]},
        ["ProcessBatch", "CountHandBack", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "a migration running: handed back, a hand-back counted for each message": Row(
        batch(),
        {ProcessBatch: [SchemaError("migrating")], CountHandBack: [None]},
        ["ProcessBatch", "CountHandBack", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "a failure with attempts left: counted against each message, handed back": Row(
        batch(),
        {ProcessBatch: [Boom("no")], CountFailure: [1, 2]},
        ["ProcessBatch", "CountFailure", "CountFailure"],
        HandedBack,
        policy={"max_attempts": 3},
        expect={"counted": True},
    ),
    "the transaction at COMMIT was not the claim's: counted against each, handed back": Row(
        batch(),
        {
            ProcessBatch: [ClaimNotCommitted("ended on the driver's connection")],
            CountFailure: [1, 2],
        },
        ["ProcessBatch", "CountFailure", "CountFailure"],
        HandedBack,
        policy={"max_attempts": 3},
        expect={"counted": True},
    ),
    "the handler asked for a redelivery: a counted failure, handed back": Row(
        batch(),
        {ProcessBatch: [HandBackRequested(5)], CountFailure: [1]},
        ["ProcessBatch", "CountFailure", "CountFailure"],
        HandedBack,
        expect={"counted": True},
    ),
    "no attempt limit: handed back however often it failed": Row(
        batch(),
        {ProcessBatch: [Boom("no")], CountFailure: [99]},
        ["ProcessBatch", "CountFailure", "CountFailure"],
        HandedBack,
        policy={"max_attempts": None},
        expect={"counted": True},
    ),
    "the last attempt of the closest message: each kept as poison, dead-lettered": Row(
        batch(2, missing=(2,)),
        {
            ProcessBatch: [Boom("no")],
            CountFailure: [1, 3],
            LookUpClaim: [None],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        },
        ["ProcessBatch", "CountFailure", "CountFailure", "LookUpClaim", "LookUpClaim"]
        + ["RecordPoison", "RecordPoison"]
        + ["Publish"] * 3,
        BatchRejected,
        policy={"max_attempts": 3},
        expect={"reason": RETRIES_EXHAUSTED, "dead_lettered": (0, 1, 2)},
    ),
    "the inbox's own error on the last attempt: inbox_error": Row(
        batch(1),
        {
            ProcessBatch: [InboxError("broken")],
            CountFailure: [3],
            LookUpClaim: [None],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        },
        ["ProcessBatch", "CountFailure", "LookUpClaim", "RecordPoison", "Publish"],
        BatchRejected,
        policy={"max_attempts": 3},
        expect={"reason": INBOX_ERROR},
    ),
    "a permanent error by setting: poison at once, named after its type": Row(
        batch(1),
        {
            ProcessBatch: [KeyError("gone")],
            CountFailure: [1],
            LookUpClaim: [None],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        },
        ["ProcessBatch", "CountFailure", "LookUpClaim", "RecordPoison", "Publish"],
        BatchRejected,
        policy={"permanent_errors": (KeyError,)},
        expect={"reason": "KeyError"},
    ),
    "the handler ended the transaction itself: poison at once": Row(
        batch(1),
        {
            ProcessBatch: [HandlerTransactionError("commit() inside the handler")],
            CountFailure: [1],
            LookUpClaim: [None],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        },
        ["ProcessBatch", "CountFailure", "LookUpClaim", "RecordPoison", "Publish"],
        BatchRejected,
        expect={"reason": HANDLER_TRANSACTION},
    ),
    "the handler rejected the batch: each dead-lettered, nothing recorded": Row(
        batch(2, missing=(2,)),
        {ProcessBatch: [RejectRequested("bad batch")], Publish: [CONFIRMED]},
        ["ProcessBatch", "Publish", "Publish", "Publish"],
        BatchRejected,
        expect={"reason": HANDLER_REJECTED, "records": (), "dead_lettered": (0, 1, 2)},
    ),
    "the batch does not fit the handler: each dead-lettered, nothing recorded": Row(
        batch(),
        {ProcessBatch: [Unfit("not a list of orders")], Publish: [CONFIRMED]},
        ["ProcessBatch", "Publish", "Publish"],
        BatchRejected,
        expect={"reason": "unfit", "records": ()},
    ),
    "the failure could not be counted: handed back, a hand-back counted for each": Row(
        batch(),
        {
            ProcessBatch: [Boom("no")],
            CountFailure: [DatabaseUnavailable()],
            CountHandBack: [None],
        },
        ["ProcessBatch", "CountFailure", "CountHandBack", "CountHandBack"],
        HandedBack,
        policy={"max_attempts": 1},
        expect={"counted": False},
    ),
    "the poison could not be recorded: handed back, a hand-back counted for each": Row(
        batch(),
        {
            ProcessBatch: [Boom("no")],
            CountFailure: [1],
            LookUpClaim: [None],
            RecordPoison: [DatabaseUnavailable()],
            CountHandBack: [None],
        },
        [
            "ProcessBatch",
            "CountFailure",
            "CountFailure",
            "LookUpClaim",
            "LookUpClaim",
            "RecordPoison",
            "CountHandBack",
            "CountHandBack",
        ],
        HandedBack,
        policy={"max_attempts": 1},
        expect={"counted": False},
    ),
    "the quarantine publish failed: handed back (the row is committed), counted": Row(
        batch(),
        {
            ProcessBatch: [outcome(FIRST, CONFLICT)],
            Publish: [ConnectionError("refused")],
            CountHandBack: [None],
        },
        ["ProcessBatch", "Publish", "CountHandBack", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "a dead-letter publish failed: handed back, counted": Row(
        batch(1, missing=(1,)),
        {
            ProcessBatch: [outcome(FIRST)],
            Publish: [ConnectionError("refused")],
            CountHandBack: [None],
        },
        ["ProcessBatch", "Publish", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    # -- the retention window, per message of the batch (as for one message) --
    "an expired message first seen: kept as poison alone, the rest claimed again": Row(
        batch(2, old=(0,)),
        {
            ProcessBatch: [outcome(FIRST, FIRST), outcome(FIRST)],
            CountFailure: [1],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        },
        ["ProcessBatch", "CountFailure", "RecordPoison", "ProcessBatch", "Publish"],
        BatchProcessed,
        policy=WINDOW,
        expect={"ran": True, "dead_lettered": (0,), "poisoned": (0,), "result": "batch result"},
    ),
    "an expired message that is a duplicate: skipped with the batch, nothing refused": Row(
        batch(2, old=(0,)),
        {ProcessBatch: [outcome(DUPLICATE, FIRST)]},
        ["ProcessBatch"],
        BatchProcessed,
        policy=WINDOW,
        expect={"dead_lettered": (), "poisoned": (), "expired": ()},
    ),
    "expired_redelivery='process': the expired message is processed, and said so": Row(
        batch(2, old=(1,)),
        {ProcessBatch: [outcome(FIRST, FIRST)]},
        ["ProcessBatch"],
        BatchProcessed,
        policy=WINDOW | {"expired_redelivery": "process"},
        expect={"dead_lettered": (), "expired": (1,)},
    ),
    "no retention window: an old message is no expired one": Row(
        batch(2, old=(0,)),
        {ProcessBatch: [outcome(FIRST, FIRST)]},
        ["ProcessBatch"],
        BatchProcessed,
        expect={"dead_lettered": (), "expired": ()},
    ),
    "every message expired and first seen: each kept as poison, nothing claimed": Row(
        batch(1, missing=(1,), old=(0,)),
        {
            ProcessBatch: [outcome(FIRST)],
            CountFailure: [1],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        },
        ["ProcessBatch", "CountFailure", "RecordPoison", "Publish", "Publish"],
        BatchProcessed,
        policy=WINDOW,
        expect={"ran": False, "dead_lettered": (0, 1), "poisoned": (0,), "result": None},
    ),
    "an expired message's poison could not be recorded: handed back, counted": Row(
        batch(2, old=(0,)),
        {
            ProcessBatch: [outcome(FIRST, FIRST)],
            CountFailure: [DatabaseUnavailable()],
            CountHandBack: [None],
        },
        ["ProcessBatch", "CountFailure", "CountHandBack", "CountHandBack"],
        HandedBack,
        policy=WINDOW,
        expect={"counted": False},
    ),
    # -- the redelivery limit, per message, where the broker counts (JetStream) --
    "redelivered without an outcome beyond the limit: kept as poison alone": Row(
        batch(2, delivered=((0, 12), (1, 1))),
        {
            CountRedelivery: [RedeliveryCount(11, 0, 0, False)],
            RecordPoison: [POISON],
            ProcessBatch: [outcome(FIRST)],
            Publish: [CONFIRMED],
        },
        ["CountRedelivery", "RecordPoison", "ProcessBatch", "Publish"],
        BatchProcessed,
        expect={"ran": True, "dead_lettered": (0,), "poisoned": (0,)},
    ),
    "redelivered within the limit: claimed with the batch": Row(
        batch(2, delivered=((0, 3), (1, 3))),
        {CountRedelivery: [RedeliveryCount(2, 0, 0, False)], ProcessBatch: [outcome(FIRST, FIRST)]},
        ["CountRedelivery", "CountRedelivery", "ProcessBatch"],
        BatchProcessed,
        expect={"dead_lettered": (), "poisoned": ()},
    ),
    "the broker says first delivery: nothing counted": Row(
        batch(2, delivered=((0, 1), (1, 1))),
        {ProcessBatch: [outcome(FIRST, FIRST)]},
        ["ProcessBatch"],
        BatchProcessed,
    ),
    "redeliveries after failures and hand-backs are no crashes: claimed": Row(
        batch(1, delivered=((0, 12),)),
        {CountRedelivery: [RedeliveryCount(11, 5, 6, False)], ProcessBatch: [outcome(FIRST)]},
        ["CountRedelivery", "ProcessBatch"],
        BatchProcessed,
    ),
    "beyond the limit but committed already (a lost ack): claimed, a duplicate": Row(
        batch(1, delivered=((0, 12),)),
        {CountRedelivery: [RedeliveryCount(11, 0, 0, True)], ProcessBatch: [outcome(DUPLICATE)]},
        ["CountRedelivery", "ProcessBatch"],
        BatchProcessed,
        expect={"ran": False, "poisoned": ()},
    ),
    "no redelivery limit: nothing counted": Row(
        batch(1, delivered=((0, 50),)),
        {ProcessBatch: [outcome(FIRST)]},
        ["ProcessBatch"],
        BatchProcessed,
        policy={"redelivery_limit": None},
    ),
    "held before the claim (the start-up check has not passed): handed back, a hand-back "
    "counted for each message, nothing claimed": Row(
        replace(batch(2, delivered=((0, 9),)), held=SchemaError("not migrated")),
        {CountHandBack: [None]},
        ["CountHandBack", "CountHandBack"],
        HandedBack,
        policy={"redelivery_limit": 1},
        expect={"counted": False},
    ),
    "held, and the hand-backs could not be counted: handed back all the same": Row(
        replace(batch(), held=DatabaseUnavailable("down")),
        {CountHandBack: [DatabaseUnavailable("down")]},
        ["CountHandBack", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "the redelivery could not be counted: handed back, a hand-back counted for each": Row(
        batch(2, delivered=((0, 4),)),
        {CountRedelivery: [DatabaseUnavailable()], CountHandBack: [None]},
        ["CountRedelivery", "CountHandBack", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
}


def _settings(row: Row) -> ConsumerPolicy:
    return replace(ConsumerPolicy(), **row.policy)


@pytest.mark.parametrize("name", list(ROWS))
def test_core_batch__settles_each_decision(name: str) -> None:
    row = ROWS[name]
    script = Script(row.answers)
    settled = drive(settle_batch_steps(row.arrival, _settings(row)), script)
    assert script.names == row.ops
    assert type(settled) is row.settled, settled
    for attribute, value in row.expect.items():
        assert getattr(settled, attribute) == value, (attribute, getattr(settled, attribute))


def test_core_batch__each_publish_names_its_item_and_route() -> None:
    script = Script({ProcessBatch: [outcome(FIRST, CONFLICT, FIRST)], Publish: [CONFIRMED]})
    arrival = batch(3, missing=(3,))
    drive(settle_batch_steps(arrival, ConsumerPolicy()), script)
    publishes = [op for op in script.performed if isinstance(op, Publish)]
    assert [(p.route, p.item) for p in publishes] == [
        (Route.QUARANTINE, 1),
        (Route.DEAD_LETTER, 3),
    ]
    assert publishes[0].details["message_id"] == "ord-1"
    assert publishes[1].details["reason"] == "MissingIdentity"


def test_core_batch__a_poison_batch_says_why_in_each_dead_letter() -> None:
    script = Script(
        {
            ProcessBatch: [Boom("no")],
            CountFailure: [2, 1],
            LookUpClaim: [None],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        }
    )
    settled = drive(settle_batch_steps(batch(), replace(ConsumerPolicy(), max_attempts=2)), script)
    assert isinstance(settled, BatchRejected)
    records = [op for op in script.performed if isinstance(op, RecordPoison)]
    assert [(r.reason, r.attempts) for r in records] == [
        (RETRIES_EXHAUSTED, 2),
        (RETRIES_EXHAUSTED, 1),
    ]
    details = [op.details for op in script.performed if isinstance(op, Publish)]
    assert {d["reason"] for d in details} == {"InboxError"}
    assert "a poison batch (retries_exhausted, 2 attempts): Boom: no" in details[0]["detail"]
    assert isinstance(settled.failure, Boom)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        (
            "an expired message first seen: kept as poison alone, the rest claimed again",
            EXPIRED_REDELIVERY,
        ),
        ("redelivered without an outcome beyond the limit: kept as poison alone", REDELIVERY_LIMIT),
    ],
)
def test_core_batch__a_message_kept_as_poison_alone_says_why(name: str, reason: str) -> None:
    row = ROWS[name]
    script = Script(row.answers)
    settled = drive(settle_batch_steps(row.arrival, _settings(row)), script)
    assert isinstance(settled, BatchProcessed)
    (record,) = [op for op in script.performed if isinstance(op, RecordPoison)]
    assert (record.reason, record.delivery.identity.message_id) == (reason, "ord-0")
    assert [poisoned.reason for poisoned in settled.poison] == [reason]
    (dead,) = [op for op in script.performed if isinstance(op, Publish)]
    assert (dead.item, dead.details["reason_code"], dead.details["poison_id"]) == (0, reason, 12)
    # the rest of the batch was claimed without it
    (last,) = [op for op in script.performed if isinstance(op, ProcessBatch)][-1:]
    assert [d.identity.message_id for d in last.deliveries] == ["ord-1"]
    assert last.items == (1,)


def test_core_batch__a_poison_batch_after_one_kept_alone_dead_letters_that_one_as_its_own() -> None:
    # Given a batch whose first message is over the redelivery limit, and whose rest then
    # fails permanently
    script = Script(
        {
            CountRedelivery: [RedeliveryCount(11, 0, 0, False)],
            RecordPoison: [POISON],
            ProcessBatch: [KeyError("gone")],
            CountFailure: [1],
            LookUpClaim: [None],
            Publish: [CONFIRMED],
        }
    )
    arrival = batch(2, delivered=((0, 12),))
    policy = replace(ConsumerPolicy(), permanent_errors=(KeyError,))
    settled = drive(settle_batch_steps(arrival, policy), script)
    # Then both are dead-lettered, each with its own reason
    assert isinstance(settled, BatchRejected)
    assert settled.dead_lettered == (0, 1)
    details = [op.details for op in script.performed if isinstance(op, Publish)]
    assert details[0]["reason_code"] == REDELIVERY_LIMIT
    assert "a poison batch (KeyError" in details[1]["detail"]


def test_core_batch__the_process_is_going_down_the_core_lets_it() -> None:
    script = Script({ProcessBatch: [KeyboardInterrupt()]})
    with pytest.raises(KeyboardInterrupt):
        drive(settle_batch_steps(batch(), ConsumerPolicy()), script)


# -- every script of answers ends in exactly one batch settlement ----------------------------

_FAILURES = [Boom("no"), DatabaseUnavailable(), KeyError("k"), RejectRequested(), Unfit("no")]
_VERDICTS = st.sampled_from([FIRST, DUPLICATE, CONFLICT, SHADOW_CONFLICT])


@st.composite
def batch_scripts(draw: st.DrawFn) -> tuple[BatchArrival, dict[type, list[Any]], ConsumerPolicy]:
    claimed = draw(st.integers(0, 3))
    missing = tuple(range(claimed, claimed + draw(st.integers(0, 2))))
    old = tuple(index for index in range(claimed) if draw(st.booleans()))
    delivered = tuple((index, draw(st.integers(1, 15))) for index in range(claimed))
    arrival = batch(claimed, missing, old=old, delivered=delivered)
    # what each claim of the batch (the first, then the rest's) answers
    attempts = [
        draw(st.sampled_from([outcome(*(draw(_VERDICTS) for _ in range(size))), *_FAILURES]))
        for size in range(claimed, -1, -1)
    ]
    answers: dict[type, list[Any]] = {
        ProcessBatch: attempts,
        CountFailure: [draw(st.integers(1, 5) | st.just(DatabaseUnavailable()))],
        RecordPoison: [draw(st.sampled_from([POISON, DatabaseUnavailable()]))],
        Publish: [draw(st.sampled_from([CONFIRMED, ConnectionError("refused")]))],
        CountHandBack: [draw(st.sampled_from([None, DatabaseUnavailable()]))],
        CountRedelivery: [
            draw(
                st.builds(
                    RedeliveryCount,
                    st.integers(0, 15),
                    st.integers(0, 3),
                    st.integers(0, 3),
                    st.booleans(),
                )
                | st.just(DatabaseUnavailable())
            )
        ],
    }
    policy = replace(
        ConsumerPolicy(),
        max_attempts=draw(st.none() | st.integers(1, 5)),
        permanent_errors=draw(st.sampled_from([(), (KeyError,)])),
        redelivery_limit=draw(st.none() | st.integers(0, 5)),
        retention_window=draw(st.none() | st.just(timedelta(days=7))),
        expired_redelivery=draw(st.sampled_from(["reject", "process"])),
    )
    return arrival, answers, policy


@settings(max_examples=300, deadline=None)
@given(drawn=batch_scripts())
def test_core_batch__every_script_ends_in_one_settlement(
    drawn: tuple[BatchArrival, dict[type, list[Any]], ConsumerPolicy],
) -> None:
    arrival, answers, policy = drawn
    script = Script(answers)
    settled = drive(settle_batch_steps(arrival, policy), script)
    assert isinstance(settled, BatchProcessed | BatchRejected | HandedBack)
    publishes = [op for op in script.performed if isinstance(op, Publish)]
    if isinstance(settled, BatchRejected):
        # every item of the batch went to the dead-letter destination, confirmed
        assert settled.dead_lettered == tuple(range(arrival.size))
        assert [p.item for p in publishes] == list(range(arrival.size))
        assert not any(script.raised[-len(publishes) :])
    if isinstance(settled, BatchProcessed):
        # the messages without an identity and those kept as poison alone, confirmed
        without = {index for index, _ in arrival.problems}
        assert settled.dead_lettered == tuple(sorted(without | set(settled.poisoned)))
        assert [p.item for p in publishes if p.route is Route.DEAD_LETTER] == list(
            settled.dead_lettered
        )
        if publishes:
            assert not any(script.raised[-len(publishes) :])
        # each message kept as poison alone has its poison row, recorded
        recorded = {
            op.delivery.identity.message_id
            for op, raised in zip(script.performed, script.raised, strict=True)
            if isinstance(op, RecordPoison) and not raised
        }
        assert {f"ord-{index}" for index in settled.poisoned} <= recorded
        # and was not claimed with the rest
        assert len(settled.verdicts) == len(arrival.deliveries) - len(settled.poisoned)


def test_core_batch__a_copy_applied_before_is_a_duplicate_in_a_poison_batch() -> None:
    # Given a batch failing for good whose first message is a redelivery of a message
    # applied before (its ack lost), with the same payload, and whose second is new
    applied = StoredClaim("cd" * 32, "v1", "h1", datetime(2026, 1, 1, tzinfo=UTC))
    script = Script(
        {
            ProcessBatch: [KeyError("gone")],
            CountFailure: [1],
            LookUpClaim: [applied, None],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        }
    )
    policy = replace(ConsumerPolicy(), permanent_errors=(KeyError,))
    settled = drive(settle_batch_steps(batch(2), policy), script)
    # Then the copy is a duplicate: acked, neither kept as poison nor dead-lettered
    assert isinstance(settled, BatchRejected)
    assert settled.duplicates == (0,)
    assert settled.dead_lettered == (1,)
    records = [
        op.delivery.identity.message_id for op in script.performed if isinstance(op, RecordPoison)
    ]
    assert records == ["ord-1"]


def test_core_batch__a_conflict_in_a_poison_batch_is_quarantined_as_alone() -> None:
    # Given a batch failing for good whose first message has the identity of a message
    # applied before with another payload (a conflict, whatever the batch's handler did)
    other = StoredClaim("ef" * 32, "v1", "h1", datetime(2026, 1, 1, tzinfo=UTC))
    script = Script(
        {
            ProcessBatch: [KeyError("gone")],
            CountFailure: [1],
            LookUpClaim: [other, None],
            QuarantineConflict: [QuarantineRecord(7, 1)],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        }
    )
    policy = replace(ConsumerPolicy(), permanent_errors=(KeyError,))
    settled = drive(settle_batch_steps(batch(2), policy), script)
    # Then it is quarantined as it would be alone (its row, published to the quarantine
    # destination), never kept as poison; the rest of the batch is, and dead-lettered
    assert isinstance(settled, BatchRejected)
    assert (settled.quarantined, settled.dead_lettered) == ((0,), (1,))
    conflicts = [op for op in script.performed if isinstance(op, QuarantineConflict)]
    assert [(op.delivery.identity.message_id, op.stored) for op in conflicts] == [("ord-0", other)]
    records = [
        op.delivery.identity.message_id for op in script.performed if isinstance(op, RecordPoison)
    ]
    assert records == ["ord-1"]
    published = [(op.route, op.item) for op in script.performed if isinstance(op, Publish)]
    assert published == [(Route.QUARANTINE, 0), (Route.DEAD_LETTER, 1)]
    quarantine = next(op for op in script.performed if isinstance(op, Publish))
    assert quarantine.details["reason"] == "identity_conflict"
    assert quarantine.details["quarantine_id"] == 7


def test_core_batch__a_conflict_in_a_poison_batch_unrecorded_hands_the_batch_back() -> None:
    # Given the same, but the quarantine row cannot be written (the database went away)
    other = StoredClaim("ef" * 32, "v1", "h1", datetime(2026, 1, 1, tzinfo=UTC))
    script = Script(
        {
            ProcessBatch: [KeyError("gone")],
            CountFailure: [1],
            LookUpClaim: [other, None],
            QuarantineConflict: [DatabaseUnavailable()],
            CountHandBack: [None],
        }
    )
    policy = replace(ConsumerPolicy(), permanent_errors=(KeyError,))
    settled = drive(settle_batch_steps(batch(2), policy), script)
    # Then nothing is dropped: the batch is handed back, nothing recorded nor published
    assert isinstance(settled, HandedBack)
    assert not [op for op in script.performed if isinstance(op, RecordPoison | Publish)]
