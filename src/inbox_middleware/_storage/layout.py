"""Where the workers claim: the record of the switch to the compact claim, and what each
claims table holds (``inbox-middleware claims show`` and ``claims switch``).

The switch is the operator's statement that no worker claims in the library's table
alone any more: every worker runs a version that knows the compact claim, configured
with ``claims="compact"``. Until it is recorded, those workers claim in both tables;
after it, in the compact table, looking in the library's too while it has rows
(`_core.claims.claims_phase`). A worker configured for the library's table refuses to
start once the switch is recorded (`check_claims`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, func, select
from sqlalchemy.dialects import postgresql

from .._core.claims import ClaimsTable
from .._core.exceptions import ConfigurationError, PrerequisiteError
from . import partitions
from .tables import InboxSchema

__all__ = ["ClaimsRecord", "check_claims", "claims_record", "switch_claims"]

_NAME = "claims"


@dataclass(frozen=True, slots=True)
class ClaimsRecord:
    """The switch as recorded, and the rows of each claims table."""

    switched_at: datetime | None
    switched_by: str | None
    library_rows: int
    compact_rows: int
    hourly_partitions: int = 0

    @property
    def switched(self) -> bool:
        return self.switched_at is not None


def claims_record(conn: Connection, naming: InboxSchema) -> ClaimsRecord:
    """What `switch_claims` recorded (nothing before it), and each table's rows."""
    tables = naming.tables
    layout = tables.layout
    row = conn.execute(
        select(layout.c.changed_at, layout.c.changed_by).where(
            layout.c.name == _NAME, layout.c.value == ClaimsTable.COMPACT.value
        )
    ).first()
    library = conn.scalar(select(func.count()).select_from(tables.inbox)) or 0
    compact = conn.scalar(select(func.count()).select_from(tables.claims)) or 0
    hours = len(partitions.hourly(conn, naming)) if conn.dialect.name == "postgresql" else 0
    return ClaimsRecord(
        None if row is None else row[0], None if row is None else row[1], library, compact, hours
    )


def switch_claims(conn: Connection, naming: InboxSchema, *, by: str) -> ClaimsRecord:
    """Record that every worker claims in the compact table (PostgreSQL); a second switch
    keeps the first one's record."""
    if conn.dialect.name != "postgresql":
        raise ConfigurationError(
            "the compact claim is for PostgreSQL; an embedded SQLite inbox claims in the "
            "library's table"
        )
    layout = naming.tables.layout
    conn.execute(
        postgresql.insert(layout)
        .values(name=_NAME, value=ClaimsTable.COMPACT.value, changed_at=func.now(), changed_by=by)
        .on_conflict_do_nothing()
    )
    return claims_record(conn, naming)


def check_claims(conn: Connection, naming: InboxSchema, configured: ClaimsTable) -> None:
    """Refuse a worker configured for the library's table once the switch is recorded:
    it would claim where the others no longer look."""
    if configured is not ClaimsTable.LIBRARY:
        return
    layout = naming.tables.layout
    switched = conn.scalar(
        select(layout.c.changed_at).where(
            layout.c.name == _NAME, layout.c.value == ClaimsTable.COMPACT.value
        )
    )
    if switched is not None:
        raise PrerequisiteError(
            f"this database's workers claim in the compact table since {switched:%Y-%m-%d} "
            "(inbox-middleware claims switch); a worker claiming in the "
            "library's table would not see their claims: create the inbox with "
            "claims='compact'"
        )
