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

A worker over many databases counts each settlement under its delivery's database too,
and `RoutedCountFlusher` (`AsyncRoutedCountFlusher`) writes each database's counts to
that database, so ``inbox-middleware status --map`` shows each database's own. A
delivery that routes to no database (an unknown tenant) is counted in memory only: no
database holds it.
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
    "AsyncRoutedCountFlusher",
    "CountFlusher",
    "RoutedCountFlusher",
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
"""Counts by (consumer, outcome)."""
_Keyed = dict[tuple[str, str, str], int]  # by (consumer, outcome, database); "": one database


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
        self._threads: list[_Keyed] = []
        self._lock = threading.Lock()
        host = socket.gethostname()[:100]
        self.worker = f"{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.since = datetime.now(UTC)

    def count(self, consumer: str, outcome: str, database: str = "") -> None:
        """One settlement more: the hot path's only cost (no lock, no I/O). ``database``:
        the map's name of the delivery's database, for a worker over many."""
        try:
            counts: _Keyed = self._local.counts
        except AttributeError:
            counts = self._thread_counts()
        key = (consumer, outcome, database)
        counts[key] = counts.get(key, 0) + 1

    def _thread_counts(self) -> _Keyed:
        counts: _Keyed = {}
        self._local.counts = counts
        with self._lock:
            self._threads.append(counts)
        return counts

    def _all(self) -> _Keyed:
        """Every thread's counts, summed (each thread's dict copied whole, atomically)."""
        with self._lock:
            threads = list(self._threads)
        totals: _Keyed = {}
        for counts in threads:
            for key, value in dict(counts).items():
                totals[key] = totals.get(key, 0) + value
        return totals

    def totals(self, database: str = "") -> Counts:
        """The counts of one database (by default, those of a worker over one)."""
        return {(c, o): v for (c, o, d), v in self._all().items() if d == database}

    def databases(self) -> set[str]:
        """The databases of a map that counts were taken for."""
        return {d for (_, _, d) in self._all() if d}


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

    def __init__(self, interval: float, source: Tally, database: str = "") -> None:
        self.interval = interval
        self.source = source
        self.database = database
        self._written: Counts = {}
        self._failing = False

    def changes(self) -> Counts:
        totals = self.source.totals(self.database)
        return {k: v for k, v in totals.items() if self._written.get(k) != v}

    def done(self, written: Counts) -> None:
        self._written.update(written)
        if self._failing:
            self._failing = False
            logger.info("the inbox's settlement counts are written again%s", self._where())

    def failed(self, error: Exception) -> None:
        if not self._failing:  # once per outage: the next flush retries
            self._failing = True
            cause = getattr(error, "orig", None) or error  # the driver's, without the SQL
            logger.warning(
                "could not write the inbox's settlement counts%s (%s: %s); retrying every "
                "%gs, nothing is lost meanwhile",
                self._where(),
                type(cause).__name__,
                (str(cause).strip().splitlines() or [""])[0],
                self.interval,
            )

    def _where(self) -> str:
        return f" to database {self.database}" if self.database else ""


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


RoutedWrite = Callable[[str, str, datetime, Counts], Any]
"""``write(database, worker, since, counts)``: one flush of one database's counts."""


class _PerDatabase:
    """What the routed flushers share: one `_Flushes` per database counts were taken for,
    each failing and recovering on its own (one database down delays only its counts)."""

    interval: float
    source: Tally
    _databases: dict[str, _Flushes]

    def _each(self) -> list[tuple[_Flushes, Counts]]:
        found = self._databases
        changed = []
        for database in sorted(self.source.databases()):
            flushes = found.get(database)
            if flushes is None:
                flushes = found[database] = _Flushes(self.interval, self.source, database)
            counts = flushes.changes()
            if counts:
                changed.append((flushes, counts))
        return changed


class RoutedCountFlusher(_PerDatabase, CountFlusher):
    """`CountFlusher` for a worker over many databases (Dramatiq): each database's counts
    go to that database, through ``write(database, worker, since, counts)``."""

    def __init__(self, write: RoutedWrite, interval: float, source: Tally = tally) -> None:
        super().__init__(lambda *args: None, interval, source)
        self._write_to = write
        self._databases = {}

    @classmethod
    def for_routed(cls, routed: Any, interval: float, source: Tally = tally) -> RoutedCountFlusher:
        """A flusher writing through a `RoutedInbox`'s engine of each database."""

        def write(database: str, worker: str, since: datetime, counts: Counts) -> None:
            inbox = routed.inbox(database)
            with inbox.engine.begin() as conn:
                flush_counts(conn, inbox.naming, worker, since, counts)

        return cls(write, interval, source)

    def flush(self) -> None:
        for flushes, counts in self._each():
            try:
                self._write_to(flushes.database, self.source.worker, self.source.since, counts)
            except Exception as exc:
                flushes.failed(exc)
            else:
                flushes.done(counts)


class AsyncRoutedCountFlusher(_PerDatabase, AsyncCountFlusher):
    """`AsyncCountFlusher` for a worker over many databases (FastStream)."""

    def __init__(self, write: RoutedWrite, interval: float, source: Tally = tally) -> None:
        super().__init__(_nothing, interval, source)
        self._write_to = write
        self._databases = {}

    @classmethod
    def for_routed(
        cls, routed: Any, interval: float, source: Tally = tally
    ) -> AsyncRoutedCountFlusher:
        """A flusher writing through an `AsyncRoutedInbox`'s engine of each database."""

        async def write(database: str, worker: str, since: datetime, counts: Counts) -> None:
            inbox = routed.inbox(database)
            async with inbox.engine.begin() as conn:
                await flush_counts_async(conn, inbox.naming, worker, since, counts)

        return cls(write, interval, source)

    async def flush(self) -> None:
        for flushes, counts in self._each():
            try:
                await self._write_to(
                    flushes.database, self.source.worker, self.source.since, counts
                )
            except Exception as exc:
                flushes.failed(exc)
            else:
                flushes.done(counts)


async def _nothing(*args: Any) -> None:
    return None
