"""What the inbox tables hold, read: the statements behind ``status``, ``explain``, the
metrics endpoint's table gauges and the ``inbox_check`` counts.

Every read takes the caller's connection. Exact figures read few rows: the claims of a
recent window (the ``processed_at`` BRIN index finds the recent pages), the pending
quarantine, poison and outbox rows (partial indexes), the recorded retention policies. A
PostgreSQL table too big to count on demand (above `EXACT_BELOW_BYTES`) is estimated
from the catalog (``pg_class.reltuples``, ``pg_stats``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, DateTime, Table, Text, and_, func, select, text, type_coerce

from .._core import claims
from .._core.protocol import ReasonCode
from .tables import IDENTITY_KEY, TABLES, InboxSchema

if TYPE_CHECKING:
    from .._core.identity import MessageIdentity

__all__ = [
    "EXACT_BELOW_BYTES",
    "OutboxBacklog",
    "PendingRepairs",
    "TableSize",
    "aware",
    "claim_queries",
    "claim_totals",
    "compact_claim_row",
    "conflicts",
    "consumer_known",
    "consumer_pairs",
    "effects",
    "estimated_consumer_totals",
    "identity_row",
    "identity_rows",
    "limit_statements",
    "oldest_claim",
    "outbox_backlog",
    "pending_repairs",
    "recent_claims",
    "retention_windows",
    "table_sizes",
]

EXACT_BELOW_BYTES = 16 * 1024 * 1024
"""Tables whose heap is smaller than this are counted exactly; larger ones estimated."""

_HISTOGRAM_PROBES = 3  # histogram buckets probed for the oldest claim before giving up
_PAIR_LIMIT = 1000  # (consumer, producer) pairs listed at most


@dataclass(frozen=True, slots=True)
class TableSize:
    table: str
    """The table's name without prefix (one of `TABLES`)."""
    rows: int | None
    rows_estimated: bool
    bytes: int | None
    """Heap, indexes and TOAST (PostgreSQL); None on SQLite."""


@dataclass(frozen=True, slots=True)
class PendingRepairs:
    """One consumer's messages waiting for an operator, in one repair table."""

    kind: str
    """``quarantine`` or ``poison``."""
    consumer: str
    pending: int
    oldest_pending_at: datetime | None
    awaiting_recovery: int
    """Redriven or accepted, not yet processed successfully."""


@dataclass(frozen=True, slots=True)
class OutboxBacklog:
    destination: str
    pending: int
    failed: int
    oldest_pending_at: datetime | None


# -- status and the table gauges -----------------------------------------------------------


def _tables(naming: InboxSchema) -> dict[str, Table]:
    t = naming.tables
    return {
        "consumer_inbox": t.inbox,
        "inbox_quarantine": t.quarantine,
        "inbox_schema_version": t.version,
        "message_outbox": t.outbox,
        "inbox_attempts": t.attempts,
        "inbox_poison": t.poison,
        "inbox_retention": t.retention,
        "inbox_outputs": t.outputs,
        "inbox_counts": t.counts,
        "inbox_claims": t.claims,
        "inbox_layout": t.layout,
    }


def table_sizes(conn: Connection, naming: InboxSchema, *, exact: bool = False) -> list[TableSize]:
    """Rows and bytes of every library table: exact below `EXACT_BELOW_BYTES` (or with
    ``exact``), else PostgreSQL's own estimate (``reltuples``, kept by ANALYZE)."""
    tables = _tables(naming)
    catalog: dict[str, tuple[float, int, int]] = {}
    if conn.dialect.name == "postgresql":
        # A partitioned table (the compact claims') is the sum of its partitions.
        rows = conn.execute(
            text(
                "SELECT c.relname, CASE WHEN bool_and(l.reltuples < 0) THEN -1 "
                "ELSE sum(greatest(l.reltuples, 0)) END, "
                "sum(pg_total_relation_size(l.oid)), sum(pg_relation_size(l.oid)) "
                "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "CROSS JOIN LATERAL (SELECT relid FROM pg_partition_tree(c.oid) WHERE isleaf "
                "UNION ALL SELECT c.oid WHERE c.relkind = 'r') AS t(relid) "
                "JOIN pg_class l ON l.oid = t.relid "
                "WHERE n.nspname = coalesce(:schema, current_schema()) "
                "AND c.relname = ANY(:names) AND c.relkind IN ('r', 'p') "
                "GROUP BY c.relname"
            ),
            {"schema": naming.schema, "names": [naming.name(name) for name in TABLES]},
        )
        catalog = {row[0]: (float(row[1]), int(row[2]), int(row[3])) for row in rows}
    sizes = []
    for name in TABLES:
        found = catalog.get(naming.name(name))
        if found is not None and not exact and found[2] >= EXACT_BELOW_BYTES:
            reltuples = found[0]
            rows_known = int(reltuples) if reltuples >= 0 else None  # -1: never analyzed
            sizes.append(TableSize(name, rows_known, True, found[1]))
            continue
        count = conn.scalar(select(func.count()).select_from(tables[name]))
        sizes.append(TableSize(name, int(count or 0), False, found[1] if found else None))
    return sizes


def oldest_claim(
    conn: Connection, naming: InboxSchema, sizes: Iterable[TableSize]
) -> tuple[datetime | None, bool]:
    """When the oldest claim still kept was processed, and whether that is an estimate.

    A small inbox is read exactly. A big one is probed through ``pg_stats``' histogram of
    ``processed_at``: the oldest claim at or before the first bucket bound that has one is
    the oldest of all, and the BRIN index reads only the pages that may hold it.
    """
    inbox = naming.tables.inbox
    counted = next((s for s in sizes if s.table == "consumer_inbox"), None)
    if counted is None or not counted.rows_estimated or conn.dialect.name != "postgresql":
        return conn.scalar(select(func.min(inbox.c.processed_at))), False
    bounds: list[datetime] = (
        conn.scalar(
            text(
                "SELECT histogram_bounds::text::timestamptz[] FROM pg_stats "
                "WHERE schemaname = coalesce(:schema, current_schema()) "
                "AND tablename = :table AND attname = 'processed_at'"
            ),
            {"schema": naming.schema, "table": naming.name("consumer_inbox")},
        )
        or []
    )
    for bound in bounds[:_HISTOGRAM_PROBES]:
        found = conn.scalar(
            select(func.min(inbox.c.processed_at)).where(inbox.c.processed_at <= bound)
        )
        if found is not None:
            return found, False
    # The statistics are older than the purges since: report what they knew, as such.
    return (bounds[0] if bounds else None), True


def recent_claims(
    conn: Connection, naming: InboxSchema, since: datetime
) -> dict[tuple[str, str], tuple[int, datetime]]:
    """Claims processed since ``since``, by (consumer, producer): count and latest.
    Exact; the BRIN index on ``processed_at`` keeps it to the recent pages."""
    inbox = naming.tables.inbox
    rows = conn.execute(
        select(
            inbox.c.consumer_name,
            inbox.c.producer_name,
            func.count(),
            func.max(inbox.c.processed_at),
        )
        .where(inbox.c.processed_at >= since)
        .group_by(inbox.c.consumer_name, inbox.c.producer_name)
    )
    return {(row[0], row[1]): (int(row[2]), row[3]) for row in rows}


def consumer_pairs(conn: Connection, naming: InboxSchema) -> list[tuple[str, str]]:
    """Every (consumer, producer) pair with claims, at most 1000.

    On PostgreSQL a loose index scan: one primary-key probe per pair, whatever the size.
    """
    inbox = naming.tables.inbox
    if conn.dialect.name != "postgresql":
        rows = conn.execute(
            select(inbox.c.consumer_name, inbox.c.producer_name)
            .distinct()
            .order_by(inbox.c.consumer_name, inbox.c.producer_name)
            .limit(_PAIR_LIMIT)
        )
        return [(row[0], row[1]) for row in rows]
    name = conn.dialect.identifier_preparer.format_table(inbox)
    statement = (
        "WITH RECURSIVE pairs(c, p) AS ("
        f" (SELECT consumer_name, producer_name FROM {name}"
        "  ORDER BY consumer_name, producer_name LIMIT 1)"
        " UNION ALL"
        " SELECT nxt.consumer_name, nxt.producer_name FROM pairs, LATERAL ("
        f"  SELECT consumer_name, producer_name FROM {name}"
        "   WHERE (consumer_name, producer_name) > (pairs.c, pairs.p)"
        "   ORDER BY consumer_name, producer_name LIMIT 1) AS nxt"
        ") SELECT c, p FROM pairs LIMIT :limit"
    )
    return [(row[0], row[1]) for row in conn.execute(text(statement), {"limit": _PAIR_LIMIT})]


def claim_totals(conn: Connection, naming: InboxSchema) -> dict[tuple[str, str], int]:
    """Claims kept by (consumer, producer), counted exactly: for a small inbox, or asked."""
    inbox = naming.tables.inbox
    rows = conn.execute(
        select(inbox.c.consumer_name, inbox.c.producer_name, func.count()).group_by(
            inbox.c.consumer_name, inbox.c.producer_name
        )
    )
    return {(row[0], row[1]): int(row[2]) for row in rows}


def estimated_consumer_totals(
    conn: Connection, naming: InboxSchema, rows: int
) -> tuple[dict[str, int], int | None]:
    """Claims kept by consumer, estimated from ``pg_stats`` for a table of about ``rows``:
    the consumers among the column's most common values, and the share of any other."""
    found = conn.execute(
        text(
            "SELECT most_common_vals::text::text[], most_common_freqs, n_distinct "
            "FROM pg_stats WHERE schemaname = coalesce(:schema, current_schema()) "
            "AND tablename = :table AND attname = 'consumer_name'"
        ),
        {"schema": naming.schema, "table": naming.name("consumer_inbox")},
    ).first()
    if found is None:
        return {}, None
    values, freqs, distinct = found[0] or [], found[1] or [], float(found[2] or 0)
    estimates = {v: round(f * rows) for v, f in zip(values, freqs, strict=False)}
    # Consumers outside the most common values share the rest of the rows evenly.
    others = distinct if distinct > 0 else -distinct * rows
    rest = max(0.0, 1.0 - sum(freqs))
    share = round(rest * rows / (others - len(values))) if others > len(values) else None
    return estimates, share


def pending_repairs(conn: Connection, naming: InboxSchema) -> list[PendingRepairs]:
    """Quarantine and poison rows waiting for a decision, or for their repair to succeed,
    by consumer. Exact: these tables hold only the exceptions."""
    found: list[PendingRepairs] = []
    t = naming.tables
    for kind, table, first in (
        ("quarantine", t.quarantine, t.quarantine.c.first_seen_at),
        ("poison", t.poison, t.poison.c.first_failure_at),
    ):
        pending = table.c.decision == "pending"
        repaired = and_(
            table.c.decision.in_(("redriven", "accepted")), table.c.recovered_at.is_(None)
        )
        rows = conn.execute(
            select(
                table.c.consumer_name,
                func.count().filter(pending),
                func.min(first).filter(pending),
                func.count().filter(repaired),
            )
            .where(table.c.decision.in_(("pending", "redriven", "accepted")))
            .group_by(table.c.consumer_name)
        )
        found += [
            PendingRepairs(kind, row[0], int(row[1]), aware(row[2]), int(row[3])) for row in rows
        ]
    return found


def conflicts(conn: Connection, naming: InboxSchema) -> dict[tuple[str, str], tuple[int, int]]:
    """Identity conflicts recorded, by (consumer, producer): rows and deliveries."""
    q = naming.tables.quarantine
    rows = conn.execute(
        select(q.c.consumer_name, q.c.producer_name, func.count(), func.sum(q.c.attempts))
        .where(q.c.reason_code == ReasonCode.IDENTITY_CONFLICT.value)
        .group_by(q.c.consumer_name, q.c.producer_name)
    )
    return {(row[0], row[1]): (int(row[2]), int(row[3] or 0)) for row in rows}


def outbox_backlog(conn: Connection, naming: InboxSchema) -> list[OutboxBacklog]:
    """Pending and failed effects by destination (their partial indexes find them)."""
    o = naming.tables.outbox
    pending = o.c.status == "pending"
    rows = conn.execute(
        select(
            o.c.destination,
            func.count().filter(pending),
            func.count().filter(o.c.status == "failed"),
            func.min(o.c.created_at).filter(pending),
        )
        .where(o.c.status.in_(("pending", "failed")))
        .group_by(o.c.destination)
        .order_by(o.c.destination)
    )
    return [OutboxBacklog(row[0], int(row[1]), int(row[2]), aware(row[3])) for row in rows]


def retention_windows(conn: Connection, naming: InboxSchema) -> dict[str, tuple[int, str]]:
    """Recorded minimum windows: consumer (``*`` for the default) -> (seconds, dominant)."""
    r = naming.tables.retention
    rows = conn.execute(select(r.c.consumer_name, r.c.minimum_seconds, r.c.dominant_scenario))
    return {row[0]: (int(row[1]), row[2]) for row in rows}


def aware(value: datetime | None) -> datetime | None:
    """SQLite hands timestamps back without a zone; they were written in UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


# -- explain: one identity's rows ---------------------------------------------------------


def identity_row(
    conn: Connection, table: Table, key: tuple[str, str, str, str]
) -> dict[str, Any] | None:
    """The row of one identity (``key``: consumer, producer, tenant, message id), if any."""
    columns: list[Any] = list(table.c)
    times = {c.name for c in columns if isinstance(c.type, DateTime)}
    if conn.dialect.name == "sqlite":
        # Read SQLite's timestamps as text: a value that is not ISO text (older claims
        # stored received_at as a number) is shown as it is instead of failing the read.
        columns = [
            type_coerce(c, Text).label(c.name) if isinstance(c.type, DateTime) else c
            for c in columns
        ]
    row = conn.execute(select(*columns).where(*_where(table, key))).mappings().first()
    if row is None:
        return None
    return {k: _timestamp(v) if k in times else v for k, v in row.items()}


def _timestamp(value: Any) -> Any:
    """A timestamp as a datetime; anything else (see `identity_row`) as text."""
    if value is None or isinstance(value, datetime):
        return value
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return str(value)


def compact_claim_row(
    conn: Connection, naming: InboxSchema, key: tuple[str, str, str, str]
) -> dict[str, Any] | None:
    """The compact claim of one identity (`_core.claims`), found by its key computed from
    ``key``, shaped as the library's row: the hash's first 16 bytes, the scheme's name
    when this version knows it, nothing for what the compact row does not keep."""
    if conn.dialect.name != "postgresql":
        return None
    table = naming.tables.claims
    row = conn.execute(
        select(table.c.payload_digest, table.c.hash_scheme, table.c.processed_at).where(
            table.c.identity == claims.claim_key(*key).hex()
        )
    ).first()
    if row is None:
        return None
    tag = claims.scheme_tag(row[1])
    return {
        "payload_sha256": str(row[0]).replace("-", ""),
        "hash_scheme": claims.stored_scheme(tag, "") or tag,
        "handler_version": None,
        "produced_at": None,
        "received_at": None,
        "processed_at": row[2],
        "trace_id": None,
    }


def identity_rows(
    conn: Connection, table: Table, key: tuple[str, str, str, str], order: Any, *, payload: bool
) -> list[dict[str, Any]]:
    """The rows of one identity in ``order``; without their payload unless ``payload``."""
    columns = [c for c in table.c if payload or c.name != "payload"]
    query = select(*columns).where(*_where(table, key)).order_by(order)
    return [dict(row) for row in conn.execute(query).mappings()]


def _where(table: Table, key: tuple[str, str, str, str]) -> list[Any]:
    return [table.c[name] == value for name, value in zip(IDENTITY_KEY, key, strict=True)]


def effects(
    conn: Connection, naming: InboxSchema, ids: list[str], columns: Iterable[str]
) -> list[dict[str, Any]]:
    """The outbox rows of these effect ids, with these columns."""
    o = naming.tables.outbox
    query = select(*(o.c[name] for name in columns)).where(o.c.effect_id.in_(ids))
    return [dict(row) for row in conn.execute(query).mappings()]


def consumer_known(conn: Connection, naming: InboxSchema, consumer: str) -> bool:
    """Whether any inbox table has a row for ``consumer`` (one index probe per table)."""
    t = naming.tables
    for table in (t.inbox, t.attempts, t.quarantine, t.poison):
        found = conn.execute(
            select(table.c.consumer_name).where(table.c.consumer_name == consumer).limit(1)
        ).first()
        if found is not None:
            return True
    return False


# -- the metrics endpoint and inbox_check ---------------------------------------------------


def limit_statements(conn: Connection, seconds: float) -> None:
    """Bound each statement of ``conn``'s transaction to ``seconds`` (PostgreSQL only)."""
    if conn.dialect.name == "postgresql":
        milliseconds = max(1, round(seconds * 1000))
        conn.execute(text(f"SET LOCAL statement_timeout = {milliseconds}"))


def claim_queries(
    naming: InboxSchema, identity: MessageIdentity, consumer: str | None
) -> tuple[Any, Any, Any]:
    """Counts of an intent's rows: its claims, its quarantine deliveries, its poison rows."""
    tables = naming.tables
    queries = []
    for table in (tables.inbox, tables.quarantine, tables.poison):
        where = [
            table.c.producer_name == identity.producer,
            table.c.tenant == identity.tenant,
            table.c.message_id == identity.message_id,
        ]
        if consumer is not None:
            where.append(table.c.consumer_name == consumer)
        if table is tables.quarantine:
            queries.append(select(func.coalesce(func.sum(table.c.attempts), 0)).where(*where))
        else:
            queries.append(select(func.count()).select_from(table).where(*where))
    return queries[0], queries[1], queries[2]
