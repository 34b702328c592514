"""Settlement counts kept in memory and flushed to ``inbox_counts`` every few seconds.

Duplicates and messages without identity leave no row of their own in the database, yet
they are the signals an operator looks for first. So every settlement is counted where
`outcomes.report` sees it, in memory, and a flusher writes this process's cumulative
counts to its own rows every ``count_interval`` seconds: ``inbox-middleware status``
then reads them from the database alone, without a metrics set-up.

    worker thread            memory (per thread)       flusher (every few seconds)
    settle, report  ──────>  counts[(consumer, outcome)] += 1
                                          ──── sum ────>  UPSERT this worker's rows
                                                          (cumulative, its own rows only)

The hot path pays one dict increment in a dict of its own thread: no lock, no I/O. A
flush that fails (the database is down) is logged once for the outage and the next one
writes the grown cumulative values, so nothing is lost but what a SIGKILL takes: the
counts since the last flush. The figures are therefore approximate, and say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine

from .._core.consumption import (
    DeadLettered,
    Duplicate,
    HandedBack,
    Poisoned,
    Processed,
    Quarantined,
    Settlement,
)
from .._core.exceptions import ConfigurationError, IdentityError, PayloadNotHashable
from .._storage.counts import flush_counts, flush_counts_async
from .._storage.tables import InboxSchema

__all__ = [
    "DEFAULT_COUNT_INTERVAL",
    "OUTCOMES",
    "AsyncCountFlusher",
    "CountFlusher",
    "Tally",
    "check_interval",
    "outcome_of",
    "tally",
]

logger = logging.getLogger("inbox_middleware")

DEFAULT_COUNT_INTERVAL = 5.0
"""Seconds between two flushes of a worker's counts."""

OUTCOMES = (
    "processed",
    "duplicate",
    "quarantined",
    "no_identity",
    "unprotected",
    "dead_lettered",
    "poisoned",
    "failed",
    "handed_back",
)
"""What a count row counts: ``processed`` (first seen, committed), ``duplicate``,
``quarantined``, ``no_identity`` (dead-lettered: no usable identity), ``unprotected``
(processed without identity, by policy), ``dead_lettered`` (for another reason),
``poisoned``, ``failed`` (the handler failed; retried), ``handed_back`` (the inbox's own
trouble: retried, counts against nothing)."""

Counts = dict[tuple[str, str], int]


def outcome_of(settlement: Settlement) -> str:
    """The `OUTCOMES` name ``settlement`` is counted under."""
    match settlement:
        case Duplicate():
            return "duplicate"
        case Processed(verdict=None):
            return "unprotected"
        case Processed():
            return "processed"
        case Quarantined():
            return "quarantined"
        case DeadLettered(error=error) if isinstance(error, IdentityError | PayloadNotHashable):
            return "no_identity"
        case DeadLettered():
            return "dead_lettered"
        case Poisoned():
            return "poisoned"
        case HandedBack(counted=True):
            return "failed"
        case _:
            return "handed_back"


class Tally:
    """This process's settlement counts, by (consumer, outcome), since it started."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # A forked child is another worker: its own name, its own counts from zero.
        self._local = threading.local()
        self._threads: list[Counts] = []
        self._lock = threading.Lock()
        host = socket.gethostname()[:100]
        self.worker = f"{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.since = datetime.now(UTC)

    def count(self, consumer: str, outcome: str) -> None:
        """One settlement more: the hot path's only cost (no lock, no I/O)."""
        try:
            counts: Counts = self._local.counts
        except AttributeError:
            counts = self._thread_counts()
        key = (consumer, outcome)
        counts[key] = counts.get(key, 0) + 1

    def _thread_counts(self) -> Counts:
        counts: Counts = {}
        self._local.counts = counts
        with self._lock:
            self._threads.append(counts)
        return counts

    def totals(self) -> Counts:
        """Every thread's counts, summed (each thread's dict copied whole, atomically)."""
        with self._lock:
            threads = list(self._threads)
        totals: Counts = {}
        for counts in threads:
            for key, value in dict(counts).items():
                totals[key] = totals.get(key, 0) + value
        return totals


tally = Tally()
"""The process's counts, which `outcomes.report` adds to."""


def check_interval(value: float | None) -> float | None:
    """``count_interval``: seconds, positive; None turns the flusher off."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigurationError(
            f"count_interval must be a positive number of seconds or None, not {value!r}"
        )
    return float(value)


class _Flushes:
    """What the two flushers share: which counts changed since the last write, and one
    log line per outage."""

    def __init__(self, interval: float, source: Tally) -> None:
        self.interval = interval
        self.source = source
        self._written: Counts = {}
        self._failing = False

    def changes(self) -> Counts:
        totals = self.source.totals()
        return {k: v for k, v in totals.items() if self._written.get(k) != v}

    def done(self, written: Counts) -> None:
        self._written.update(written)
        if self._failing:
            self._failing = False
            logger.info("the inbox's settlement counts are written again")

    def failed(self, error: Exception) -> None:
        if not self._failing:  # once per outage: the next flush retries
            self._failing = True
            cause = getattr(error, "orig", None) or error  # the driver's, without the SQL
            logger.warning(
                "could not write the inbox's settlement counts (%s: %s); retrying every "
                "%gs, nothing is lost meanwhile",
                type(cause).__name__,
                (str(cause).strip().splitlines() or [""])[0],
                self.interval,
            )


class CountFlusher(_Flushes):
    """Flushes the counts from a daemon thread (a Dramatiq worker), and once more on
    `stop`. ``write(worker, since, counts)`` performs one flush."""

    def __init__(
        self,
        write: Callable[[str, datetime, Counts], None],
        interval: float,
        source: Tally = tally,
    ) -> None:
        super().__init__(interval, source)
        self._write = write
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_engine(
        cls, engine: Engine, naming: InboxSchema, interval: float, source: Tally = tally
    ) -> CountFlusher:
        """A flusher writing through a sync `Engine`."""

        def write(worker: str, since: datetime, counts: Counts) -> None:
            with engine.begin() as conn:
                flush_counts(conn, naming, worker, since, counts)

        return cls(write, interval, source)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="inbox-counts", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def flush(self) -> None:
        changed = self.changes()
        if not changed:
            return
        try:
            self._write(self.source.worker, self.source.since, changed)
        except Exception as exc:
            self.failed(exc)
        else:
            self.done(changed)

    def stop(self) -> None:
        """Stop the thread and write what was counted since the last flush."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout=self.interval + 5)
        self.flush()


class AsyncCountFlusher(_Flushes):
    """Flushes the counts from an asyncio task (a FastStream app), and once more on
    `stop`. ``write(worker, since, counts)`` performs one flush."""

    def __init__(
        self,
        write: Callable[[str, datetime, Counts], Awaitable[None]],
        interval: float,
        source: Tally = tally,
    ) -> None:
        super().__init__(interval, source)
        self._write = write
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def for_engine(
        cls, engine: Any, naming: InboxSchema, interval: float, source: Tally = tally
    ) -> AsyncCountFlusher:
        """A flusher writing through an `AsyncEngine`."""

        async def write(worker: str, since: datetime, counts: Counts) -> None:
            async with engine.begin() as conn:
                await flush_counts_async(conn, naming, worker, since, counts)

        return cls(write, interval, source)

    def start(self) -> None:
        """Start the task on the running loop (again, if a previous loop's task ended)."""
        if self._task is not None and not self._task.done():
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="inbox-counts")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.flush()

    async def flush(self) -> None:
        changed = self.changes()
        if not changed:
            return
        try:
            await self._write(self.source.worker, self.source.since, changed)
        except Exception as exc:
            self.failed(exc)
        else:
            self.done(changed)

    async def stop(self) -> None:
        """Stop the task and write what was counted since the last flush."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await self.flush()
