"""Metrics that expose the protocol, for Prometheus and (optionally) OpenTelemetry.

An inbox that silently stops deduplicating is worse than none, so the counters follow
every decision: first-seen messages, duplicates and conflicts by consumer and producer,
messages without identity, retries, lock waits, failures by reason code, and messages
moved to quarantine, poison or repair and later recovered. Shadow mode counts the
duplicates and conflicts it did not skip.

Both exporters are optional (extras ``metrics`` and ``otel``); without them every call
is a no-op. ``INBOX_PROMETHEUS_METRICS=0`` turns the Prometheus side off where it is
installed; ``INBOX_OTEL_METRICS=1`` turns the OpenTelemetry mirror on (through the global
meter provider). A sample recorded during a traced delivery (`inbox_middleware._observe.tracing`)
carries its trace and span id as a Prometheus exemplar (OpenMetrics exposition only, and
not in multiprocess mode, where prometheus-client keeps none). Labels are bounded:
consumer names come from declarations, producers and reason codes from messages, so
each consumer keeps at most `MAX_LABEL_VALUES` distinct values per label and folds the
rest into ``"other"``. Message ids are never labels.

The Prometheus instruments are created at the first recorded sample, not at import, so
that a worker process which sets ``PROMETHEUS_MULTIPROC_DIR`` while it boots (Dramatiq's
Prometheus middleware does) still writes its samples there. Dramatiq and FastStream run
several worker processes: set that directory before they start, and serve the aggregate,
with the table gauges of `inbox_middleware._operate.status`, with
`inbox_middleware.metrics.serve` (or ``inbox-middleware metrics serve``).

This module records; `inbox_middleware.metrics` serves (the HTTP endpoint and the table
collector) and re-exports these names, so that the storage layer and the adapters record
samples without importing what reads the tables.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from .tracing import exemplar

__all__ = ["MAX_LABEL_VALUES", "MULTIPROCESS_VARIABLE", "Metrics", "label_values", "metrics"]

logger = logging.getLogger("inbox_middleware.metrics")

MAX_LABEL_VALUES = 50
"""Distinct producers (and reason codes) kept per consumer before folding into "other"."""

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

MULTIPROCESS_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
"""The environment variable naming the folder worker processes write their samples to."""

# name: (kind, exported name, help, label names). Prometheus appends ``_total`` to
# counters; OpenTelemetry instruments are named ``inbox.<name>``.
_INSTRUMENTS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "messages": (
        "counter",
        "inbox_messages",
        "Deliveries decided by the inbox and committed, by decision (first, duplicate, "
        "conflict); the same in shadow mode",
        ("consumer", "producer", "decision"),
    ),
    "shadow": (
        "counter",
        "inbox_shadow_would_skip",
        "Duplicates and conflicts that shadow mode processed instead of skipping",
        ("consumer", "producer", "decision"),
    ),
    "identified": (
        "gauge",
        "inbox_producer_last_identified_timestamp_seconds",
        "When a consumer last committed an identified message from a producer (Unix time)",
        ("consumer", "producer"),
    ),
    "missing_identity": (
        "counter",
        "inbox_missing_identity",
        "Messages without a usable identity, by reason (missing, invalid, unhashable) and "
        "what was done (rejected, processed, broker_id)",
        ("consumer", "reason", "outcome"),
    ),
    "transaction_retries": (
        "counter",
        "inbox_transaction_retries",
        "Transactions rerun after a serialization failure or deadlock",
        ("consumer",),
    ),
    "claim_in_progress": (
        "counter",
        "inbox_claim_in_progress",
        "Claims that waited lock_timeout on a concurrent delivery and were handed back",
        ("consumer",),
    ),
    "claim_seconds": (
        "histogram",
        "inbox_claim_seconds",
        "Duration of the claim: the INSERT, including any wait on a concurrent delivery's "
        "claim (lock wait), and the look-up of a duplicate or conflict",
        ("consumer",),
    ),
    "commit_seconds": (
        "histogram",
        "inbox_commit_seconds",
        "Duration of the inbox transaction's commit",
        ("consumer",),
    ),
    "handler_failures": (
        "counter",
        "inbox_handler_failures",
        "Handler failures by stable reason code (a transient one: its exception type)",
        ("consumer", "reason_code"),
    ),
    "moved": (
        "counter",
        "inbox_moved",
        "Messages moved to quarantine or poison instead of being processed",
        ("consumer", "destination"),
    ),
    "recovered": (
        "counter",
        "inbox_recovered",
        "Moved messages later processed successfully, by where they had been moved",
        ("consumer", "source"),
    ),
    "expired": (
        "counter",
        "inbox_expired_redeliveries",
        "First-seen messages older than the retention window, by what was done",
        ("consumer", "outcome"),
    ),
    "routes": (
        "counter",
        "inbox_database_routes",
        "Deliveries of a fleet over many databases, by database (the map's name, never the "
        "tenant) and outcome (routed; unavailable: the database did not answer, handed "
        "back; busy: the database holds pool_size deliveries already, busy_wait or longer, "
        "handed back; "
        "unknown_tenant: dead-lettered, database none; unresolved: handed back)",
        ("consumer", "database", "outcome"),
    ),
    "outbox_attempts": (
        "counter",
        "inbox_outbox_attempts",
        "Outbox delivery attempts recorded, by outcome (delivered, retry, failed, "
        "released, lost_lease) and database (the map's name, never the tenant; empty for "
        "a dispatcher over one database)",
        ("destination", "outcome", "database"),
    ),
}


class _Bounded:
    """Admits at most `limit` distinct values per key; later ones become "other"."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: defaultdict[str, set[str]] = defaultdict(set)
        self._lock = threading.Lock()

    def __call__(self, key: str, value: str) -> str:
        seen = self._seen[key]
        if value in seen:
            return value
        with self._lock:
            if len(seen) < self.limit:
                seen.add(value)
                return value
        return "other"


class _Series:
    """One labelled series in every enabled exporter: ``add``, ``observe`` or ``set`` it.

    The methods are bound once, when the series is created: with Prometheus alone they
    are the Prometheus child's own, so recording costs no extra call.
    """

    __slots__ = ("_otel", "_prom", "add", "attributes", "last", "observe", "set")

    def __init__(self, prom: Any, otel: Any, attributes: dict[str, str]) -> None:
        self.last = 0.0  # when a gauge was last set (see `Metrics.decision`)
        self._prom, self._otel, self.attributes = prom, otel, attributes
        # A counter child has inc, a histogram's observe, a gauge's set: the others stay
        # no-ops, never called for that kind.
        self.add: Callable[[], None] = _fan_out(
            getattr(prom, "inc", None), otel and (lambda: otel.add(1, attributes))
        )
        self.observe: Callable[[float], None] = _fan_out(
            getattr(prom, "observe", None),
            otel and (lambda value: otel.record(value, attributes)),
        )
        self.set: Callable[[float], None] = _fan_out(
            getattr(prom, "set", None), otel and (lambda value: otel.set(value, attributes))
        )

    def add_traced(self, exemplar: dict[str, str]) -> None:
        """`add`, with the trace of the delivery as the Prometheus sample's exemplar (the
        OpenTelemetry SDK takes its exemplars from the current span itself)."""
        if self._prom is not None:
            self._prom.inc(1, exemplar)
        if self._otel:
            self._otel.add(1, self.attributes)

    def observe_traced(self, value: float, exemplar: dict[str, str]) -> None:
        """`observe`, with an exemplar (see `add_traced`)."""
        if self._prom is not None:
            self._prom.observe(value, exemplar)
        if self._otel:
            self._otel.record(value, self.attributes)


def _fan_out(*calls: Any) -> Any:
    wanted = [call for call in calls if call]
    if len(wanted) == 1:
        return wanted[0]

    def both(*args: Any) -> None:
        for call in wanted:
            call(*args)

    return both


class Metrics:
    """The library's metrics. Use the module-level `metrics` instance.

    Parameters:
      prometheus: export to prometheus-client's default registry; None: when it is
        installed and ``INBOX_PROMETHEUS_METRICS`` is not ``0``.
      meter: an OpenTelemetry ``Meter`` to mirror every metric to; None: the global
        meter provider's when ``INBOX_OTEL_METRICS`` is ``1`` and the API is installed.

    Every recording method is cheap when both are off (one attribute test), and a series
    is looked up once per distinct label set, then reused.
    """

    def __init__(self, *, prometheus: bool | None = None, meter: Any = None) -> None:
        if prometheus is None:
            prometheus = _prometheus_wanted()
        self._meter = meter if meter is not None else _global_meter()
        self._want_prometheus = prometheus
        self._producers = _Bounded(MAX_LABEL_VALUES)
        self._reasons = _Bounded(MAX_LABEL_VALUES)
        self._series: dict[tuple[str, tuple[str, ...]], _Series] = {}
        self._prom: dict[str, Any] | None = None
        self._otel: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self.enabled = bool(prometheus or self._meter is not None)
        """False: every recording method returns at once. Tests and benchmarks may flip it."""

    # -- recording ------------------------------------------------------------------------

    def decision(self, consumer: str, producer: str, decision: str, shadow: bool = False) -> None:
        """A committed claim decision: ``first``, ``duplicate`` or ``conflict``; ``shadow``:
        a duplicate or conflict that shadow mode processed instead of skipping."""
        if not self.enabled:
            return
        producer = self._producers(consumer, producer)
        _count(self._get("messages", consumer, producer, decision))
        identified = self._get("identified", consumer, producer)
        now = time.time()
        if now - identified.last >= 1.0:  # a time for alerts over minutes: once a second
            identified.last = now
            identified.set(now)
        if shadow:
            self._get("shadow", consumer, producer, decision).add()

    def missing_identity(self, consumer: str, reason: str, outcome: str = "rejected") -> None:
        """A message without a usable identity; ``reason``: missing, invalid, unhashable;
        ``outcome``: rejected, processed (unprotected) or broker_id."""
        if self.enabled:
            self._get("missing_identity", consumer, reason, outcome).add()

    def transaction_retry(self, consumer: str) -> None:
        if self.enabled:
            self._get("transaction_retries", consumer).add()

    def claim_in_progress(self, consumer: str) -> None:
        """A claim gave up after lock_timeout; its message is retried later."""
        if self.enabled:
            self._get("claim_in_progress", consumer).add()

    def claim_seconds(self, consumer: str, seconds: float) -> None:
        """The claim's duration: long ones waited on a concurrent claim."""
        if self.enabled:
            _observe(self._get("claim_seconds", consumer), seconds)

    def commit_seconds(self, consumer: str, seconds: float) -> None:
        if self.enabled:
            _observe(self._get("commit_seconds", consumer), seconds)

    def handler_failure(self, consumer: str, reason_code: str) -> None:
        if self.enabled:
            reason_code = self._reasons(consumer, reason_code)
            _count(self._get("handler_failures", consumer, reason_code))

    def moved(self, consumer: str, destination: str) -> None:
        """A message handed to ``quarantine``, ``poison`` or ``repair``: not a success."""
        if self.enabled:
            _count(self._get("moved", consumer, destination))

    def recovered(self, consumer: str, source: str) -> None:
        """A redriven or accepted message later processed successfully."""
        if self.enabled:
            self._get("recovered", consumer, source).add()

    def route(self, consumer: str, database: str, outcome: str) -> None:
        """A delivery over many databases: ``routed`` to ``database``, or not
        (``unavailable``, ``unknown_tenant``, ``unresolved``). One label value per
        database of the map: the tenant is never a label."""
        if self.enabled:
            self._get("routes", consumer, database, outcome).add()

    def expired(self, consumer: str, outcome: str) -> None:
        """A first-seen message older than the retention window: ``rejected`` or
        ``processed`` per the expired-redelivery policy."""
        if self.enabled:
            self._get("expired", consumer, outcome).add()

    def outbox(self, destination: str, outcome: str, database: str = "") -> None:
        """An outbox delivery attempt: ``delivered``, ``retry``, ``failed``, ``released``
        (given back unattempted) or ``lost_lease``; ``database``: the map's name of the
        database the effect was leased from (a dispatcher over many), as
        `route` labels it; empty over one database, which Prometheus stores as no label."""
        if self.enabled:
            self._get("outbox_attempts", destination, outcome, database).add()

    # -- plumbing -------------------------------------------------------------------------

    def _get(self, name: str, *values: str) -> _Series:
        key = (name, values)
        series = self._series.get(key)
        if series is None:
            series = self._create(name, values)
        return series

    def _create(self, name: str, values: tuple[str, ...]) -> _Series:
        with self._lock:
            if self._prom is None:
                self._prom = _prometheus() if self._want_prometheus else {}
                self._otel = _opentelemetry(self._meter) if self._meter is not None else {}
            assert self._otel is not None
            labels = _INSTRUMENTS[name][3]
            prom = self._prom.get(name)
            series = _Series(
                prom.labels(*values) if prom is not None else None,
                self._otel.get(name),
                # Over one database the database label is empty: Prometheus stores such
                # a label as none, and the OpenTelemetry mirror leaves it out the same way.
                {
                    label: value
                    for label, value in zip(labels, values, strict=True)
                    if value or label != "database"
                },
            )
            self._series[(name, values)] = series
            return series


def _count(series: _Series) -> None:
    traced = exemplar()  # a context-variable read; None unless a delivery is traced
    if traced is None:
        series.add()
    else:
        series.add_traced(traced)


def _observe(series: _Series, value: float) -> None:
    traced = exemplar()
    if traced is None:
        series.observe(value)
    else:
        series.observe_traced(value, traced)


def _prometheus_wanted() -> bool:
    if os.environ.get("INBOX_PROMETHEUS_METRICS", "1").lower() in ("0", "false", "no", "off"):
        return False
    return importlib.util.find_spec("prometheus_client") is not None


def _global_meter() -> Any:
    if os.environ.get("INBOX_OTEL_METRICS", "").lower() not in ("1", "true", "yes", "on"):
        return None
    try:
        from opentelemetry import metrics as otel
    except ImportError:
        return None
    return otel.get_meter("inbox_middleware")


_PROMETHEUS: dict[str, Any] | None = None
_PROMETHEUS_LOCK = threading.Lock()


def _prometheus() -> dict[str, Any]:
    """The Prometheus instruments, created once per process in the default registry."""
    global _PROMETHEUS  # noqa: PLW0603 (the default registry is process-wide too)
    with _PROMETHEUS_LOCK:
        if _PROMETHEUS is None:
            _PROMETHEUS = _create_prometheus()
        return _PROMETHEUS


def _create_prometheus() -> dict[str, Any]:
    from prometheus_client import Counter, Gauge, Histogram, values

    if os.environ.get(MULTIPROCESS_VARIABLE) and values.ValueClass is values.MutexValue:
        logger.warning(
            "%s is set, but prometheus_client was imported before it was: this process's "
            "inbox metrics stay in the process and the multiprocess aggregate will not see "
            "them. Set it in the environment before the worker starts.",
            MULTIPROCESS_VARIABLE,
        )
    made: dict[str, Any] = {}
    for name, (kind, exported, text, labels) in _INSTRUMENTS.items():
        if kind == "counter":
            made[name] = Counter(exported, text, labels)
        elif kind == "histogram":
            made[name] = Histogram(exported, text, labels, buckets=LATENCY_BUCKETS)
        else:  # across worker processes the latest time wins
            made[name] = Gauge(exported, text, labels, multiprocess_mode="max")
    return made


def _opentelemetry(meter: Any) -> dict[str, Any]:
    made: dict[str, Any] = {}
    for name, (kind, _, text, _) in _INSTRUMENTS.items():
        if kind == "counter":
            made[name] = meter.create_counter(f"inbox.{name}", description=text)
        elif kind == "histogram":
            made[name] = meter.create_histogram(f"inbox.{name}", unit="s", description=text)
        else:
            made[name] = meter.create_gauge(f"inbox.{name}", unit="s", description=text)
    return made


metrics = Metrics()


def label_values() -> Iterator[tuple[str, dict[str, str]]]:
    """Every (metric, labels) pair exported so far: what a cardinality check inspects."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    for family in REGISTRY.collect():
        if family.name.startswith("inbox_"):
            for sample in family.samples:
                yield sample.name, dict(sample.labels)
