"""What the broker is told of each settlement: `broker_operation` and `batch_operation`.

Each adapter performs the operation these return, once; here, without a broker, every
settlement of the core's tables (one delivery and batches) is mapped with and without a
dead-letter destination of the adapter's own, and the mapping is held to the inbox's
rule: nothing is acked or rejected unless its effect committed or the core decided it and
left a record of why, and a rolled-back attempt is always handed back.
"""

from __future__ import annotations

from typing import Any, get_args

import pytest

from inbox_middleware._core.consumption import (
    BatchProcessed,
    BatchRejected,
    BatchSettlement,
    BrokerOperation,
    DeadLettered,
    Duplicate,
    HandedBack,
    Poisoned,
    Processed,
    Publish,
    Quarantined,
    RecordPoison,
    Route,
    Settlement,
    Tell,
    batch_operation,
    broker_operation,
    drive,
    settle_batch_steps,
)
from inbox_middleware._core.exceptions import DatabaseUnavailable, MissingIdentity
from inbox_middleware._core.protocol import Decision, Verdict

from . import test_settlement_batch as batches
from . import test_settlement_table as table
from .script import Script, run

DESTINATIONS = [True, False]
"""Whether the adapter has a dead-letter destination of its own (it publishes dead
letters there) or leaves them to the broker's own dead-letter path."""

# One of each settlement, for the table below.
_ERROR = MissingIdentity("no producer")
SETTLEMENTS: dict[type, Any] = {
    Processed: Processed("result", Verdict(Decision.FIRST)),
    Duplicate: Duplicate(Verdict(Decision.DUPLICATE)),
    Quarantined: Quarantined(Verdict(Decision.CONFLICT), table.CONFLICT.quarantine),
    DeadLettered: DeadLettered("MissingIdentity", _ERROR),
    Poisoned: Poisoned("retries_exhausted", object(), "boom", exhausted=True),
    HandedBack: HandedBack(DatabaseUnavailable("down"), counted=False),
}


def test_broker_operation__every_settlement_has_a_row() -> None:
    assert set(SETTLEMENTS) == set(get_args(Settlement))


@pytest.mark.parametrize(
    ("kind", "destination", "expected"),
    [
        (Processed, True, BrokerOperation(Tell.ACK)),
        (Processed, False, BrokerOperation(Tell.ACK)),
        (Duplicate, False, BrokerOperation(Tell.ACK)),
        (Quarantined, False, BrokerOperation(Tell.ACK)),
        # published by the inbox to its own destination: acked
        (DeadLettered, True, BrokerOperation(Tell.ACK)),
        (Poisoned, True, BrokerOperation(Tell.ACK)),
        # no destination of the inbox's: the broker's own dead-letter path
        (DeadLettered, False, BrokerOperation(Tell.REJECT)),
        (Poisoned, False, BrokerOperation(Tell.REJECT)),
        (HandedBack, True, BrokerOperation(Tell.HAND_BACK, counted=False)),
        (HandedBack, False, BrokerOperation(Tell.HAND_BACK, counted=False)),
    ],
)
def test_broker_operation__each_settlement(kind: type, destination: bool, expected: Any) -> None:
    operation = broker_operation(SETTLEMENTS[kind], dead_letter_destination=destination)
    assert operation == expected
    assert operation.settled is (expected.tell is not Tell.HAND_BACK)


def test_broker_operation__a_counted_hand_back_says_so() -> None:
    counted = HandedBack(KeyError("k"), counted=True)
    assert broker_operation(counted, dead_letter_destination=True) == BrokerOperation(
        Tell.HAND_BACK, counted=True
    )


def _holds_the_rule(settlement: Settlement, script: Script, destination: bool) -> None:
    """What the broker is told of ``settlement``, which the core reached performing
    ``script``'s operations, keeps every message: an ack or a rejection only where the
    effect committed or the core left a record (a poison row, a dead letter published)."""
    operation = broker_operation(settlement, dead_letter_destination=destination)
    published = {op.route for op in script.performed if isinstance(op, Publish)}
    match settlement:
        case HandedBack(counted=counted):
            assert operation == BrokerOperation(Tell.HAND_BACK, counted=counted)
        case DeadLettered() | Poisoned():
            # told the broker only once the inbox tried its dead-letter publish (to its own
            # destination, or logged for the broker's path) without an error
            assert Route.DEAD_LETTER in published
            assert operation.tell is (Tell.ACK if destination else Tell.REJECT)
            if isinstance(settlement, Poisoned):
                assert any(isinstance(op, RecordPoison) for op in script.performed)
        case Quarantined():
            assert Route.QUARANTINE in published
            assert operation.tell is Tell.ACK
        case Processed() | Duplicate():
            assert operation.tell is Tell.ACK


@pytest.mark.parametrize("destination", DESTINATIONS)
@pytest.mark.parametrize("name", list(table.ROWS))
def test_broker_operation__every_row_of_the_core_s_table(name: str, destination: bool) -> None:
    row = table.ROWS[name]
    script = Script(row.answers)
    settled = run(table.arrival(**row.arrival), script, table._settings(row))
    _holds_the_rule(settled, script, destination)


@pytest.mark.parametrize("destination", DESTINATIONS)
@pytest.mark.parametrize("name", list(batches.ROWS))
def test_batch_operation__every_row_of_the_batch_table(name: str, destination: bool) -> None:
    row = batches.ROWS[name]
    script = Script(row.answers)
    settled = drive(settle_batch_steps(row.arrival, batches._settings(row)), script)
    operation = batch_operation(settled, dead_letter_destination=destination)
    match settled:
        case HandedBack(counted=counted):
            assert operation == BrokerOperation(Tell.HAND_BACK, counted=counted)
        case BatchProcessed(dead_lettered=indexes) | BatchRejected(dead_lettered=indexes):
            assert operation.tell is Tell.ACK
            assert operation.rejected == (() if destination else indexes)
            dead_letters = [
                op.item
                for op in script.performed
                if isinstance(op, Publish) and op.route is Route.DEAD_LETTER
            ]
            # each item rejected or acked as dead-lettered had its dead-letter publish
            assert sorted(dead_letters) == sorted(indexes)


def test_batch_operation__every_batch_settlement_is_mapped() -> None:
    assert {HandedBack, BatchProcessed, BatchRejected} == set(get_args(BatchSettlement))
