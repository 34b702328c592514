"""The dispatcher: leases due effects, delivers them outside any transaction, records
the outcome while its lease holds.

One batch::

    dispatcher                       PostgreSQL                     remote
    ----------                       ----------                     ------
    BEGIN
    lease: UPDATE ... FROM (SELECT ... FOR UPDATE SKIP LOCKED)
           token T, leased_until = now() + lease, attempts + 1
    COMMIT ─────────────────────────> leased (other dispatchers skip these rows)
    deliver each, timeout < lease  ──────────────────────────────> POST, Idempotency-Key
                                                                   (applied once per key)
    BEGIN
    settle: UPDATE ... WHERE lease_token = T
    COMMIT ─────────────────────────> dispatched / pending again / failed

Wake-ups (``listen``) need a session-level connection: LISTEN registers in one server
session, and a transaction pooler (PgBouncer in transaction mode) hands that session to
other clients between transactions, so notifications never reach the dispatcher. At
start-up the dispatcher sends itself a probe NOTIFY the way `outbox.add` sends one
(through ``engine``); if the LISTEN connection does not receive it, a warning says so and
the dispatcher polls. ``listen_url`` points the LISTEN connection elsewhere (the server
itself) while the leases still go through the pooler.

A dispatcher that dies holds its leases until ``leased_until``; the lease also moved
``next_attempt_at`` there, so the effects are due again then and another dispatcher takes
them over. Deliveries end (or are cancelled) before the lease does, so two dispatchers
never deliver one effect at the same time. If a result comes back after the lease was
taken over anyway (a stalled process, a paused VM), the token no longer matches: the
outcome is not recorded, the loss is logged and counted in `DispatcherStats`, and the
new holder delivers the effect again with the same idempotency key, which the remote
answers without applying it twice.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import URL, Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError

from .._core.consumption import backoff_delay
from .._core.exceptions import ConfigurationError
from .._observe.instruments import metrics
from .._storage.tables import InboxSchema
from ._destination import Destination, Destinations, Effect
from ._errors import PermanentDeliveryError, database_error
from ._statements import DISPATCHED, FAILED, PENDING, OutboxStatements, statements_for

__all__ = ["Backoff", "Dispatcher", "DispatcherStats"]

logger = logging.getLogger("inbox_middleware.outbox")
T = TypeVar("T")

_LEASE_SPARE = 0.2  # the share of the lease no delivery may use: cancellation, clock drift
_MIN_SHARE = 0.1  # a delivery with less than this share of delivery_timeout left is not started
_MAX_ERROR = 2000
_PROBE_TIMEOUT = 5.0  # seconds a probe NOTIFY may take to reach the LISTEN connection
_BURST_HORIZON = 1.0
"""Seconds ahead a burst (`Dispatcher.run(burst=True)`) still waits for a pending effect:
the first retry of the default backoff comes within it."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before a retry: exponential, capped, partly random.

    Retry ``n`` (after the ``n``-th failed attempt) waits ``min(cap, base * factor**(n-1))``
    seconds, of which the share ``jitter`` is drawn at random, so effects that failed
    together (the remote was down) do not all come back at the same instant.
    """

    base: float = 1.0
    factor: float = 2.0
    cap: float = 300.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if not (self.base > 0 and self.factor >= 1 and self.cap >= self.base):
            raise ConfigurationError("backoff needs base > 0, factor >= 1 and cap >= base")
        if not 0 <= self.jitter <= 1:
            raise ConfigurationError("backoff jitter is a share between 0 and 1")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1 for the first);
        ``rng`` makes the random share reproducible."""
        ceiling = backoff_delay(self.base, self.cap, attempt, self.factor)
        spread = ceiling * self.jitter
        return ceiling - spread + (rng or random).uniform(0, spread)


@dataclass(slots=True)
class DispatcherStats:
    """Counters since the dispatcher started."""

    batches: int = 0
    leased: int = 0
    dispatched: int = 0
    retried: int = 0
    failed: int = 0
    released: int = 0
    leases_lost: int = 0
    """Outcomes not recorded because another dispatcher had taken the lease over."""


class _Stoppable(abc.ABC):
    """What both dispatchers share: `stop` from any thread, `start` in a thread of its own.
    A subclass sets ``_loop``, ``_stopping`` and ``_aborting`` while it runs."""

    _stop_requested: bool
    _abort_requested: bool
    _loop: asyncio.AbstractEventLoop | None
    _stopping: asyncio.Event | None
    _aborting: asyncio.Event | None

    @abc.abstractmethod
    async def run(self, *, burst: bool = False) -> None:
        """Dispatch until stopped (``burst``: until nothing is due)."""

    def stop(self, *, now: bool = False) -> None:
        """Stop after the in-flight deliveries (``now``: cancel and release them at once).

        Safe to call from any thread and from a signal handler.
        """
        self._stop_requested = True
        self._abort_requested = self._abort_requested or now
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def request() -> None:
            assert self._stopping is not None
            assert self._aborting is not None
            self._stopping.set()
            if self._abort_requested:
                self._aborting.set()

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            request()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(request)

    def start(self) -> threading.Thread:
        """Run in a daemon thread with its own event loop; `stop` it, then ``join()``."""
        thread = threading.Thread(
            target=asyncio.run, args=(self.run(),), name="outbox-dispatcher", daemon=True
        )
        thread.start()
        return thread


class Dispatcher(_Stoppable):
    """Delivers recorded effects through their destinations (PostgreSQL only).

    Run it with ``await dispatcher.run()`` in an event loop, with `start` in a thread of
    its own, or as ``inbox-middleware outbox run``. `stop` ends it gracefully.

    Parameters:
      engine: a synchronous PostgreSQL `Engine` (psycopg); its statements run in threads.
      destinations: the destinations by name; only their effects are leased.
      naming: schema and table prefix of the outbox table.
      batch_size: the most effects leased at once.
      lease: seconds a lease lasts; a dead dispatcher's effects are taken over after it.
      delivery_timeout: seconds one delivery may take; at most 80% of ``lease``.
      max_attempts: attempts before an effect is ``failed``.
      backoff: the delay between attempts.
      poll_interval: seconds between looks for due effects while idle.
      listen: also wake up on ``NOTIFY`` from ``outbox.add(..., notify=True)``. It needs
        a session-level connection: through a transaction pooler, a start-up check warns
        and the dispatcher polls (see ``listen_url``).
      listen_url: the database URL of the LISTEN connection (implies ``listen``), when
        ``engine`` goes through a transaction pooler: the same database, on the server
        itself or through a session-mode pooler. Default: ``engine``'s URL.
      shutdown_grace: seconds in-flight deliveries may still take after `stop`; then
        they are cancelled and their leases released. Default: ``delivery_timeout``.
    """

    def __init__(
        self,
        engine: Engine,
        destinations: Mapping[str, Destination],
        *,
        naming: InboxSchema | None = None,
        batch_size: int = 100,
        lease: float = 60.0,
        delivery_timeout: float = 10.0,
        max_attempts: int = 10,
        backoff: Backoff | None = None,
        poll_interval: float = 1.0,
        listen: bool = False,
        listen_url: str | URL | None = None,
        shutdown_grace: float | None = None,
    ) -> None:
        require_postgresql(engine)
        listen = listen or listen_url is not None
        if listen and listen_url is None and engine.dialect.driver != "psycopg":
            raise ConfigurationError("listen=True needs the psycopg driver, or a listen_url")
        self.destinations = (
            destinations if isinstance(destinations, Destinations) else Destinations(destinations)
        )
        if not self.destinations:
            raise ConfigurationError("the dispatcher has no destinations")
        if batch_size < 1 or max_attempts < 1:
            raise ConfigurationError("batch_size and max_attempts must be at least 1")
        if not 0 < delivery_timeout <= lease * (1 - _LEASE_SPARE):
            raise ConfigurationError(
                f"delivery_timeout ({delivery_timeout}s) must be positive and at most "
                f"{1 - _LEASE_SPARE:.0%} of the lease ({lease}s), so that a delivery ends "
                "before another dispatcher may take the effect over"
            )
        if poll_interval <= 0:
            raise ConfigurationError("poll_interval must be positive")
        self.engine = engine
        self.naming = naming or InboxSchema()
        self.batch_size = batch_size
        self.lease = lease
        self.delivery_timeout = delivery_timeout
        self.max_attempts = max_attempts
        self.backoff = backoff or Backoff()
        self.poll_interval = poll_interval
        self.listen = listen
        self.listen_url = make_url(listen_url) if listen_url is not None else engine.url
        self.listening = False
        """True while a LISTEN connection that notifications are known to reach is open."""
        self.shutdown_grace = delivery_timeout if shutdown_grace is None else shutdown_grace
        self.stats = DispatcherStats()
        self._database = ""  # the map's name of its database, under a `RoutedDispatcher`
        self._statements: OutboxStatements = statements_for(self.naming, "postgresql")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._aborting: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._stop_requested = False
        self._abort_requested = False
        self.on_leased: Callable[[list[Effect]], None] | None = None
        """Called with each leased batch before delivery (for tests and metrics)."""

    # -- running --------------------------------------------------------------------------

    async def run(self, *, burst: bool = False) -> None:
        """Dispatch until `stop` is called (``burst``: until nothing is due)."""
        self._loop = asyncio.get_running_loop()
        self._stopping, self._aborting, self._wake = (asyncio.Event() for _ in range(3))
        if self._stop_requested:
            self._stopping.set()
        if self._abort_requested:
            self._aborting.set()
        listener = asyncio.create_task(self._listen()) if self.listen else None
        logger.info(
            "outbox dispatcher started: dispatching to %s from %s, polling every %ss%s, "
            "batch %d, lease %ss",
            ", ".join(self.destinations) or "no destination",
            self.engine.url.render_as_string(hide_password=True),
            self.poll_interval,
            " and on NOTIFY" if self.listen else "",
            self.batch_size,
            self.lease,
        )
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                try:
                    count = await self.dispatch_once()
                except Exception as exc:
                    mapped = database_error(exc)
                    if mapped is None:
                        raise
                    logger.warning("outbox dispatcher: %s; retrying", mapped)
                    count = 0
                if burst and count == 0:
                    # A burst drains what is due or about to be: a retry a moment away
                    # (the first backoff) is waited for, one due later stays pending.
                    wait = await self._storage("looking for the next due effect", self._next_due)
                    if wait is None or wait > _BURST_HORIZON:
                        break
                    await self._idle(max(wait, 0.01))
                elif count < self.batch_size and not burst:
                    await self._idle()
        finally:
            if listener is not None:
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener
            await self.destinations.aclose()
            logger.info("outbox dispatcher stopped: %s", self.stats)

    def _join(
        self,
        loop: asyncio.AbstractEventLoop | None,
        stopping: asyncio.Event,
        aborting: asyncio.Event,
    ) -> None:
        """Take another runner's loop and stop events (`RoutedDispatcher`, which calls
        `dispatch_once` for each database): its `stop` ends this one's deliveries too."""
        self._loop, self._stopping, self._aborting = loop, stopping, aborting

    async def _idle(self, seconds: float | None = None) -> None:
        """Wait ``seconds`` (default: the poll interval), until stopped or woken."""
        assert self._stopping is not None
        assert self._wake is not None
        waits = [asyncio.ensure_future(self._stopping.wait())]
        if self.listen:
            waits.append(asyncio.ensure_future(self._wake.wait()))
        try:
            await asyncio.wait(
                waits,
                timeout=self.poll_interval if seconds is None else seconds,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for wait in waits:
                wait.cancel()

    async def _listen(self) -> None:
        """Keep a LISTEN connection open; each notification wakes the idle loop.

        Each time it connects, a probe NOTIFY sent through the engine must reach it; if
        none does (a transaction pooler in between), it warns once and gives up: the
        dispatcher keeps polling.
        """
        import psycopg

        assert self._wake is not None
        url = self.listen_url.set(drivername="postgresql")
        dsn = url.render_as_string(hide_password=False)
        channel = self._statements.channel  # validated identifiers: safe between quotes
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                    await conn.execute(f'LISTEN "{channel}"')
                    if not await self._probe(conn):
                        logger.warning(
                            "outbox dispatcher: a NOTIFY sent through the engine did not reach "
                            "the LISTEN connection (%s) within %ss: they do not share a session-"
                            "level path (a transaction pooler such as PgBouncer in transaction "
                            "mode?). Wake-ups are off; polling every %ss. Give listen_url "
                            "(--listen-url) a connection to the server itself to wake on NOTIFY.",
                            url.render_as_string(hide_password=True),
                            _PROBE_TIMEOUT,
                            self.poll_interval,
                        )
                        return
                    self.listening = True
                    logger.info("outbox dispatcher: woken by NOTIFY on %s", channel)
                    self._wake.set()  # anything recorded while not listening
                    async for _ in conn.notifies():
                        self._wake.set()
            except (psycopg.Error, DBAPIError) as exc:
                logger.warning("outbox LISTEN connection failed (%s); polling meanwhile", exc)
            finally:
                self.listening = False
            await asyncio.sleep(self.poll_interval)

    async def _probe(self, conn: Any) -> bool:
        """Whether a NOTIFY committed through the engine reaches ``conn`` in time."""
        assert self._wake is not None
        token = f"inbox-probe-{uuid.uuid4().hex}"
        await asyncio.to_thread(self._send_probe, token)
        async for notify in conn.notifies(timeout=_PROBE_TIMEOUT):
            if notify.payload == token:
                return True
            self._wake.set()  # a real notification meanwhile
        return False

    def _send_probe(self, token: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                self._statements.probe, {"channel": self._statements.channel, "payload": token}
            )

    # -- one batch ------------------------------------------------------------------------

    async def dispatch_once(self) -> int:
        """Lease one batch of due effects, deliver it, record the outcomes; return its size."""
        started = time.monotonic()  # before the lease: the local deadline errs early
        token = uuid.uuid4().hex
        effects = await self._storage("leasing", self._lease, token)
        if not effects:
            return 0
        self.stats.batches += 1
        self.stats.leased += len(effects)
        if self.on_leased is not None:
            self.on_leased(effects)
        deadline = started + self.lease * (1 - _LEASE_SPARE)
        tasks = [
            asyncio.create_task(self._deliver(effect, deadline), name=effect.effect_id)
            for effect in effects
        ]
        try:
            await self._wait_for(tasks, started + self.lease)
        finally:
            # Also when this coroutine is cancelled: whatever is still running is
            # cancelled, and every lease is settled or released before returning.
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            outcomes = [
                result if isinstance(result, dict) else _released(effect)
                for effect, result in zip(effects, results, strict=True)
            ]
            await asyncio.shield(self._storage("recording outcomes", self._settle, token, outcomes))
        return len(effects)

    async def _wait_for(self, tasks: list[asyncio.Task[dict[str, Any]]], lease_end: float) -> None:
        """Until the deliveries end; after `stop`, for ``shutdown_grace`` at most.

        Each delivery is cancelled at its timeout, within the lease; one still running
        when the lease has run out does not end when cancelled (a destination that
        catches `CancelledError` and goes on). The batch waits for it, and the dispatcher
        leases nothing meanwhile: a warning says so, again at each further lease's length.
        """
        assert self._stopping is not None
        assert self._aborting is not None
        pending: set[asyncio.Future[Any]] = set(tasks)
        stopping = asyncio.ensure_future(self._stopping.wait())
        warn_at = lease_end
        try:
            while pending and not stopping.done():
                left = warn_at - time.monotonic()
                if left <= 0:
                    logger.warning(
                        "outbox dispatcher: deliveries still running %.0fs into a %.3gs "
                        "lease, not ended by cancellation (%s); the dispatcher leases nothing "
                        "until they end",
                        time.monotonic() - lease_end + self.lease,
                        self.lease,
                        ", ".join(
                            sorted(t.get_name() for t in pending if isinstance(t, asyncio.Task))
                        ),
                    )
                    warn_at += self.lease
                    continue
                done, _ = await asyncio.wait(
                    [*pending, stopping], timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                pending -= done
        finally:
            stopping.cancel()
        if not pending:
            return
        logger.info(
            "outbox dispatcher stopping: up to %ss for %d in-flight deliveries",
            self.shutdown_grace,
            len(pending),
        )
        aborting = asyncio.ensure_future(self._aborting.wait())
        deadline = time.monotonic() + self.shutdown_grace
        try:
            while pending and not aborting.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                done, _ = await asyncio.wait(
                    [*pending, aborting], timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                pending -= done
        finally:
            aborting.cancel()

    async def _deliver(self, effect: Effect, deadline: float) -> dict[str, Any]:
        if effect.attempt > self.max_attempts:
            return self._failed(
                effect,
                f"attempt {effect.attempt - 1} ended without a result before its lease expired "
                "(its dispatcher stopped or died)",
            )
        timeout = min(self.delivery_timeout, deadline - time.monotonic())
        if timeout < self.delivery_timeout * _MIN_SHARE:
            return _released(effect)  # too little of the lease left to start
        destination = self.destinations[effect.destination]
        try:
            async with asyncio.timeout(timeout):
                result = await destination.deliver(effect, timeout)
        except TimeoutError:
            # Ambiguous: the remote may have applied it. The retry also waits for the
            # lease's end, in case the attempt is still running somewhere (a thread).
            return self._retry(effect, f"TimeoutError: no answer within {timeout:.3g}s", True)
        except PermanentDeliveryError as exc:
            return self._failed(effect, _describe(exc), exc.result)
        except Exception as exc:
            return self._retry(effect, _describe(exc), False, getattr(exc, "result", None))
        return _outcome(effect, DISPATCHED, result=_json(result, present=True))

    def _retry(
        self, effect: Effect, error: str, after_lease: bool, result: Any = None
    ) -> dict[str, Any]:
        if effect.attempt >= self.max_attempts:
            return self._failed(effect, f"gave up after {effect.attempt} attempts: {error}", result)
        delay = self.backoff.delay(effect.attempt)
        logger.warning(
            "outbox effect %s (%s) attempt %d failed, retrying in %.1fs: %s",
            effect.effect_id,
            effect.destination,
            effect.attempt,
            delay,
            error,
        )
        return _outcome(
            effect, PENDING, error=error, delay=delay, after_lease=after_lease, result=_json(result)
        )

    def _failed(self, effect: Effect, error: str, result: Any = None) -> dict[str, Any]:
        logger.error(
            "outbox effect %s (%s) failed: %s", effect.effect_id, effect.destination, error
        )
        return _outcome(effect, FAILED, error=error, result=_json(result))

    # -- storage (in a worker thread) -----------------------------------------------------

    async def _storage(self, what: str, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` in a worker thread, awaited; each lease's length it goes without
        an answer, a warning says so.

        The server bounds what it runs (`OutboxStatements.bounds`), but not what never
        reaches it or never comes back: a connection lost without a reset (a half-open
        TCP connection) or a statement a pooler holds while the server is down. Then the
        dispatcher leases nothing, and would otherwise say nothing.
        """
        work = asyncio.ensure_future(asyncio.to_thread(call, *args))
        began = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({work}, timeout=self.lease)
                if done:
                    return work.result()
                logger.warning(
                    "outbox dispatcher: %s has had no answer from the database for %.0fs "
                    "(a connection lost without a reset, or a pooler holding the statement "
                    "while the server is down?); still waiting",
                    what,
                    time.monotonic() - began,
                )
        finally:
            work.cancel()  # when cancelled: the thread runs on, its result dropped

    def _bound(self, conn: Connection) -> None:
        """Bound the transaction on the server: its statements, and its waits for this
        client, to a lease's length (beyond it, a lease obtained has already run out)."""
        conn.execute(self._statements.bounds, {"ms": str(max(1, round(self.lease * 1000)))})

    def _next_due(self) -> float | None:
        with self.engine.connect() as conn:
            self._bound(conn)
            seconds = conn.execute(
                self._statements.next_due, {"destinations": list(self.destinations)}
            ).scalar()
        return None if seconds is None else float(seconds)

    def _lease(self, token: str) -> list[Effect]:
        with self.engine.begin() as conn:
            self._bound(conn)
            rows = conn.execute(
                self._statements.lease,
                {
                    "destinations": list(self.destinations),
                    "limit": self.batch_size,
                    "lease": timedelta(seconds=self.lease),
                    "token": token,
                },
            ).all()
        return [
            Effect(
                effect_id=row.effect_id,
                destination=row.destination,
                payload=row.payload,
                headers=row.headers,
                attempt=row.attempts,
                created_at=row.created_at,
            )
            for row in rows
        ]

    def _settle(self, token: str, outcomes: list[dict[str, Any]]) -> None:
        params = OutboxStatements.settle_params(token, outcomes)
        with self.engine.begin() as conn:
            self._bound(conn)
            recorded = set(conn.scalars(self._statements.settle, params))
        stats = self.stats
        for outcome in outcomes:
            metrics.outbox(outcome["destination"], _counted(outcome, recorded), self._database)
            if outcome["effect_id"] not in recorded:
                stats.leases_lost += 1
                logger.warning(
                    "outbox effect %s: lease lost to another dispatcher before its outcome "
                    "(%s) was recorded; the new holder delivers it again with the same "
                    "idempotency key",
                    outcome["effect_id"],
                    outcome["status"],
                )
            elif outcome["uncount"]:
                stats.released += 1
            elif outcome["status"] == DISPATCHED:
                stats.dispatched += 1
            elif outcome["status"] == FAILED:
                stats.failed += 1
            else:
                stats.retried += 1


def require_postgresql(engine: object) -> None:
    """Refuse anything but a synchronous PostgreSQL engine, saying why."""
    if not isinstance(engine, Engine):
        raise ConfigurationError(
            f"the dispatcher needs a synchronous sqlalchemy Engine, got {type(engine).__name__}"
        )
    if engine.dialect.name != "postgresql":
        raise ConfigurationError(
            "the outbox dispatcher needs PostgreSQL (it leases with FOR UPDATE SKIP "
            f"LOCKED); on {engine.dialect.name} effects can be recorded, not dispatched"
        )


def _outcome(
    effect: Effect,
    status: str,
    *,
    result: str | None = None,
    error: str | None = None,
    delay: float = 0.0,
    after_lease: bool = False,
    uncount: int = 0,
) -> dict[str, Any]:
    return {
        "effect_id": effect.effect_id,
        "destination": effect.destination,  # for the metrics; not written
        "status": status,
        "result": result,
        "error": None if error is None else error[:_MAX_ERROR],
        "delay": delay,
        "after_lease": after_lease,
        "uncount": uncount,
    }


def _counted(outcome: dict[str, Any], recorded: set[str]) -> str:
    """The ``outcome`` label of an attempt in ``inbox_outbox_attempts_total``."""
    if outcome["effect_id"] not in recorded:
        return "lost_lease"
    if outcome["uncount"]:
        return "released"
    if outcome["status"] == DISPATCHED:
        return "delivered"
    return "failed" if outcome["status"] == FAILED else "retry"


def _released(effect: Effect) -> dict[str, Any]:
    """Give the lease back unattempted (or interrupted): due now, the attempt not counted."""
    return _outcome(effect, PENDING, uncount=1)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _json(value: Any, *, present: bool = False) -> str | None:
    """The remote result as JSON text for the database; non-JSON values as their repr."""
    if value is None and not present:
        return None
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return json.dumps({"repr": repr(value)[:_MAX_ERROR]})
