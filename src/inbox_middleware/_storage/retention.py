"""The retention statements: the recorded policies, and the purge of old claims.

``retention`` decides (the minimum window, the refusal of a shorter one) and drives the
purge batch by batch; these build and run the SQL, on the caller's connection. A purge
batch deletes at most ``limit`` claims older than ``seconds``, skipping rows locked by a
concurrent purge, then the failure counts older than that go.

On PostgreSQL the purge walks the heap by block ranges: each batch reads only the blocks
``low`` to ``high - 1`` (``ctid >= '(low,0)' AND ctid < '(high,0)'``, a TID range scan,
PostgreSQL 14 and later; before that, the ``ctid = ANY`` of every line pointer those
blocks can hold, a TID scan). The cost of a batch is therefore its range's, whatever the
planner, the table's size or synchronized scans do: a batch taken by a sequential scan
with ``LIMIT`` is fast only while PostgreSQL resumes each scan where the last one stopped,
reads again the rows the batches before it left behind otherwise, and its last batch reads
the rest of the table. The count walks the same ranges, without parallel workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, NamedTuple

from sqlalchemy import (
    Connection,
    Float,
    Integer,
    Row,
    Text,
    and_,
    bindparam,
    delete,
    func,
    literal_column,
    or_,
    select,
    text,
    tuple_,
)
from sqlalchemy.dialects import postgresql, sqlite

from .tables import IDENTITY_KEY, InboxSchema

__all__ = [
    "TID_RANGE_SCAN",
    "OutputPurge",
    "PurgeStatements",
    "all_policy_rows",
    "compact_rows",
    "consumers_with_rows",
    "output_purge",
    "policy_rows",
    "purge_statements",
    "write_policy",
]


TID_RANGE_SCAN = (14,)
"""The first PostgreSQL version with TID range scans."""
TUPLES_PER_BLOCK = 291
"""MaxHeapTuplesPerPage for 8 kB blocks: the line pointers one heap block can hold."""


class PurgeStatements(NamedTuple):
    batch: Any
    """Deletes one batch of old claims (parameters ``seconds``, ``consumer``, ``limit``;
    on PostgreSQL also ``low`` and ``high``, the block range)."""
    failures: Any
    """Deletes the failure counts older than the window."""
    count: Any
    """Counts the claims a purge would delete now (PostgreSQL: in blocks ``low`` to
    ``high - 1``)."""
    outputs: Any
    """Deletes the stored outputs older than the window whose claim is gone from the
    library's table (each is as old as its claim; see `output_purge` for the compact
    table's)."""
    extent: Any
    """PostgreSQL: the inbox's blocks now and its live rows per block (from its statistics;
    NULL before the first ANALYZE). None on SQLite."""


def write_policy(
    conn: Connection,
    naming: InboxSchema,
    *,
    consumer: str,
    scenarios: Mapping[str, Any],
    minimum_seconds: int,
    dominant_scenario: str,
    updated_by: str,
) -> None:
    """Insert or replace the policy recorded for ``consumer``."""
    table = naming.tables.retention
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    values = {
        "consumer_name": consumer,
        "scenarios": scenarios,
        "minimum_seconds": minimum_seconds,
        "dominant_scenario": dominant_scenario,
        "updated_at": func.now(),
        "updated_by": updated_by,
    }
    statement = insert(table).values(**values)
    conn.execute(
        statement.on_conflict_do_update(
            index_elements=["consumer_name"],
            set_={k: getattr(statement.excluded, k) for k in values if k != "consumer_name"},
        )
    )


def policy_rows(
    conn: Connection, naming: InboxSchema, consumers: Sequence[str]
) -> dict[str, Row[Any]]:
    """The policies recorded for these consumers, by consumer name."""
    table = naming.tables.retention
    query = select(table).where(table.c.consumer_name.in_(list(consumers)))
    return {row.consumer_name: row for row in conn.execute(query)}


def all_policy_rows(conn: Connection, naming: InboxSchema) -> dict[str, Row[Any]]:
    """Every recorded policy, by consumer name (``*``: the default)."""
    return {row.consumer_name: row for row in conn.execute(select(naming.tables.retention))}


def consumers_with_rows(conn: Connection, naming: InboxSchema) -> list[str]:
    """Every consumer with rows a purge deletes (claims, failure counts, stored outputs),
    in name order. On PostgreSQL a loose index scan of each table's primary key, which
    starts with the consumer's name: one probe per consumer, whatever the size."""
    tables = naming.tables
    names: set[str] = set()
    for table in (tables.inbox, tables.attempts, tables.outputs):
        if conn.dialect.name != "postgresql":
            names.update(conn.execute(select(table.c.consumer_name).distinct()).scalars())
            continue
        name = conn.dialect.identifier_preparer.format_table(table)
        statement = (
            "WITH RECURSIVE names(c) AS ("
            f" (SELECT consumer_name FROM {name} ORDER BY consumer_name LIMIT 1)"
            " UNION ALL"
            f" SELECT (SELECT consumer_name FROM {name} WHERE consumer_name > names.c"
            "  ORDER BY consumer_name LIMIT 1) FROM names WHERE names.c IS NOT NULL"
            ") SELECT c FROM names WHERE c IS NOT NULL"
        )
        names.update(conn.execute(text(statement)).scalars())
    return sorted(names)


def compact_rows(conn: Connection, naming: InboxSchema) -> bool:
    """Whether the compact claims table has a row (PostgreSQL; SQLite claims in the
    library's table only)."""
    if conn.dialect.name != "postgresql":
        return False
    claims = naming.tables.claims
    return conn.scalar(select(select(claims.c.identity).limit(1).exists())) is True


@cache
def purge_statements(
    naming: InboxSchema, dialect: str, *, tid_range_scan: bool = True, compact: int | None = None
) -> PurgeStatements:
    """The purge's statements for one naming and dialect, built once; ``tid_range_scan``
    False: for a PostgreSQL before 14, which has none. ``compact``: the batches, count and
    extent are those of that lasting partition of the compact claims table
    (``tables.claims_partitions``, PostgreSQL), whose rows name no consumer: every
    consumer's claims older than the window go."""
    inbox, attempts, outputs = naming.tables.inbox, naming.tables.attempts, naming.tables.outputs
    cutoff = _cutoff()
    if dialect == "sqlite":
        cutoff = func.datetime("now", func.printf("-%f seconds", bindparam("seconds")))
    consumer = bindparam("consumer", type_=Text)
    old = and_(
        inbox.c.processed_at < cutoff,
        or_(consumer.is_(None), inbox.c.consumer_name == consumer),
    )
    if compact is not None:
        inbox = naming.tables.claims_partitions[compact]
        old = inbox.c.processed_at < cutoff
    limit = bindparam("limit", type_=Integer)
    extent: Any = None
    if dialect == "postgresql":
        ctid: Any = literal_column("ctid")
        blocks = _block_range(tid_range_scan)
        doomed = select(ctid).select_from(inbox).where(blocks, old).limit(limit)
        doomed = doomed.with_for_update(skip_locked=True)
        batch = delete(inbox).where(ctid == func.any(func.array(doomed.scalar_subquery())))
        count: Any = select(func.count()).select_from(inbox).where(blocks, old)
        extent = _extent(inbox)
    else:
        key = tuple_(
            inbox.c.consumer_name, inbox.c.producer_name, inbox.c.tenant, inbox.c.message_id
        )
        doomed = select(*key.clauses).where(old).limit(limit)
        batch = delete(inbox).where(key.in_(doomed))
        count = select(func.count()).select_from(inbox).where(old)
    failures = delete(attempts).where(
        attempts.c.last_failure_at < cutoff,
        or_(consumer.is_(None), attempts.c.consumer_name == consumer),
    )
    stored = delete(outputs).where(*_stale_output(naming, cutoff, consumer))
    return PurgeStatements(batch, failures, count, stored, extent)


def _cutoff() -> Any:
    """PostgreSQL's now, less the window (parameter ``seconds``)."""
    return func.now() - func.make_interval(0, 0, 0, 0, 0, 0, bindparam("seconds", type_=Float))


def _stale_output(naming: InboxSchema, cutoff: Any, consumer: Any) -> tuple[Any, ...]:
    """A stored output older than the window (``cutoff``) of ``consumer`` (None: any)
    whose claim is no longer in the library's table. An output lives as long as its
    claim: a duplicate of a live claim sends it again, and one purged first would leave
    that duplicate nothing to send, acked all the same."""
    inbox, outputs = naming.tables.inbox, naming.tables.outputs
    claimed = select(inbox.c.consumer_name).where(
        *(inbox.c[name] == outputs.c[name] for name in IDENTITY_KEY)
    )
    return (
        outputs.c.created_at < cutoff,
        or_(consumer.is_(None), outputs.c.consumer_name == consumer),
        ~claimed.exists(),
    )


class OutputPurge(NamedTuple):
    """The stored outputs' purge where compact claims exist (PostgreSQL): a compact row
    keeps a digest of its identity, not the identity, so whether an output's claim lives
    there is asked by its key (`claims.claim_key`, computed by the caller), a page of
    outputs at a time."""

    page: Any
    """The next ``limit`` stale outputs (`_stale_output`) after the identity ``after_*``
    (``after_consumer_name`` and so on), in key order, locked: their identities."""
    live: Any
    """Of the compact keys ``keys``, those a compact claim holds."""
    gone: Any
    """Deletes the stored outputs of the identities ``keys``, still stale."""


@cache
def output_purge(naming: InboxSchema) -> OutputPurge:
    """The statements of `OutputPurge` for one naming, built once (PostgreSQL)."""
    outputs, claims = naming.tables.outputs, naming.tables.claims
    stale = _stale_output(naming, _cutoff(), bindparam("consumer", type_=Text))
    key = tuple_(*(outputs.c[name] for name in IDENTITY_KEY))
    after = tuple_(*(bindparam(f"after_{name}", type_=Text) for name in IDENTITY_KEY))
    page = (
        select(*key.clauses)
        .where(*stale, key > after)
        .order_by(*key.clauses)
        .limit(bindparam("limit", type_=Integer))
        .with_for_update(skip_locked=True)
    )
    live = select(claims.c.identity).where(claims.c.identity.in_(bindparam("keys", expanding=True)))
    gone = delete(outputs).where(*stale, key.in_(bindparam("keys", expanding=True)))
    return OutputPurge(page, live, gone)


def _block_range(tid_range_scan: bool) -> Any:
    """``low <= block < high``: a TID range scan's condition, or (before PostgreSQL 14)
    the list of every tuple identifier in those blocks, which a TID scan fetches."""
    if tid_range_scan:
        return text(
            "ctid >= format('(%s,0)', CAST(:low AS bigint))::tid "
            "AND ctid < format('(%s,0)', CAST(:high AS bigint))::tid"
        )
    return text(
        "ctid = ANY (ARRAY(SELECT format('(%s,%s)', block, line)::tid "
        "FROM generate_series(CAST(:low AS bigint), CAST(:high AS bigint) - 1) AS block, "
        f"generate_series(1, {TUPLES_PER_BLOCK}) AS line))"
    )


def _extent(inbox: Any) -> Any:
    # validated identifiers (InboxSchema): quoting them is enough, and keeps their case
    name = f'"{inbox.schema}"."{inbox.name}"' if inbox.schema else f'"{inbox.name}"'
    return text(
        "SELECT pg_relation_size(c.oid) / current_setting('block_size')::bigint, "
        "CASE WHEN c.relpages > 0 AND c.reltuples > 0 THEN c.reltuples / c.relpages END "
        "FROM pg_class c WHERE c.oid = CAST(:table AS regclass)"
    ).bindparams(table=name)
