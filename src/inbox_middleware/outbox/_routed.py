"""The dispatcher over many databases: every database of a `DatabaseMap` (or one
tenant's), each leased with ``FOR UPDATE SKIP LOCKED`` as one `Dispatcher` does, in a
bounded round robin.

A fleet over many databases records each effect in its tenant's database, in the
handler's transaction (the handler's session is that database's). One `RoutedDispatcher`
covers them all without polling hundreds of databases every tick::

    every poll_interval          the next ``sweep`` databases of the rotation are looked at
    a look that leased effects   that database is looked at again at once (it is "hot")
    at most ``parallel``         databases are looked at (leased, delivered, settled) at once
    a database that fails        is paused (backoff up to ``down_pause_cap``), the others go on

So an effect recorded in a database nobody is dispatching from waits at most
``ceil(databases / sweep) * poll_interval`` seconds for its look (`latency_bound`), plus
the time the ``parallel`` slots are busy delivering other databases' batches; a database
with a backlog is drained batch after batch. Several dispatchers over one map share the
work as they do over one database: their leases skip each other's rows.

One database's outage stops only its own dispatching: its look fails (or times out
connecting, ``connect_timeout``), it is paused and tried again later, and it holds one of
the ``parallel`` slots at most meanwhile. Effects whose outcome could not be recorded
(the database went down after the delivery) stay leased until their lease ends and are
delivered again, with the same effect id as the idempotency key: at least once, and once
downstream where the destination dedupes by that key.

Wake-ups on NOTIFY are for one database (`Dispatcher`'s ``listen``): a LISTEN connection
per database would hold as many connections as there are databases, and would not work
through a transaction pooler anyway. Here the rotation is the wake-up.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from sqlalchemy import Engine, create_engine
from sqlalchemy.exc import DBAPIError

from .._core.exceptions import ConfigurationError, InboxError, RouteUnavailable
from .._core.tenancy import Router
from .._storage.engines import pooler_connect_args
from .._storage.migrate import check_schema
from .._storage.routed import database_url
from .._storage.tables import InboxSchema
from ._destination import Destination, Destinations
from ._dispatcher import _BURST_HORIZON, Backoff, Dispatcher, DispatcherStats, _Stoppable
from ._errors import database_error

__all__ = ["RoutedDispatcher"]

logger = logging.getLogger("inbox_middleware.outbox")

DEFAULT_SWEEP = 10
"""Idle databases looked at per poll interval."""
DEFAULT_PARALLEL = 4
"""Databases looked at (leased, delivered, settled) at the same time."""
DEFAULT_KEEP_OPEN = 16
"""Databases whose connection stays open between looks; the others reconnect."""


class RoutedDispatcher(_Stoppable):
    """Delivers the effects recorded in every database of a map (PostgreSQL only).

    Run it as `Dispatcher` is run: ``await dispatcher.run()``, `start` in a thread, or
    ``inbox-middleware outbox run --map FILE``; `stop` ends it gracefully.

    Every ``poll_interval`` it looks at the next ``sweep`` databases of the map, in
    turn; a database whose look leased effects is looked at again at once, until it has
    none due; at most ``parallel`` databases are looked at together. An effect recorded
    in an idle database is leased within `latency_bound` seconds (plus the time the
    slots are busy), and each database is leased with ``FOR UPDATE SKIP LOCKED``, so
    several dispatchers over one map share the work. A database that fails is left
    alone for ``down_pause`` seconds (doubled at each failure in a row) while the
    others go on; its effects wait, leased ones until their lease ends.

    Parameters:
      router: the `DatabaseMap` (or `MapFile`, read again as it changes).
      destinations: the destinations by name, shared by every database.
      databases: only these databases of the map (default: every one, as the map names
        them at each rotation).
      sweep: idle databases looked at per ``poll_interval``.
      parallel: databases looked at, at most, at the same time (a database that hangs
        holds one of these slots).
      keep_open: databases whose single connection stays open between looks; beyond
        it, the least recently used one is closed (so a dispatcher holds at most
        ``max(parallel, keep_open)`` connections, however many databases the map has).
      connect_timeout: seconds a connection attempt waits (a black-holed database).
      down_pause: seconds a failing database is left alone, doubled at each failure in
        a row up to ``down_pause_cap``.
      engine_options: more `create_engine` options for every database.
      naming: as `Dispatcher`, for each database.
      batch_size: as `Dispatcher`, for each database.
      lease: as `Dispatcher`.
      delivery_timeout: as `Dispatcher`.
      max_attempts: as `Dispatcher`.
      backoff: as `Dispatcher`.
      poll_interval: seconds between two sweeps of the rotation.
      shutdown_grace: as `Dispatcher`.
    """

    def __init__(
        self,
        router: Router,
        destinations: Mapping[str, Destination],
        *,
        databases: Sequence[str] | None = None,
        naming: InboxSchema | None = None,
        batch_size: int = 100,
        lease: float = 60.0,
        delivery_timeout: float = 10.0,
        max_attempts: int = 10,
        backoff: Backoff | None = None,
        poll_interval: float = 1.0,
        shutdown_grace: float | None = None,
        sweep: int = DEFAULT_SWEEP,
        parallel: int = DEFAULT_PARALLEL,
        keep_open: int = DEFAULT_KEEP_OPEN,
        connect_timeout: float = 5.0,
        down_pause: float = 1.0,
        down_pause_cap: float = 30.0,
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(router, Router):
            raise ConfigurationError(
                f"router must be a DatabaseMap (or a Router), got {type(router).__name__}"
            )
        if sweep < 1 or parallel < 1 or keep_open < 0:
            raise ConfigurationError("sweep and parallel must be at least 1, keep_open 0 or more")
        if poll_interval <= 0 or connect_timeout <= 0:
            raise ConfigurationError("poll_interval and connect_timeout must be positive")
        if not 0 < down_pause <= down_pause_cap:
            raise ConfigurationError("down_pause must be positive and at most down_pause_cap")
        self.router = router
        self.only = tuple(databases) if databases is not None else None
        for name in self.only if self.only is not None else router.names():
            # A name the map does not know, or not PostgreSQL: ConfigurationError now.
            if database_url(router.url(name), asynchronous=False).get_backend_name() != (
                "postgresql"
            ):
                raise ConfigurationError(
                    f"database {name!r} is not PostgreSQL: the outbox dispatcher leases with "
                    "FOR UPDATE SKIP LOCKED; effects can be recorded there, not dispatched"
                )
        self.destinations = (
            destinations if isinstance(destinations, Destinations) else Destinations(destinations)
        )
        if not self.destinations:
            raise ConfigurationError("the dispatcher has no destinations")
        self.settings: dict[str, Any] = {
            "naming": naming or InboxSchema(),
            "batch_size": batch_size,
            "lease": lease,
            "delivery_timeout": delivery_timeout,
            "max_attempts": max_attempts,
            "backoff": backoff,
            "poll_interval": poll_interval,
            "shutdown_grace": shutdown_grace,
        }
        # The settings are checked now, by a dispatcher that never connects.
        Dispatcher(create_engine("postgresql+psycopg://"), self.destinations, **self.settings)
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.sweep = sweep
        self.parallel = parallel
        self.keep_open = keep_open
        self.connect_timeout = connect_timeout
        self.down_pause = down_pause
        self.down_pause_cap = down_pause_cap
        self.engine_options = dict(engine_options or {})
        self._dispatchers: dict[str, Dispatcher] = {}
        self._open: OrderedDict[str, None] = OrderedDict()
        self._failures: dict[str, int] = {}
        self._down_until: dict[str, float] = {}
        self._checked: set[str] = set()
        self._cursor = 0
        self._names: tuple[str, ...] = ()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._aborting: asyncio.Event | None = None
        self._stop_requested = False
        self._abort_requested = False

    # -- what it covers --------------------------------------------------------------------

    def databases(self) -> tuple[str, ...]:
        """The databases dispatched from: the map's (read again, for a `MapFile`), or the
        ones given. While a map file is being rewritten, the last ones read."""
        if self.only is not None:
            return self.only
        try:
            self._names = self.router.names()
        except RouteUnavailable as exc:
            logger.warning("outbox dispatcher: %s; keeping the databases read before", exc)
        return self._names

    @property
    def latency_bound(self) -> float:
        """Seconds an idle database waits, at most, between two looks: the rotation
        over every database, ``sweep`` per ``poll_interval`` (not counting the time the
        slots are busy delivering, nor a database paused after failing)."""
        return math.ceil(len(self.databases()) / self.sweep) * self.poll_interval

    @property
    def stats(self) -> DispatcherStats:
        """Counters since start, summed over the databases."""
        total = DispatcherStats()
        for one in self.stats_by_database().values():
            for name in (f.name for f in fields(DispatcherStats)):
                setattr(total, name, getattr(total, name) + getattr(one, name))
        return total

    def stats_by_database(self) -> dict[str, DispatcherStats]:
        with self._lock:
            return {name: d.stats for name, d in self._dispatchers.items()}

    def dispatcher(self, database: str) -> Dispatcher:
        """The `Dispatcher` of one database (its engine created at the first call)."""
        with self._lock:
            found = self._dispatchers.get(database)
            if found is None:
                found = self._dispatchers[database] = Dispatcher(
                    self._engine(database), self.destinations, **self.settings
                )
                found._database = database  # its attempts' database label
            if self._stopping is not None and self._aborting is not None:
                found._join(self._loop, self._stopping, self._aborting)
            return found

    def _engine(self, database: str) -> Engine:
        url = database_url(self.router.url(database), asynchronous=False)
        connect: dict[str, Any] = pooler_connect_args(url.get_driver_name())
        connect["connect_timeout"] = max(1, round(self.connect_timeout))
        # A database whose packets are dropped after the connect (a black hole) fails a
        # statement once its bytes go unacknowledged this long, rather than after the
        # kernel's TCP timeout (minutes), so its look ends and frees its slot.
        connect["tcp_user_timeout"] = round(max(self.connect_timeout, 1.0) * 2000)
        connect |= {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5}
        options: dict[str, Any] = {
            "pool_size": 1,  # a look leases, then settles: one connection at a time
            "max_overflow": 1,  # `run(burst=True)`'s look ahead, beside an in-flight look
            "pool_timeout": 30,
            "pool_pre_ping": True,
        }
        options.update(self.engine_options)
        options["connect_args"] = connect | dict(options.get("connect_args", {}))
        return create_engine(url, **options)

    # -- running ---------------------------------------------------------------------------

    async def run(self, *, burst: bool = False) -> None:
        """Dispatch until `stop` is called (``burst``: until no database has an effect
        due, nor due within a second; a database that fails is then reported and left)."""
        self._loop = asyncio.get_running_loop()
        self._stopping, self._aborting = asyncio.Event(), asyncio.Event()
        if self._stop_requested:
            self._stopping.set()
        if self._abort_requested:
            self._aborting.set()
        with self._lock:
            for one in self._dispatchers.values():
                one._join(self._loop, self._stopping, self._aborting)
        logger.info(
            "outbox dispatcher started over %d databases: dispatching to %s, %d databases "
            "per %ss (an idle database is looked at within %ss), %d at a time, batch %d",
            len(self.databases()),
            ", ".join(self.destinations),
            self.sweep,
            self.poll_interval,
            self.latency_bound,
            self.parallel,
            self.batch_size,
        )
        try:
            if burst:
                await self._burst()
            else:
                await self._rotate()
        finally:
            await self.destinations.aclose()
            self.dispose()
            logger.info("outbox dispatcher stopped: %s", self.stats)

    async def _rotate(self) -> None:
        assert self._stopping is not None
        in_flight: dict[asyncio.Task[int], str] = {}
        queued: OrderedDict[str, None] = OrderedDict()  # to look at, in order
        hot: set[str] = set()
        tick_at = 0.0
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                if now >= tick_at:
                    busy = set(in_flight.values())
                    for name in self._next_sweep(now, busy | set(queued)):
                        queued[name] = None
                    tick_at = now + self.poll_interval
                # A database with a backlog goes after the sweep's: it is drained batch
                # after batch, and idle databases still get their look.
                for name in sorted(hot):
                    queued[name] = None
                hot.clear()
                while queued and len(in_flight) < self.parallel:
                    name, _ = queued.popitem(last=False)
                    in_flight[asyncio.create_task(self._look(name))] = name
                timeout = max(0.0, tick_at - time.monotonic())
                done, _ = await asyncio.wait(
                    [*in_flight, stopping], timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    if task is stopping:
                        continue
                    name = in_flight.pop(task)
                    if task.result() > 0:
                        hot.add(name)
        finally:
            stopping.cancel()
            await self._end(list(in_flight))

    async def _end(self, looks: list[asyncio.Task[int]]) -> None:
        """Let the looks in flight end: their deliveries within the shutdown grace (they
        share the stop events); a look stuck on a database that does not answer is
        cancelled after it (its leases end on their own, and the effects are taken over)."""
        if not looks:
            return
        grace = self.settings["shutdown_grace"]
        grace = self.settings["delivery_timeout"] if grace is None else grace
        _, stuck = await asyncio.wait(looks, timeout=grace + self.connect_timeout)
        for look in stuck:
            look.cancel()
        await asyncio.gather(*looks, return_exceptions=True)

    def _next_sweep(self, now: float, skip: set[str]) -> list[str]:
        """The next ``sweep`` databases of the rotation, past the paused ones and those
        already in flight or queued."""
        names = self.databases()
        chosen: list[str] = []
        for _ in range(len(names)):
            if len(chosen) >= self.sweep:
                break
            self._cursor %= len(names)
            name = names[self._cursor]
            self._cursor += 1
            if name in skip or self._down_until.get(name, 0.0) > now:
                continue
            chosen.append(name)
        return chosen

    async def _look(self, database: str) -> int:
        """One batch from ``database``; its size, 0 when the database failed (paused).

        A database is checked before its first lease (its tables at this code's version):
        one not migrated yet is paused and reported, never a reason to stop the others.
        """
        try:
            one = self.dispatcher(database)
            if database not in self._checked:
                await asyncio.to_thread(self._check, one)
                self._checked.add(database)
            count = await one.dispatch_once()
        except Exception as exc:
            mapped = database_error(exc)
            if mapped is None and not isinstance(exc, InboxError | DBAPIError):
                raise
            self._went_down(database, mapped or exc)
            return 0
        if self._failures.pop(database, 0):
            logger.info("outbox dispatcher: database %s answers again", database)
        self._down_until.pop(database, None)
        self._keep(database)
        return count

    def _check(self, one: Dispatcher) -> None:
        with one.engine.connect() as conn:
            check_schema(conn, one.naming)

    def _went_down(self, database: str, reason: BaseException) -> None:
        failures = self._failures[database] = self._failures.get(database, 0) + 1
        pause = min(self.down_pause_cap, self.down_pause * 2 ** (failures - 1))
        self._down_until[database] = time.monotonic() + pause
        logger.warning(
            "outbox dispatcher: database %s failed (%s); the others go on, it is tried "
            "again in %.1fs",
            database,
            reason,
            pause,
        )
        self._close(database)

    def _keep(self, database: str) -> None:
        """Keep ``database``'s connection open, closing the least recently used ones
        beyond ``keep_open``."""
        self._open[database] = None
        self._open.move_to_end(database)
        while len(self._open) > self.keep_open:
            oldest, _ = self._open.popitem(last=False)
            self._close(oldest)

    def _close(self, database: str) -> None:
        self._open.pop(database, None)
        with self._lock:
            one = self._dispatchers.get(database)
        if one is not None:
            # A connection checked out (a look in flight) is closed when it returns; the
            # engine reconnects at the next look.
            one.engine.dispose()

    async def _burst(self) -> None:
        """Passes over every database until one leases nothing and nothing is due soon."""
        assert self._stopping is not None
        while not self._stopping.is_set():
            names = [n for n in self.databases() if n not in self._down_until]
            counts = await self._each(names, self._look)
            if any(counts):
                continue
            waits = await self._each(names, self._next_due)
            soon = [w for w in waits if w is not None and w <= _BURST_HORIZON]
            if not soon:
                break
            await asyncio.sleep(max(min(soon), 0.01))
        for name in self._down_until:
            logger.error("outbox dispatcher: database %s was not dispatched from", name)

    async def _each(self, names: list[str], step: Any) -> list[Any]:
        """``step(name)`` for each database, ``parallel`` at a time."""
        slots = asyncio.Semaphore(self.parallel)

        async def one(name: str) -> Any:
            async with slots:
                return await step(name)

        return list(await asyncio.gather(*(one(name) for name in names)))

    async def _next_due(self, database: str) -> float | None:
        try:
            return await asyncio.to_thread(self.dispatcher(database)._next_due)
        except Exception as exc:
            if database_error(exc) is None:
                raise
            return None

    def dispose(self) -> None:
        """Close every database's connections."""
        with self._lock:
            dispatchers = list(self._dispatchers.values())
        for one in dispatchers:
            one.engine.dispose()
        self._open.clear()
