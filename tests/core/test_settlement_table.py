"""The settlement core's table: one row per arrow of the diagram in `consumption`.

Each row is an arrival, the consumer's settings and a script of answers; it says which
operations the core performs, in order, and which settlement comes out. No database, no
broker: the suites with real services prove that the adapters perform and tell the
broker what these rows decide. A new decision gets its row here first.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from inbox_middleware._core.consumption import (
    EXPIRED_REDELIVERY,
    HANDLER_REJECTED,
    HANDLER_TRANSACTION,
    INBOX_ERROR,
    REDELIVERY_LIMIT,
    RETRIES_EXHAUSTED,
    Arrival,
    CountFailure,
    CountHandBack,
    CountRedelivery,
    DeadLettered,
    Duplicate,
    HandBackRequested,
    HandedBack,
    LoadOutputs,
    LookUpClaim,
    MarkSent,
    Poisoned,
    Process,
    Processed,
    Publish,
    Quarantined,
    RecordPoison,
    RedeliveryCount,
    RejectRequested,
    RetryBudget,
    Route,
    RunUnprotected,
    SendOutputs,
    Unfit,
    drive,
    outputs_failed_steps,
)
from inbox_middleware._core.exceptions import (
    ClaimNotCommitted,
    CommitUnanswered,
    DatabaseUnavailable,
    HandlerTransactionError,
    InboxError,
    InboxInterrupted,
    InvalidIdentity,
    MissingIdentity,
    PayloadNotHashable,
    PermanentError,
    SchemaError,
    TransactionAborted,
    TransientError,
)
from inbox_middleware._core.identity import MessageIdentity
from inbox_middleware._core.outputs import OUTPUTS_UNDELIVERABLE, Output
from inbox_middleware._core.policy import ConsumerPolicy
from inbox_middleware._core.protocol import Decision, QuarantineRecord, StoredClaim, Verdict
from inbox_middleware._storage import Committed

from .script import Poison, Script, delivery, run, run_async

STORED = StoredClaim("ab" * 32, "v1", "", datetime(2026, 1, 1, tzinfo=UTC))
FIRST = Verdict(Decision.FIRST)
DUPLICATE = Verdict(Decision.DUPLICATE, STORED)
CONFLICT = Verdict(Decision.CONFLICT, STORED, quarantine=QuarantineRecord(7, 2))
SHADOW_DUPLICATE = Verdict(Decision.DUPLICATE, STORED, shadow=True)
OUTPUT = Output(b'"stored"', "json")
POISON = Poison(12, 3)
RECOVERED = Poison(12, 3, recovered=True)  # a copy with the same payload had committed
CONFIRMED = None  # what a confirmed publish answers


class Boom(Exception):
    """An ordinary handler failure."""


class Timeout(BaseException):
    """Stands for a framework interruption that fails the attempt (Dramatiq's TimeLimit)."""


class Shutdown(BaseException):
    """Stands for a worker shutting down: no fault of the message."""


def unanswered(interruption: BaseException) -> CommitUnanswered:
    """What storage raises when ``interruption`` landed while the COMMIT ran."""
    error = CommitUnanswered("interrupted while the COMMIT ran")
    error.__cause__ = interruption
    return error


def interrupted(interruption: BaseException) -> InboxInterrupted:
    """What storage raises when ``interruption`` landed in the claim, before the handler."""
    error = InboxInterrupted("interrupted while claiming")
    error.__cause__ = interruption
    return error


@dataclass(frozen=True)
class Row:
    """One arrow: given this arrival, settings and answers, these operations and this
    settlement."""

    arrival: dict[str, Any]
    answers: dict[type, list[Any]]
    ops: list[str]
    settled: type
    policy: dict[str, Any] = field(default_factory=dict)
    expect: dict[str, Any] = field(default_factory=dict)


def arrival(**given: Any) -> Arrival:
    fields: dict[str, Any] = {"delivery": delivery()}
    fields.update(given)
    return Arrival(**fields)


OLD = datetime.now(UTC) - timedelta(days=30)
STORED_AT = datetime(2026, 1, 1, 12, tzinfo=UTC)  # when the broker stored the message
EARLIER = replace(delivery(), identity=MessageIdentity("nats-stream:S", "1"))


def claimed_at(when: datetime) -> StoredClaim:
    return replace(STORED, processed_at=when)


ROWS: dict[str, Row] = {
    # -- no usable identity ------------------------------------------------------------
    "missing identity, policy process: run unprotected, processed": Row(
        {"delivery": None, "problem": MissingIdentity()},
        {RunUnprotected: ["raw result"]},
        ["RunUnprotected"],
        Processed,
        policy={"missing_identity": "process"},
        expect={"result": "raw result", "verdict": None},
    ),
    "missing identity, policy process, the handler fails: handed back, counted": Row(
        {"delivery": None, "problem": MissingIdentity()},
        {RunUnprotected: [Boom()]},
        ["RunUnprotected"],
        HandedBack,
        policy={"missing_identity": "process"},
        expect={"counted": True, "delay": None},
    ),
    "missing identity, policy process, the handler asks for a delay: handed back with it": Row(
        {"delivery": None, "problem": MissingIdentity()},
        {RunUnprotected: [HandBackRequested(5.0)]},
        ["RunUnprotected"],
        HandedBack,
        policy={"missing_identity": "process"},
        expect={"counted": True, "delay": 5.0},
    ),
    "missing identity, policy process, a framework interruption: handed back, counted": Row(
        {"delivery": None, "problem": MissingIdentity(), "interrupts": (Timeout,)},
        {RunUnprotected: [Timeout()]},
        ["RunUnprotected"],
        HandedBack,
        policy={"missing_identity": "process"},
        expect={"counted": True},
    ),
    "missing identity, shadow mode: run unprotected": Row(
        {"delivery": None, "problem": MissingIdentity()},
        {RunUnprotected: [None]},
        ["RunUnprotected"],
        Processed,
        policy={"shadow": True},
    ),
    "missing identity, policy reject: dead-lettered, reason missing": Row(
        {"delivery": None, "problem": MissingIdentity()},
        {Publish: [CONFIRMED]},
        ["Publish"],
        DeadLettered,
        expect={"reason": "missing"},
    ),
    "invalid identity, even with policy process: dead-lettered, reason invalid": Row(
        {"delivery": None, "problem": InvalidIdentity("too long")},
        {Publish: [CONFIRMED]},
        ["Publish"],
        DeadLettered,
        policy={"missing_identity": "process"},
        expect={"reason": "invalid"},
    ),
    "payload without a canonical form: dead-lettered, reason unhashable": Row(
        {"delivery": None, "problem": PayloadNotHashable()},
        {Publish: [CONFIRMED]},
        ["Publish"],
        DeadLettered,
        expect={"reason": "unhashable"},
    ),
    "dead letter refused by the broker: handed back, uncounted": Row(
        {"delivery": None, "problem": MissingIdentity()},
        {Publish: [ConnectionError("broker down")]},
        ["Publish"],
        HandedBack,
        expect={"counted": False},
    ),
    # -- held: the start-up check, run at the first message, has not passed -----------------
    "held: counted as a hand-back in this process, handed back before the claim": Row(
        {"held": SchemaError("the inbox tables do not exist")},
        {CountHandBack: [None]},
        ["CountHandBack"],
        HandedBack,
        expect={"counted": False, "delay": None},
    ),
    "held past the redelivery limit: still handed back, never poisoned": Row(
        {"held": DatabaseUnavailable(), "deliveries": 50, "redelivered": True},
        {CountHandBack: [None]},
        ["CountHandBack"],
        HandedBack,
        policy={"redelivery_limit": 3},
        expect={"counted": False},
    ),
    "held, the hand-back not even remembered: still handed back": Row(
        {"held": DatabaseUnavailable()},
        {CountHandBack: [RuntimeError("bug")]},
        ["CountHandBack"],
        HandedBack,
    ),
    "held without a usable identity: handed back, nothing to count it against": Row(
        {"held": DatabaseUnavailable(), "delivery": None, "problem": MissingIdentity()},
        {},
        [],
        HandedBack,
    ),
    # -- the redelivery limit ----------------------------------------------------------
    "the broker's first delivery: no count, processed": Row(
        {"deliveries": 1},
        {Process: [FIRST]},
        ["Process"],
        Processed,
        policy={"redelivery_limit": 10},
    ),
    "broker count within the limit: counted in the database, processed": Row(
        {"deliveries": 11, "redelivered": True},
        {CountRedelivery: [RedeliveryCount(10, 0, 0, False)], Process: [FIRST]},
        ["CountRedelivery", "Process"],
        Processed,
        policy={"redelivery_limit": 10},
    ),
    "an outage: broker count far over the limit, few deliveries reached the database": Row(
        {"deliveries": 40, "redelivered": True},
        {CountRedelivery: [RedeliveryCount(2, 0, 0, False)], Process: [FIRST]},
        ["CountRedelivery", "Process"],
        Processed,
        policy={"redelivery_limit": 3},
    ),
    "the database counted more than the broker did: the broker's count bounds it": Row(
        {"deliveries": 3, "redelivered": True},
        {CountRedelivery: [RedeliveryCount(50, 0, 0, False)], Process: [FIRST]},
        ["CountRedelivery", "Process"],
        Processed,
        policy={"redelivery_limit": 10},
    ),
    "no limit set: no count, processed": Row(
        {"deliveries": 500, "redelivered": True},
        {Process: [FIRST]},
        ["Process"],
        Processed,
        policy={"redelivery_limit": None},
    ),
    "broker count over the limit, failures and hand-backs explain it: processed": Row(
        {"deliveries": 13, "redelivered": True},
        {CountRedelivery: [RedeliveryCount(0, 1, 1, False)], Process: [FIRST]},
        ["CountRedelivery", "Process"],
        Processed,
        policy={"redelivery_limit": 10},
    ),
    "broker count over the limit, crashes the database counted: poisoned, dead-lettered": Row(
        {"deliveries": 13, "redelivered": True},
        {
            CountRedelivery: [RedeliveryCount(12, 0, 1, False)],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        },
        ["CountRedelivery", "RecordPoison", "Publish"],
        Poisoned,
        policy={"redelivery_limit": 10},
        expect={"reason": REDELIVERY_LIMIT},
    ),
    "over the limit but the claim committed (a lost ack): processed as a duplicate": Row(
        {"deliveries": 20, "redelivered": True},
        {CountRedelivery: [RedeliveryCount(0, 0, 0, True)], Process: [DUPLICATE]},
        ["CountRedelivery", "Process"],
        Duplicate,
        policy={"redelivery_limit": 10},
    ),
    "no broker count: the inbox's own count decides, within the limit": Row(
        {"redelivered": True},
        {CountRedelivery: [RedeliveryCount(3, 0, 0, False)], Process: [FIRST]},
        ["CountRedelivery", "Process"],
        Processed,
        policy={"redelivery_limit": 10},
    ),
    "no broker count: the inbox's own count over the limit: poisoned": Row(
        {"redelivered": True},
        {
            CountRedelivery: [RedeliveryCount(11, 0, 0, False)],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        },
        ["CountRedelivery", "RecordPoison", "Publish"],
        Poisoned,
        policy={"redelivery_limit": 10},
        expect={"reason": REDELIVERY_LIMIT},
    ),
    "outcomes do not come back as redeliveries: failures are not subtracted": Row(
        {"deliveries": 13, "redelivered": True, "outcomes_redeliver": False},
        {
            CountRedelivery: [RedeliveryCount(12, 5, 5, False)],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        },
        ["CountRedelivery", "RecordPoison", "Publish"],
        Poisoned,
        policy={"redelivery_limit": 10},
    ),
    "the count fails (the database is down): handed back, uncounted": Row(
        {"redelivered": True},
        {CountRedelivery: [DatabaseUnavailable()], CountHandBack: [None]},
        ["CountRedelivery", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "poisoned by the limit, the dead letter refused: handed back": Row(
        {"redelivered": True},
        {
            CountRedelivery: [RedeliveryCount(11, 0, 0, False)],
            RecordPoison: [POISON],
            Publish: [ConnectionError()],
            CountHandBack: [None],
        },
        ["CountRedelivery", "RecordPoison", "Publish", "CountHandBack"],
        HandedBack,
        policy={"redelivery_limit": 10},
        expect={"counted": False},
    ),
    # -- a broker id whose form changed (a rolling deploy) -----------------------------
    "claimed under the earlier form once stored (an earlier worker): a duplicate": Row(
        {"earlier_form": EARLIER, "stored_at": STORED_AT},
        {LookUpClaim: [claimed_at(STORED_AT + timedelta(seconds=1))]},
        ["LookUpClaim"],
        Duplicate,
    ),
    "claimed under the earlier form, outputs kept: the earlier claim's outputs": Row(
        {"earlier_form": EARLIER, "stored_at": STORED_AT, "keeps_outputs": True},
        {LookUpClaim: [claimed_at(STORED_AT)], LoadOutputs: [OUTPUT]},
        ["LookUpClaim", "LoadOutputs"],
        Duplicate,
        expect={"output": OUTPUT},
    ),
    "claimed under the earlier form before it was stored (a re-created stream): processed": Row(
        {"earlier_form": EARLIER, "stored_at": STORED_AT},
        {LookUpClaim: [claimed_at(STORED_AT - timedelta(minutes=5))], Process: [FIRST]},
        ["LookUpClaim", "Process"],
        Processed,
    ),
    "no claim under the earlier form: processed": Row(
        {"earlier_form": EARLIER, "stored_at": STORED_AT},
        {LookUpClaim: [None], Process: [FIRST]},
        ["LookUpClaim", "Process"],
        Processed,
    ),
    "the earlier form's look-up fails (the database is down): handed back": Row(
        {"earlier_form": EARLIER, "stored_at": STORED_AT},
        {LookUpClaim: [DatabaseUnavailable()], CountHandBack: [None]},
        ["LookUpClaim", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    # -- claim, handler, commit --------------------------------------------------------
    "first seen: processed with the handler's result": Row(
        {},
        {Process: [FIRST]},
        ["Process"],
        Processed,
        expect={"result": "handler result", "recovered": None, "expired": None},
    ),
    "first seen, a redriven poison message storage marked recovered: recovered": Row(
        {"repair_marker": "poison:12:op-1"},
        {Process: [Committed(FIRST, "handler result", 1, "poison")]},
        ["Process"],
        Processed,
        expect={"recovered": "poison"},
    ),
    "first seen, an accepted quarantined message storage marked recovered: recovered": Row(
        {"repair_marker": "quarantine:7:op-2"},
        {Process: [Committed(FIRST, "handler result", 1, "quarantine")]},
        ["Process"],
        Processed,
        expect={"recovered": "quarantine"},
    ),
    "first seen, a marker that matched no row of this delivery: nothing recovered": Row(
        {"repair_marker": "poison:12"},
        {Process: [FIRST]},
        ["Process"],
        Processed,
        expect={"recovered": None},
    ),
    "duplicate, nothing downstream: duplicate, no output loaded": Row(
        {},
        {Process: [DUPLICATE]},
        ["Process"],
        Duplicate,
        expect={"output": None, "recovered": None},
    ),
    "duplicate, a redriven copy that met the claim another copy committed: recovered": Row(
        {"repair_marker": "poison:12:op-1", "keeps_outputs": True},
        {Process: [Committed(DUPLICATE, None, 1, "poison")], LoadOutputs: [OUTPUT]},
        ["Process", "LoadOutputs"],
        Duplicate,
        expect={"output": OUTPUT, "recovered": "poison"},
    ),
    "duplicate with outputs kept: the stored output loaded": Row(
        {"keeps_outputs": True},
        {Process: [DUPLICATE], LoadOutputs: [OUTPUT]},
        ["Process", "LoadOutputs"],
        Duplicate,
        expect={"output": OUTPUT},
    ),
    "duplicate, the output cannot be loaded: handed back": Row(
        {"keeps_outputs": True},
        {Process: [DUPLICATE], LoadOutputs: [DatabaseUnavailable()], CountHandBack: [None]},
        ["Process", "LoadOutputs", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "conflict: published to quarantine, quarantined": Row(
        {},
        {Process: [CONFLICT], Publish: [CONFIRMED]},
        ["Process", "Publish"],
        Quarantined,
    ),
    "conflict, the quarantine publish refused: handed back (the row is committed)": Row(
        {},
        {Process: [CONFLICT], Publish: [ConnectionError()], CountHandBack: [None]},
        ["Process", "Publish", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "shadow mode, a would-be duplicate: the handler ran, processed": Row(
        {"delivery": delivery(shadow=True)},
        {Process: [SHADOW_DUPLICATE]},
        ["Process"],
        Processed,
        policy={"shadow": True},
    ),
    # -- expired redeliveries ----------------------------------------------------------
    "first seen, older than the retention window, policy reject: poisoned, expired": Row(
        {"delivery": delivery(produced_at=OLD)},
        {Process: [FIRST], CountFailure: [1], RecordPoison: [POISON], Publish: [CONFIRMED]},
        ["Process", "CountFailure", "RecordPoison", "Publish"],
        Poisoned,
        policy={"retention_window": timedelta(days=7)},
        expect={"reason": EXPIRED_REDELIVERY},
    ),
    "first seen, older than the window, policy process: processed, its age reported": Row(
        {"delivery": delivery(produced_at=OLD)},
        {Process: [FIRST]},
        ["Process"],
        Processed,
        policy={"retention_window": timedelta(days=7), "expired_redelivery": "process"},
    ),
    "first seen, older than the window, shadow: processed": Row(
        {"delivery": delivery(produced_at=OLD, shadow=True)},
        {Process: [FIRST]},
        ["Process"],
        Processed,
        policy={"retention_window": timedelta(days=7), "shadow": True},
    ),
    "first seen, within the window: processed, no age": Row(
        {"delivery": delivery(produced_at=datetime.now(UTC))},
        {Process: [FIRST]},
        ["Process"],
        Processed,
        policy={"retention_window": timedelta(days=7)},
        expect={"expired": None},
    ),
    "a duplicate older than the window: a duplicate (its claim is still there)": Row(
        {"delivery": delivery(produced_at=OLD)},
        {Process: [DUPLICATE]},
        ["Process"],
        Duplicate,
        policy={"retention_window": timedelta(days=7)},
    ),
    # -- raised: rolled back, the claim with it ----------------------------------------
    "the body does not fit the handler: dead-lettered, reason unfit": Row(
        {},
        {Process: [Unfit("bad body")], Publish: [CONFIRMED]},
        ["Process", "Publish"],
        DeadLettered,
        expect={"reason": "unfit"},
    ),
    "transient (database): handed back, uncounted, counted as a hand-back": Row(
        {},
        {Process: [TransientError()], CountHandBack: [None]},
        ["Process", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "the database unreachable: the hand-back remembered in this process": Row(
        {},
        {Process: [DatabaseUnavailable()], CountHandBack: [None]},
        ["Process", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "the schema missing or older (a migration running): handed back": Row(
        {},
        {Process: [SchemaError()], CountHandBack: [None]},
        ["Process", "CountHandBack"],
        HandedBack,
    ),
    "a worker shutting down: handed back, uncounted": Row(
        {"shutdowns": (Shutdown,)},
        {Process: [Shutdown()], CountHandBack: [None]},
        ["Process", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "the hand-back cannot be counted: handed back all the same": Row(
        {},
        {Process: [TransientError()], CountHandBack: [DatabaseUnavailable()]},
        ["Process", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "permanent (PermanentError): counted, poisoned with its code, dead-lettered": Row(
        {},
        {
            Process: [PermanentError("bad_account")],
            CountFailure: [1],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        },
        ["Process", "CountFailure", "RecordPoison", "Publish"],
        Poisoned,
        expect={"reason": "bad_account"},
    ),
    "the handler rejected it: poisoned, handler_rejected": Row(
        {},
        {
            Process: [RejectRequested()],
            CountFailure: [1],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        },
        ["Process", "CountFailure", "RecordPoison", "Publish"],
        Poisoned,
        expect={"reason": HANDLER_REJECTED},
    ),
    "a type listed as permanent: poisoned under the type's name": Row(
        {},
        {Process: [KeyError("x")], CountFailure: [1], RecordPoison: [POISON], Publish: [None]},
        ["Process", "CountFailure", "RecordPoison", "Publish"],
        Poisoned,
        policy={"permanent_errors": (KeyError,)},
        expect={"reason": "KeyError"},
    ),
    "an ordinary failure with attempts left: handed back, counted": Row(
        {},
        {Process: [Boom()], CountFailure: [3]},
        ["Process", "CountFailure"],
        HandedBack,
        policy={"max_attempts": 10},
        expect={"counted": True, "delay": None},
    ),
    "the handler asks for a redelivery after a delay: handed back with it, counted": Row(
        {},
        {Process: [HandBackRequested(2.5)], CountFailure: [1]},
        ["Process", "CountFailure"],
        HandedBack,
        expect={"counted": True, "delay": 2.5},
    ),
    "the last attempt fails: poisoned, retries_exhausted": Row(
        {},
        {Process: [Boom()], CountFailure: [10], RecordPoison: [POISON], Publish: [None]},
        ["Process", "CountFailure", "RecordPoison", "Publish"],
        Poisoned,
        policy={"max_attempts": 10},
        expect={"reason": RETRIES_EXHAUSTED},
    ),
    "the last attempt fails in the inbox's own path: poisoned, inbox_error": Row(
        {},
        {
            Process: [InboxError("the inbox's own trouble")],
            CountFailure: [10],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        },
        ["Process", "CountFailure", "RecordPoison", "Publish"],
        Poisoned,
        policy={"max_attempts": 10},
        expect={"reason": INBOX_ERROR},
    ),
    "the framework's retries end with this failure: poisoned, retries_exhausted": Row(
        {"retry_budget": RetryBudget(0, 0)},
        {Process: [Boom()], CountFailure: [1], RecordPoison: [POISON], Publish: [None]},
        ["Process", "CountFailure", "RecordPoison", "Publish"],
        Poisoned,
        policy={"max_attempts": None},
        expect={"reason": RETRIES_EXHAUSTED},
    ),
    "no limit of the inbox's own and none of the framework's: handed back": Row(
        {},
        {Process: [Boom()], CountFailure: [1000]},
        ["Process", "CountFailure"],
        HandedBack,
        policy={"max_attempts": None},
        expect={"counted": True},
    ),
    "a framework interruption (time limit) fails the attempt: counted": Row(
        {"interrupts": (Timeout,)},
        {Process: [Timeout()], CountFailure: [1]},
        ["Process", "CountFailure"],
        HandedBack,
        expect={"counted": True},
    ),
    "a time limit in the claim (waiting for the database): handed back, uncounted": Row(
        {"interrupts": (Timeout,), "retry_budget": RetryBudget(0, 0)},
        {Process: [interrupted(Timeout())], CountHandBack: [None]},
        ["Process", "CountHandBack"],
        HandedBack,
        policy={"max_attempts": 1},
        expect={"counted": False},
    ),
    "a time limit in the COMMIT, which committed after all: a duplicate, outputs sent": Row(
        {"interrupts": (Timeout,), "retry_budget": RetryBudget(0, 0), "keeps_outputs": True},
        {Process: [unanswered(Timeout())], LookUpClaim: [STORED], LoadOutputs: [OUTPUT]},
        ["Process", "LookUpClaim", "LoadOutputs"],
        Duplicate,
        policy={"max_attempts": 1},
        expect={"output": OUTPUT},
    ),
    "a time limit in the COMMIT, which did not commit: the last attempt failed, poisoned": Row(
        {"interrupts": (Timeout,), "retry_budget": RetryBudget(0, 0)},
        {
            Process: [unanswered(Timeout())],
            LookUpClaim: [None],
            CountFailure: [1],
            RecordPoison: [POISON],
            Publish: [None],
        },
        ["Process", "LookUpClaim", "CountFailure", "RecordPoison", "Publish"],
        Poisoned,
        policy={"max_attempts": 1},
        expect={"reason": RETRIES_EXHAUSTED},
    ),
    "a time limit in the COMMIT, whose outcome cannot be read: handed back, uncounted": Row(
        {"interrupts": (Timeout,)},
        {
            Process: [unanswered(Timeout())],
            LookUpClaim: [DatabaseUnavailable()],
            CountHandBack: [None],
        },
        ["Process", "LookUpClaim", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "a shutdown in the COMMIT, which did not commit: handed back, uncounted": Row(
        {"shutdowns": (Shutdown,)},
        {Process: [unanswered(Shutdown())], LookUpClaim: [None], CountHandBack: [None]},
        ["Process", "LookUpClaim", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    # An interruption that lands in the inbox's own operations (counting, recording,
    # looking up, publishing), not in the handler's: no fault of the message, handed back
    # as the database's trouble is, never left to the framework's retries to count.
    "a time limit while the failure is counted: handed back, uncounted": Row(
        {"interrupts": (Timeout,), "retry_budget": RetryBudget(0, 1)},
        {Process: [Boom()], CountFailure: [Timeout()], CountHandBack: [None]},
        ["Process", "CountFailure", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "a time limit while the last attempt's poison is recorded: handed back, uncounted": Row(
        {"interrupts": (Timeout,), "retry_budget": RetryBudget(0, 0)},
        {Process: [Boom()], CountFailure: [1], RecordPoison: [Timeout()], CountHandBack: [None]},
        ["Process", "CountFailure", "RecordPoison", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "a shutdown while a redelivery is counted: handed back, uncounted": Row(
        {"shutdowns": (Shutdown,), "deliveries": 3, "redelivered": True},
        {CountRedelivery: [Shutdown()], CountHandBack: [None]},
        ["CountRedelivery", "CountHandBack"],
        HandedBack,
        policy={"redelivery_limit": 1},
        expect={"counted": False},
    ),
    "a time limit in the hand-back's own count: handed back, uncounted": Row(
        {"interrupts": (Timeout,)},
        {Process: [DatabaseUnavailable()], CountHandBack: [Timeout()]},
        ["Process", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "a time limit while a duplicate's outputs are loaded: handed back, uncounted": Row(
        {"interrupts": (Timeout,), "keeps_outputs": True},
        {Process: [DUPLICATE], LoadOutputs: [Timeout()], CountHandBack: [None]},
        ["Process", "LoadOutputs", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "a time limit while a conflict is published to quarantine: handed back, uncounted": Row(
        {"interrupts": (Timeout,)},
        {Process: [CONFLICT], Publish: [Timeout()], CountHandBack: [None]},
        ["Process", "Publish", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    # A poison row written recovered: a copy with the same payload committed meanwhile.
    # That copy applied the intent: this one is its duplicate, never dead-lettered.
    "a requeued copy over the redelivery limit, the other copy applied: a duplicate": Row(
        {"deliveries": 3, "redelivered": True},
        {
            CountRedelivery: [RedeliveryCount(2, 0, 0, False)],
            RecordPoison: [RECOVERED],
            LookUpClaim: [STORED],
        },
        ["CountRedelivery", "RecordPoison", "LookUpClaim"],
        Duplicate,
        policy={"redelivery_limit": 1},
    ),
    "the last attempt failed, a copy with the same payload applied: its outputs sent": Row(
        {"keeps_outputs": True},
        {
            Process: [Boom()],
            CountFailure: [1],
            RecordPoison: [RECOVERED],
            LookUpClaim: [STORED],
            LoadOutputs: [OUTPUT],
        },
        ["Process", "CountFailure", "RecordPoison", "LookUpClaim", "LoadOutputs"],
        Duplicate,
        policy={"max_attempts": 1},
        expect={"output": OUTPUT},
    ),
    "recorded recovered, the claim not readable now: handed back (its redelivery sees it)": Row(
        {"deliveries": 3, "redelivered": True},
        {
            CountRedelivery: [RedeliveryCount(2, 0, 0, False)],
            RecordPoison: [RECOVERED],
            LookUpClaim: [DatabaseUnavailable()],
            CountHandBack: [None],
        },
        ["CountRedelivery", "RecordPoison", "LookUpClaim", "CountHandBack"],
        HandedBack,
        policy={"redelivery_limit": 1},
        expect={"counted": False},
    ),
    "the failure cannot be counted: handed back, uncounted": Row(
        {},
        {Process: [Boom()], CountFailure: [DatabaseUnavailable()], CountHandBack: [None]},
        ["Process", "CountFailure", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "a permanent failure whose poison cannot be recorded: handed back, uncounted": Row(
        {},
        {
            Process: [PermanentError("bad")],
            CountFailure: [1],
            RecordPoison: [DatabaseUnavailable()],
            CountHandBack: [None],
        },
        ["Process", "CountFailure", "RecordPoison", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "poisoned, the dead letter refused: handed back (the poison row is committed)": Row(
        {},
        {
            Process: [PermanentError("bad")],
            CountFailure: [1],
            RecordPoison: [POISON],
            Publish: [ConnectionError()],
            CountHandBack: [None],
        },
        ["Process", "CountFailure", "RecordPoison", "Publish", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "the handler ended the transaction itself: poisoned at once, handler_transaction": Row(
        {},
        {
            Process: [HandlerTransactionError("commit() inside the handler")],
            CountFailure: [1],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        },
        ["Process", "CountFailure", "RecordPoison", "Publish"],
        Poisoned,
        policy={"max_attempts": 10},
        expect={"reason": HANDLER_TRANSACTION},
    ),
    "the transaction at COMMIT was not the claim's, or rolled back: an ordinary failure": Row(
        {},
        {Process: [ClaimNotCommitted("ended on the driver's connection")], CountFailure: [1]},
        ["Process", "CountFailure"],
        HandedBack,
        policy={"max_attempts": 10},
        expect={"counted": True},
    ),
    "the handler left the transaction aborted (a caught error): an ordinary failure": Row(
        {},
        {Process: [TransactionAborted("40001 caught by the handler")], CountFailure: [1]},
        ["Process", "CountFailure"],
        HandedBack,
        policy={"max_attempts": 10},
        expect={"counted": True},
    ),
}


def _settings(row: Row) -> ConsumerPolicy:
    return replace(ConsumerPolicy(), **row.policy)


def _check(row: Row, script: Script, settled: Any) -> None:
    assert script.names == row.ops
    assert type(settled) is row.settled, settled
    for name, value in row.expect.items():
        assert getattr(settled, name) == value, (name, getattr(settled, name))


@pytest.mark.parametrize("name", list(ROWS))
def test_core__settles_each_arrow_of_the_diagram(name: str) -> None:
    row = ROWS[name]
    script = Script(row.answers)
    _check(row, script, run(arrival(**row.arrival), script, _settings(row)))


@pytest.mark.parametrize("name", list(ROWS))
def test_core__the_async_driver_settles_alike(name: str) -> None:
    row = ROWS[name]
    script = Script(row.answers)
    _check(row, script, run_async(arrival(**row.arrival), script, _settings(row)))


# -- what the rows above cannot say in one line ----------------------------------------------


def test_core__the_dead_letter_says_why_and_whose_it_is() -> None:
    script = Script({Publish: [CONFIRMED]})
    run(arrival(delivery=None, problem=MissingIdentity("no producer")), script)
    (publish,) = script.performed
    assert isinstance(publish, Publish)
    assert publish.route is Route.DEAD_LETTER
    assert publish.details["reason"] == "MissingIdentity"
    assert publish.details["detail"] == "no producer"


def test_core__the_quarantine_publish_carries_both_hashes_and_the_row() -> None:
    script = Script({Process: [CONFLICT], Publish: [CONFIRMED]})
    run(arrival(), script)
    publish = script.performed[-1]
    assert isinstance(publish, Publish)
    assert publish.route is Route.QUARANTINE
    assert publish.details["quarantine_id"] == 7
    assert publish.details["stored_sha256"] == STORED.payload_sha256
    assert publish.details["consumer"] == "billing"


def test_core__the_poison_dead_letter_names_the_row() -> None:
    script = Script(
        {Process: [PermanentError("bad")], CountFailure: [1], RecordPoison: [POISON]}
        | {Publish: [CONFIRMED]}
    )
    settled = run(arrival(), script)
    assert isinstance(settled, Poisoned)
    record = script.performed[2]
    assert isinstance(record, RecordPoison)
    assert (record.reason, record.attempts) == ("bad", 1)
    assert script.performed[-1].details["poison_id"] == POISON.id  # type: ignore[union-attr]


def test_core__the_hand_back_is_remembered_in_process_only_when_the_database_is_down() -> None:
    for error, unreachable in ((DatabaseUnavailable(), True), (TransientError(), False)):
        script = Script({Process: [error], CountHandBack: [None]})
        run(arrival(), script)
        count = script.performed[-1]
        assert isinstance(count, CountHandBack)
        assert count.unreachable is unreachable


def test_core__a_held_delivery_is_remembered_as_a_hand_back_in_this_process() -> None:
    script = Script({CountHandBack: [None]})
    run(arrival(held=SchemaError("not migrated")), script)
    (count,) = script.performed
    assert isinstance(count, CountHandBack)
    assert count.unreachable is True


def test_core__the_process_is_going_down_the_core_lets_it() -> None:
    # KeyboardInterrupt and cancellation: nothing is settled, the broker keeps the message.
    for exc in (KeyboardInterrupt(), SystemExit()):
        script = Script({Process: [exc]})
        with pytest.raises(type(exc)):
            run(arrival(), script)
        script = Script({RunUnprotected: [exc]})
        with pytest.raises(type(exc)):
            run(
                arrival(delivery=None, problem=MissingIdentity()),
                script,
                ConsumerPolicy(missing_identity="process"),
            )


def test_core__the_process_going_down_in_the_inbox_s_own_record_is_let_through() -> None:
    # Only the framework's interruptions are the inbox's to hand back; not these.
    for exc in (KeyboardInterrupt(), SystemExit()):
        script = Script({Process: [Boom()], CountFailure: [exc]})
        with pytest.raises(type(exc)):
            run(arrival(interrupts=(Timeout,), shutdowns=(Shutdown,)), script)
        assert script.names == ["Process", "CountFailure"]


def test_core__the_process_going_down_while_the_commit_ran_is_let_through() -> None:
    # Whether it committed is unknown; the process is going down: nothing is settled.
    for exc in (KeyboardInterrupt(), SystemExit()):
        for landed in (unanswered(exc), interrupted(exc)):
            script = Script({Process: [landed]})
            with pytest.raises(type(exc)):
                run(arrival(interrupts=(Timeout,)), script)
            assert [type(op).__name__ for op in script.performed] == ["Process"]


def test_core__the_process_op_carries_the_repair_marker_and_outputs_flag() -> None:
    script = Script({Process: [FIRST]})
    run(arrival(repair_marker="poison:3", keeps_outputs=True), script)
    (process,) = script.performed
    assert isinstance(process, Process)
    assert (process.repair_marker, process.keeps_outputs) == ("poison:3", True)


# -- outputs that could not be published after the commit -------------------------------------

OUTPUT_ROWS: dict[str, Row] = {
    "transient trouble publishing outputs: handed back, uncounted": Row(
        {},
        {CountHandBack: [None]},
        ["CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "a failed publish with attempts left: handed back, counted": Row(
        {},
        {CountFailure: [2]},
        ["CountFailure"],
        HandedBack,
        policy={"max_attempts": 10},
        expect={"counted": True},
    ),
    "the last attempt: poisoned, outputs_undeliverable, dead-lettered": Row(
        {},
        {CountFailure: [10], RecordPoison: [POISON], Publish: [CONFIRMED]},
        ["CountFailure", "RecordPoison", "Publish"],
        Poisoned,
        policy={"max_attempts": 10},
        expect={"reason": OUTPUTS_UNDELIVERABLE},
    ),
    "the framework gives up: poisoned, outputs_undeliverable": Row(
        {"retry_budget": RetryBudget(0, 0)},
        {CountFailure: [1], RecordPoison: [POISON], Publish: [CONFIRMED]},
        ["CountFailure", "RecordPoison", "Publish"],
        Poisoned,
        policy={"max_attempts": None},
        expect={"reason": OUTPUTS_UNDELIVERABLE},
    ),
    "the failure cannot be counted: handed back, uncounted": Row(
        {},
        {CountFailure: [DatabaseUnavailable()], CountHandBack: [None]},
        ["CountFailure", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
}


@pytest.mark.parametrize("name", list(OUTPUT_ROWS))
def test_core__outputs_that_failed_after_the_commit(name: str) -> None:
    row = OUTPUT_ROWS[name]
    script = Script(row.answers)
    exc: Exception = TransientError() if "transient" in name else ConnectionError("refused")
    settled = drive(outputs_failed_steps(arrival(**row.arrival), _settings(row), exc), script)
    _check(row, script, settled)


def test_core__every_arrow_has_a_row() -> None:
    # The diagram's settlements and operations all appear in the table.
    settlements = {row.settled for row in ROWS.values()}
    assert settlements == {Processed, Duplicate, Quarantined, DeadLettered, Poisoned, HandedBack}
    performed = {op for row in ROWS.values() for op in row.ops}
    assert performed == {
        "RunUnprotected",
        "Publish",
        "CountRedelivery",
        "RecordPoison",
        "Process",
        "LoadOutputs",
        "LookUpClaim",
        "CountFailure",
        "CountHandBack",
    }


# -- the framework's retry budget: "is this the last attempt?" --------------------------------


@pytest.mark.parametrize(
    ("budget", "raised", "last"),
    [
        (RetryBudget(retries=0, max_retries=0), Boom(), True),  # no Retries middleware
        (RetryBudget(retries=2, max_retries=3), Boom(), False),
        (RetryBudget(retries=3, max_retries=3), Boom(), True),
        (RetryBudget(retries=99, max_retries=None), Boom(), False),
        # retry_when decides alone when given, with the count and the handler's error
        (RetryBudget(5, 3, retry_when=lambda count, exc: count < 9), Boom(), False),
        (RetryBudget(0, 3, retry_when=lambda count, exc: isinstance(exc, Boom)), KeyError(), True),
        # a Retry the handler raised is judged as itself, not as the core's wrapper
        (
            RetryBudget(0, 3, retry_when=lambda count, exc: isinstance(exc, Boom)),
            HandBackRequested(cause=Boom()),
            False,
        ),
    ],
)
def test_core__the_frameworks_retry_budget_says_whether_this_attempt_was_the_last(
    budget: RetryBudget, raised: BaseException, last: bool
) -> None:
    script = Script(
        {Process: [raised], CountFailure: [1], RecordPoison: [POISON], Publish: [CONFIRMED]}
    )
    settled = run(
        arrival(retry_budget=budget), script, replace(ConsumerPolicy(), max_attempts=None)
    )
    assert type(settled) is (Poisoned if last else HandedBack), settled
    if last:
        assert isinstance(settled, Poisoned)
        assert settled.reason == RETRIES_EXHAUSTED and settled.exhausted


# -- outputs the adapter sends before the ack (Dramatiq: pipeline steps, on_success) ----------

SENT = {"keeps_outputs": True, "sends_outputs": True}

SEND_ROWS: dict[str, Row] = {
    "first seen: the stored outputs sent, then processed": Row(
        SENT,
        {Process: [FIRST], SendOutputs: [None]},
        ["Process", "SendOutputs"],
        Processed,
        expect={"result": OUTPUT},
    ),
    "a duplicate: the stored outputs loaded and sent again": Row(
        SENT,
        {Process: [DUPLICATE], LoadOutputs: [OUTPUT], SendOutputs: [None]},
        ["Process", "LoadOutputs", "SendOutputs"],
        Duplicate,
        expect={"output": OUTPUT},
    ),
    "a redriven copy of outputs that could not be sent: sent, then its row recovered": Row(
        SENT | {"repair_marker": "poison:12:op-1"},
        {Process: [DUPLICATE], LoadOutputs: [OUTPUT], SendOutputs: [None], MarkSent: ["poison"]},
        ["Process", "LoadOutputs", "SendOutputs", "MarkSent"],
        Duplicate,
        expect={"output": OUTPUT, "recovered": "poison"},
    ),
    "the same, its row not marked (the database): a duplicate all the same, nothing resent": Row(
        SENT | {"repair_marker": "poison:12:op-1"},
        {
            Process: [DUPLICATE],
            LoadOutputs: [OUTPUT],
            SendOutputs: [None],
            MarkSent: [DatabaseUnavailable()],
        },
        ["Process", "LoadOutputs", "SendOutputs", "MarkSent"],
        Duplicate,
        expect={"output": OUTPUT, "recovered": None},
    ),
    "a redriven copy whose row its claim recovered: sent, nothing more to mark": Row(
        SENT | {"repair_marker": "poison:12:op-1"},
        {
            Process: [Committed(DUPLICATE, None, 1, "poison")],
            LoadOutputs: [OUTPUT],
            SendOutputs: [None],
        },
        ["Process", "LoadOutputs", "SendOutputs"],
        Duplicate,
        expect={"output": OUTPUT, "recovered": "poison"},
    ),
    "a duplicate of a claim that stored nothing: nothing to send": Row(
        SENT,
        {Process: [DUPLICATE], LoadOutputs: [None]},
        ["Process", "LoadOutputs"],
        Duplicate,
    ),
    "a time limit while the outputs are sent: handed back, uncounted (the claim stays)": Row(
        {**SENT, "interrupts": (Timeout,)},
        {Process: [FIRST], SendOutputs: [Timeout()], CountHandBack: [None]},
        ["Process", "SendOutputs", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "the send failed with attempts left: handed back, counted (the claim stays)": Row(
        SENT,
        {Process: [FIRST], SendOutputs: [ConnectionError("refused")], CountFailure: [1]},
        ["Process", "SendOutputs", "CountFailure"],
        HandedBack,
        policy={"max_attempts": 10},
        expect={"counted": True},
    ),
    "the send failed on the last attempt: poisoned, outputs_undeliverable": Row(
        SENT,
        {
            Process: [DUPLICATE],
            LoadOutputs: [OUTPUT],
            SendOutputs: [ConnectionError("refused")],
            CountFailure: [10],
            RecordPoison: [POISON],
            Publish: [CONFIRMED],
        },
        ["Process", "LoadOutputs", "SendOutputs", "CountFailure", "RecordPoison", "Publish"],
        Poisoned,
        policy={"max_attempts": 10},
        expect={"reason": OUTPUTS_UNDELIVERABLE, "exhausted": True},
    ),
    "the send failed for transient trouble: handed back, uncounted": Row(
        SENT,
        {Process: [FIRST], SendOutputs: [TransientError()], CountHandBack: [None]},
        ["Process", "SendOutputs", "CountHandBack"],
        HandedBack,
        expect={"counted": False},
    ),
    "the adapter publishes the result itself (FastStream): nothing sent here": Row(
        {"keeps_outputs": True},
        {Process: [FIRST]},
        ["Process"],
        Processed,
        expect={"result": OUTPUT},
    ),
}


@pytest.mark.parametrize("name", list(SEND_ROWS))
def test_core__outputs_sent_before_the_ack(name: str) -> None:
    row = SEND_ROWS[name]
    script = Script(row.answers, result=OUTPUT)
    _check(row, script, run(arrival(**row.arrival), script, _settings(row)))
    sent = [op for op in script.performed if isinstance(op, SendOutputs)]
    assert all(op.output == OUTPUT and op.delivery == delivery() for op in sent)


def test_core__the_commit_s_outcome_is_read_once_the_transaction_holding_the_key_ended() -> None:
    script = Script({Process: [unanswered(Timeout())], LookUpClaim: [None], CountFailure: [1]})
    run(arrival(interrupts=(Timeout,)), script)
    look_up = script.performed[1]
    assert isinstance(look_up, LookUpClaim)
    assert look_up.settled is True
