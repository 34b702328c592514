"""Failed attempts, hand-backs, redeliveries and poison rows: their statements.

A failed attempt rolls back, its claim with it, so nothing it wrote survives. What the
operator needs to know about the failure is therefore written by a separate, short
transaction after the rollback::

    attempt transaction                  failure transaction (after the rollback)
    -------------------                  ----------------------------------------
    BEGIN; INSERT claim; handler raises
    ROLLBACK                             BEGIN
                                         UPSERT inbox_attempts: attempts + 1
                                         permanent, or out of attempts:
                                           UPSERT inbox_poison with the payload
                                         COMMIT
    then: hand back (retry later), or move the message to repair (poison)

What is permanent and when attempts run out is decided by `consumption`; this module
only writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from sqlalchemy import (
    Boolean,
    Connection,
    bindparam,
    case,
    delete,
    func,
    or_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from .._core.consumption import RedeliveryCount
from .._core.outputs import OUTPUTS_UNDELIVERABLE
from .._core.protocol import Delivery, Verdict
from .tables import IDENTITY_KEY, InboxSchema

__all__ = [
    "FailureRecorder",
    "Marker",
    "PoisonRecord",
    "mark_batch_recovered",
    "mark_recovered",
    "mark_repaired",
    "parse_marker",
]


@dataclass(frozen=True, slots=True)
class PoisonRecord:
    id: int
    attempts: int
    recovered: bool = False
    """Written recovered: a copy with the same payload had committed (see `record_poison`)."""


class FailureRecorder:
    """Writes failure counts and poison rows.

    Every method takes a connection in a transaction of its own (``engine.begin()``, or
    ``async_engine.begin()`` with ``run_sync``): never the failed attempt's.
    """

    def __init__(self, naming: InboxSchema, dialect: str) -> None:
        tables = naming.tables
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        key = list(IDENTITY_KEY)
        attempts = tables.attempts
        count = insert(attempts).values(
            **{name: bindparam(name) for name in key},
            attempts=1,
            first_failure_at=func.now(),
            last_failure_at=func.now(),
            last_error=bindparam("error"),
        )
        self._count = count.on_conflict_do_update(
            index_elements=key,
            set_={
                "attempts": attempts.c.attempts + 1,
                "last_failure_at": func.now(),
                "last_error": count.excluded.last_error,
            },
        ).returning(attempts.c.attempts)

        poison = tables.poison
        # ``applied``: a later copy of this message (same identity, same payload) committed
        # already, found where the inbox claims (`Inbox._applied`): the row is written
        # recovered, not pending (the claim of a copy that commits later marks a pending
        # row recovered itself: `statements`).
        applied = bindparam("applied", type_=Boolean)
        decision = case((applied, "recovered"), else_="pending")
        recovered_at = case((applied, func.now()), else_=None)
        record = insert(poison).values(
            **{name: bindparam(name) for name in key},
            payload_sha256=bindparam("payload_sha256"),
            hash_scheme=bindparam("hash_scheme"),
            payload=bindparam("payload"),
            payload_format=bindparam("payload_format"),
            headers=bindparam("headers", type_=poison.c.headers.type),
            source=bindparam("source"),
            reason_code=bindparam("reason_code"),
            error=bindparam("error"),
            attempts=bindparam("attempts"),
            first_failure_at=func.now(),
            last_failure_at=func.now(),
            handler_version=bindparam("handler_version"),
            decision=decision,
            recovered_at=recovered_at,
        )
        # A message redriven after a repair that fails again is pending once more: the
        # row keeps its first failure time and takes everything else from this failure.
        self._poison = record.on_conflict_do_update(
            index_elements=key,
            set_={
                **{
                    name: getattr(record.excluded, name)
                    for name in (
                        "payload_sha256",
                        "hash_scheme",
                        "payload",
                        "payload_format",
                        "headers",
                        "source",
                        "reason_code",
                        "error",
                        "attempts",
                        "handler_version",
                    )
                },
                "last_failure_at": func.now(),
                "decision": decision,
                "recovered_at": recovered_at,
                "decided_by": None,
                "decided_at": None,
                "decision_note": None,
                "operation_id": None,
                "published_at": None,
            },
        ).returning(poison.c.id, poison.c.attempts, poison.c.decision)

        redelivery = insert(attempts).values(
            **{name: bindparam(name) for name in key},
            attempts=0,
            redeliveries=1,
            first_failure_at=func.now(),
            last_failure_at=func.now(),
            last_error=bindparam("error"),
        )
        self._redelivery = redelivery.on_conflict_do_update(
            index_elements=key,
            set_={
                "redeliveries": attempts.c.redeliveries + 1,
                "last_failure_at": func.now(),
            },
        ).returning(attempts.c.redeliveries, attempts.c.attempts, attempts.c.hand_backs)

        hand_back = insert(attempts).values(
            **{name: bindparam(name) for name in key},
            attempts=0,
            redeliveries=0,
            hand_backs=1,
            first_failure_at=func.now(),
            last_failure_at=func.now(),
            last_error=bindparam("error"),
        )
        self._hand_back = hand_back.on_conflict_do_update(
            index_elements=key,
            set_={"hand_backs": attempts.c.hand_backs + 1},
        )
        self._reset = delete(attempts).where(*(attempts.c[name] == bindparam(name) for name in key))

    def count_redelivery(
        self, conn: Connection, delivery: Delivery, *, claimed: bool
    ) -> RedeliveryCount:
        """Count one broker redelivery of ``delivery`` that reached the database (with
        the failures and hand-backs counted so far), with whether its processing committed
        already (``claimed``, read by the caller where the inbox claims)."""
        params = self._key(delivery) | {"error": "redelivered"}
        row = conn.execute(self._redelivery, params).first()
        redeliveries, failures, hand_backs = (int(v) for v in row) if row else (0, 0, 0)
        return RedeliveryCount(redeliveries, failures, hand_backs, claimed)

    def count_hand_back(self, conn: Connection, delivery: Delivery, error: str) -> None:
        """Count one hand-back the inbox made (no failure of the message's own)."""
        conn.execute(self._hand_back, self._key(delivery) | {"error": error})

    def reset(self, conn: Connection, key: tuple[str, str, str, str]) -> None:
        """Forget a message's failures, redeliveries and hand-backs (it was redriven)."""
        consumer, producer, tenant, message_id = key
        params = {
            "consumer_name": consumer,
            "producer_name": producer,
            "tenant": tenant,
            "message_id": message_id,
        }
        conn.execute(self._reset, params)

    def count_failure(self, conn: Connection, delivery: Delivery, error: str) -> int:
        """Count one failed attempt of ``delivery``; return its failures so far."""
        params = self._key(delivery) | {"error": error}
        attempts: int = conn.execute(self._count, params).scalar_one()
        return attempts

    def record_poison(
        self,
        conn: Connection,
        delivery: Delivery,
        *,
        reason_code: str,
        error: str,
        attempts: int,
        applied: bool = False,
    ) -> PoisonRecord:
        """Keep ``delivery`` with its payload as poison, pending an operator's decision;
        written recovered when ``applied`` (a copy with the same payload committed)."""
        params = self._key(delivery) | {
            "applied": applied,
            "payload_sha256": delivery.payload_hash.sha256,
            "hash_scheme": delivery.payload_hash.scheme,
            "payload": delivery.stored_payload(),
            "payload_format": delivery.payload_format,
            "headers": delivery.stored_headers(),
            "source": delivery.source,
            "reason_code": reason_code,
            "error": error,
            "attempts": attempts,
            "handler_version": delivery.handler_version,
        }
        row = conn.execute(self._poison, params).one()
        return PoisonRecord(id=row[0], attempts=row[1], recovered=row[2] == "recovered")

    @staticmethod
    def _key(delivery: Delivery) -> dict[str, Any]:
        consumer, producer, tenant, message_id = delivery.key
        return {
            "consumer_name": consumer,
            "producer_name": producer,
            "tenant": tenant,
            "message_id": message_id,
        }


class Marker(NamedTuple):
    """A repair marker: the row a republished message repairs, and the operation that
    republished it (None in markers written before operations were carried)."""

    kind: str
    row_id: int
    operation: str | None


def parse_marker(marker: object) -> Marker | None:
    """``"poison:12:op-1"`` -> Marker("poison", 12, "op-1"); ``"poison:12"`` -> Marker
    ("poison", 12, None); anything else -> None."""
    if isinstance(marker, bytes | bytearray):
        marker = bytes(marker).decode("utf-8", "replace")
    if not isinstance(marker, str) or ":" not in marker:
        return None
    kind, _, rest = marker.partition(":")
    number, colon, operation = rest.partition(":")
    if kind not in ("quarantine", "poison") or not number.isdigit() or len(number) > 18:
        return None
    return Marker(kind, int(number), operation if colon and operation else None)


def mark_recovered(
    conn: Connection,
    naming: InboxSchema,
    marker: object,
    key: tuple[str, str, str, str],
    *,
    through: Literal["handler", "claim", "send"] = "handler",
) -> str | None:
    """In the processing transaction of the message with identity ``key``: the repaired
    message committed; say so in its row. Return the row's kind, or None when no row
    matched.

    A marker is a header or an option any producer can set (or an upstream handler copy),
    so it applies only to the row it names when that row is the same consumer's, for the
    same identity (for an accepted quarantine row: its accepted message id), decided by a
    repair (redriven, or accepted) and, when the marker names one, by the same operation.
    Anything else is an ordinary message that carries a stray header: no row changes.

    ``through``: what repaired it. The ``handler`` of a first-seen message. The ``claim``
    it met, committed by another copy of its intent (`Verdict.repairs`: a duplicate), whose
    effect is the one the repair was for; but not a row of outputs that could not be sent,
    which that claim committed itself and whose repair is their ``send`` (`MarkSent`,
    after the duplicate's COMMIT), which marks only such a row."""
    parsed = parse_marker(marker)
    if parsed is None:
        return None
    consumer, producer, tenant, message_id = key
    table = naming.tables.poison if parsed.kind == "poison" else naming.tables.quarantine
    same = [
        table.c.id == parsed.row_id,
        table.c.consumer_name == consumer,
        table.c.producer_name == producer,
        table.c.tenant == tenant,
    ]
    if parsed.operation is not None:
        same.append(table.c.operation_id == parsed.operation)
    # Not recovered yet, or by this very transaction (PostgreSQL: the claim of a copy of
    # the same payload marks a redriven poison row itself, `statements`; now() is the
    # transaction's start): a row is counted recovered once, whichever copy comes again.
    fresh: list[Any] = [table.c.recovered_at.is_(None)]
    if conn.dialect.name == "postgresql":
        fresh.append(table.c.recovered_at == func.now())
    same.append(or_(*fresh))
    values: dict[str, Any] = {"recovered_at": func.now()}
    if parsed.kind == "poison":
        decided = table.c.decision.in_(("redriven", "recovered"))
        same += [table.c.message_id == message_id, decided]
        if through != "handler":
            undeliverable = table.c.reason_code == OUTPUTS_UNDELIVERABLE
            same.append(undeliverable if through == "send" else ~undeliverable)
        values["decision"] = "recovered"
    else:
        redriven = (table.c.decision == "redriven") & (table.c.message_id == message_id)
        accepted = (table.c.decision == "accepted") & (table.c.accepted_message_id == message_id)
        same.append(or_(redriven, accepted))
    found = conn.execute(update(table).where(*same).values(**values)).rowcount
    return parsed.kind if found else None


def mark_batch_recovered(
    conn: Connection,
    naming: InboxSchema,
    deliveries: Sequence[Delivery],
    verdicts: Sequence[Verdict],
    markers: Sequence[str | None],
) -> tuple[str | None, ...]:
    """`mark_recovered` for each message of a batch that carries a marker (``markers``:
    each delivery's, in the batch's order; empty: none) and repairs its row
    (`Verdict.repairs`), in the batch's transaction, after its handler; per delivery, the
    kind of row it marked, or None (empty when no delivery carries a marker)."""
    if not any(marker is not None for marker in markers):
        return ()
    marked: list[str | None] = []
    done: set[str] = set()  # two copies of one repaired message in a batch: one row, once
    for delivery, verdict, marker in zip(deliveries, verdicts, markers, strict=False):
        kind = None
        if marker is not None and marker not in done:
            kind = mark_repaired(conn, naming, marker, delivery, verdict)
            if kind is not None:
                done.add(marker)
        marked.append(kind)
    return tuple(marked)


def mark_repaired(
    conn: Connection, naming: InboxSchema, marker: str, delivery: Delivery, verdict: Verdict
) -> str | None:
    """`mark_recovered` for a copy that carries ``marker`` and was claimed with
    ``verdict``, in its transaction: repaired by its handler when it ran, by the claim it
    met when it is a duplicate (`Verdict.repairs`), not at all otherwise."""
    if not verdict.repairs:
        return None
    through: Literal["handler", "claim"] = "handler" if verdict.runs_handler else "claim"
    return mark_recovered(conn, naming, marker, delivery.key, through=through)
