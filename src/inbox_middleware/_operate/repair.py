"""Operator decisions on quarantined and poison messages: list, show, redrive, discard,
and accept (quarantine).

The tables are the source of truth; every decision is recorded in the row with who made
it, when and why. Redrive and accept republish the stored message; both are idempotent
by operation id, and done only once the broker confirmed the publish::

    redrive 12 --operation-id op-1   ->  UPDATE ... SET decision = 'redriven',
                                            operation_id = 'op-1'
                                         WHERE id = 12 AND (decision = 'pending'
                                            OR decision = 'redriven' AND operation_id = 'op-1')
                                     ->  COMMIT, then publish (the broker confirms it)
                                     ->  UPDATE ... SET published_at = now()
                                         WHERE id = 12 AND operation_id = 'op-1'; COMMIT
    the publish fails, or the        ->  the row says redriven by op-1, published_at NULL:
    command dies before confirming       recorded, not confirmed
    the same command again           ->  the row matches again (by id, or by a filter,
                                         which selects pending rows and this operation's
                                         unconfirmed ones): publish again. The copy carries
                                         the same identity, so the consumer's inbox applies
                                         it at most once.
    another operation id             ->  refused: already redriven by op-1

A republished message carries a repair marker (``poison:12:op-1``); when it is later
processed, the executor marks the row ``recovered`` in the same transaction, if the row
is that consumer's, for that identity, and decided by that operation (a marker is a
header anyone can set).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol

from sqlalchemy import Connection, Table

from .._core.exceptions import ConfigurationError, InboxError
from .._core.identity import MAX_MESSAGE_ID_LENGTH
from .._storage import repairs
from .._storage.failures import mark_recovered as _mark_recovered
from .._storage.failures import parse_marker as _parse_marker
from .._storage.tables import InboxSchema

__all__ = [
    "Kind",
    "RepairError",
    "Republisher",
    "StoredMessage",
    "accept",
    "default_operation",
    "discard",
    "list_rows",
    "list_unconfirmed",
    "mark_recovered",
    "parse_marker",
    "redrive",
    "show_row",
]

Kind = Literal["quarantine", "poison"]
KINDS: tuple[Kind, ...] = ("quarantine", "poison")


class RepairError(InboxError):
    """An operator decision cannot be made on this row."""


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """What a quarantine or poison row keeps of a message, to publish it again."""

    kind: Kind
    row_id: int
    consumer: str
    producer: str
    tenant: str
    message_id: str
    payload: bytes
    payload_format: str
    headers: Mapping[str, Any]
    source: str
    operation: str | None = None
    """The operation that republishes it."""

    @property
    def marker(self) -> str:
        """``poison:12:op-1``: the row it repairs, and the operation that republished it."""
        base = f"{self.kind}:{self.row_id}"
        return base if self.operation is None else f"{base}:{self.operation}"


class Republisher(Protocol):
    """Publishes a stored message back to its source; one per framework."""

    @property
    def formats(self) -> Sequence[str]:
        """The ``payload_format`` values it can publish."""

    def republish(self, message: StoredMessage, *, message_id: str) -> None:
        """Publish ``message`` to ``message.source`` under ``message_id``, carrying
        ``message.marker`` so that its later processing marks the row recovered."""


def _table(naming: InboxSchema, kind: Kind) -> Table:
    if kind not in KINDS:
        raise ConfigurationError(f"kind must be quarantine or poison, not {kind!r}")
    return naming.tables.quarantine if kind == "quarantine" else naming.tables.poison


def list_rows(
    conn: Connection,
    naming: InboxSchema,
    kind: Kind,
    *,
    consumer: str | None = None,
    decision: str | None = "pending",
    limit: int | None = 50,
    producer: str | None = None,
    reason: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> list[dict[str, Any]]:
    """Rows without their payload, most recent failure or sighting first; ``since`` and
    ``until`` bound that last failure or sighting (``since`` included, ``until`` not)."""
    table = _table(naming, kind)
    last = "last_seen_at" if kind == "quarantine" else "last_failure_at"
    equal = {
        "consumer_name": consumer,
        "producer_name": producer,
        "reason_code": reason,
        "decision": decision,
    }
    return repairs.rows(conn, table, last, equal, since=since, until=until, limit=limit)


def list_unconfirmed(
    conn: Connection,
    naming: InboxSchema,
    kind: Kind,
    decision: str,
    *,
    consumer: str | None = None,
    producer: str | None = None,
    reason: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> list[dict[str, Any]]:
    """Rows an operation decided (``decision``: redriven, accepted) whose publish was
    never confirmed, with `list_rows`'s filters: a run of that operation again finishes
    them."""
    table = _table(naming, kind)
    last = "last_seen_at" if kind == "quarantine" else "last_failure_at"
    equal = {
        "consumer_name": consumer,
        "producer_name": producer,
        "reason_code": reason,
        "decision": decision,
    }
    return repairs.rows(
        conn, table, last, equal, since=since, until=until, limit=None, unconfirmed=True
    )


def default_operation(action: str, kind: Kind, row: Mapping[str, Any]) -> str:
    """The operation id of ``action`` (redrive, accept) on ``row`` when none is given:
    derived from the row, so that the same command run again is the same operation."""
    if action == "accept":
        return f"accept-quarantine-{row['id']}"
    return f"redrive-{kind}-{row['id']}-{row['attempts']}"


def show_row(conn: Connection, naming: InboxSchema, kind: Kind, row_id: int) -> dict[str, Any]:
    row = repairs.row(conn, _table(naming, kind), row_id)
    if row is None:
        raise RepairError(f"there is no {kind} row #{row_id}")
    return dict(row)


def discard(
    conn: Connection, naming: InboxSchema, kind: Kind, row_id: int, *, by: str, reason: str
) -> dict[str, Any]:
    """Give up on a pending row, saying why. The message is not published again."""
    if not reason.strip():
        raise RepairError("a discard needs a reason")
    return _decide(conn, naming, kind, row_id, "discarded", by=by, note=reason, operation=None)


def redrive(
    conn: Connection,
    naming: InboxSchema,
    kind: Kind,
    row_id: int,
    *,
    by: str,
    publisher: Republisher,
    operation_id: str | None = None,
    note: str | None = None,
) -> tuple[dict[str, Any], str]:
    """Publish the stored message again under its own identity; return (row, operation).

    Commits the decision on ``conn`` before publishing, and records the publish as
    confirmed (``published_at``) once the publisher returned: a publish that fails leaves
    the row redriven by this operation and unconfirmed, for the same operation to finish.
    For poison, the identity was never claimed (its attempts rolled back), so the repaired
    consumer processes it once. For quarantine, the copy meets the original claim again:
    a duplicate when its payload now matches (a canonical form fixed to ignore a volatile
    field), a conflict otherwise (the row is then pending again).
    """
    row = show_row(conn, naming, kind, row_id)
    operation = operation_id or default_operation("redrive", kind, row)
    row = _decide(conn, naming, kind, row_id, "redriven", by=by, note=note, operation=operation)
    # A fresh start: the redriven message's earlier failures must not poison it again on
    # its first failure after the repair.
    from .._storage.failures import FailureRecorder

    key = (row["consumer_name"], row["producer_name"], row["tenant"], row["message_id"])
    FailureRecorder(naming, conn.dialect.name).reset(conn, key)
    _commit(conn)
    _publish(publisher, kind, row, message_id=row["message_id"], operation=operation)
    return _confirmed(conn, naming, kind, row, operation), operation


def accept(
    conn: Connection,
    naming: InboxSchema,
    row_id: int,
    *,
    by: str,
    publisher: Republisher,
    operation_id: str | None = None,
    note: str | None = None,
) -> tuple[dict[str, Any], str]:
    """Treat a quarantined payload as a new intent, under a new recorded message id.

    The new id is derived from the row, so accepting twice (same operation) publishes the
    same intent again, which the consumer applies once. Returns (row, new message id).
    """
    row = show_row(conn, naming, "quarantine", row_id)
    operation = operation_id or default_operation("accept", "quarantine", row)
    new_id = accepted_message_id(row["message_id"], row_id)
    row = _decide(
        conn,
        naming,
        "quarantine",
        row_id,
        "accepted",
        by=by,
        note=note,
        operation=operation,
        extra={"accepted_message_id": new_id},
    )
    _commit(conn)
    _publish(publisher, "quarantine", row, message_id=new_id, operation=operation)
    return _confirmed(conn, naming, "quarantine", row, operation), new_id


def accepted_message_id(message_id: str, row_id: int) -> str:
    candidate = f"{message_id}+accepted-{row_id}"
    if len(candidate) <= MAX_MESSAGE_ID_LENGTH:
        return candidate
    digest = hashlib.sha256(message_id.encode()).hexdigest()[:32]
    return f"accepted-{row_id}-{digest}"


def parse_marker(marker: object) -> tuple[Kind, int] | None:
    """``"poison:12:op-1"`` (or ``"poison:12"``) -> ("poison", 12); anything else -> None."""
    parsed = _parse_marker(marker)
    return None if parsed is None else (parsed.kind, parsed.row_id)  # type: ignore[return-value]


def mark_recovered(
    conn: Connection, naming: InboxSchema, marker: object, key: tuple[str, str, str, str]
) -> Kind | None:
    """In the processing transaction of the message with identity ``key`` (consumer,
    producer, tenant, message id): the repaired message committed; say so in the row the
    marker names, if it is this message's own repair (see `storage.failures`)."""
    return _mark_recovered(conn, naming, marker, key)  # type: ignore[return-value]


def _decide(
    conn: Connection,
    naming: InboxSchema,
    kind: Kind,
    row_id: int,
    decision: str,
    *,
    by: str,
    note: str | None,
    operation: str | None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    values: dict[str, Any] = {
        "decided_by": by,
        "decision_note": note,
        **(extra or {}),
    }
    row = repairs.decide(
        conn, _table(naming, kind), row_id, decision, operation=operation, values=values
    )
    if row is None:
        current = show_row(conn, naming, kind, row_id)
        raise RepairError(
            f"{kind} row #{row_id} is already {current['decision']}"
            + (f" by operation {current['operation_id']}" if current["operation_id"] else "")
            + (
                f" ({current['decided_by']}, {current['decided_at']})"
                if current["decided_by"]
                else ""
            )
        )
    return dict(row)


def _confirmed(
    conn: Connection, naming: InboxSchema, kind: Kind, row: dict[str, Any], operation: str
) -> dict[str, Any]:
    """The publish returned: the broker has the message. Say so in the row."""
    repairs.confirm(conn, _table(naming, kind), row["id"], operation)
    confirmed = show_row(conn, naming, kind, row["id"])
    _commit(conn)
    return confirmed


def _commit(conn: Connection) -> None:
    if conn.in_transaction():
        conn.commit()


def _publish(
    publisher: Republisher,
    kind: Kind,
    row: Mapping[str, Any],
    *,
    message_id: str,
    operation: str,
) -> None:
    stored = StoredMessage(
        kind=kind,
        row_id=row["id"],
        consumer=row["consumer_name"],
        producer=row["producer_name"],
        tenant=row["tenant"],
        message_id=row["message_id"],
        payload=bytes(row["payload"] or b""),
        payload_format=row["payload_format"],
        headers=row["headers"] or {},
        source=row["source"],
        operation=operation,
    )
    if not stored.payload:
        raise RepairError(f"{kind} row #{row['id']} kept no payload to publish")
    if stored.payload_format not in publisher.formats:
        raise RepairError(
            f"{kind} row #{row['id']} holds a {stored.payload_format or 'unknown'} message; "
            f"this publisher handles {', '.join(publisher.formats)}"
        )
    publisher.republish(stored, message_id=message_id)
