"""The inbox metrics, served: an HTTP endpoint (`serve`) and the table gauges collector.

The samples are recorded by `inbox_middleware._observe.instruments` (counters and histograms that
follow every decision; see its docstring for the exporters, the label bounds and the
multiprocess directory), whose names this module re-exports. Dramatiq and FastStream run
several worker processes: set ``PROMETHEUS_MULTIPROC_DIR`` before they start, and serve
the aggregate, with the table gauges of `inbox_middleware._operate.status`, with `serve` (or
``inbox-middleware metrics serve``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from sqlalchemy import Engine

from .._observe.instruments import (
    MAX_LABEL_VALUES,
    MULTIPROCESS_VARIABLE,
    Metrics,
    label_values,
    metrics,
)
from .._storage.engines import run_sync, sync_engine
from .._storage.inspection import limit_statements
from .._storage.tables import InboxSchema
from .status import table_gauges

__all__ = [
    "MAX_LABEL_VALUES",
    "Metrics",
    "MetricsServer",
    "TableCollector",
    "label_values",
    "metrics",
    "serve",
]

logger = logging.getLogger("inbox_middleware.metrics")


class MetricsServer:
    """A running metrics endpoint (see `serve`); `close` stops it."""

    def __init__(self, httpd: Any, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread

    @property
    def port(self) -> int:
        """The port it listens on (useful after ``serve(0)``)."""
        port: int = self._httpd.server_port
        return port

    @property
    def url(self) -> str:
        host = self._httpd.server_address[0]
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(
    port: int,
    *,
    addr: str = "127.0.0.1",
    engine: Engine | str | None = None,
    naming: InboxSchema | None = None,
    cache_seconds: float = 30.0,
    multiprocess_dir: str | None = None,
) -> MetricsServer:
    """Serve the inbox metrics over HTTP (``/metrics``) from a thread; return the server.

    Parameters:
      port: the TCP port; 0 picks a free one (see `MetricsServer.port`).
      addr: the address to listen on; the default answers this host only.
      engine: a synchronous `Engine` (or a database URL) to read the table gauges from:
        inbox size, oldest claim, outbox backlog, quarantine and poison pending. None:
        no table gauges.
      naming: schema and table prefix of the inbox tables.
      cache_seconds: how long the table gauges are reused, so a scrape storm does not
        reach the database.
      multiprocess_dir: the folder worker processes write their samples to; by default
        ``PROMETHEUS_MULTIPROC_DIR``. With one, the endpoint serves the aggregate of every
        worker process (run it beside the workers, as its own process or in one of
        them); without, this process's own metrics.
    """
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    folder = multiprocess_dir or os.environ.get(MULTIPROCESS_VARIABLE)
    if folder:
        from prometheus_client.multiprocess import MultiProcessCollector

        MultiProcessCollector(registry, path=folder)  # type: ignore[no-untyped-call]
    else:
        registry.register(_Forward(REGISTRY.collect))
    owned = None
    if engine is not None:
        if isinstance(engine, str):
            engine = owned = sync_engine(engine)
        registry.register(TableCollector(engine, naming, cache_seconds=cache_seconds))
    try:
        httpd, thread = start_http_server(port, addr=addr, registry=registry)
    except BaseException:
        if owned is not None:
            owned.dispose()
        raise
    server = MetricsServer(httpd, thread)
    if owned is not None:
        close = server.close

        def close_and_dispose() -> None:
            close()
            owned.dispose()

        server.close = close_and_dispose  # type: ignore[method-assign]
    return server


class TableCollector:
    """The table gauges (`status.table_gauges`) as a Prometheus collector.

    The tables are read at most once per ``cache_seconds`` (the scrape that finds the
    figures older refreshes them; concurrent scrapes wait for it rather than query too),
    each statement bounded by ``statement_timeout`` seconds. Ages are computed at every
    scrape from the cached timestamps, so they keep growing between reads. When a read
    fails the previous figures are served, and ``inbox_table_stats_up`` is 0.
    """

    def __init__(
        self,
        engine: Engine,
        naming: InboxSchema | None = None,
        *,
        cache_seconds: float = 30.0,
        statement_timeout: float = 5.0,
    ) -> None:
        self.engine = engine
        self.naming = naming or InboxSchema()
        self.cache_seconds = cache_seconds
        self.statement_timeout = statement_timeout
        self.reads = 0
        """How often the tables were read (for tests of the cache)."""
        self._gauges: Any = None
        self._read_at = -math.inf
        self._up = False
        self._lock = threading.Lock()

    def describe(self) -> Iterable[Any]:
        return []  # registering must not query the database

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        gauges, up = self._current()

        def family(name: str, text: str, labels: Iterable[str] = ()) -> Any:
            return GaugeMetricFamily(name, text, labels=list(labels))

        yield _with(
            family("inbox_table_stats_up", "1 if the last read of the tables succeeded"),
            [((), float(up))],
        )
        if gauges is None:
            return
        now = time.time()
        yield _with(
            family("inbox_table_stats_age_seconds", "Age of the table figures served"),
            [((), max(0.0, now - gauges.read_at.timestamp()))],
        )
        yield _with(
            family(
                "inbox_table_rows",
                "Rows per library table: exact when small, else pg_class.reltuples",
                ["table"],
            ),
            [((t.table,), float(t.rows)) for t in gauges.tables if t.rows is not None],
        )
        yield _with(
            family("inbox_table_bytes", "Size of each library table, with indexes", ["table"]),
            [((t.table,), float(t.bytes)) for t in gauges.tables if t.bytes is not None],
        )
        oldest = gauges.oldest_claim_at
        yield _with(
            family(
                "inbox_oldest_claim_age_seconds",
                "Age of the oldest claim still kept (how far back duplicates are caught)",
            ),
            [] if oldest is None else [((), max(0.0, now - oldest.timestamp()))],
        )
        labels = ("consumer", "kind")
        yield _with(
            family("inbox_repair_pending", "Quarantine and poison rows pending a decision", labels),
            [((r.consumer, r.kind), float(r.pending)) for r in gauges.repairs],
        )
        yield _with(
            family(
                "inbox_repair_oldest_pending_age_seconds",
                "Age of the oldest quarantine or poison row pending a decision",
                labels,
            ),
            [
                ((r.consumer, r.kind), max(0.0, now - r.oldest_pending_at.timestamp()))
                for r in gauges.repairs
                if r.oldest_pending_at is not None
            ],
        )
        yield _with(
            family(
                "inbox_repair_awaiting_recovery",
                "Redriven or accepted messages not yet processed successfully",
                labels,
            ),
            [((r.consumer, r.kind), float(r.awaiting_recovery)) for r in gauges.repairs],
        )
        yield _with(
            family(
                "inbox_outbox_pending", "Outbox effects waiting to be delivered", ["destination"]
            ),
            [((b.destination,), float(b.pending)) for b in gauges.outbox],
        )
        yield _with(
            family("inbox_outbox_failed", "Outbox effects that failed for good", ["destination"]),
            [((b.destination,), float(b.failed)) for b in gauges.outbox],
        )
        yield _with(
            family(
                "inbox_outbox_oldest_pending_age_seconds",
                "Age of the oldest outbox effect waiting to be delivered",
                ["destination"],
            ),
            [
                ((b.destination,), max(0.0, now - b.oldest_pending_at.timestamp()))
                for b in gauges.outbox
                if b.oldest_pending_at is not None
            ],
        )
        yield _with(
            family(
                "inbox_retention_minimum_seconds",
                "The recorded retention policy's minimum window, by consumer (* the default)",
                ["consumer"],
            ),
            [((consumer,), float(seconds)) for consumer, seconds in gauges.retention.items()],
        )

    def _current(self) -> tuple[Any, bool]:
        with self._lock:
            if time.monotonic() - self._read_at >= self.cache_seconds:
                self._read_at = time.monotonic()
                try:
                    self._gauges = self._read()
                    self._up = True
                except Exception:
                    logger.warning("could not read the inbox tables for metrics", exc_info=True)
                    self._up = False
            return self._gauges, self._up

    def _read(self) -> Any:
        self.reads += 1
        if self.engine.dialect.is_async:  # an engine over asyncpg only (see storage.engines)
            return run_sync(self._query)
        return self._query()

    def _query(self) -> Any:
        with self.engine.begin() as conn:
            limit_statements(conn, self.statement_timeout)
            return table_gauges(conn, self.naming)


def _with(family: Any, samples: Iterable[tuple[tuple[str, ...], float]]) -> Any:
    for labels, value in samples:
        family.add_metric(list(labels), value)
    return family


class _Forward:
    """Serves another registry's samples (this process's own, without multiprocess mode)."""

    def __init__(self, collect: Callable[[], Iterable[Any]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Any]:
        return self._collect()
