"""What the inbox holds, read cheaply enough to ask on every scrape or from a shell.

Every figure says whether it is exact or an estimate. Exact figures read few rows: the
claims of a recent window (the ``processed_at`` BRIN index finds the recent pages), the
pending quarantine, poison and outbox rows (partial indexes), the recorded retention
policies. The rest, on a PostgreSQL table too big to count on demand (above
`EXACT_BELOW_BYTES`), comes from the catalog: row counts from ``pg_class.reltuples``,
per-consumer totals from ``pg_stats``' most common values; the oldest claim is found
through ``pg_stats``' histogram of ``processed_at`` (the first bucket that holds a row,
read through the BRIN index). Duplicates and messages without identity leave no row of
their own: each worker counts every settlement in memory and writes its cumulative counts
to ``inbox_counts`` every few seconds (`inbox_middleware._operate.tally`), so their totals since
each worker started are read from there, approximate (a SIGKILLed worker loses its last
interval); per-producer duplicates and shadow-mode counts come from the metrics endpoint
when one is given.

`snapshot` gathers everything ``inbox-middleware status`` shows, as JSON-ready data in
the shape of `SCHEMA`; `table_gauges` the subset the metrics endpoint exports.
"""

from __future__ import annotations

import urllib.request
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection

from .._storage.counts import CountTotals, count_totals
from .._storage.inspection import (
    EXACT_BELOW_BYTES,
    OutboxBacklog,
    PendingRepairs,
    TableSize,
    aware,
    claim_totals,
    conflicts,
    consumer_pairs,
    estimated_consumer_totals,
    oldest_claim,
    outbox_backlog,
    pending_repairs,
    recent_claims,
    retention_windows,
    table_sizes,
)
from .._storage.tables import ALL_CONSUMERS, TABLES, InboxSchema
from .tally import OUTCOMES

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


def table_gauges(conn: Connection, naming: InboxSchema) -> TableGauges:
    """The figures the metrics endpoint exports; cheap on any size of inbox."""
    sizes = table_sizes(conn, naming)
    oldest, estimated = oldest_claim(conn, naming, sizes)
    return TableGauges(
        tables=sizes,
        oldest_claim_at=aware(oldest),
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
    compact_size = next(s for s in sizes if s.table == "inbox_claims")
    oldest, oldest_estimated = oldest_claim(conn, naming, sizes)
    oldest = aware(oldest)
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
        counted=count_totals(conn, naming, now - window),
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
    names |= {name for name, _ in facts.counted.counts}
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
            "compact_rows": compact_size.rows,
            "compact_rows_estimated": compact_size.rows_estimated,
        },
        "consumers": [
            facts.consumer(name, sorted(p for c, p in pairs if c == name)) for name in sorted(names)
        ],
        "outbox": _outbox(now, outbox),
        "oldest_unprocessed": _oldest_unprocessed(now, facts.repairs, outbox),
        "counted": {
            "approximate": True,
            "workers": facts.counted.workers,
            "live_workers": facts.counted.live_workers,
            "since": _iso(facts.counted.since),
            "updated_at": _iso(facts.counted.updated_at),
        },
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
    counted: CountTotals
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
            "counted": {o: self.counted.counts.get((name, o), 0) for o in OUTCOMES},
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


def _iso(value: datetime | None) -> str | None:
    value = aware(value)
    return None if value is None else value.isoformat()


def _age(now: datetime, then: datetime | None) -> float | None:
    then = aware(then)
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
                    # the compact claims table's (claims="compact"), counted apart: its
                    # claims name neither a consumer nor a producer
                    "compact_rows": _MAYBE_COUNT,
                    "compact_rows_estimated": {"type": "boolean"},
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
                        "counted": _object(dict.fromkeys(OUTCOMES, _COUNT)),
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
            "counted": _object(
                {
                    "approximate": {"const": True},
                    "workers": _COUNT,
                    "live_workers": _COUNT,
                    "since": _TIME,
                    "updated_at": _TIME,
                }
            ),
            "metrics": _object(
                {"source": {"type": ["string", "null"]}, "error": {"type": ["string", "null"]}}
            ),
        }
    ),
}
"""The JSON schema ``inbox-middleware status --json`` follows."""
