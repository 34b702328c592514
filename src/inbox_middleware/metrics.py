"""Metrics that expose the protocol, for Prometheus and (optionally) OpenTelemetry.

An inbox that silently stops deduplicating is worse than none, so the counters follow
every decision: first-seen messages, duplicates and conflicts by consumer and producer,
messages without identity, retries, lock waits, failures by reason code, and messages
moved to quarantine, poison or repair and later recovered.

Both exporters are optional (extras ``metrics`` and ``otel``); without them every call
is a no-op. Labels are bounded: consumer names come from declarations, producers and
reason codes from messages, so each consumer keeps at most `MAX_LABEL_VALUES` distinct
values per label and folds the rest into ``"other"``. Message ids are never labels.

Dramatiq and FastStream run several worker processes: set ``PROMETHEUS_MULTIPROC_DIR``
before they start and serve the aggregate with `serve` (see the monitoring guide).
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

__all__ = ["MAX_LABEL_VALUES", "Metrics", "metrics"]

MAX_LABEL_VALUES = 50
"""Distinct producers (and reason codes) kept per consumer before folding into "other"."""

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


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


class Metrics:
    """The library's metrics. Use the module-level `metrics` instance."""

    def __init__(self) -> None:
        self._producers = _Bounded(MAX_LABEL_VALUES)
        self._reasons = _Bounded(MAX_LABEL_VALUES)
        self._prom: dict[str, Any] = _prometheus()
        self._otel: dict[str, Any] = _opentelemetry()
        self.enabled = bool(self._prom or self._otel)

    # -- recording ------------------------------------------------------------------------

    def decision(self, consumer: str, producer: str, decision: str) -> None:
        """A claim decided: ``first``, ``duplicate`` or ``conflict``."""
        if self.enabled:
            producer = self._producers(consumer, producer)
            self._count("messages", consumer=consumer, producer=producer, decision=decision)
            self._set("identified", time.time(), consumer=consumer, producer=producer)

    def missing_identity(self, consumer: str, reason: str) -> None:
        """A message without a usable identity; ``reason``: missing, invalid, unhashable."""
        self._count("missing_identity", consumer=consumer, reason=reason)

    def transaction_retry(self, consumer: str) -> None:
        self._count("transaction_retries", consumer=consumer)

    def claim_in_progress(self, consumer: str) -> None:
        """A claim gave up after lock_timeout; its message is retried later."""
        self._count("claim_in_progress", consumer=consumer)

    def claim_seconds(self, consumer: str, seconds: float) -> None:
        """The claim statement's duration: long ones waited on a concurrent claim."""
        self._observe("claim_seconds", seconds, consumer=consumer)

    def commit_seconds(self, consumer: str, seconds: float) -> None:
        self._observe("commit_seconds", seconds, consumer=consumer)

    def handler_failure(self, consumer: str, reason_code: str) -> None:
        if self.enabled:
            reason_code = self._reasons(consumer, reason_code)
            self._count("handler_failures", consumer=consumer, reason_code=reason_code)

    def moved(self, consumer: str, destination: str) -> None:
        """A message handed to ``quarantine``, ``poison`` or ``repair``: not a success."""
        self._count("moved", consumer=consumer, destination=destination)

    def recovered(self, consumer: str, source: str) -> None:
        """A redriven or accepted message later processed successfully."""
        self._count("recovered", consumer=consumer, source=source)

    def expired(self, consumer: str, outcome: str) -> None:
        """A first-seen message older than the retention window: ``rejected`` or
        ``processed`` per the expired-redelivery policy."""
        self._count("expired", consumer=consumer, outcome=outcome)

    def outbox(self, destination: str, outcome: str) -> None:
        """An outbox delivery attempt: ``delivered``, ``retry``, ``failed`` or ``lost_lease``."""
        self._count("outbox_attempts", destination=destination, outcome=outcome)

    # -- plumbing -------------------------------------------------------------------------

    def _count(self, name: str, **labels: str) -> None:
        if name in self._prom:
            self._prom[name].labels(**labels).inc()
        if name in self._otel:
            self._otel[name].add(1, labels)

    def _observe(self, name: str, value: float, **labels: str) -> None:
        if name in self._prom:
            self._prom[name].labels(**labels).observe(value)
        if name in self._otel:
            self._otel[name].record(value, labels)

    def _set(self, name: str, value: float, **labels: str) -> None:
        if name in self._prom:
            self._prom[name].labels(**labels).set(value)


def _prometheus() -> dict[str, Any]:
    try:
        from prometheus_client import Counter, Gauge, Histogram
    except ImportError:
        return {}
    return {
        "messages": Counter(
            "inbox_messages",
            "Deliveries decided by the inbox, by decision",
            ["consumer", "producer", "decision"],
        ),
        "identified": Gauge(
            "inbox_producer_last_identified_timestamp_seconds",
            "When a consumer last received an identified message from a producer",
            ["consumer", "producer"],
            multiprocess_mode="max",  # across worker processes, the latest time wins
        ),
        "missing_identity": Counter(
            "inbox_missing_identity", "Messages without a usable identity", ["consumer", "reason"]
        ),
        "transaction_retries": Counter(
            "inbox_transaction_retries",
            "Transactions rerun after a serialization failure or deadlock",
            ["consumer"],
        ),
        "claim_in_progress": Counter(
            "inbox_claim_in_progress",
            "Claims that waited lock_timeout on a concurrent delivery and were handed back",
            ["consumer"],
        ),
        "claim_seconds": Histogram(
            "inbox_claim_seconds",
            "Duration of the claim statement, including any wait on a concurrent claim",
            ["consumer"],
            buckets=_LATENCY_BUCKETS,
        ),
        "commit_seconds": Histogram(
            "inbox_commit_seconds",
            "Duration of the inbox transaction's commit",
            ["consumer"],
            buckets=_LATENCY_BUCKETS,
        ),
        "handler_failures": Counter(
            "inbox_handler_failures",
            "Handler failures by stable reason code",
            ["consumer", "reason_code"],
        ),
        "moved": Counter(
            "inbox_moved",
            "Messages moved to quarantine, poison or repair",
            ["consumer", "destination"],
        ),
        "recovered": Counter(
            "inbox_recovered",
            "Moved messages later processed successfully",
            ["consumer", "source"],
        ),
        "outbox_attempts": Counter(
            "inbox_outbox_attempts",
            "Outbox delivery attempts by outcome",
            ["destination", "outcome"],
        ),
        "expired": Counter(
            "inbox_expired_redeliveries",
            "First-seen messages older than the retention window, by what was done",
            ["consumer", "outcome"],
        ),
    }


def _opentelemetry() -> dict[str, Any]:
    if os.environ.get("INBOX_OTEL_METRICS", "").lower() not in ("1", "true", "yes"):
        return {}
    try:
        from opentelemetry import metrics as otel
    except ImportError:
        return {}
    meter = otel.get_meter("inbox_middleware")
    counters = {
        name: meter.create_counter(f"inbox.{name}")
        for name in (
            "messages",
            "missing_identity",
            "transaction_retries",
            "claim_in_progress",
            "handler_failures",
            "moved",
            "recovered",
            "outbox_attempts",
            "expired",
        )
    }
    histograms = {
        name: meter.create_histogram(f"inbox.{name}", unit="s")
        for name in ("claim_seconds", "commit_seconds")
    }
    return {**counters, **histograms}


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
