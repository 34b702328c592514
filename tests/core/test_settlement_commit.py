"""The core's decision at the COMMIT: storage reports what it saw of the claim's
transaction (`TransactionState`), the core says whether it may commit and, if not, what
the attempt fails with (`commit_refusal`), which `settle_steps` then settles like any
failure of the attempt. No database: storage's half (reading the state on psycopg and
asyncpg) is proven in tests/integration/test_handler_transaction.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from inbox_middleware._core.consumption import (
    HANDLER_TRANSACTION,
    Arrival,
    CountFailure,
    HandedBack,
    Poisoned,
    Process,
    Processed,
    Publish,
    RecordPoison,
    TransactionState,
    commit_refusal,
    reason_code,
)
from inbox_middleware._core.exceptions import HandlerTransactionError, TransactionAborted
from inbox_middleware._core.protocol import Decision, Verdict

from .script import Poison, Script, delivery, run

FIRST = Verdict(Decision.FIRST)


@dataclass
class Row:
    refusal: type[BaseException] | None
    """The error the attempt fails with (its exact type); None: it commits."""
    reason: str | None
    """Its reason code (None: an ordinary failure, retried)."""
    ops: list[str]
    settled: type
    expect: dict[str, Any]


ROWS: dict[TransactionState, Row] = {
    TransactionState.OPEN: Row(None, None, ["Process"], Processed, {}),
    TransactionState.ENDED: Row(
        HandlerTransactionError,
        HANDLER_TRANSACTION,
        ["Process", "CountFailure", "RecordPoison", "Publish"],
        Poisoned,
        {"reason": HANDLER_TRANSACTION},
    ),
    TransactionState.ABORTED: Row(
        TransactionAborted,
        None,
        ["Process", "CountFailure"],
        HandedBack,
        {"counted": True},
    ),
}


def test_core_commit__every_state_has_a_row() -> None:
    assert set(ROWS) == set(TransactionState)


@pytest.mark.parametrize("state", list(TransactionState))
def test_core_commit__what_storage_saw_decides_the_commit(state: TransactionState) -> None:
    row = ROWS[state]
    claim = delivery()
    refusal = commit_refusal(state, claim)
    # Then the core decides whether the transaction may commit, and what the attempt
    # fails with: the exact type (users catch them), naming the message
    if row.refusal is None:
        assert refusal is None
        answer: Any = FIRST
    else:
        assert type(refusal) is row.refusal
        assert (refusal.consumer, refusal.message_id) == ("billing", "ord-1")
        assert reason_code(refusal) == row.reason
        answer = refusal
    # and the settlement of an attempt whose COMMIT was refused
    script = Script({Process: [answer], CountFailure: [1], RecordPoison: [Poison(3, 1)]})
    script = Script({**script.answers, Publish: [None]})
    settled = run(Arrival(claim), script)
    assert script.names == row.ops
    assert type(settled) is row.settled, settled
    for attribute, value in row.expect.items():
        assert getattr(settled, attribute) == value


def test_core_commit__outside_a_delivery_the_refusal_names_nothing() -> None:
    refusal = commit_refusal(TransactionState.ABORTED, None)
    assert isinstance(refusal, TransactionAborted)
    assert refusal.message_id is None


def test_core_commit__the_refusals_say_what_to_do_instead() -> None:
    ended = commit_refusal(TransactionState.ENDED, delivery())
    aborted = commit_refusal(TransactionState.ABORTED, delivery())
    assert "Raise an exception to abandon the message" in str(ended)
    assert "session.begin_nested()" in str(aborted)
