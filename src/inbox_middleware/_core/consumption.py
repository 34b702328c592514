"""One delivery in, one settlement out: the consumption core, sans I/O, no framework.

An adapter turns a framework's message into an `Arrival` (the delivery, or why there is
none, and what the broker says about earlier deliveries) and drives `settle_steps` with
its own I/O: the generator yields the operations to perform (`Op`), receives their
results or their exceptions, and returns exactly one `Settlement`, which
`broker_operation` turns into what the adapter tells the broker, once (ack, reject to the
broker's own dead-letter path, or hand back)::

    Arrival ──> held (the start-up check has not passed)? ──> CountHandBack ──> HandedBack
       ├──> missing identity? ── policy: process ──> RunUnprotected ──> Processed
       │                         └─ reject ──> Publish(dead letter) ──────> DeadLettered
       ├──> routed over many databases? ──> ResolveRoute
       │      ├─ unknown tenant ──> Publish(dead letter) ─────────────────> DeadLettered
       │      ├─ raised (resolver, map reloading, budget) ─> CountHandBack ─> HandedBack
       │      └─ the tenant's database: every operation below goes there
       ├──> redelivered without outcome too often? ──> RecordPoison ──────> Poisoned
       ├──> claimed under its earlier broker id since it was stored? ─────> Duplicate
       └──> Process (claim, handler, commit, in one transaction)
              ├─ first seen ────────────────────────────────────────────> Processed
              ├─ duplicate ─────────────────────────────────────────────> Duplicate
              ├─ conflict ──> Publish(quarantine) ──────────────────────> Quarantined
              └─ raised: rolled back, the claim with it
                   ├─ transient (database, lock_timeout, shutdown) ──────> HandedBack
                   ├─ permanent (the handler's own commit() included),
                   │  or out of attempts ──> RecordPoison ──────────────> Poisoned
                   └─ otherwise ──> CountFailure ────────────────────────> HandedBack

Where the adapter sends the stored output itself before the ack (``sends_outputs``:
Dramatiq's pipeline steps and callbacks), a processed or duplicate delivery with an output
yields `SendOutputs` before it settles; a failure there is `outputs_failed_steps`'s (the
claim stays: handed back and counted, poison ``outputs_undeliverable`` when the attempts
run out). A batch subscriber's messages are settled as a whole by `settle_batch_steps`,
each setting applied to each message of the batch as to one message (the redelivery limit
where the broker counts each message's deliveries; `batch_operation` says what its broker
is told). Whether the claim's transaction may commit is decided here too, from what
storage saw of it (`commit_refusal`).

Settlement is total: an exception from any operation (the database at any step, a
publish, the inbox's own bug) is decided here, never passed to the framework. An error
the inbox cannot even record is a hand-back: the message stays with the broker. So is a
framework interruption (a time limit, a shutdown) that lands in any operation but the
handler's (`_inbox_interruptions`); only the process going down passes through.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Awaitable, Callable, Generator, Hashable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from .exceptions import (
    ClaimInProgress,
    ClaimNotCommitted,
    CommitUnanswered,
    DatabaseUnavailable,
    HandlerTransactionError,
    InboxError,
    InboxInterrupted,
    MissingIdentity,
    PayloadNotHashable,
    PermanentError,
    SchemaError,
    TransactionAborted,
    TransientError,
    UnknownTenant,
)
from .outputs import OUTPUTS_UNDELIVERABLE, Output
from .policy import ConsumerPolicy
from .protocol import (
    Decision,
    Delivery,
    QuarantineRecord,
    ReasonCode,
    StoredClaim,
    Verdict,
    compare,
)

__all__ = [
    "EXPIRED_REDELIVERY",
    "HANDLER_REJECTED",
    "HANDLER_TRANSACTION",
    "INBOX_ERROR",
    "REDELIVERY_LIMIT",
    "REMEMBERED_MESSAGES",
    "RETRIES_EXHAUSTED",
    "UNIDENTIFIED_KEY_BYTES",
    "UNKNOWN_TENANT",
    "Arrival",
    "BatchArrival",
    "BatchProcessed",
    "BatchRejected",
    "BatchSettlement",
    "BrokerOperation",
    "CountFailure",
    "CountHandBack",
    "CountRedelivery",
    "DeadLettered",
    "Duplicate",
    "HandBackRequested",
    "HandedBack",
    "LoadOutputs",
    "LookUpClaim",
    "MarkSent",
    "Observer",
    "Op",
    "Poisoned",
    "Process",
    "ProcessBatch",
    "Processed",
    "Publish",
    "QuarantineConflict",
    "Quarantined",
    "RecordPoison",
    "RefusedFirstSeen",
    "RejectRequested",
    "ResolveRoute",
    "RetryBudget",
    "Route",
    "Rules",
    "RunUnprotected",
    "SendOutputs",
    "Settlement",
    "Tell",
    "TransactionState",
    "Unfit",
    "backoff_delay",
    "batch_operation",
    "broker_operation",
    "commit_refusal",
    "conflict_details",
    "describe",
    "drive",
    "drive_async",
    "expired",
    "first_seen_refusal",
    "outputs_failed_steps",
    "outputs_sent_steps",
    "reason_code",
    "rejection_details",
    "settle_batch_steps",
    "settle_steps",
]

# The reason codes the core records, by their older names (see `ReasonCode`).
RETRIES_EXHAUSTED = ReasonCode.RETRIES_EXHAUSTED
REDELIVERY_LIMIT = ReasonCode.REDELIVERY_LIMIT
EXPIRED_REDELIVERY = ReasonCode.EXPIRED_REDELIVERY
HANDLER_REJECTED = ReasonCode.HANDLER_REJECTED
HANDLER_TRANSACTION = ReasonCode.HANDLER_TRANSACTION
INBOX_ERROR = ReasonCode.INBOX_ERROR

UNKNOWN_TENANT = "unknown_tenant"
"""The reason of a dead letter whose tenant no database of the map serves."""

_ERROR_TEXT = 2000  # longest error text kept

S = TypeVar("S")
T = TypeVar("T")


Rules = ConsumerPolicy
"""The consumer settings the core reads: the policy itself (an older name)."""


# -- what arrives -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RetryBudget:
    """The framework's own retry budget as the message carries it (Dramatiq's Retries:
    the ``retries`` made so far, the ``max_retries`` allowed, the user's ``retry_when``).
    No retrying middleware at all is a budget of none: ``RetryBudget(0, 0)``."""

    retries: int
    max_retries: int | None
    retry_when: Callable[[int, BaseException], bool] | None = None
    """When given, decides alone whether to retry (after ``retries`` retries, this error)."""

    def ends_with(self, exc: BaseException) -> bool:
        """Whether the framework gives up after this failure."""
        if isinstance(exc, HandBackRequested) and exc.cause is not None:
            exc = exc.cause  # the framework's own Retry, judged as itself
        if self.retry_when is not None:
            return not self.retry_when(self.retries, exc)
        return self.max_retries is not None and self.retries >= self.max_retries


@dataclass(frozen=True, slots=True)
class Arrival:
    """One delivery as the adapter read it from the framework's message."""

    delivery: Delivery | None
    """None when the message has no usable identity (see ``problem``)."""
    problem: InboxError | None = None
    """Why there is no delivery: `IdentityError` or `PayloadNotHashable`."""
    deliveries: int | None = None
    """The broker's own count of deliveries, this one included, when it keeps one."""
    redelivered: bool = False
    """The broker says an earlier delivery ended without an outcome (or was handed back)."""
    repair_marker: str | None = None
    """``poison:12`` or ``quarantine:7`` on a redriven or accepted message."""
    retry_budget: RetryBudget | None = None
    """The framework's own retry budget (Dramatiq's Retries), when it has one: the inbox
    records poison when a failure ends it, so no message dies without a record."""
    interrupts: tuple[type[BaseException], ...] = ()
    """Framework interruptions that are failures of the attempt (Dramatiq's time limit)."""
    shutdowns: tuple[type[BaseException], ...] = ()
    """Framework interruptions that are no fault of the message (a worker shutting down)."""
    outcomes_redeliver: bool = True
    """Whether a failed or handed-back delivery comes back as a redelivery (a nack does;
    Dramatiq retries with a new message), so that the redelivery limit subtracts them."""
    keeps_outputs: bool = False
    """Whether something downstream consumes the handler's result (publishers, a reply,
    a pipeline step): it is then stored with the claim, and a duplicate loads it."""
    sends_outputs: bool = False
    """Whether the adapter sends the stored output itself before the ack (Dramatiq's
    pipeline step and ``on_success``): the core then yields `SendOutputs` and decides what
    its failure means. Otherwise the framework publishes the settlement's output."""
    declared_consumer: str | None = None
    """The consumer the message was delivered to, known from the declaration even when
    the message has no usable identity (a dead letter names it)."""
    source: str | None = None
    """The queue, stream, subject or topic it came from, likewise."""
    earlier_form: Delivery | None = None
    """The same delivery under the form its broker id had in earlier versions (a
    sequence or offset alone), while workers of both versions may run; see
    `_claimed_earlier`."""
    stored_at: datetime | None = None
    """When the broker stored the message (in the broker id's current form)."""
    held: BaseException | None = None
    """Why the inbox cannot settle anything yet: the start-up check, run at the first
    message (FastStream without ``guard``), failed (the database down, the schema not
    migrated). The delivery is handed back before anything else, counted as a hand-back."""
    routed: bool = False
    """Whether the adapter serves many databases (a `DatabaseMap`): the core then asks
    for the delivery's database first (`ResolveRoute`), and decides what an unknown
    tenant or a failed resolution means."""

    @property
    def consumer(self) -> str | None:
        return self.delivery.consumer if self.delivery else self.declared_consumer


# -- what the adapter performs ------------------------------------------------------------


class Route(StrEnum):
    QUARANTINE = "quarantine"
    DEAD_LETTER = "dead_letter"


@dataclass(frozen=True, slots=True)
class CountRedelivery:
    """In a short transaction of its own: count this redelivery, one that reached the
    database; answer a `RedeliveryCount`. ``counted`` is the broker's own count, which
    bounds the database's (see `_limit_redeliveries`)."""

    delivery: Delivery
    counted: int | None


@dataclass(frozen=True, slots=True)
class RedeliveryCount:
    redeliveries: int
    failures: int
    hand_backs: int
    claimed: bool
    """Whether the delivery's processing committed already (the ack was lost)."""


@dataclass(frozen=True, slots=True)
class Process:
    """Claim, run the handler (first seen) and commit, in one transaction; answer the
    storage `Committed`."""

    delivery: Delivery
    repair_marker: str | None
    keeps_outputs: bool = False
    """Store the handler's result with the claim (see `Arrival.keeps_outputs`)."""
    refuse_first_seen: PermanentError | None = None
    """Raised, after the claim and instead of the handler, when the claim is first seen
    (an expired redelivery the policy rejects): rolled back, then decided like any
    permanent failure."""


@dataclass(frozen=True, slots=True)
class ResolveRoute:
    """Choose the database of ``delivery``'s tenant, where every later operation of this
    delivery goes (the claim, the handler's session, outputs, attempts, poison,
    quarantine); answer its name. Raise `UnknownTenant` when no database serves the
    tenant, anything else when it cannot be chosen now."""

    delivery: Delivery


@dataclass(frozen=True, slots=True)
class RunUnprotected:
    """Run the handler in a transaction without a claim; answer its result."""


@dataclass(frozen=True, slots=True)
class CountFailure:
    """In a short transaction of its own: count one failed attempt; answer the count."""

    delivery: Delivery
    error: str


@dataclass(frozen=True, slots=True)
class CountHandBack:
    """Best effort, in a short transaction of its own: count one hand-back, so the
    redelivery it causes is not taken for a crash. Answers nothing. With ``unreachable``
    (the database is the trouble) it is only remembered in this process."""

    delivery: Delivery
    unreachable: bool = False


@dataclass(frozen=True, slots=True)
class RecordPoison:
    """In a short transaction of its own: keep the message as poison; answer the
    `PoisonRecord`-like object (``id``, ``attempts``, ``recovered``: written recovered,
    because a copy with the same payload had committed)."""

    delivery: Delivery
    reason: str
    error: str
    attempts: int


@dataclass(frozen=True, slots=True)
class QuarantineConflict:
    """In a short transaction of its own: record ``delivery`` as an identity conflict
    with the committed claim ``stored`` (its quarantine row, as a claim that meets the
    conflict records it); answer the `QuarantineRecord`."""

    delivery: Delivery
    stored: StoredClaim


@dataclass(frozen=True, slots=True)
class LoadOutputs:
    """Load the output stored with ``delivery``'s claim; answer the `Output`, or None
    when nothing was stored (a claim from before outputs were kept)."""

    delivery: Delivery


@dataclass(frozen=True, slots=True)
class LookUpClaim:
    """Read the claim of ``delivery``'s key, without claiming; answer the `StoredClaim`,
    or None when there is none. With ``settled``, once any transaction still holding the
    key has ended, as a claim waits for it (within the ``lock_timeout``), so that a COMMIT
    still running on the server is seen."""

    delivery: Delivery
    settled: bool = False


@dataclass(frozen=True, slots=True)
class MarkSent:
    """The outputs a repaired copy (``delivery``, carrying ``marker``) met are sent: when
    the row the marker names is of outputs that could not be sent, its repair is done;
    mark it recovered. Answer the row's kind, or None when no row of that reason
    matched."""

    delivery: Delivery
    marker: str


@dataclass(frozen=True, slots=True)
class SendOutputs:
    """Send what follows the committed ``delivery`` (its stored ``output``), before the
    ack: a pipeline step, a callback. Raise when it could not be sent."""

    delivery: Delivery
    output: Output


@dataclass(frozen=True, slots=True)
class Publish:
    """Publish the message, confirmed, to its quarantine or dead-letter destination with
    ``details`` (what the repair tools read). Raise when the broker did not take it."""

    route: Route
    details: dict[str, Any]
    item: int | None = None
    """The batch item it concerns (its index in the batch); None: the whole message."""


@dataclass(frozen=True, slots=True)
class ProcessBatch:
    """Claim every delivery of a batch, run the handler on the first-seen ones and
    commit, in one transaction; answer the storage `BatchCommitted` (one verdict each).
    After the claim and instead of the handler, raise `first_seen_refusal` when it finds
    one (an expired message first seen, which the policy rejects): rolled back whole."""

    deliveries: tuple[Delivery, ...]
    items: tuple[int, ...] = ()
    """Each delivery's index in the batch."""
    refusals: tuple[PermanentError | None, ...] = ()
    """Per delivery: what to raise when its claim is first seen (see `Process`)."""


class RefusedFirstSeen(Exception):
    """Raised in a batch's transaction, after the claim, when messages the core refuses
    to process if first seen (expired ones) are: the batch rolls back, and the core keeps
    those messages as poison (``items``, their indexes in the batch) and claims the rest
    again."""

    def __init__(self, items: tuple[int, ...], errors: tuple[PermanentError, ...]) -> None:
        super().__init__(f"{len(items)} message(s) of the batch refused: {errors[0]}")
        self.items = items
        self.errors = errors


def first_seen_refusal(op: ProcessBatch, verdicts: tuple[Verdict, ...]) -> RefusedFirstSeen | None:
    """What the batch's transaction raises after its claim, before the handler: the
    refusals of ``op`` whose delivery the claim found first seen; None: run the handler."""
    refused = [
        (item, refusal)
        for item, refusal, verdict in zip(op.items, op.refusals, verdicts, strict=False)
        if refusal is not None and verdict.decision is Decision.FIRST
    ]
    if not refused:
        return None
    return RefusedFirstSeen(
        tuple(item for item, _ in refused), tuple(refusal for _, refusal in refused)
    )


Op = (
    CountRedelivery
    | Process
    | RunUnprotected
    | CountFailure
    | CountHandBack
    | RecordPoison
    | QuarantineConflict
    | LoadOutputs
    | LookUpClaim
    | MarkSent
    | Publish
    | ProcessBatch
    | SendOutputs
    | ResolveRoute
)


# -- what the handler may ask for ---------------------------------------------------------


class HandBackRequested(Exception):
    """The handler asked for a later redelivery (FastStream's `NackMessage`, Dramatiq's
    `Retry`): rolled back and handed back, counted as a failed attempt."""

    def __init__(self, delay: float | None = None, *, cause: BaseException | None = None) -> None:
        super().__init__("the handler asked for a redelivery")
        self.delay = delay
        self.cause = cause


class Unfit(InboxError):
    """The message's body does not fit the handler: the framework could not decode it
    into the handler's parameters. A validation error raised inside the handler, or by
    its return value, is the handler's own failure, not this.

    Retrying cannot help, so it goes where messages with an unusable identity go, with
    the validation error as its reason.
    """


class RejectRequested(Exception):
    """The handler rejected the message (FastStream's `RejectMessage`, Dramatiq's
    ``message.fail()``): rolled back, kept as poison and dead-lettered."""

    def __init__(self, reason: str = "the handler rejected it") -> None:
        super().__init__(reason)


# -- settlements ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Processed:
    """The handler ran and its transaction committed (or ran unprotected): ack."""

    result: Any = None
    verdict: Verdict | None = None
    """None when the message ran unprotected (no identity, by policy)."""
    recovered: str | None = None
    """``poison`` or ``quarantine`` when this was a redriven message that now committed."""
    attempts: int = 1
    expired: timedelta | None = None
    """The message's age, when it was older than the retention window and processed
    anyway (``expired_redelivery="process"``, or shadow mode)."""


@dataclass(frozen=True, slots=True)
class Duplicate:
    """Processed before (the same payload): the handler skipped; publish ``output`` again
    when one was stored, then ack. ``recovered``: the kind of repair row a repaired copy
    marked recovered (another copy had committed its effect)."""

    verdict: Verdict
    output: Output | None = None
    recovered: str | None = None


@dataclass(frozen=True, slots=True)
class Quarantined:
    """Same identity, other payload: recorded, published to quarantine, skipped, ack."""

    verdict: Verdict
    record: QuarantineRecord


@dataclass(frozen=True, slots=True)
class DeadLettered:
    """Nothing ran (no usable identity, the body does not fit the handler): published to
    the dead-letter destination when the adapter has one, else the broker's own path."""

    reason: str
    error: InboxError


@dataclass(frozen=True, slots=True)
class Poisoned:
    """Failed for good: kept in the poison table, then dead-lettered like `DeadLettered`."""

    reason: str
    record: Any
    """The `PoisonRecord` (``id``, ``attempts``)."""
    error: str
    failure: BaseException | None = None
    """The exception that failed the last attempt (the handler's, or its outputs'
    publish); None when no attempt raised (a crash loop, the handler's own rejection)."""
    exhausted: bool = False
    """The attempts ran out (``max_attempts``, or the framework's retry budget): not a
    permanent failure. Dramatiq sends ``on_retry_exhausted`` for these only."""


@dataclass(frozen=True, slots=True)
class HandedBack:
    """Rolled back and given back to the broker for a later redelivery."""

    error: BaseException
    counted: bool
    """True when the attempt counted as a failure (the framework may count it too); False
    for transient trouble that counts against nothing."""
    delay: float | None = None
    """Seconds requested by the handler; None: the adapter's backoff decides."""

    def wait(
        self, key: Hashable, backoff: Callable[[], float], in_progress: float | None = None
    ) -> float:
        """Seconds before the message comes back: the handler's requested delay; for a
        claim another delivery holds (`ClaimInProgress`), ``in_progress`` when the consumer
        sets one; else the adapter's ``backoff``, but never sooner than its database is
        tried again.

        A database found down (``DatabaseUnavailable.retry_after``) is not tried again for
        a pause that grows while it stays down; its deliveries come back after that pause,
        spread over one more pause by their key (the same for every copy of a message), so
        that they neither cycle through the worker at the backoff's rate for the whole
        outage (hundreds of cheap refusals a second, taken from the other databases'
        deliveries) nor all come back in the same instant."""
        if self.delay is not None:
            return self.delay
        if in_progress is not None and isinstance(self.error, ClaimInProgress):
            return in_progress
        wait = backoff()
        after = getattr(self.error, "retry_after", None)
        if isinstance(after, int | float) and after > 0:
            # Spread over the database's whole pause, not over what is left of it: the
            # deliveries refused late in a pause would otherwise all come back just after
            # it, a wave through the shared queue ahead of the other databases' messages.
            window = getattr(self.error, "retry_spread", None)
            if not isinstance(window, int | float) or window <= 0:
                window = after
            spread = zlib.crc32(repr(key).encode()) / 2**32
            wait = max(wait, after + window * spread)
        return wait


Settlement = Processed | Duplicate | Quarantined | DeadLettered | Poisoned | HandedBack


# -- what the broker is told --------------------------------------------------------------


class Tell(StrEnum):
    """What the broker is told of a settled delivery: once, by the adapter."""

    ACK = "ack"
    """Settled: its effect committed, or the inbox recorded why not (a duplicate, a
    quarantine row, a poison row, a dead letter it published itself)."""
    REJECT = "reject"
    """Settled by the broker's own dead-letter path: nothing of it ran, or it failed for
    good, and the adapter has no dead-letter destination of its own to publish it to."""
    HAND_BACK = "hand_back"
    """Rolled back: given back to the broker for a later delivery."""


@dataclass(frozen=True, slots=True)
class BrokerOperation:
    """The broker operation a settlement comes to (`broker_operation`)."""

    tell: Tell
    counted: bool = False
    """For a hand-back: the attempt counted as a failure, which a framework that counts
    its own retries (Dramatiq's Retries) takes; the wait is `HandedBack.wait`."""
    rejected: tuple[int, ...] = ()
    """For a batch's ack: the items rejected first, to the broker's own dead-letter path."""

    @property
    def settled(self) -> bool:
        """The delivery is done with: its hand-back backoff is forgotten."""
        return self.tell is not Tell.HAND_BACK


def broker_operation(settlement: Settlement, *, dead_letter_destination: bool) -> BrokerOperation:
    """What the broker is told of ``settlement``: a hand-back is handed back; a delivery
    dead-lettered or kept as poison is acked when the adapter published it to its own
    ``dead_letter_destination``, else rejected to the broker's own path; every other
    settlement is acked."""
    match settlement:
        case HandedBack(counted=counted):
            return BrokerOperation(Tell.HAND_BACK, counted=counted)
        case DeadLettered() | Poisoned() if not dead_letter_destination:
            return BrokerOperation(Tell.REJECT)
    return BrokerOperation(Tell.ACK)


# -- the core -------------------------------------------------------------------------------


def reason_code(exc: BaseException, permanent: tuple[type[BaseException], ...] = ()) -> str | None:
    """The stable reason code when ``exc`` is permanent, else None (retry).

    A handler that tries to end the inbox's transaction itself (its session's
    ``commit()``, ``rollback()``, ``close()``), or publishes directly where that is
    refused, makes a programming error that fails the same way at every attempt: poison
    at once (``handler_transaction``). Not a `TransactionAborted`: the error the handler
    swallowed may have been transient (a serialization failure, a deadlock, a lock or a
    statement timeout), so that attempt is an ordinary failure, retried. Nor a
    `ClaimNotCommitted`: the commit found that the transaction committing was not the
    claim's (ended on the driver's own connection) or was rolled back; the attempt
    failed, like any failed commit, and is retried.
    """
    if isinstance(exc, PermanentError):
        return exc.reason_code
    if isinstance(exc, RejectRequested):
        return HANDLER_REJECTED
    if isinstance(exc, HandlerTransactionError) and not isinstance(
        exc, (TransactionAborted, ClaimNotCommitted)
    ):
        return HANDLER_TRANSACTION
    if permanent and isinstance(exc, permanent):
        return type(exc).__name__
    return None


class TransactionState(StrEnum):
    """What storage saw of the claim's transaction right before its COMMIT."""

    OPEN = "open"
    """In progress and healthy: it may commit."""
    ENDED = "ended"
    """Ended behind the inbox (the connection's ``rollback()``, a ``ROLLBACK`` or
    ``COMMIT`` on the driver's own connection): nothing the handler did, nor the claim,
    is in the transaction that would commit."""
    ABORTED = "aborted"
    """Failed by a statement error the handler caught (PostgreSQL answers COMMIT with
    ROLLBACK then, and no error)."""


def commit_refusal(
    state: TransactionState, delivery: Delivery | None
) -> HandlerTransactionError | None:
    """Whether the claim's transaction may commit, from what storage saw of it: None,
    or the error the attempt fails with instead (rolled back, never acked; `reason_code`
    then decides what the failure means: a transaction ended behind the inbox is the
    handler's programming error, poison at once; an aborted one an ordinary failure)."""
    names = {
        "consumer": delivery.consumer if delivery else None,
        "producer": delivery.identity.producer if delivery else None,
        "message_id": delivery.identity.message_id if delivery else None,
    }
    match state:
        case TransactionState.ENDED:
            return HandlerTransactionError(
                "the handler ended the inbox's transaction itself (the connection's "
                "rollback(), or a statement on the driver's connection): nothing it did (nor "
                "the claim) is in the transaction that would commit. Raise an exception to "
                "abandon the message",
                **names,
            )
        case TransactionState.ABORTED:
            return TransactionAborted(
                "the transaction was aborted by an earlier error that the handler caught, so "
                "nothing it did (nor the claim) could commit. Run a statement that is expected "
                "to fail inside session.begin_nested(), so that only its savepoint is lost",
                **names,
            )
    return None


def describe(exc: BaseException) -> str:
    """One line for the error column: the type and the message, bounded."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _ERROR_TEXT else text[: _ERROR_TEXT - 1] + "…"


def identity_reason(exc: InboxError) -> str:
    """The ``reason`` label of a message without a usable identity."""
    if isinstance(exc, MissingIdentity):
        return "missing"
    return "unhashable" if isinstance(exc, PayloadNotHashable) else "invalid"


def expired(delivery: Delivery, window: timedelta | None) -> timedelta | None:
    """How old a first-seen message is when its producer timestamp is beyond ``window``
    (its claim may have been purged already), else None."""
    produced = delivery.identity.produced_at
    if window is None or produced is None:
        return None
    age = datetime.now(UTC) - produced
    return age if age > window else None


def _transient(exc: BaseException, arrival: Arrival) -> bool:
    """No fault of the message: retried later, counted against nothing."""
    if isinstance(exc, TransientError | SchemaError):  # SchemaError: a migration is running
        return True
    return bool(arrival.shutdowns) and isinstance(exc, arrival.shutdowns)


def settle_steps(arrival: Arrival, rules: ConsumerPolicy) -> Generator[Op, Any, Settlement]:
    """Decide one delivery; yields the operations to perform, returns its settlement."""
    return _inbox_interruptions(arrival, _settle(arrival, rules))


def _settle(arrival: Arrival, rules: ConsumerPolicy) -> Generator[Op, Any, Settlement]:
    delivery = arrival.delivery
    if arrival.held is not None:
        return (yield from _held(arrival, arrival.held))
    if delivery is None:
        return (yield from _without_identity(arrival, rules))
    if arrival.routed:
        try:
            yield ResolveRoute(delivery)
        except UnknownTenant as exc:
            # No database holds this tenant's data, so none can keep a record of it: the
            # dead letter, with its reason, is the durable record. Never a default database.
            details = rejection_details(exc, arrival.consumer, arrival.source)
            details["tenant"] = exc.tenant
            return (yield from _reject(DeadLettered(UNKNOWN_TENANT, exc), details))
        except Exception as exc:
            # The resolver's or the map's trouble, or the connection budget: no fault of
            # the message, and no database to count the hand-back in but this process.
            with contextlib.suppress(Exception):
                yield CountHandBack(delivery, unreachable=True)
            return HandedBack(exc, counted=False)
    try:
        poisoned = yield from _limit_redeliveries(arrival, delivery, rules)
    except Exception as exc:  # the database's trouble: the same as at the claim
        return (yield from _hand_back(exc, delivery))
    if poisoned is not None:
        return (yield from _kept_as_poison(arrival, rules, poisoned, delivery))
    if arrival.earlier_form is not None and not delivery.shadow:
        try:
            earlier = yield from _claimed_earlier(arrival, arrival.earlier_form)
        except Exception as exc:
            return (yield from _hand_back(exc, delivery))
        if earlier is not None:
            return earlier

    age = expired(delivery, rules.retention_window)
    refusal = _expired_refusal(delivery, rules, age)
    try:
        outcome = yield Process(delivery, arrival.repair_marker, arrival.keeps_outputs, refusal)
    except BaseException as exc:
        return (yield from _failed(arrival, delivery, rules, exc))
    verdict: Verdict = outcome.verdict
    if verdict.runs_handler:  # first seen, or anything in shadow mode
        # The row a repair marker names, when the executor found it to be this delivery's
        # own repair and marked it recovered in the same transaction (a stray marker is
        # nothing).
        recovered: str | None = outcome.recovered
        old = age if verdict.decision is Decision.FIRST else None
        processed = Processed(outcome.result, verdict, recovered, outcome.attempts, old)
        return (yield from _send_outputs(arrival, rules, processed, outcome.result))
    if verdict.decision is Decision.DUPLICATE:
        try:
            return (yield from _duplicate(arrival, rules, delivery, verdict, outcome.recovered))
        except Exception as exc:  # its outputs could not be loaded
            return (yield from _hand_back(exc, delivery))
    assert verdict.quarantine is not None
    details = conflict_details(delivery, verdict)
    try:
        # The quarantine row is committed already (the table is the source of truth); if
        # this publish fails, the message is handed back, and its redelivery records the
        # conflict again (attempts + 1) and publishes again.
        yield Publish(Route.QUARANTINE, details)
    except Exception as exc:
        return (yield from _hand_back(exc, delivery))
    return Quarantined(verdict, verdict.quarantine)


_HANDLERS = (Process, RunUnprotected)
"""The operations that run the handler: an interruption there is decided by the steps
that yield them (`_failed`, `_without_identity`)."""


def _inbox_interruptions(
    arrival: Arrival, steps: Generator[Op, Any, Settlement]
) -> Generator[Op, Any, Settlement]:
    """``steps``, told of a framework interruption (``arrival.interrupts``: a time limit;
    ``arrival.shutdowns``) that lands in one of the inbox's own operations, not in the
    handler: counting a failure, a redelivery or a hand-back, recording poison, looking
    a claim or its outputs up, publishing. It is no fault of the message: thrown into
    ``steps`` as the inbox's `InboxInterrupted` (caused by it), which they hand back as
    the database's trouble, counted against nothing; left to the framework, it would
    count as a failed attempt, and a last one would end the message with no record.
    Any other interruption (the process going down) goes through as it is."""
    stops = arrival.interrupts + arrival.shutdowns
    if not stops:
        return (yield from steps)
    answer: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = steps.send(answer) if error is None else steps.throw(error)
        except StopIteration as done:
            result: Settlement = done.value
            return result
        try:
            answer, error = (yield op), None
        except GeneratorExit:
            steps.close()
            raise
        except BaseException as exc:
            answer, error = None, exc
            if isinstance(exc, stops) and not isinstance(op, _HANDLERS):
                error = _interrupted_in(op, exc)


def _interrupted_in(op: Op, interruption: BaseException) -> InboxInterrupted:
    """The inbox's report of ``interruption``, landed in ``op``, as storage reports one
    landed in the claim."""
    delivery: Delivery | None = getattr(op, "delivery", None)
    identity = delivery.identity if delivery is not None else None
    error = InboxInterrupted(
        f"interrupted during the inbox's {type(op).__name__}"
        + (f" of {identity.message_id!r}" if identity is not None else ""),
        consumer=delivery.consumer if delivery is not None else None,
        producer=identity.producer if identity is not None else None,
        message_id=identity.message_id if identity is not None else None,
    )
    error.__cause__ = interruption
    return error


def _expired_refusal(
    delivery: Delivery, rules: ConsumerPolicy, age: timedelta | None
) -> PermanentError | None:
    """Older than the retention window: if its claim turns out first seen, the claim of an
    earlier delivery may have been purged, so "first seen" cannot be trusted; what to
    raise then (None: process it)."""
    if age is None or rules.expired_redelivery != "reject" or delivery.shadow:
        return None
    return PermanentError(
        EXPIRED_REDELIVERY,
        f"a message produced {age} ago, beyond the {rules.retention_window} "
        "retention window: its claim may have been purged",
    )


def _claimed_earlier(arrival: Arrival, earlier: Delivery) -> Generator[Op, Any, Settlement | None]:
    """A rolling deploy: a worker of an earlier version claimed this message under its
    broker id's earlier form (a sequence or offset alone). That claim is this message's
    when it was made once the broker had stored the message; a claim made before is an
    earlier message's, which a re-created stream or topic gave the same sequence or offset,
    and says nothing about this one."""
    stored = arrival.stored_at
    if stored is None:
        return None
    claim: StoredClaim | None = yield LookUpClaim(earlier)
    if claim is None or claim.processed_at is None or claim.processed_at < stored:
        return None
    verdict = Verdict(Decision.DUPLICATE, claim)
    if not arrival.keeps_outputs:
        return Duplicate(verdict)
    output = yield LoadOutputs(earlier)
    return Duplicate(verdict, output)


def _send_outputs(
    arrival: Arrival, rules: ConsumerPolicy, settlement: Processed | Duplicate, output: Any
) -> Generator[Op, Any, Settlement]:
    """Where the adapter sends the stored output before the ack, send it; a failure is
    decided by `outputs_failed_steps` (the claim stays, so the redelivery sends again)."""
    if not arrival.sends_outputs or not isinstance(output, Output):
        return settlement
    assert arrival.delivery is not None
    try:
        yield SendOutputs(arrival.delivery, output)
    except Exception as exc:
        return (yield from outputs_failed_steps(arrival, rules, exc))
    return (yield from outputs_sent_steps(arrival, settlement))


def outputs_sent_steps(arrival: Arrival, settlement: Settlement) -> Generator[Op, Any, Settlement]:
    """The stored outputs of a settled delivery were sent: before the ack, by the adapter
    (`SendOutputs`), or after the COMMIT by the framework (FastStream publishes a handler's
    result itself). A redrive of outputs that could not be sent is done now: its copy, a
    duplicate, marks the row recovered (`MarkSent`). Answers the settlement, with the row's
    kind when one was marked."""
    marker = arrival.repair_marker
    if (
        type(settlement) is not Duplicate
        or settlement.recovered is not None
        or marker is None
        or arrival.delivery is None
    ):
        return settlement
    try:
        recovered = yield MarkSent(arrival.delivery, marker)
    except Exception:
        return settlement  # sent all the same: the row waits, nothing is sent again
    return Duplicate(settlement.verdict, settlement.output, recovered)


def _without_identity(arrival: Arrival, rules: ConsumerPolicy) -> Generator[Op, Any, Settlement]:
    problem = arrival.problem
    assert problem is not None
    if rules.shadow or (
        isinstance(problem, MissingIdentity) and rules.missing_identity == "process"
    ):
        try:
            result = yield RunUnprotected()
        except BaseException as exc:
            if not isinstance(exc, Exception) and not isinstance(exc, arrival.interrupts):
                raise
            # Nothing to count failures against: handed back, the framework's own retry
            # budget (if any) bounds it.
            return HandedBack(exc, counted=True, delay=_requested_delay(exc))
        return Processed(result)
    details = rejection_details(problem, arrival.consumer, arrival.source)
    return (yield from _reject(DeadLettered(identity_reason(problem), problem), details))


def conflict_details(delivery: Delivery, verdict: Verdict) -> dict[str, Any]:
    """What a quarantined message carries with it (the repair tools read it)."""
    assert verdict.stored is not None
    assert verdict.quarantine is not None
    return {
        "reason": ReasonCode.IDENTITY_CONFLICT,
        "consumer": delivery.consumer,
        "producer": delivery.identity.producer,
        "tenant": delivery.identity.tenant,
        "message_id": delivery.identity.message_id,
        "quarantine_id": verdict.quarantine.id,
        "attempts": verdict.quarantine.attempts,
        "stored_sha256": verdict.stored.payload_sha256,
        "conflicting_sha256": delivery.payload_hash.sha256,
        "hash_scheme": delivery.payload_hash.scheme,
        "source": delivery.source,
    }


def rejection_details(
    error: InboxError, consumer: str | None, source: str | None
) -> dict[str, Any]:
    """What a dead-lettered message carries with it: why it was rejected."""
    return {
        "reason": type(error).__name__,
        "detail": str(error),
        "consumer": consumer,
        "source": source,
    }


def _reject(settlement: DeadLettered, details: dict[str, Any]) -> Generator[Op, Any, Settlement]:
    try:
        yield Publish(Route.DEAD_LETTER, details)
    except Exception as exc:
        return HandedBack(exc, counted=False)
    return settlement


def _kept_as_poison(
    arrival: Arrival, rules: ConsumerPolicy, poisoned: Poisoned, delivery: Delivery
) -> Generator[Op, Any, Settlement]:
    """Kept as poison: dead-lettered, unless its row was written recovered, because a copy
    with the same payload had committed (a copy requeued while the other one applied,
    over the redelivery limit; a last attempt failing beside it). That copy applied the
    intent: this one is settled as the duplicate it is, its stored outputs sent, and
    nothing applied is dead-lettered. A copy that commits only after the record is the
    window that remains: its claim marks the row recovered, the dead letter is sent."""
    if getattr(poisoned.record, "recovered", False):  # a record without it: not recovered
        try:
            applied = yield from _committed_after_all(arrival, rules, delivery)
        except Exception as exc:  # the poison row stands; the redelivery finds the claim
            return (yield from _hand_back(exc, delivery))
        if applied is not None:
            return applied
    return (yield from _dead_letter(poisoned, delivery))


def _dead_letter(poisoned: Poisoned, delivery: Delivery) -> Generator[Op, Any, Settlement]:
    try:
        yield Publish(Route.DEAD_LETTER, _poison_details(poisoned, delivery))
    except Exception as exc:
        # The poison row is committed: a redelivery is recorded again, then published.
        return (yield from _hand_back(exc, delivery))
    return poisoned


def _poison_details(poisoned: Poisoned, delivery: Delivery) -> dict[str, Any]:
    """What a message kept as poison carries to the dead-letter destination."""
    record = poisoned.record
    return {
        "reason": "Poisoned",
        "reason_code": poisoned.reason,
        "detail": f"poison message #{record.id} after {record.attempts} attempts "
        f"({poisoned.error}); kept in the poison table with its payload",
        "consumer": delivery.consumer,
        "source": delivery.source,
        "poison_id": record.id,
        "attempts": record.attempts,
    }


def _limit_redeliveries(
    arrival: Arrival, delivery: Delivery, rules: ConsumerPolicy
) -> Generator[Op, Any, Poisoned | None]:
    """Bound crash loops: a message the broker keeps redelivering with no outcome (its
    worker killed, out of memory) is kept as poison after ``redelivery_limit``.

    The evidence that a worker died with this message: a redelivery that reached the
    database (counted there, in the attempts row, by whichever worker received it) after
    a delivery that left no outcome, neither a failure counted nor a hand-back counted
    (in the attempts row, or in the memory of the worker that received the redelivery).
    A delivery that never reached the database (an outage: every worker hands it back
    without counting anything durable) is no evidence, however high the broker's own
    count climbed meanwhile: that count only bounds the database's. A live worker that
    overran the broker's ack deadline is no death either: its outcome is counted (or its
    claim found committed). What remains is counted in `docs/explanation/limits.md`.
    """
    limit = rules.redelivery_limit
    counted = arrival.deliveries
    if limit is None or (counted is None and not arrival.redelivered):
        return None
    if counted is not None and counted <= 1:
        return None  # the broker says this is the first delivery
    count: RedeliveryCount = yield CountRedelivery(delivery, counted)
    redeliveries = count.redeliveries
    if counted is not None:
        redeliveries = min(redeliveries, counted - 1)
    crashes = redeliveries
    if arrival.outcomes_redeliver:
        crashes -= count.failures + count.hand_backs
    if crashes <= limit or count.claimed:
        return None  # within the limit, or an ack lost after the commit: a duplicate
    error = "redelivered: earlier deliveries ended without an outcome"
    record = yield RecordPoison(delivery, REDELIVERY_LIMIT, error, crashes)
    return Poisoned(REDELIVERY_LIMIT, record, error)


def _failed(
    arrival: Arrival, delivery: Delivery, rules: ConsumerPolicy, exc: BaseException
) -> Generator[Op, Any, Settlement]:
    """The attempt rolled back with ``exc``: hand back, or count, or keep as poison.

    An interruption that landed in the inbox's work, not the handler's (`InboxInterrupted`:
    waiting for the database or a concurrent claim, or the COMMIT, which may even have
    committed) is no fault of the message: never counted, so never the last attempt;
    handed back, its redelivery finds the claim (a duplicate) or runs again."""
    interruption = _interruption(exc)
    if not isinstance(interruption, Exception) and not isinstance(
        interruption, arrival.interrupts + arrival.shutdowns
    ):
        raise interruption  # the process is going down (KeyboardInterrupt, cancellation)
    if isinstance(exc, CommitUnanswered):
        try:
            committed = yield from _committed_after_all(arrival, rules, delivery)
        except Exception as trouble:  # still unknown: the redelivery's claim decides
            return (yield from _hand_back(trouble, delivery))
        if committed is not None:
            return committed
        exc = interruption  # it did not commit: a failed attempt, failed by the interruption
    if isinstance(exc, Unfit):
        details = rejection_details(exc, delivery.consumer, delivery.source)
        return (yield from _reject(DeadLettered("unfit", exc), details))
    if _transient(exc, arrival):
        return (yield from _hand_back(exc, delivery))
    code = reason_code(exc, rules.permanent_errors)
    exhausted = False
    error = describe(exc)
    try:
        attempts: int = yield CountFailure(delivery, error)
        if code is None:
            exhausted = _last(rules, attempts, exc, arrival.retry_budget)
            if exhausted:
                code = _exhausted(exc)
        if code is None:
            return HandedBack(exc, counted=True, delay=_requested_delay(exc))
        record = yield RecordPoison(delivery, code, error, attempts)
    except Exception as trouble:
        # Not recorded (the database may be down): the message must not be dropped, so
        # it is handed back whatever kind of failure this was, counted against nothing.
        yield from _hand_back(trouble, delivery)
        return HandedBack(exc, counted=False)
    # A rejection by the handler is its decision, not a failure of the attempt.
    failure = None if isinstance(exc, RejectRequested) else exc
    poisoned = Poisoned(code, record, error, failure, exhausted)
    return (yield from _kept_as_poison(arrival, rules, poisoned, delivery))


def _committed_after_all(
    arrival: Arrival, rules: ConsumerPolicy, delivery: Delivery
) -> Generator[Op, Any, Settlement | None]:
    """An attempt interrupted while its COMMIT ran: whether it committed, read once any
    transaction still holding the key has ended. Committed (this payload's claim): settled
    as the duplicate it now is, its stored outputs sent; not committed: None. Another
    payload's claim (a conflict committed meanwhile): handed back, for the redelivery to
    quarantine. Raises when it cannot be told (the database, the lock_timeout)."""
    stored: StoredClaim | None = yield LookUpClaim(delivery, settled=True)
    if stored is None:
        return None
    decision, verified = compare(stored, delivery)
    if decision is not Decision.DUPLICATE:
        return (yield from _hand_back(InboxError("another payload's claim committed"), delivery))
    return (
        yield from _duplicate(
            arrival, rules, delivery, Verdict(Decision.DUPLICATE, stored, verified)
        )
    )


def _duplicate(
    arrival: Arrival,
    rules: ConsumerPolicy,
    delivery: Delivery,
    verdict: Verdict,
    recovered: str | None = None,
) -> Generator[Op, Any, Settlement]:
    """A duplicate: its stored outputs loaded and sent where the adapter keeps them.
    Raises when they cannot be loaded."""
    if not arrival.keeps_outputs:
        return Duplicate(verdict, None, recovered)
    output = yield LoadOutputs(delivery)
    settlement = Duplicate(verdict, output, recovered)
    return (yield from _send_outputs(arrival, rules, settlement, output))


def _interruption(exc: BaseException) -> BaseException:
    """What ended the attempt: the interruption itself when it landed in the inbox's work
    (`InboxInterrupted`: the claim, the COMMIT), where storage reports it."""
    if isinstance(exc, InboxInterrupted) and exc.__cause__ is not None:
        return exc.__cause__
    return exc


def _last(
    rules: ConsumerPolicy, attempts: int, exc: BaseException, budget: RetryBudget | None = None
) -> bool:
    """Whether this failed attempt was the last one allowed: by ``max_attempts``, or by
    the framework's own retry budget. The one place that says so, for a message, its
    outputs and a batch alike."""
    if rules.max_attempts is not None and attempts >= rules.max_attempts:
        return True
    return budget is not None and budget.ends_with(exc)


def _exhausted(exc: BaseException) -> str:
    """The reason code of a message whose attempts ran out with ``exc``."""
    return INBOX_ERROR if isinstance(exc, InboxError) else RETRIES_EXHAUSTED


def outputs_failed_steps(
    arrival: Arrival, rules: ConsumerPolicy, exc: BaseException
) -> Generator[Op, Any, Settlement]:
    """The delivery committed, but publishing its outputs failed with ``exc``: the claim
    (and the stored outputs) stay, the message is handed back, and its redelivery is a
    duplicate that publishes them again. Counted as a failed attempt: when the attempts
    run out, the message is kept as poison (``outputs_undeliverable``) and a redrive
    publishes the outputs again."""
    return _inbox_interruptions(arrival, _outputs_failed(arrival, rules, exc))


def _outputs_failed(
    arrival: Arrival, rules: ConsumerPolicy, exc: BaseException
) -> Generator[Op, Any, Settlement]:
    delivery = arrival.delivery
    assert delivery is not None
    if _transient(exc, arrival):
        return (yield from _hand_back(exc, delivery))
    error = describe(exc)
    try:
        attempts: int = yield CountFailure(delivery, error)
        if not _last(rules, attempts, exc, arrival.retry_budget):
            return HandedBack(exc, counted=True)
        record = yield RecordPoison(delivery, OUTPUTS_UNDELIVERABLE, error, attempts)
    except Exception as trouble:
        yield from _hand_back(trouble, delivery)
        return HandedBack(exc, counted=False)
    poisoned = Poisoned(OUTPUTS_UNDELIVERABLE, record, error, exc, exhausted=True)
    return (yield from _dead_letter(poisoned, delivery))


# -- batches --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchArrival:
    """A batch subscriber's messages as the adapter read them, to be claimed, handled and
    committed as a whole."""

    deliveries: tuple[tuple[int, Delivery], ...]
    """The items with a usable identity, each with its index in the batch."""
    problems: tuple[tuple[int, InboxError], ...] = ()
    """The items without one, with why: dead-lettered one by one after the commit."""
    size: int = 0
    """How many items the batch has (those without an identity included)."""
    declared_consumer: str | None = None
    source: str | None = None
    delivered: tuple[tuple[int, int], ...] = ()
    """The broker's own count of deliveries of an item, this one included, by its index,
    where the broker keeps one per message of a batch (JetStream): the redelivery limit
    applies to those items as to one message. Without (Redis streams, Kafka), it does not
    apply, as it does not to one message of those brokers."""
    held: BaseException | None = None
    """Why the batch is held back before its claim (the start-up check has not passed):
    handed back, a hand-back counted for each of its messages, as one message is."""


@dataclass(frozen=True, slots=True)
class BatchProcessed:
    """The batch committed (or nothing in it was left to claim): its conflicts were
    quarantined, its items without an identity and those kept as poison alone
    (``poisoned``: over the redelivery limit, or expired and first seen) dead-lettered
    (``dead_lettered``); ack."""

    result: Any
    verdicts: tuple[Verdict, ...]
    """One per claimed item, in the batch's order (those kept as poison alone have none)."""
    dead_lettered: tuple[int, ...] = ()
    poisoned: tuple[int, ...] = ()
    poison: tuple[Poisoned, ...] = ()
    """Why each of ``poisoned`` was kept as poison, in the same order."""
    expired: tuple[int, ...] = ()
    """The items processed although older than the retention window
    (``expired_redelivery="process"``), first seen."""
    recovered: tuple[str, ...] = ()
    """The kind of repair row (poison, quarantine) each redriven or accepted message of
    the batch marked recovered in its transaction, one a row: counted as one message's."""

    @property
    def ran(self) -> bool:
        """Whether the handler ran (something in the batch was first seen)."""
        return any(verdict.runs_handler for verdict in self.verdicts)


@dataclass(frozen=True, slots=True)
class BatchRejected:
    """The batch failed for good (``reason``: a reason code, or ``handler_rejected`` and
    ``unfit`` when nothing was recorded): each item kept as poison (``records``, when its
    attempts ran out or the failure is permanent) and dead-lettered, but for the copies of
    messages that committed before (``duplicates``, ``quarantined``); ack."""

    reason: str
    error: InboxError
    records: tuple[Any, ...]
    dead_lettered: tuple[int, ...]
    failure: BaseException | None = None
    duplicates: tuple[int, ...] = ()
    """The items whose same payload had committed before (a copy whose ack was lost, back
    in a batch that failed for good): duplicates, acked, neither recorded nor
    dead-lettered."""
    quarantined: tuple[int, ...] = ()
    """The items whose identity had committed before with another payload: conflicts,
    whatever the batch's handler did, quarantined as each would be alone (its row,
    published to the quarantine destination), neither kept as poison nor dead-lettered."""
    conflicts: tuple[Verdict, ...] = ()
    """The verdict of each of ``quarantined``, in the same order (its stored claim and
    quarantine row)."""


BatchSettlement = BatchProcessed | BatchRejected | HandedBack


def batch_operation(
    settlement: BatchSettlement, *, dead_letter_destination: bool
) -> BrokerOperation:
    """What the broker is told of a batch's ``settlement``, as a whole: handed back, or
    acked; the items dead-lettered in it are rejected first (``rejected``) when the
    adapter has no ``dead_letter_destination`` of its own (it published them otherwise)."""
    match settlement:
        case HandedBack(counted=counted):
            return BrokerOperation(Tell.HAND_BACK, counted=counted)
        case BatchProcessed(dead_lettered=indexes) | BatchRejected(dead_lettered=indexes):
            return BrokerOperation(Tell.ACK, rejected=() if dead_letter_destination else indexes)


def settle_batch_steps(
    batch: BatchArrival, rules: ConsumerPolicy
) -> Generator[Op, Any, BatchSettlement]:
    """Decide one batch; yields the operations to perform, returns its settlement.

    Every setting means for a message of a batch what it means for one message:

    - the redelivery limit, per message, before the claim, where the broker counts each
      message's deliveries (`BatchArrival.delivered`): one over it is kept as poison
      alone, and the rest of the batch goes on;
    - the retention window, per message: an expired message whose claim is first seen
      rolls the batch back (`RefusedFirstSeen`) and is kept as poison alone
      (``expired_redelivery="reject"``), then the rest is claimed again; with
      ``"process"`` it is processed with the batch (`BatchProcessed.expired`);
    - a failure is one attempt of each of its messages: it counts against each, the
      batch's last attempt is the last of the message closest to ``max_attempts``, and a
      permanent failure (``permanent_errors``, the handler's own commit) keeps each as
      poison at once, except a message whose identity committed before: a duplicate
      (same payload) or a conflict (another payload, quarantined) as it would be alone;
    - a hand-back is counted for each message, so its redelivery is no crash.
    """
    if batch.held is not None:
        return (yield from _batch_held(batch.held, batch.deliveries))
    poisoned: dict[int, Poisoned] = {}
    delivered = dict(batch.delivered)
    try:
        for index, delivery in batch.deliveries:
            arrival = Arrival(delivery, deliveries=delivered.get(index))
            over = yield from _limit_redeliveries(arrival, delivery, rules)
            if over is not None:
                poisoned[index] = over
    except Exception as exc:  # the database's trouble: the same as at the claim
        return (yield from _batch_hand_back(exc, batch.deliveries))
    window = rules.retention_window
    ages = {index: expired(delivery, window) for index, delivery in batch.deliveries}
    claims = [(index, claim) for index, claim in batch.deliveries if index not in poisoned]
    outcome = None
    while claims:
        refusals = tuple(_expired_refusal(claim, rules, ages[index]) for index, claim in claims)
        op = ProcessBatch(tuple(c for _, c in claims), tuple(i for i, _ in claims), refusals)
        try:
            outcome = yield op
            break
        except RefusedFirstSeen as refused:
            # Rolled back whole: each refused message is kept as poison as one message is
            # (counted, recorded), the rest is claimed again without them.
            try:
                for index, error in zip(refused.items, refused.errors, strict=True):
                    delivery = dict(claims)[index]
                    poisoned[index] = yield from _refused(delivery, error)
            except Exception as exc:
                return (yield from _batch_hand_back(exc, batch.deliveries))
            claims = [(index, claim) for index, claim in claims if index not in refused.items]
        except BaseException as exc:
            interruption = _interruption(exc)
            if not isinstance(exc, Exception) or not isinstance(interruption, Exception):
                raise interruption from None  # the worker going down (a task's cancellation)
            failed = yield from _batch_failed(claims, rules, exc)
            if isinstance(failed, HandedBack):
                return failed
            try:
                for index, verdict in zip(failed.quarantined, failed.conflicts, strict=True):
                    claim = dict(claims)[index]
                    yield Publish(Route.QUARANTINE, conflict_details(claim, verdict), index)
            except Exception as trouble:
                return (yield from _batch_hand_back(trouble, batch.deliveries))
            settled = set(failed.duplicates) | set(failed.quarantined)
            everything = tuple(i for i in range(batch.size) if i not in settled)
            return (yield from _batch_dead_letter(batch, failed, everything, poisoned))
    verdicts: tuple[Verdict, ...] = outcome.verdicts if outcome is not None else ()
    try:
        for (index, claim), verdict in zip(claims, verdicts, strict=True):
            if verdict.decision is Decision.CONFLICT and not verdict.shadow:
                yield Publish(Route.QUARANTINE, conflict_details(claim, verdict), index)
    except Exception as exc:
        return (yield from _batch_hand_back(exc, batch.deliveries))
    result = outcome.result if outcome is not None else None
    old = tuple(
        index
        for (index, _), verdict in zip(claims, verdicts, strict=True)
        if ages[index] is not None and verdict.decision is Decision.FIRST
    )
    rejected = {index for index, _ in batch.problems} | set(poisoned)
    kept = tuple(sorted(poisoned))
    recovered = tuple(kind for kind in outcome.recovered if kind) if outcome is not None else ()
    processed = BatchProcessed(
        result,
        verdicts,
        tuple(sorted(rejected)),
        kept,
        tuple(poisoned[i] for i in kept),
        old,
        recovered,
    )
    return (yield from _batch_dead_letter(batch, processed, processed.dead_lettered, poisoned))


def _claimed_before(
    claims: Sequence[tuple[int, Delivery]],
) -> Generator[Op, Any, tuple[set[int], dict[int, StoredClaim]]]:
    """The messages of a batch about to be kept as poison whose identity had committed
    before, each read back: with the same payload (a redelivery whose ack was lost), a
    duplicate; with another, a conflict (the claim decides it, not the handler, which
    never ran it). Neither is kept as poison: each settles as it would alone."""
    applied = set()
    conflicts: dict[int, StoredClaim] = {}
    for index, delivery in claims:
        if delivery.shadow:
            continue  # in shadow mode a duplicate or a conflict runs, and fails with its batch
        stored: StoredClaim | None = yield LookUpClaim(delivery)
        if stored is None or stored.processed_at is None:
            continue
        decision, _ = compare(stored, delivery)
        if decision is Decision.DUPLICATE:
            applied.add(index)
        elif decision is Decision.CONFLICT:
            conflicts[index] = stored
    return applied, conflicts


def _refused(delivery: Delivery, error: PermanentError) -> Generator[Op, Any, Poisoned]:
    """A message of a batch refused after its claim (expired, first seen): kept as poison
    as one message is (`_failed` with a permanent error)."""
    text = describe(error)
    attempts: int = yield CountFailure(delivery, text)
    record = yield RecordPoison(delivery, error.reason_code, text, attempts)
    return Poisoned(error.reason_code, record, text, error)


def _batch_failed(
    claims: list[tuple[int, Delivery]], rules: ConsumerPolicy, exc: Exception
) -> Generator[Op, Any, BatchRejected | HandedBack]:
    """The batch rolled back with ``exc``: hand it back, or count it against each of its
    messages, or keep each as poison."""
    if isinstance(exc, RejectRequested):
        return BatchRejected(HANDLER_REJECTED, InboxError(str(exc)), (), ())
    if isinstance(exc, Unfit):
        return BatchRejected("unfit", exc, (), ())
    if isinstance(exc, TransientError | SchemaError):
        return (yield from _batch_hand_back(exc, claims))
    code = reason_code(exc, rules.permanent_errors)
    error = describe(exc)
    try:
        counts: list[int] = []
        for _, claim in claims:
            counts.append((yield CountFailure(claim, error)))
        if code is None and not _last(rules, max(counts), exc):
            return HandedBack(exc, counted=True)
        code = code or _exhausted(exc)
        applied, conflicting = yield from _claimed_before(claims)
        conflicts: list[Verdict] = []
        for index, stored in conflicting.items():
            claim = dict(claims)[index]
            record = yield QuarantineConflict(claim, stored)
            conflicts.append(Verdict(Decision.CONFLICT, stored, True, record))
        records = []
        for (index, claim), attempts in zip(claims, counts, strict=True):
            if index not in applied and index not in conflicting:
                records.append((yield RecordPoison(claim, code, error, attempts)))
    except Exception as trouble:
        # Not recorded (the database may be down): nothing may be dropped, so the batch
        # is handed back whatever kind of failure this was, counted against nothing.
        yield from _batch_hand_back(trouble, claims)
        return HandedBack(exc, counted=False)
    why = InboxError(
        f"a poison batch ({code}, {max(counts)} attempts): {error}; kept in the poison table"
    )
    return BatchRejected(
        code,
        why,
        tuple(records),
        (),
        exc,
        tuple(sorted(applied)),
        tuple(conflicting),
        tuple(conflicts),
    )


def _batch_dead_letter(
    batch: BatchArrival,
    settlement: BatchProcessed | BatchRejected,
    indexes: tuple[int, ...],
    poisoned: dict[int, Poisoned],
) -> Generator[Op, Any, BatchSettlement]:
    """Publish each of ``indexes`` to the dead-letter destination, then settle."""
    problems = dict(batch.problems)
    claims = dict(batch.deliveries)
    try:
        for index in indexes:
            if index in poisoned:
                details = _poison_details(poisoned[index], claims[index])
            else:
                rejected = settlement if isinstance(settlement, BatchRejected) else None
                error = rejected.error if rejected is not None else problems[index]
                details = rejection_details(error, batch.declared_consumer, batch.source)
            yield Publish(Route.DEAD_LETTER, details, index)
    except Exception as exc:
        return (yield from _batch_hand_back(exc, batch.deliveries))
    if isinstance(settlement, BatchRejected):
        return replace(settlement, dead_lettered=indexes)
    return settlement


def _batch_hand_back(
    exc: BaseException, claims: Sequence[tuple[int, Delivery]]
) -> Generator[Op, Any, HandedBack]:
    """Hand a batch back for no fault of its messages: a hand-back counted for each (see
    `_hand_back`), so that the redelivery is not taken for a crash."""
    for _, delivery in claims:
        yield from _hand_back(exc, delivery)
    return HandedBack(exc, counted=False)


def _batch_held(
    exc: BaseException, claims: Sequence[tuple[int, Delivery]]
) -> Generator[Op, Any, HandedBack]:
    """A batch held back before its claim, as `_held` holds one message: a hand-back
    counted in this process for each of its messages."""
    for _, delivery in claims:
        with contextlib.suppress(Exception):  # best effort
            yield CountHandBack(delivery, unreachable=True)
    return HandedBack(exc, counted=False)


def _hand_back(exc: BaseException, delivery: Delivery) -> Generator[Op, Any, Settlement]:
    """Hand back for no fault of the message: count the hand-back where it can be counted
    (in the attempts row; in this process when the database is the trouble), so that the
    redelivery it causes is not taken for a crash."""
    with contextlib.suppress(Exception):  # best effort
        yield CountHandBack(delivery, unreachable=isinstance(exc, DatabaseUnavailable))
    return HandedBack(exc, counted=False)


def _held(arrival: Arrival, exc: BaseException) -> Generator[Op, Any, Settlement]:
    """Handed back before the claim: the start-up check has not passed. Counted as a
    hand-back in this process (the database is the trouble, or its schema is), so that
    neither the redelivery limit nor anything else takes the redelivery for a crash."""
    if arrival.delivery is not None:
        with contextlib.suppress(Exception):  # best effort
            yield CountHandBack(arrival.delivery, unreachable=True)
    return HandedBack(exc, counted=False)


def _requested_delay(exc: BaseException) -> float | None:
    return exc.delay if isinstance(exc, HandBackRequested) else None


# -- drivers ----------------------------------------------------------------------------------


class Observer(Protocol):
    """Watches the steps a trampoline drives (tracing does): told before an operation is
    performed, after it (with its answer, or its error), and of the steps' result. What
    ``started`` returns is handed back to ``ended``. An observer never changes an
    outcome: it must not raise."""

    def started(self, op: Any) -> Any: ...
    def ended(self, op: Any, started: Any, answer: Any, error: BaseException | None) -> None: ...
    def finished(self, result: Any) -> None: ...


def drive(
    steps: Generator[T, Any, S], perform: Callable[[T], Any], observer: Observer | None = None
) -> S:
    """Run ``steps`` to its end, performing each operation with ``perform``: the one
    trampoline of the library (the core's settlements, the claim protocol's statements).
    An operation's exception is thrown into ``steps``, which decide what it means."""
    answer: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = steps.send(answer) if error is None else steps.throw(error)
        except StopIteration as done:
            result: S = done.value
            if observer is not None:
                observer.finished(result)
            return result
        started = observer.started(op) if observer is not None else None
        try:
            answer, error = perform(op), None
        except BaseException as exc:
            answer, error = None, exc
        if observer is not None:
            observer.ended(op, started, answer, error)


async def drive_async(
    steps: Generator[T, Any, S],
    perform: Callable[[T], Awaitable[Any]],
    observer: Observer | None = None,
) -> S:
    """`drive` for operations that are awaited."""
    answer: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = steps.send(answer) if error is None else steps.throw(error)
        except StopIteration as done:
            result: S = done.value
            if observer is not None:
                observer.finished(result)
            return result
        started = observer.started(op) if observer is not None else None
        try:
            answer, error = await perform(op), None
        except BaseException as exc:
            answer, error = None, exc
        if observer is not None:
            observer.ended(op, started, answer, error)


def backoff_delay(first: float, limit: float, failures: int, factor: float = 2.0) -> float:
    """The library's one backoff formula: seconds to wait after the ``failures``-th
    failure in a row (1 for the first), from ``first``, ``factor`` times more each time,
    at most ``limit``. The hand-back delays keep their count per message in the process;
    the outbox its stored attempt count; a hand-back re-enqueued during a broker outage
    its tries."""
    exponent = min(max(failures - 1, 0), 64)  # beyond this the limit applies anyway
    return float(min(limit, first * factor**exponent))


REMEMBERED_MESSAGES = 10_000
"""How many messages a process remembers per-message hand-back state for (their delays,
the hand-backs it could not record): the oldest are forgotten first."""

UNIDENTIFIED_KEY_BYTES = 64
"""The leading bytes of a body that key the hand-back delays of a message (or a batch)
without a usable identity."""


@dataclass(slots=True)
class HandBackDelays:
    """Delays before a hand-back: doubling per hand-back of the same message from
    ``first`` up to ``limit`` seconds, remembered for the latest ``memory`` messages."""

    first: float
    limit: float
    memory: int = REMEMBERED_MESSAGES
    _counts: dict[Hashable, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.limit:
            from .exceptions import ConfigurationError

            raise ConfigurationError("retry_backoff needs 0 < first <= limit seconds")

    def next(self, key: Hashable) -> float:
        count = self._counts.pop(key, 0) + 1
        self._counts[key] = count  # most recent last
        while len(self._counts) > self.memory:
            del self._counts[next(iter(self._counts))]
        return backoff_delay(self.first, self.limit, count)

    def forget(self, key: Hashable) -> None:
        self._counts.pop(key, None)
