"""The repair statements: quarantine and poison rows listed, read, and decided on.

``repair`` validates and raises; these run the SQL on the caller's connection. A decision
is one conditional UPDATE: it applies to a pending row only (or to a row the same
operation decided already, so that an operation can run again), and returns the row as it
now is, or None when the row was decided otherwise. Its publish, once the broker
confirmed it, is recorded by a second one (``published_at``).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Table, bindparam, case, func, or_, select, update

__all__ = ["confirm", "decide", "row", "rows"]


def rows(
    conn: Connection,
    table: Table,
    last: str,
    equal: Mapping[str, object],
    *,
    since: datetime | None,
    until: datetime | None,
    limit: int | None,
    unconfirmed: bool = False,
) -> list[dict[str, Any]]:
    """Rows without their payload, latest ``last`` first; ``equal``: column values wanted
    (None: any), ``since`` included, ``until`` not; ``unconfirmed``: only rows whose
    publish was not confirmed."""
    when = table.c[last]
    query = select(*(c for c in table.c if c.name != "payload")).order_by(when.desc())
    for name, value in equal.items():
        if value is not None:
            query = query.where(table.c[name] == value)
    if since is not None:
        query = query.where(when >= since)
    if until is not None:
        query = query.where(when < until)
    if unconfirmed:
        query = query.where(table.c.published_at.is_(None))
    if limit is not None:
        query = query.limit(limit)
    return [dict(found) for found in conn.execute(query).mappings()]


def row(conn: Connection, table: Table, row_id: int) -> dict[str, Any] | None:
    """The whole row, payload included."""
    found = conn.execute(select(table).where(table.c.id == row_id)).mappings().first()
    return None if found is None else dict(found)


def decide(
    conn: Connection,
    table: Table,
    row_id: int,
    decision: str,
    *,
    operation: str | None,
    values: Mapping[str, Any],
) -> dict[str, Any] | None:
    """Record ``decision`` (with ``values``: who, why, ...) on a pending row; the row after."""
    allowed = table.c.decision == "pending"
    if operation is not None:  # the same operation may run again: it is the same decision
        allowed = or_(
            allowed,
            (table.c.decision == decision) & (table.c.operation_id == bindparam("operation")),
        )
    # A new decision has published nothing yet; the same operation run again keeps the
    # confirmation of its earlier publish.
    published = case((table.c.decision == "pending", None), else_=table.c.published_at)
    statement = (
        update(table)
        .where(table.c.id == row_id, allowed)
        .values(
            decision=decision,
            decided_at=func.now(),
            operation_id=operation,
            published_at=published,
            **values,
        )
        .returning(table)
    )
    found = conn.execute(statement, {"operation": operation} if operation else {})
    decided = found.mappings().first()
    return None if decided is None else dict(decided)


def confirm(conn: Connection, table: Table, row_id: int, operation: str) -> bool:
    """Record that the broker confirmed the publish of ``operation``'s decision on this
    row; False when the row was decided otherwise meanwhile (it failed, or conflicted,
    again and is pending once more)."""
    statement = (
        update(table)
        .where(table.c.id == row_id, table.c.operation_id == operation)
        .values(published_at=func.now())
    )
    return bool(conn.execute(statement).rowcount)
