"""The claim protocol as pure decisions: no SQL, no I/O, no framework.

The one telling of the story every adapter follows (the storage executors, Dramatiq's
middleware and FastStream's processing link here). One attempt, in one transaction::

    adapter                          PostgreSQL                    broker
    -------                          ----------                    ------
    identity, payload hash
    BEGIN (READ COMMITTED)
    INSERT claim ──────────────────> row (first seen) or conflict
      first seen ──> handler(session), its writes in the same transaction
      duplicate ───> (the stored hash matches) nothing runs
      conflict ────> quarantine row
    COMMIT ────────────────────────> durable
    outputs sent (a reply, a pipeline step), when something consumes them
    ack ──────────────────────────────────────────────────────────> settled
    (killed before the ack: the message comes back, and is then a duplicate)

    any exception ──> ROLLBACK (the claim goes with it) ──> retried at once (serialization
                      failure, deadlock), or the consumption core decides: never an ack

What follows the COMMIT (ack, quarantine, dead letter, hand-back) is decided by the
consumption core (`inbox_middleware._core.consumption`), and each adapter tells its broker in
one place.

A delivery is claimed by inserting its key. The primary key serializes concurrent
claims; nothing here reads before it writes::

    worker A                         worker B (same message)
    --------                         -----------------------
    BEGIN                            BEGIN
    INSERT key  -> row returned
                                     INSERT key  -> blocks on A's uncommitted row
    handler writes ...
    COMMIT                           -> unblocks: conflict, no row returned
    ack                              SELECT stored hash -> same: duplicate
                                     COMMIT (nothing written), ack

    had A rolled back instead:       -> unblocks: B's INSERT succeeds, B owns the message

`claim_steps` yields the storage operations to perform and receives their results, so
the synchronous and asynchronous executors share every decision and differ only in
whether they ``await``.

`claim_batch_steps` decides a batch the same way in one transaction: one INSERT claims
every key, in key order, so two batches that share keys lock them in the same order and
cannot deadlock on each other::

    batch A: k1 k3           batch B: k3 k1   -> both insert k1 first, then k3:
    INSERT k1, k3 (sorted)   INSERT k1 ...       B waits on A's k1, never A on B's k3

The keys that were not claimed are read back in one statement and decided one by one, as
for a single delivery; a key that appears twice in one batch is decided against its first
appearance.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from . import claims
from .exceptions import TransactionConflict
from .identity import MessageIdentity, PayloadHash, jsonable

__all__ = [
    "Claim",
    "ClaimBatch",
    "Decision",
    "Delivery",
    "LookUp",
    "LookUpBatch",
    "QuarantineRecord",
    "ReasonCode",
    "RecordConflict",
    "Step",
    "StoredClaim",
    "Verdict",
    "claim_batch_steps",
    "claim_steps",
    "compare",
]

# A claimed row can vanish between our conflicting INSERT and the hash lookup only if a
# purge removed it in that instant; claiming again is then correct, but not forever.
_MAX_VANISHED = 3


class ReasonCode(StrEnum):
    """Why the library itself kept a message as poison or quarantined it. The values are
    stored (``inbox_poison.reason_code``, ``inbox_quarantine.reason_code``), used as metric
    labels and as CLI filters: they never change. A permanent error of the user's own has
    its own code (`PermanentError.reason_code`, or the type's name in
    ``permanent_errors``)."""

    RETRIES_EXHAUSTED = "retries_exhausted"
    """The attempts ran out (``max_attempts``, or the framework's retry budget)."""
    REDELIVERY_LIMIT = "redelivery_limit"
    """Redelivered without an outcome (its worker died) more than ``redelivery_limit``."""
    EXPIRED_REDELIVERY = "expired_redelivery"
    """First seen but older than the retention window, policy ``reject``."""
    HANDLER_REJECTED = "handler_rejected"
    """The handler rejected the message (``RejectMessage``, ``message.fail()``)."""
    HANDLER_TRANSACTION = "handler_transaction"
    """The handler ended the inbox's transaction itself, or settled the message itself."""
    INBOX_ERROR = "inbox_error"
    """The attempts ran out in the inbox's own path."""
    OUTPUTS_UNDELIVERABLE = "outputs_undeliverable"
    """The stored outputs could not be published within the attempts allowed."""
    RESULT_UNSTORABLE = "result_unstorable"
    """The handler's result cannot be encoded and stored with the claim."""
    IDENTITY_CONFLICT = "identity_conflict"
    """Same identity, another payload: quarantined."""


class Decision(StrEnum):
    FIRST = "first"
    """This attempt owns first processing: run the handler, commit, then ack."""
    DUPLICATE = "duplicate"
    """A committed claim with the same payload exists: skip the handler, ack."""
    CONFLICT = "conflict"
    """A committed claim with a different payload exists: quarantine, skip, ack."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """One delivery of a message to one consumer, as the adapters hand it to the core."""

    consumer: str
    identity: MessageIdentity
    payload_hash: PayloadHash
    handler_version: str = ""
    source: str = ""
    """The queue, stream or subject the message came from."""
    payload: bytes | Callable[[], bytes] | None = None
    """The message as received, kept with a quarantined conflict or a poison message; a
    callable is called only then, so the common path never encodes it (`stored_payload`)."""
    payload_format: str = ""
    """How `payload` is encoded (``dramatiq``, ``faststream``), to publish it again."""
    headers: Mapping[str, Any] = field(default_factory=dict)
    """Kept with the payload; made JSON-safe only when stored (`stored_headers`)."""
    received_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    rehash: Callable[[str], str | None] | None = None
    """Hash this payload under an older scheme, or ``None`` when the scheme is unknown."""
    shadow: bool = False
    """Shadow mode (a consumer setting): claim and decide as usual, but skip nothing. A
    would-be duplicate or conflict is counted and logged, and its handler runs; a conflict
    writes no quarantine row. The claim row means what it means when enforcing."""

    @property
    def key(self) -> tuple[str, str, str, str]:
        return self.identity.key(self.consumer)

    def stored_payload(self) -> bytes | None:
        return self.payload() if callable(self.payload) else self.payload

    def stored_headers(self) -> dict[str, Any]:
        return {str(name): jsonable(value) for name, value in self.headers.items()}


@dataclass(frozen=True, slots=True)
class StoredClaim:
    """What the inbox holds for a key: the committed first processing."""

    payload_sha256: str
    hash_scheme: str
    handler_version: str
    processed_at: datetime | None


@dataclass(frozen=True, slots=True)
class QuarantineRecord:
    """The quarantine row a conflict was recorded in, and how often it was seen."""

    id: int
    attempts: int


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: Decision
    stored: StoredClaim | None = None
    verified: bool = True
    """False when the stored hash used a scheme this version cannot recompute."""
    quarantine: QuarantineRecord | None = None
    shadow: bool = False
    """A duplicate or conflict decided in shadow mode: the handler runs all the same."""

    @property
    def runs_handler(self) -> bool:
        """Whether the handler runs: first seen, or any decision in shadow mode."""
        return self.decision is Decision.FIRST or self.shadow

    @property
    def repairs(self) -> bool:
        """Whether a repaired copy (one that carries a repair marker) with this verdict
        marks its row recovered: it ran the handler, or it met its intent's committed claim
        (a duplicate: another copy committed what the repair was for)."""
        return self.runs_handler or self.decision is Decision.DUPLICATE


@dataclass(frozen=True, slots=True)
class Claim:
    """Insert the key; the result is True when this transaction now owns it."""

    delivery: Delivery


@dataclass(frozen=True, slots=True)
class LookUp:
    """Read the committed claim for the key; the result is a `StoredClaim` or None."""

    delivery: Delivery


@dataclass(frozen=True, slots=True)
class RecordConflict:
    """Upsert the quarantine row for this identity and conflicting hash."""

    delivery: Delivery
    stored: StoredClaim


@dataclass(frozen=True, slots=True)
class ClaimBatch:
    """Insert every key in one statement, in key order; the result is the set of keys
    (`Delivery.key`) this transaction now owns."""

    deliveries: tuple[Delivery, ...]


@dataclass(frozen=True, slots=True)
class LookUpBatch:
    """Read the committed claims of these keys in one statement; the result maps each key
    found to its `StoredClaim` (a key missing from it was purged in the meantime)."""

    deliveries: tuple[Delivery, ...]


Step = Claim | LookUp | RecordConflict | ClaimBatch | LookUpBatch


def compare(stored: StoredClaim, delivery: Delivery) -> tuple[Decision, bool]:
    """Same intent and payload is a duplicate; same intent, other payload, a conflict.

    Returns the decision and whether the payload could be compared at all.
    """
    ours = delivery.payload_hash
    scheme = claims.stored_scheme(stored.hash_scheme, ours.scheme)
    if scheme == ours.scheme:
        theirs: str | None = ours.sha256
    elif scheme is None:  # a compact row's scheme number this version does not know
        theirs = None
    else:
        theirs = delivery.rehash(scheme) if delivery.rehash else None
    if theirs is None:
        # The claim was hashed by a scheme we cannot reproduce. The identity matches, and
        # calling it a conflict would quarantine every in-flight redelivery after an
        # upgrade; treat it as a duplicate and let the caller report it as unverified.
        return Decision.DUPLICATE, False
    if claims.same_payload(theirs, stored.payload_sha256):
        return Decision.DUPLICATE, True
    return Decision.CONFLICT, True


def claim_steps(delivery: Delivery) -> Generator[Step, Any, Verdict]:
    """Decide a delivery inside the caller's transaction, one storage step at a time."""
    for _ in range(_MAX_VANISHED):
        if (yield Claim(delivery)):
            return Verdict(Decision.FIRST)
        # A separate statement, not a CTE: the INSERT waited for a concurrent claim that
        # committed after our statement's snapshot, which the same statement cannot see.
        stored: StoredClaim | None = yield LookUp(delivery)
        if stored is None:
            continue
        return (yield from _decide(delivery, stored))
    raise TransactionConflict(
        "the claim kept conflicting with a row that then disappeared",
        consumer=delivery.consumer,
        producer=delivery.identity.producer,
        message_id=delivery.identity.message_id,
    )


def claim_batch_steps(
    deliveries: Sequence[Delivery],
) -> Generator[Step, Any, tuple[Verdict, ...]]:
    """Decide a batch inside the caller's transaction; verdicts in the batch's order."""
    verdicts: list[Verdict | None] = [None] * len(deliveries)
    first: dict[tuple[str, str, str, str], int] = {}
    for index, delivery in enumerate(deliveries):
        first.setdefault(delivery.key, index)
    pending = sorted((deliveries[index] for index in first.values()), key=_sort_key)
    for _ in range(_MAX_VANISHED):
        if not pending:
            break
        claimed: set[tuple[str, str, str, str]] = yield ClaimBatch(tuple(pending))
        for delivery in pending:
            if delivery.key in claimed:
                verdicts[first[delivery.key]] = Verdict(Decision.FIRST)
        rest = tuple(d for d in pending if d.key not in claimed)
        if not rest:
            pending = []
            break
        # A separate statement, as for one delivery: it sees rows committed while the
        # INSERT waited.
        stored: dict[tuple[str, str, str, str], StoredClaim] = yield LookUpBatch(rest)
        pending = [d for d in rest if d.key not in stored]
        for delivery in rest:
            if delivery.key in stored:
                verdicts[first[delivery.key]] = yield from _decide(delivery, stored[delivery.key])
    if pending:
        raise TransactionConflict(
            "the batch claim kept conflicting with rows that then disappeared",
            consumer=pending[0].consumer,
            producer=pending[0].identity.producer,
            message_id=pending[0].identity.message_id,
        )
    for index, delivery in enumerate(deliveries):
        if verdicts[index] is None:
            # Repeated within the batch: compared with its first appearance, or with the
            # committed claim that first appearance was compared with.
            earlier = verdicts[first[delivery.key]]
            assert earlier is not None
            reference = earlier.stored or _as_stored(deliveries[first[delivery.key]])
            verdicts[index] = yield from _decide(delivery, reference)
    return tuple(v for v in verdicts if v is not None)


def _decide(delivery: Delivery, stored: StoredClaim) -> Generator[Step, Any, Verdict]:
    decision, verified = compare(stored, delivery)
    record: QuarantineRecord | None = None
    if decision is Decision.CONFLICT and not delivery.shadow:
        # In shadow mode a conflict is counted and logged, never written: its handler runs,
        # so a pending quarantine row would invite a repair that processes it again, and
        # the row would still be there, not pending, when enforcement meets the conflict.
        record = yield RecordConflict(delivery, stored)
    return Verdict(decision, stored, verified, record, delivery.shadow)


def _as_stored(delivery: Delivery) -> StoredClaim:
    """The claim ``delivery`` is inserting, as a later delivery of its key will see it."""
    return StoredClaim(
        delivery.payload_hash.sha256, delivery.payload_hash.scheme, delivery.handler_version, None
    )


def _sort_key(delivery: Delivery) -> tuple[str, str, str, str]:
    return delivery.key
