"""The consumption core's decisions, without services: a scripted ``perform`` answers each
operation (or raises), and each row says which settlement must come out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from inbox_middleware._core.consumption import (
    HANDLER_TRANSACTION,
    INBOX_ERROR,
    RETRIES_EXHAUSTED,
    Arrival,
    CountFailure,
    CountHandBack,
    DeadLettered,
    HandedBack,
    Op,
    Poisoned,
    Process,
    Publish,
    RecordPoison,
    Unfit,
    drive,
    settle_steps,
)
from inbox_middleware._core.exceptions import (
    DirectPublishRefused,
    HandlerTransactionError,
    TransactionAborted,
    TransactionConflict,
)
from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.policy import ConsumerPolicy
from inbox_middleware._core.protocol import Delivery

DELIVERY = Delivery("billing", MessageIdentity("orders", "ord-1"), hash_json({"a": 1}, "json.v1"))


@dataclass
class Record:
    id: int
    attempts: int


class Script:
    """Performs the core's operations: the attempt raises ``error``; ``failures`` failed
    attempts were counted before this one."""

    def __init__(self, error: BaseException, failures: int = 0) -> None:
        self.error = error
        self.failures = failures
        self.done: list[type[Op]] = []

    def __call__(self, op: Op) -> Any:
        self.done.append(type(op))
        match op:
            case Process():
                raise self.error
            case CountFailure():
                self.failures += 1
                return self.failures
            case RecordPoison(attempts=attempts):
                return Record(1, attempts)
            case CountHandBack() | Publish():
                return None
        raise AssertionError(f"unexpected operation {op!r}")


def settle(error: BaseException, *, failures: int = 0, max_attempts: int = 10) -> Any:
    script = Script(error, failures)
    rules = ConsumerPolicy(max_attempts=max_attempts)
    settlement = drive(settle_steps(Arrival(DELIVERY), rules), script)
    return settlement, script.done


def aborted_by(code: str) -> TransactionAborted:
    error = TransactionAborted(f"aborted by {code}")
    error.__cause__ = Exception(code)
    return error


# -- the handler ends the inbox's transaction itself: permanent, poison at once -------------


@pytest.mark.parametrize("method", ["commit", "rollback", "close"])
def test_core__handler_ending_the_transaction_is_poison_at_once(method):
    error = HandlerTransactionError(f"the handler called {method}()")
    settlement, done = settle(error)
    assert isinstance(settlement, Poisoned)
    assert settlement.reason == HANDLER_TRANSACTION
    assert settlement.record.attempts == 1
    assert f"{method}()" in settlement.error
    assert done == [Process, CountFailure, RecordPoison, Publish]


def test_core__refused_direct_publish_is_poison_at_once():
    settlement, _ = settle(DirectPublishRefused("published directly"))
    assert isinstance(settlement, Poisoned)
    assert settlement.reason == HANDLER_TRANSACTION


# -- an aborted transaction stays retryable: what it swallowed may have been transient -------


@pytest.mark.parametrize("code", ["40001", "40P01", "55P03", "57014", "23505"])
def test_core__aborted_transaction_is_an_ordinary_counted_failure(code):
    settlement, done = settle(aborted_by(code))
    assert isinstance(settlement, HandedBack)
    assert settlement.counted
    assert done == [Process, CountFailure]


def test_core__aborted_transaction_out_of_attempts_is_inbox_error():
    settlement, _ = settle(aborted_by("23505"), failures=9)
    assert isinstance(settlement, Poisoned)
    assert settlement.reason == INBOX_ERROR


def test_core__transient_error_is_handed_back_uncounted():
    settlement, done = settle(TransactionConflict("deadlock"))
    assert isinstance(settlement, HandedBack)
    assert not settlement.counted
    assert CountFailure not in done


def test_core__handler_error_out_of_attempts_is_retries_exhausted():
    settlement, _ = settle(ValueError("boom"), failures=2, max_attempts=3)
    assert isinstance(settlement, Poisoned)
    assert settlement.reason == RETRIES_EXHAUSTED


def test_core__unfit_body_is_dead_lettered_without_an_attempt():
    settlement, done = settle(Unfit("the body does not fit"))
    assert isinstance(settlement, DeadLettered)
    assert done == [Process, Publish]
