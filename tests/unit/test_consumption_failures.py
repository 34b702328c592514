"""The consumption core's decisions about a failed attempt and about outputs that could
not be sent, driven by a scripted ``perform``: no database, no broker.

Each row says what the core decides and what the settlement tells the adapter: which
exception failed the attempt (Dramatiq sends ``on_failure`` for it) and whether the
attempts ran out (Dramatiq sends ``on_retry_exhausted`` then, never for a permanent
failure)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from inbox_middleware._core.consumption import (
    Arrival,
    CountFailure,
    CountRedelivery,
    HandedBack,
    Op,
    Poisoned,
    Process,
    Publish,
    RecordPoison,
    RejectRequested,
    RetryBudget,
    drive,
    outputs_failed_steps,
    settle_steps,
)
from inbox_middleware._core.exceptions import PermanentError
from inbox_middleware._core.identity import MessageIdentity, PayloadHash
from inbox_middleware._core.policy import ConsumerPolicy
from inbox_middleware._core.protocol import Delivery

DELIVERY = Delivery("billing", MessageIdentity("orders", "ord-1"), PayloadHash("v1", "00"))


class Boom(Exception):
    pass


def script(raised: BaseException | None, attempts: int = 1, redeliveries: int = 0) -> Any:
    """A ``perform`` whose handler raises ``raised``; the failure count is ``attempts``, the
    redeliveries the database counted ``redeliveries``."""

    def perform(op: Op) -> Any:
        match op:
            case Process():
                if raised is not None:
                    raise raised
                raise AssertionError("only failures here")
            case CountFailure():
                return attempts
            case CountRedelivery():
                return SimpleNamespace(
                    redeliveries=redeliveries, failures=0, hand_backs=0, claimed=False
                )
            case RecordPoison(reason=reason, attempts=count):
                return SimpleNamespace(id=12, attempts=count, reason=reason)
            case Publish():
                return None
        return None

    return perform


def arrival(gives_up: bool) -> Arrival:
    return Arrival(DELIVERY, retry_budget=RetryBudget(0, 0 if gives_up else None))


RULES = ConsumerPolicy(max_attempts=None, permanent_errors=(KeyError,))


@pytest.mark.parametrize(
    ("raised", "gives_up", "reason", "failure", "exhausted"),
    [
        # the last attempt allowed by the framework: retries ran out
        (Boom("x"), True, "retries_exhausted", Boom, True),
        # a configured permanent type (Dramatiq's throws): failed, not exhausted
        (KeyError("k"), False, "KeyError", KeyError, False),
        (PermanentError("account_closed", "no"), False, "account_closed", PermanentError, False),
        # the handler's own rejection is a decision, not a failed attempt
        (RejectRequested(), False, "handler_rejected", None, False),
    ],
)
def test_failed__poison_says_what_failed_and_whether_attempts_ran_out(
    raised: BaseException,
    gives_up: bool,
    reason: str,
    failure: type[BaseException] | None,
    exhausted: bool,
) -> None:
    settlement = drive(settle_steps(arrival(gives_up), RULES), script(raised, attempts=3))
    assert isinstance(settlement, Poisoned)
    assert settlement.reason == reason
    assert settlement.exhausted is exhausted
    if failure is None:
        assert settlement.failure is None
    else:
        assert isinstance(settlement.failure, failure)


def test_failed__an_attempt_with_retries_left_is_handed_back_counted() -> None:
    settlement = drive(settle_steps(arrival(False), RULES), script(Boom("x")))
    assert isinstance(settlement, HandedBack) and settlement.counted


def test_outputs_failed__retried_while_attempts_remain() -> None:
    error = ConnectionError("refused")
    settlement = drive(outputs_failed_steps(arrival(False), RULES, error), script(None))
    assert isinstance(settlement, HandedBack)
    assert settlement.counted and settlement.error is error


def test_outputs_failed__kept_as_poison_when_the_attempts_run_out() -> None:
    error = ConnectionError("refused")
    settlement = drive(outputs_failed_steps(arrival(True), RULES, error), script(None, 2))
    assert isinstance(settlement, Poisoned)
    assert (settlement.reason, settlement.record.attempts) == ("outputs_undeliverable", 2)
    assert settlement.failure is error and settlement.exhausted


def test_redelivery_limit__a_crash_loop_is_poison_that_no_attempt_failed() -> None:
    # Given a message the broker delivered 12 times, each ending with a dead worker (each
    # redelivery reached the database, which counted 11)
    crashed = Arrival(DELIVERY, deliveries=12, redelivered=True)
    rules = ConsumerPolicy(max_attempts=None, redelivery_limit=10)
    settlement = drive(settle_steps(crashed, rules), script(None, redeliveries=11))
    # Then it is poison, and no exception failed it: no on_failure, no on_retry_exhausted
    assert isinstance(settlement, Poisoned)
    assert (settlement.reason, settlement.failure, settlement.exhausted) == (
        "redelivery_limit",
        None,
        False,
    )
