"""Move a tenant's inbox rows to another database, with its business rows.

A fleet over many databases claims each delivery in its tenant's database. Moving a
tenant (docs/how-to/many-databases.md) moves its claims with its data, so that a
redelivery of a message applied before the move is a duplicate after it:

1. pause the tenant in the map (``paused``): its deliveries are handed back meanwhile;
2. in one transaction on the target: copy the business rows and `copy_tenant`;
3. point the tenant at the target in the map and unpause it;
4. delete the tenant's rows from the source (`delete_tenant`, with the business rows).

The rows moved are the tenant's claims (``consumer_inbox``), their stored outputs, the
attempt counters, and the quarantine and poison rows; quarantine and poison rows get new
ids on the target (decide pending ones first: a repair marker names the old id). The
outbox has no tenant column: let the source's dispatcher deliver the tenant's pending
effects before the move.
"""

from __future__ import annotations

from sqlalchemy import Connection, Table, delete, insert, select

from .._core.exceptions import ConfigurationError
from .retention import compact_rows
from .tables import InboxSchema

__all__ = ["TENANT_TABLES", "copy_tenant", "delete_tenant"]

TENANT_TABLES = ("inbox", "outputs", "attempts", "quarantine", "poison")
"""The inbox tables with a tenant column, in the order they are copied."""

_NEW_IDS = ("quarantine", "poison")  # serial ids: the target numbers them anew


def _tables(naming: InboxSchema | None) -> list[tuple[str, Table]]:
    tables = (naming or InboxSchema()).tables
    return [(name, getattr(tables, name)) for name in TENANT_TABLES]


def copy_tenant(
    source: Connection, target: Connection, tenant: str, naming: InboxSchema | None = None
) -> dict[str, int]:
    """Copy ``tenant``'s inbox rows from ``source`` into ``target``, in ``target``'s open
    transaction (commit it with the business rows); answer the rows copied per table. A
    row the target has already (the same key) makes the copy fail: nothing half-copied
    commits."""
    if compact_rows(source, naming or InboxSchema()):
        raise ConfigurationError(
            "this database keeps claims in the compact row (inbox_claims), which names no "
            "tenant: a tenant's claims cannot be told from the others', so they cannot be "
            "moved with it (a redelivery after the move would be processed again); move "
            "tenants of a fleet that claims in the library's table"
        )
    copied: dict[str, int] = {}
    for name, table in _tables(naming):
        rows = [
            {k: v for k, v in row.items() if not (name in _NEW_IDS and k == "id")}
            for row in source.execute(select(table).where(table.c.tenant == tenant)).mappings()
        ]
        if rows:
            target.execute(insert(table), rows)
        copied[name] = len(rows)
    return copied


def delete_tenant(
    conn: Connection, tenant: str, naming: InboxSchema | None = None
) -> dict[str, int]:
    """Delete ``tenant``'s inbox rows from the database it left (in ``conn``'s
    transaction); answer the rows deleted per table."""
    deleted: dict[str, int] = {}
    for name, table in reversed(_tables(naming)):
        deleted[name] = conn.execute(delete(table).where(table.c.tenant == tenant)).rowcount
    return deleted
