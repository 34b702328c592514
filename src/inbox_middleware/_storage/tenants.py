"""Move a tenant's inbox rows to another database, with its business rows.

A fleet over many databases claims each delivery in its tenant's database. Moving a
tenant (docs/how-to/many-databases.md) moves its claims with its data, so that a
redelivery of a message applied before the move is a duplicate after it:

1. pause the tenant in the map (``paused``): its deliveries are handed back meanwhile;
2. in one transaction on the target: copy the business rows and `copy_tenant`;
3. point the tenant at the target in the map and unpause it;
4. delete the tenant's rows from the source (`delete_tenant`, with the business rows).

A delivery of the tenant may still be at work in the source when it is paused (routed
before the pause, its handler running). `copy_tenant` first takes the source's inbox
tables in SHARE mode, in the source's transaction: it waits for every transaction that
has written them, so a claim made before the pause is committed (and copied) or rolled
back before anything is read; and the routed inbox asks the map again once it has
claimed, and last in each bookkeeping write (`routed`), so a claim or a record made after
the pause is rolled back and its message handed back. Keep the source's transaction open
from the copy to `delete_tenant` (one ``with`` block): until it ends, every claim in the
source waits, every tenant's.

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
from .statements import share_lock
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
    commits. On PostgreSQL it first waits for the transactions in flight in ``source``'s
    inbox tables, whose writers then wait until ``source``'s transaction ends."""
    if compact_rows(source, naming or InboxSchema()):
        raise ConfigurationError(
            "this database keeps claims in the compact row (inbox_claims), which names no "
            "tenant: a tenant's claims cannot be told from the others', so they cannot be "
            "moved with it (a redelivery after the move would be processed again); move "
            "tenants of a fleet that claims in the library's table"
        )
    tables = _tables(naming)
    if source.dialect.name == "postgresql":  # no claim in flight from here on
        source.execute(share_lock(source.dialect, [table for _, table in tables]))
    copied: dict[str, int] = {}
    for name, table in tables:
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
