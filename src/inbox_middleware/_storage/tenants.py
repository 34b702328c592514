"""Move a tenant's inbox rows to another database, with its business rows.

A fleet over many databases claims each delivery in its tenant's database. Moving a
tenant (docs/how-to/many-databases.md) moves its claims with its data, so that a
redelivery of a message applied before the move is a duplicate after it:

1. pause the tenant in the map (``paused``): its deliveries are handed back meanwhile;
2. in one transaction on the target: copy the business rows and `copy_tenant`;
3. point the tenant at the target in the map and unpause it;
4. delete the tenant's rows from the source (`delete_tenant`, with the business rows).

A delivery of the tenant may still be at work in the source when it is paused (routed
before the pause, its handler running). `copy_tenant` first waits, without taking a lock,
for every transaction that holds a write lock on the source's inbox tables at that moment
(`wait_for_writers`), so a claim made before the pause is committed (and copied) or rolled
back before anything is read; and the routed inbox asks the map again once it has
claimed, and last in each bookkeeping write (`routed`), so a claim or a record made after
the pause is rolled back and its message handed back. The other tenants of the source
claim all along.

The rows moved are the tenant's claims (``consumer_inbox``), their stored outputs, the
attempt counters, and the quarantine and poison rows; quarantine and poison rows get new
ids on the target (decide pending ones first: a repair marker names the old id). The
outbox has no tenant column: let the source's dispatcher deliver the tenant's pending
effects before the move.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from sqlalchemy import Connection, Table, delete, insert, select

from .._core.exceptions import ConfigurationError, TransientError
from .retention import compact_rows
from .statements import LOCK_TIMEOUT_SECONDS, STILL_RUNNING, writers_in_flight
from .tables import InboxSchema

__all__ = ["TENANT_TABLES", "copy_tenant", "delete_tenant", "wait_for_writers"]

TENANT_TABLES = ("inbox", "outputs", "attempts", "quarantine", "poison")
"""The inbox tables with a tenant column, in the order they are copied."""

_NEW_IDS = ("quarantine", "poison")  # serial ids: the target numbers them anew


def _tables(naming: InboxSchema | None) -> list[tuple[str, Table]]:
    tables = (naming or InboxSchema()).tables
    return [(name, getattr(tables, name)) for name in TENANT_TABLES]


_POLL = 0.02  # seconds between two looks at the transactions still in flight


def wait_for_writers(conn: Connection, tables: Sequence[Table]) -> None:
    """Return once every transaction that held a write lock on one of ``tables`` when
    called (PostgreSQL; ``conn``'s own excepted) has ended, committed or rolled back.

    Unlike ``LOCK TABLE ... IN SHARE MODE``, which waits for the same transactions, it
    takes no lock: while it waits, new writers are not queued behind it, so the other
    tenants of a database claim on while one tenant's move waits for its longest
    handler. A transaction that begins writing after the call is not waited for: the
    caller must have made sure, before calling, that such a transaction cannot commit
    anything it cares about (a paused tenant's claim is rolled back by its route).

    Bounded as the lock would be: by the session's ``lock_timeout`` when it has one (a
    `TransientError` then; nothing was read)."""
    running = list(conn.execute(writers_in_flight(conn.dialect, tables)).scalars())
    limit = float(conn.scalar(LOCK_TIMEOUT_SECONDS) or 0)
    deadline = time.monotonic() + limit
    while running:
        if limit and time.monotonic() >= deadline:
            raise TransientError(
                f"waited lock_timeout ({limit:g} s) for {len(running)} transaction(s) in "
                "flight in the inbox tables to end: nothing was copied; move again later"
            )
        time.sleep(_POLL)
        rows = conn.execute(STILL_RUNNING, {"transactions": running}).all()
        if any(waits_for_us for _, waits_for_us in rows):
            raise ConfigurationError(
                "a transaction in flight in the inbox tables waits for a lock this "
                "transaction holds, and the move waits for it to end: call copy_tenant "
                "first in the source's transaction, before writing the tenant's rows"
            )
        running = [transaction for transaction, _ in rows]


def copy_tenant(
    source: Connection, target: Connection, tenant: str, naming: InboxSchema | None = None
) -> dict[str, int]:
    """Copy ``tenant``'s inbox rows from ``source`` into ``target``, in ``target``'s open
    transaction (commit it with the business rows); answer the rows copied per table. A
    row the target has already (the same key) makes the copy fail: nothing half-copied
    commits. On PostgreSQL it first waits for the transactions in flight in ``source``'s
    inbox tables (`wait_for_writers`); no other tenant's claims wait for it."""
    if compact_rows(source, naming or InboxSchema()):
        raise ConfigurationError(
            "this database keeps claims in the compact row (inbox_claims), which names no "
            "tenant: a tenant's claims cannot be told from the others', so they cannot be "
            "moved with it (a redelivery after the move would be processed again); move "
            "tenants of a fleet that claims in the library's table"
        )
    tables = _tables(naming)
    if source.dialect.name == "postgresql":  # no claim in flight from here on
        wait_for_writers(source, [table for _, table in tables])
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
