"""What the inbox holds, read cheaply enough to ask on every scrape or from a shell.

Every figure says whether it is exact or an estimate. Exact figures read few rows: the
claims of a recent window (the ``processed_at`` BRIN index finds the recent pages), the
pending quarantine, poison and outbox rows (partial indexes), the recorded retention
policies. The rest, on a PostgreSQL table too big to count on demand (above
`EXACT_BELOW_BYTES`), comes from the catalog: row counts from ``pg_class.reltuples``,
per-consumer totals from ``pg_stats``' most common values; the oldest claim is found
through ``pg_stats``' histogram of ``processed_at`` (the first bucket that holds a row,
read through the BRIN index). Duplicates are never written to the database, so their
counts come from the metrics endpoint when one is given.

`snapshot` gathers everything ``inbox-middleware status`` shows, as JSON-ready data in
the shape of `SCHEMA`; `table_gauges` the subset the metrics endpoint exports.
"""

from __future__ import annotations

import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Table, and_, func, select, text

from .storage.tables import ALL_CONSUMERS, TABLES, InboxSchema

__all__ = [
    "EXACT_BELOW_BYTES",
    "FORMAT",
    "SCHEMA",
    "OutboxBacklog",
    "PendingRepairs",
    "TableGauges",
    "TableSize",
    "read_metrics",
    "snapshot",
    "table_gauges",
]

FORMAT = "inbox-middleware.status/1"

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


@dataclass(frozen=True, slots=True)
class TableGauges:
    """What the metrics endpoint exports from the tables (`table_gauges`)."""

    tables: list[TableSize]
    oldest_claim_at: datetime | None
    oldest_claim_estimated: bool
    repairs: list[PendingRepairs]
    outbox: list[OutboxBacklog]
    retention: dict[str, int]
    """Minimum window in seconds by consumer (``*``: the default), as recorded."""
    read_at: datetime = field(default_factory=lambda: datetime.now(UTC))


# -- the queries ---------------------------------------------------------------------------


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
    }


def table_sizes(conn: Connection, naming: InboxSchema, *, exact: bool = False) -> list[TableSize]:
    """Rows and bytes of every library table: exact below `EXACT_BELOW_BYTES` (or with
    ``exact``), else PostgreSQL's own estimate (``reltuples``, kept by ANALYZE)."""
    tables = _tables(naming)
    catalog: dict[str, tuple[float, int, int]] = {}
    if conn.dialect.name == "postgresql":
        rows = conn.execute(
            text(
                "SELECT c.relname, c.reltuples, pg_total_relation_size(c.oid), "
                "pg_relation_size(c.oid) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = coalesce(:schema, current_schema()) "
                "AND c.relname = ANY(:names) AND c.relkind IN ('r', 'p')"
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
            PendingRepairs(kind, row[0], int(row[1]), _aware(row[2]), int(row[3])) for row in rows
        ]
    return found


def conflicts(conn: Connection, naming: InboxSchema) -> dict[tuple[str, str], tuple[int, int]]:
    """Identity conflicts recorded, by (consumer, producer): rows and deliveries."""
    q = naming.tables.quarantine
    rows = conn.execute(
        select(q.c.consumer_name, q.c.producer_name, func.count(), func.sum(q.c.attempts))
        .where(q.c.reason_code == "identity_conflict")
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
    return [OutboxBacklog(row[0], int(row[1]), int(row[2]), _aware(row[3])) for row in rows]


def retention_windows(conn: Connection, naming: InboxSchema) -> dict[str, tuple[int, str]]:
    """Recorded minimum windows: consumer (``*`` for the default) -> (seconds, dominant)."""
    r = naming.tables.retention
    rows = conn.execute(select(r.c.consumer_name, r.c.minimum_seconds, r.c.dominant_scenario))
    return {row[0]: (int(row[1]), row[2]) for row in rows}


def table_gauges(conn: Connection, naming: InboxSchema) -> TableGauges:
    """The figures the metrics endpoint exports; cheap on any size of inbox."""
    sizes = table_sizes(conn, naming)
    oldest, estimated = oldest_claim(conn, naming, sizes)
    return TableGauges(
        tables=sizes,
        oldest_claim_at=_aware(oldest),
        oldest_claim_estimated=estimated,
        repairs=pending_repairs(conn, naming),
        outbox=outbox_backlog(conn, naming),
        retention={k: v[0] for k, v in retention_windows(conn, naming).items()},
    )


# -- metrics read back ---------------------------------------------------------------------


def read_metrics(url: str, timeout: float = 5.0) -> dict[str, dict[tuple[str, ...], float]]:
    """The inbox counters a metrics endpoint serves, by metric and label values.

    Keys: ``messages`` (consumer, producer, decision), ``shadow`` (the same), and
    ``missing_identity`` (consumer).
    """
    from prometheus_client.parser import text_string_to_metric_families

    if not url.startswith(("http://", "https://")):
        raise ValueError(f"the metrics URL must be http(s): {url!r}")
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body = response.read().decode("utf-8")
    found: dict[str, dict[tuple[str, ...], float]] = defaultdict(lambda: defaultdict(float))
    wanted = {
        "inbox_messages_total": ("messages", ("consumer", "producer", "decision")),
        "inbox_shadow_would_skip_total": ("shadow", ("consumer", "producer", "decision")),
        "inbox_missing_identity_total": ("missing_identity", ("consumer",)),
    }
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name in wanted:
                key, labels = wanted[sample.name]
                values = tuple(sample.labels.get(label, "") for label in labels)
                found[key][values] += sample.value
    return {key: dict(value) for key, value in found.items()}


# -- the snapshot --------------------------------------------------------------------------


def snapshot(
    conn: Connection,
    naming: InboxSchema,
    *,
    window: timedelta = timedelta(hours=1),
    exact: bool = False,
    consumer: str | None = None,
    counters: Mapping[str, Mapping[tuple[str, ...], float]] | None = None,
    metrics_source: str | None = None,
    metrics_error: str | None = None,
) -> dict[str, Any]:
    """Everything ``inbox-middleware status`` shows, JSON-ready (see `SCHEMA`).

    ``counters``: what `read_metrics` returned, for the figures only the metrics have
    (duplicates, shadow-mode counts, messages without identity); None: shown as null.
    ``exact`` counts every claim (a scan of the whole inbox) instead of estimating.
    """
    now = datetime.now(UTC)
    sizes = table_sizes(conn, naming, exact=exact)
    inbox_size = next(s for s in sizes if s.table == "consumer_inbox")
    oldest, oldest_estimated = oldest_claim(conn, naming, sizes)
    oldest = _aware(oldest)
    facts = _Facts(
        now=now,
        seconds=window.total_seconds(),
        # ``exact`` made every size exact: an estimated inbox size means a big table.
        estimated=inbox_size.rows_estimated,
        recent=recent_claims(conn, naming, now - window),
        conflicts=conflicts(conn, naming),
        repairs=pending_repairs(conn, naming),
        retention=retention_windows(conn, naming),
        counters=counters,
    )
    if facts.estimated:
        facts.consumer_totals, facts.share = estimated_consumer_totals(
            conn, naming, inbox_size.rows or 0
        )
    else:
        facts.totals = claim_totals(conn, naming)
        for (name, _), count in facts.totals.items():
            facts.consumer_totals[name] = facts.consumer_totals.get(name, 0) + count
    pairs = set(consumer_pairs(conn, naming)) | set(facts.recent) | set(facts.conflicts)
    names = {c for c, _ in pairs} | {r.consumer for r in facts.repairs}
    names |= {name for name in facts.retention if name != ALL_CONSUMERS}
    if counters:
        pairs |= {(k[0], k[1]) for k in counters.get("messages", {})}
        names |= {k[0] for k in counters.get("messages", {})}
        names |= {k[0] for k in counters.get("missing_identity", {})}
    if consumer is not None:
        names &= {consumer}
    outbox = outbox_backlog(conn, naming)
    return {
        "format": FORMAT,
        "generated_at": _iso(now),
        "window_seconds": facts.seconds,
        "exact": not facts.estimated,
        "tables": [
            {"table": s.table, "rows": s.rows, "rows_estimated": s.rows_estimated, "bytes": s.bytes}
            for s in sizes
        ],
        "inbox": {
            "rows": inbox_size.rows,
            "rows_estimated": inbox_size.rows_estimated,
            "oldest_claim_at": _iso(oldest),
            "oldest_claim_age_seconds": _age(now, oldest),
            "oldest_claim_estimated": oldest_estimated,
        },
        "consumers": [
            facts.consumer(name, sorted(p for c, p in pairs if c == name)) for name in sorted(names)
        ],
        "outbox": _outbox(now, outbox),
        "oldest_unprocessed": _oldest_unprocessed(now, facts.repairs, outbox),
        "metrics": {"source": metrics_source, "error": metrics_error},
    }


@dataclass
class _Facts:
    """What `snapshot` read, and how it becomes each consumer's entry."""

    now: datetime
    seconds: float
    estimated: bool
    recent: dict[tuple[str, str], tuple[int, datetime]]
    conflicts: dict[tuple[str, str], tuple[int, int]]
    repairs: list[PendingRepairs]
    retention: dict[str, tuple[int, str]]
    counters: Mapping[str, Mapping[tuple[str, ...], float]] | None
    totals: dict[tuple[str, str], int] = field(default_factory=dict)
    consumer_totals: dict[str, int] = field(default_factory=dict)
    share: int | None = None

    def metric(self, key: str, *labels: str) -> int | None:
        if self.counters is None:
            return None
        return round(self.counters.get(key, {}).get(labels, 0.0))

    def rate(self, count: int) -> float:
        return count / self.seconds if self.seconds else 0.0

    def producer(self, consumer: str, producer: str) -> dict[str, Any]:
        count, last = self.recent.get((consumer, producer), (0, None))
        rows, deliveries = self.conflicts.get((consumer, producer), (0, 0))
        shadow = [self.metric("shadow", consumer, producer, d) for d in ("duplicate", "conflict")]
        return {
            "producer": producer,
            "claims": None if self.estimated else self.totals.get((consumer, producer), 0),
            "claims_estimated": self.estimated,
            "recent_claims": count,
            "claims_per_second": self.rate(count),
            "last_processed_at": _iso(last),
            "conflicts": rows,
            "conflicting_deliveries": deliveries,
            "first_seen": self.metric("messages", consumer, producer, "first"),
            "duplicates": self.metric("messages", consumer, producer, "duplicate"),
            "shadow_processed": None if self.counters is None else sum(n or 0 for n in shadow),
        }

    def consumer(self, name: str, producer_names: list[str]) -> dict[str, Any]:
        producers = [self.producer(name, producer) for producer in producer_names]
        mine = {r.kind: r for r in self.repairs if r.consumer == name}
        quarantine, poison = mine.get("quarantine"), mine.get("poison")
        waiting = [r.oldest_pending_at for r in mine.values() if r.pending and r.oldest_pending_at]
        recent = sum(p["recent_claims"] for p in producers)
        latest = [p["last_processed_at"] for p in producers if p["last_processed_at"]]
        default = self.share if self.estimated else 0
        return {
            "consumer": name,
            "claims": self.consumer_totals.get(name, default),
            "claims_estimated": self.estimated,
            "recent_claims": recent,
            "claims_per_second": self.rate(recent),
            "last_processed_at": max(latest, default=None),
            "duplicates": (
                None if self.counters is None else sum(p["duplicates"] or 0 for p in producers)
            ),
            "conflicts": sum(p["conflicts"] for p in producers),
            "missing_identity": self.metric("missing_identity", name),
            "quarantine_pending": quarantine.pending if quarantine else 0,
            "oldest_quarantine_pending_at": _iso(
                quarantine.oldest_pending_at if quarantine else None
            ),
            "poison_pending": poison.pending if poison else 0,
            "oldest_poison_pending_at": _iso(poison.oldest_pending_at if poison else None),
            "awaiting_recovery": sum(r.awaiting_recovery for r in mine.values()),
            "oldest_unprocessed_at": _iso(min(waiting, default=None)),
            "retention": self.horizon(name),
            "producers": producers,
        }

    def horizon(self, name: str) -> dict[str, Any] | None:
        recorded_for = name if name in self.retention else ALL_CONSUMERS
        found = self.retention.get(recorded_for)
        if found is None:
            return None
        return {
            "recorded_for": recorded_for,
            "minimum_seconds": found[0],
            "dominant_scenario": found[1],
            "horizon": _iso(self.now - timedelta(seconds=found[0])),
        }


def _outbox(now: datetime, outbox: list[OutboxBacklog]) -> dict[str, Any]:
    oldest = min((b.oldest_pending_at for b in outbox if b.oldest_pending_at), default=None)
    return {
        "pending": sum(b.pending for b in outbox),
        "failed": sum(b.failed for b in outbox),
        "oldest_pending_at": _iso(oldest),
        "oldest_pending_age_seconds": _age(now, oldest),
        "destinations": [
            {
                "destination": b.destination,
                "pending": b.pending,
                "failed": b.failed,
                "oldest_pending_at": _iso(b.oldest_pending_at),
            }
            for b in outbox
        ],
    }


def _oldest_unprocessed(
    now: datetime, repairs: list[PendingRepairs], outbox: list[OutboxBacklog]
) -> dict[str, Any] | None:
    """The message waiting longest: a pending quarantine or poison row, or outbox effect."""
    waiting: list[tuple[datetime, str, str | None]] = [
        (r.oldest_pending_at, r.kind, r.consumer)
        for r in repairs
        if r.pending and r.oldest_pending_at is not None
    ]
    waiting += [(b.oldest_pending_at, "outbox", None) for b in outbox if b.oldest_pending_at]
    if not waiting:
        return None
    at, kind, consumer = min(waiting, key=lambda item: item[0])
    return {"kind": kind, "consumer": consumer, "at": _iso(at), "age_seconds": _age(now, at)}


def _aware(value: datetime | None) -> datetime | None:
    """SQLite hands timestamps back without a zone; they were written in UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


def _iso(value: datetime | None) -> str | None:
    value = _aware(value)
    return None if value is None else value.isoformat()


def _age(now: datetime, then: datetime | None) -> float | None:
    then = _aware(then)
    if then is None:
        return None
    return max(0.0, (now - then).total_seconds())


# -- the JSON schema of `snapshot` -----------------------------------------------------------

_TIME = {"type": ["string", "null"], "format": "date-time"}
_COUNT = {"type": "integer", "minimum": 0}
_MAYBE_COUNT = {"type": ["integer", "null"], "minimum": 0}
_RATE = {"type": "number", "minimum": 0}


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": sorted(properties),
        "additionalProperties": False,
    }


SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "inbox-middleware status",
    **_object(
        {
            "format": {"const": FORMAT},
            "generated_at": {"type": "string", "format": "date-time"},
            "window_seconds": {"type": "number", "exclusiveMinimum": 0},
            "exact": {"type": "boolean"},
            "tables": {
                "type": "array",
                "items": _object(
                    {
                        "table": {"enum": list(TABLES)},
                        "rows": _MAYBE_COUNT,
                        "rows_estimated": {"type": "boolean"},
                        "bytes": _MAYBE_COUNT,
                    }
                ),
            },
            "inbox": _object(
                {
                    "rows": _MAYBE_COUNT,
                    "rows_estimated": {"type": "boolean"},
                    "oldest_claim_at": _TIME,
                    "oldest_claim_age_seconds": {"type": ["number", "null"], "minimum": 0},
                    "oldest_claim_estimated": {"type": "boolean"},
                }
            ),
            "consumers": {
                "type": "array",
                "items": _object(
                    {
                        "consumer": {"type": "string"},
                        "claims": _MAYBE_COUNT,
                        "claims_estimated": {"type": "boolean"},
                        "recent_claims": _COUNT,
                        "claims_per_second": _RATE,
                        "last_processed_at": _TIME,
                        "duplicates": _MAYBE_COUNT,
                        "conflicts": _COUNT,
                        "missing_identity": _MAYBE_COUNT,
                        "quarantine_pending": _COUNT,
                        "oldest_quarantine_pending_at": _TIME,
                        "poison_pending": _COUNT,
                        "oldest_poison_pending_at": _TIME,
                        "awaiting_recovery": _COUNT,
                        "oldest_unprocessed_at": _TIME,
                        "retention": {
                            "oneOf": [
                                {"type": "null"},
                                _object(
                                    {
                                        "recorded_for": {"type": "string"},
                                        "minimum_seconds": _COUNT,
                                        "dominant_scenario": {"type": "string"},
                                        "horizon": {"type": "string", "format": "date-time"},
                                    }
                                ),
                            ]
                        },
                        "producers": {
                            "type": "array",
                            "items": _object(
                                {
                                    "producer": {"type": "string"},
                                    "claims": _MAYBE_COUNT,
                                    "claims_estimated": {"type": "boolean"},
                                    "recent_claims": _COUNT,
                                    "claims_per_second": _RATE,
                                    "last_processed_at": _TIME,
                                    "conflicts": _COUNT,
                                    "conflicting_deliveries": _COUNT,
                                    "first_seen": _MAYBE_COUNT,
                                    "duplicates": _MAYBE_COUNT,
                                    "shadow_processed": _MAYBE_COUNT,
                                }
                            ),
                        },
                    }
                ),
            },
            "outbox": _object(
                {
                    "pending": _COUNT,
                    "failed": _COUNT,
                    "oldest_pending_at": _TIME,
                    "oldest_pending_age_seconds": {"type": ["number", "null"], "minimum": 0},
                    "destinations": {
                        "type": "array",
                        "items": _object(
                            {
                                "destination": {"type": "string"},
                                "pending": _COUNT,
                                "failed": _COUNT,
                                "oldest_pending_at": _TIME,
                            }
                        ),
                    },
                }
            ),
            "oldest_unprocessed": {
                "oneOf": [
                    {"type": "null"},
                    _object(
                        {
                            "kind": {"enum": ["quarantine", "poison", "outbox"]},
                            "consumer": {"type": ["string", "null"]},
                            "at": {"type": "string", "format": "date-time"},
                            "age_seconds": {"type": "number", "minimum": 0},
                        }
                    ),
                ]
            },
            "metrics": _object(
                {"source": {"type": ["string", "null"]}, "error": {"type": ["string", "null"]}}
            ),
        }
    ),
}
"""The JSON schema ``inbox-middleware status --json`` follows."""
