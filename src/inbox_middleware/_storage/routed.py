"""The inbox over many databases: one `Inbox` (or `AsyncInbox`) per database of a
`DatabaseMap`, chosen for each delivery by its identity.

`RoutedInbox` and `AsyncRoutedInbox` are what the adapters hold in place of one
`Inbox`: ``process``, ``transaction``, ``bookkeep``, ``keep_output`` and ``check`` go to
the database of the delivery they concern, so the claim, the handler's session, the stored
output, the attempts, the poison and the quarantine rows of a delivery all land in its
tenant's database. The consumption core asks for the route first (`ResolveRoute`,
answered by ``bookkeep``) and decides what an unknown tenant or a failed resolution means.

**Connection budget.** Engines are created lazily, at a database's first delivery, each
with a small pool (``pool_size`` connections, no overflow). At most
``connection_budget // pool_size`` databases hold connections at once: when another one
is needed, the least recently used database whose connections are all idle is closed
(its engine disposed; it reopens on its next delivery). When every open database is busy,
the delivery is handed back (`RouteUnavailable`) rather than exceed the budget. So a
worker never holds more than ``connection_budget`` connections, however many databases
the map names; a fleet over hundreds of databases should also put PgBouncer in front of
them (cold connects then cost a pooler round trip, not a PostgreSQL backend start).

**Start-up check.** ``check`` verifies every database the map names: a schema not
migrated or settings that break the guarantee refuse the start, as with one database; a
database that does not answer is left to its first delivery (checked then, lazily, like a
database only a resolver names), so one database down never keeps the fleet from
starting. A database not checked yet is checked before its first claim; while that fails
its deliveries are handed back.

A handler works in its own tenant's database only: there is no transaction over two
databases (no two-phase commit). Write to another tenant through the outbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session

from .._core.consumption import CountHandBack, Op, ResolveRoute
from .._core.exceptions import (
    ConfigurationError,
    DatabaseUnavailable,
    RouteUnavailable,
    TransientError,
    UnknownTenant,
)
from .._core.outputs import Output
from .._core.protocol import Delivery
from .._core.tenancy import (
    DEFAULT_BUSY_WAIT,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_DOWN_PAUSE,
    DEFAULT_DOWN_PAUSE_LIMIT,
    Router,
)
from .._observe.instruments import metrics
from .engines import pooler_connect_args
from .errors import Failure, classify
from .executors import DEFAULT_LOCK_TIMEOUT, DEFAULT_SERIALIZATION_RETRIES, Inbox
from .tables import InboxSchema

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

    from .aio import AsyncInbox

__all__ = [
    "DEFAULT_CONNECTION_BUDGET",
    "DEFAULT_POOL_SIZE",
    "AsyncRoutedInbox",
    "RoutedInbox",
    "database_url",
]

logger = logging.getLogger("inbox_middleware")

DEFAULT_POOL_SIZE = 4
"""Connections per open database."""
DEFAULT_CONNECTION_BUDGET = 64
"""Connections a worker process holds at most over all its databases."""
R = TypeVar("R")


def database_url(url: str, asynchronous: bool) -> Any:
    """The map's URL with the driver the inbox uses: asyncpg for an async inbox, else
    psycopg (or whichever sync driver is installed)."""
    from .engines import parse_url, postgresql_driver

    parsed = parse_url(url)
    if parsed.get_backend_name() != "postgresql":
        return parsed
    if asynchronous:
        return parsed.set(drivername="postgresql+asyncpg")
    driver = postgresql_driver(parsed.set(drivername="postgresql"))
    if driver == "asyncpg":
        raise ConfigurationError("a synchronous routed inbox needs psycopg or psycopg2")
    return parsed.set(drivername=f"postgresql+{driver}")


class _Routes:
    """What both routed inboxes share: the map, the open databases in order of use, and
    the budget rule. ``_open`` holds the databases that may hold connections, least
    recently used first."""

    def __init__(
        self,
        router: Router,
        *,
        naming: InboxSchema | None = None,
        lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT,
        serialization_retries: int = DEFAULT_SERIALIZATION_RETRIES,
        claims: str = "library",
        pool_size: int = DEFAULT_POOL_SIZE,
        connection_budget: int = DEFAULT_CONNECTION_BUDGET,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        engine_options: dict[str, Any] | None = None,
        check_lazily: bool = True,
        down_pause: float = DEFAULT_DOWN_PAUSE,
        down_pause_limit: float = DEFAULT_DOWN_PAUSE_LIMIT,
        busy_wait: float = DEFAULT_BUSY_WAIT,
    ) -> None:
        if not isinstance(router, Router):
            raise ConfigurationError(
                f"router must be a DatabaseMap (or a Router), got {type(router).__name__}"
            )
        if pool_size < 1:
            raise ConfigurationError("pool_size must be one connection or more")
        if connection_budget < pool_size:
            raise ConfigurationError("connection_budget must hold one database's pool")
        if busy_wait < 0:
            raise ConfigurationError("busy_wait must be zero seconds or more")
        self.router = router
        self.naming = naming or InboxSchema()
        self.pool_size = pool_size
        self.connection_budget = connection_budget
        self.max_open = connection_budget // pool_size
        self.connect_timeout = connect_timeout
        self.engine_options = dict(engine_options or {})
        self.storage_options: dict[str, Any] = {
            "naming": self.naming,
            "lock_timeout": lock_timeout,
            "serialization_retries": serialization_retries,
            "claims": claims,
        }
        self._lock = threading.Lock()
        self._open: OrderedDict[str, None] = OrderedDict()
        self._checked: set[str] = set()
        self._down_until: dict[str, float] = {}
        self._downs: dict[str, int] = {}  # failed tries in a row, by database
        self._pauses: dict[str, float] = {}  # the current pause's length, by database
        self._down_since: dict[str, float] = {}  # its first failed try of this outage
        # the deliveries holding a database's places: their token and when they began
        self._holders: dict[str, dict[object, float]] = {}
        self._freed = threading.Condition(self._lock)  # a place was given up
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}
        self.down_pause = down_pause
        self.down_pause_limit = max(down_pause, down_pause_limit)
        self.busy_wait = busy_wait
        self.check_lazily = check_lazily
        self._inboxes: dict[str, Any] = {}  # each database's inbox, made at its first use

    routed = True
    """What the adapters read to mark their arrivals routed."""

    def _busy(self, database: str) -> bool:
        """Whether ``database``'s engine has connections checked out (not to be closed)."""
        inbox = self._inboxes.get(database)
        return inbox is not None and inbox.engine.pool.checkedout() > 0

    def route(self, delivery: Delivery) -> str:
        return self.router.route(delivery.identity)

    def _still_routed(self, deliveries: Sequence[Delivery], database: str) -> None:
        """Once claimed, in the claim's transaction (and last in a bookkeeping write's):
        the map still sends ``deliveries`` to ``database``. A tenant paused (or pointed
        elsewhere) since they were routed is being moved: `RouteUnavailable` rolls the
        transaction back and hands them back, so nothing of theirs commits in the
        database the tenant leaves once its rows have been copied (the copy waits for the
        transactions that wrote there before, `tenants.copy_tenant`)."""
        for delivery in deliveries:
            now = self.route(delivery)  # RouteUnavailable when paused
            if now != database:
                raise RouteUnavailable(
                    f"tenant {delivery.identity.tenant!r} moved to database {now!r} while "
                    f"its delivery was claimed in {database!r}: handed back"
                )

    def resolve(self, delivery: Delivery) -> str:
        """The core's `ResolveRoute`: the database, counted by database and outcome."""
        try:
            database = self.route(delivery)
        except UnknownTenant:
            metrics.route(delivery.consumer, "none", "unknown_tenant")
            raise
        except Exception:
            metrics.route(delivery.consumer, "none", "unresolved")
            raise
        metrics.route(delivery.consumer, database, "routed")
        return database

    def _admit(self, database: str, busy: Callable[[str], bool]) -> list[str]:
        """Mark ``database`` used now; answer the idle databases to close to stay in the
        budget. Raises `RouteUnavailable` when every other open database is busy."""
        with self._lock:
            if database in self._open:
                self._open.move_to_end(database)
                return []
            closing: list[str] = []
            for name in list(self._open):
                if len(self._open) - len(closing) < self.max_open:
                    break
                if not busy(name):
                    closing.append(name)
            if len(self._open) - len(closing) >= self.max_open:
                raise RouteUnavailable(
                    f"the connection budget ({self.connection_budget} connections, "
                    f"{self.max_open} databases of {self.pool_size}) is spent: every open "
                    f"database is busy; database {database!r} waits"
                )
            for name in closing:
                del self._open[name]
            self._open[database] = None
            return closing

    def _options(self, url: Any) -> dict[str, Any]:
        options: dict[str, Any] = {
            "pool_size": self.pool_size,
            "max_overflow": 0,
            "pool_timeout": 30,
            "pool_pre_ping": True,
        }
        options.update(self.engine_options)
        driver = url.get_driver_name()
        connect = pooler_connect_args(driver) if url.get_backend_name() == "postgresql" else {}
        if driver == "asyncpg":
            connect["timeout"] = self.connect_timeout
        elif url.get_backend_name() == "postgresql":
            connect["connect_timeout"] = max(1, round(self.connect_timeout))
        if url.get_backend_name() == "sqlite":
            options = {k: v for k, v in options.items() if k not in ("pool_size", "max_overflow")}
        options["connect_args"] = connect | dict(options.get("connect_args", {}))
        return options

    def _unchecked_failure(self, database: str, exc: Exception) -> TransientError:
        logger.warning("inbox database %s failed its check: %s", database, exc)
        text = f"database {database!r} is not checked yet: {exc}"
        if _unanswered(exc):
            refused = DatabaseUnavailable(text)
            refused.retry_after = self._went_down(database)
            return refused
        return RouteUnavailable(text)

    def _take(self, database: str, token: object, arrived: float) -> float | None:
        """Under the lock: take one of ``database``'s places for ``token`` (None), or answer
        the seconds left to wait for one (0 or less: none, handed back)."""
        holders = self._holders.setdefault(database, {})
        now = time.monotonic()
        if len(holders) < self.pool_size:
            holders[token] = now
            return None
        # Its places are taken: wait while they are young (the database answers and
        # they will be given up soon), not once the oldest has run busy_wait (it hangs).
        return min(arrived, *holders.values()) + self.busy_wait - now

    def _give_up(self, database: str, token: object) -> None:
        with self._lock:
            self._holders[database].pop(token, None)
            self._freed.notify_all()
            waiters = self._waiters.pop(database, [])
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                loop.call_soon_threadsafe(_wake, future)

    def _busy_refusal(self, database: str, consumer: str) -> RouteUnavailable:
        """Under the lock: the refusal of a delivery that found ``database``'s places
        taken. Its oldest has run ``busy_wait`` or more: the database hangs (a query that
        never answers on a connection it had), so it is paused as a database that does
        not answer (`_went_down`: the pause grows while it stays so, and its first answer
        ends it), and its deliveries come back after the pause, not at a fixed pace for as
        long as it hangs. Else (busy, with young deliveries) after one first pause."""
        metrics.route(consumer, database, "busy")
        refused = RouteUnavailable(
            f"database {database!r} holds {self.pool_size} deliveries of this worker "
            f"already (its pool), busy for {self.busy_wait}s or more: handed back"
        )
        now = time.monotonic()
        if now - min(self._holders[database].values()) < self.busy_wait:
            refused.retry_after = self.down_pause
            return refused
        until = self._down_until.get(database, 0.0)
        refused.retry_after = until - now if until > now else self._pause(database, now)
        refused.retry_spread = self._spread(database, now)
        return refused

    @contextlib.contextmanager
    def _slot(self, database: str, consumer: str) -> Iterator[None]:
        """One of the database's ``pool_size`` places for a delivery of this worker. None
        free: the delivery waits for one while they are held by deliveries younger than
        ``busy_wait`` (a database that answers, busy for a moment: a hand-back would cost
        the delivery a pause), else it is handed back at once (`RouteUnavailable`). So a
        database that hangs (packets dropped: a connect or a query that never answers)
        holds at most ``pool_size`` of the worker's threads or tasks, and a few more for
        ``busy_wait`` at most, and the others go on serving the other databases."""
        token, arrived = object(), time.monotonic()
        with self._freed:
            while (left := self._take(database, token, arrived)) is not None:
                if left <= 0:
                    raise self._busy_refusal(database, consumer)
                self._freed.wait(left)
        try:
            yield
        finally:
            self._give_up(database, token)

    @contextlib.asynccontextmanager
    async def _aslot(self, database: str, consumer: str) -> AsyncIterator[None]:
        """`_slot` for an event loop: the wait awaits, it never blocks the loop."""
        token, arrived = object(), time.monotonic()
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                left = self._take(database, token, arrived)
                if left is None:
                    break
                if left <= 0:
                    raise self._busy_refusal(database, consumer)
                freed: asyncio.Future[None] = loop.create_future()
                self._waiters.setdefault(database, []).append((loop, freed))
            try:
                await asyncio.wait((freed,), timeout=left)
            finally:
                with self._lock:
                    waiting = self._waiters.get(database, [])
                    if (loop, freed) in waiting:
                        waiting.remove((loop, freed))
        try:
            yield
        finally:
            self._give_up(database, token)

    def _went_down(self, database: str, consumer: str = "") -> float:
        """Remember that ``database`` does not answer: for a pause its deliveries are
        handed back at once, without a connection attempt, so that a database whose
        packets are dropped does not hold the worker's threads (or its event loop's slots)
        for a connect timeout each, while other databases wait. The pause starts at
        ``down_pause`` and doubles while the database stays down, up to
        ``down_pause_limit``; answers the pause."""
        with self._lock:
            pause = self._pause(database, time.monotonic())
        if consumer:
            metrics.route(consumer, database, "unavailable")
        return pause

    def _pause(self, database: str, now: float) -> float:
        """Under the lock: pause ``database`` from ``now``, for longer than its last pause
        if it did not answer since; answers the pause."""
        downs = self._downs[database] = self._downs.get(database, 0) + 1
        pause = min(self.down_pause * 2.0 ** min(downs - 1, 32), self.down_pause_limit)
        self._down_until[database] = now + pause
        self._pauses[database] = pause
        self._down_since.setdefault(database, now)
        return pause

    def _spread(self, database: str, now: float) -> float:
        """Under the lock: the seconds after its pause over which a paused database's
        hand-backs come back: the pause, or half the time it has been down if longer. Its
        backlog grows with the outage; spread over a fixed pause, it would come back
        through the workers ever faster (a 60 s outage's 900 messages every 10 s), ahead
        of the other tenants' messages on a shared queue; spread over half the outage so
        far, about four times its arrival rate, however long the outage. The price: once
        it answers, its backlog comes back over up to that long."""
        pause = self._pauses.get(database, self.down_pause)
        return max(pause, (now - self._down_since.get(database, now)) / 2)

    def _answered(self, database: str) -> None:
        """``database`` answered: its pauses start again from ``down_pause``."""
        if database in self._downs:
            with self._lock:
                self._downs.pop(database, None)
                self._down_until.pop(database, None)
                self._pauses.pop(database, None)
                self._down_since.pop(database, None)

    def _refuse_if_down(self, database: str, consumer: str) -> None:
        """Hand back at once while ``database`` is paused (the exception's ``retry_after``
        says for how long); once the pause is over, one delivery tries it: the pause is
        stretched by that try's longest wait (``connect_timeout``, then the pause again),
        so the others are still handed back meanwhile. Its answer ends the pause, or its
        failure starts the next, longer one."""
        if database not in self._down_until:
            return
        with self._lock:
            until = self._down_until.get(database)
            if until is None:
                return
            now = time.monotonic()
            left = until - now
            if left <= 0:  # this delivery tries the database; the others wait for it
                self._down_until[database] = now + self.connect_timeout + self.down_pause
                return
            spread = self._spread(database, now)
        metrics.route(consumer, database, "unavailable")
        refused = DatabaseUnavailable(
            f"database {database!r} did not answer; tried again in {left:.1f}s"
        )
        refused.retry_after = left
        refused.retry_spread = spread
        raise refused

    def _failed(self, database: str, consumer: str, exc: DatabaseUnavailable) -> None:
        exc.retry_after = self._went_down(database, consumer)

    @contextlib.contextmanager
    def _reaching(self, database: str, consumer: str, *, pauses: bool = True) -> Iterator[None]:
        """Around a call that reaches ``database`` (its inbox in hand, the refusal of a
        paused database passed): a failure to reach it pauses it (``pauses``); any other
        end is its answer, which ends its pause. The delivery that tries a paused
        database may fail for a reason of its own (its handler's error, a conflict, a
        refused commit): the database answered all the same. Left paused, it would refuse
        that delivery's own bookkeeping (its poison row) and every other delivery until
        the next try, which may be the same delivery again: a Kafka partition whose first
        message fails in its handler would keep its database paused for good."""
        try:
            yield
        except DatabaseUnavailable as exc:
            if pauses and exc.retry_after is None:  # not this process's refusal: it failed now
                self._failed(database, consumer, exc)
            raise
        except Exception:
            self._answered(database)
            raise
        self._answered(database)


class RoutedInbox(_Routes):
    """`Inbox` over the databases of a `DatabaseMap` (sync engines: psycopg).

    Parameters as `Inbox`, and: ``router``, the `DatabaseMap` (or `MapFile`);
    ``pool_size``, connections per open database; ``connection_budget``, connections
    over all databases (see the module for the rule); ``connect_timeout``, seconds a
    connection attempt waits; ``engine_options``, more `create_engine` options;
    ``check_lazily``, whether a database is checked before its first claim;
    ``down_pause`` and ``down_pause_limit``, seconds a database that did not answer is
    not tried again, the first time and at most (doubling in between); ``busy_wait``,
    seconds a delivery waits for a place among its database's ``pool_size`` while they
    are taken by deliveries younger than that (see ``_slot``)."""

    def inbox(self, database: str) -> Inbox:
        """The `Inbox` of one database, its engine created at the first call."""
        with self._lock:
            found = self._inboxes.get(database)
            if found is None:
                url = database_url(self.router.url(database), asynchronous=False)
                engine = create_engine(url, **self._options(url))
                found = self._inboxes[database] = Inbox(engine, **self.storage_options)
            return found

    @property
    def engines(self) -> dict[str, Engine]:
        """The engines created so far, by database."""
        return {name: inbox.engine for name, inbox in self._inboxes.items()}

    def _use(self, database: str, consumer: str) -> Inbox:
        """The inbox of ``database``, where a delivery was routed: refused at once while
        the database is down, checked at its first use."""
        self._refuse_if_down(database, consumer)
        inbox = self.inbox(database)
        for name in self._admit(database, self._busy):
            self._inboxes[name].engine.dispose()
        if self.check_lazily and database not in self._checked:
            try:
                inbox.check()
            except Exception as exc:  # down, or refused: its deliveries wait for a fix
                raise self._unchecked_failure(database, exc) from exc
            self._checked.add(database)
        return inbox

    # -- what the adapters call -------------------------------------------------------------

    def process(self, delivery: Delivery, handler: Callable[[Session], R], **kw: Any) -> Any:
        database = self.route(delivery)

        def routed(session: Session) -> R:
            self._still_routed((delivery,), database)
            return handler(session)

        with self._slot(database, delivery.consumer):
            inbox = self._use(database, delivery.consumer)  # refused at once while it is down
            with self._reaching(database, delivery.consumer):
                return inbox.process(delivery, routed, **kw)

    def process_batch(
        self, deliveries: Sequence[Delivery], handler: Callable[..., R], **kw: Any
    ) -> Any:
        first, database = _one_database(self, deliveries)

        def routed(session: Session, *more: Any) -> R:
            self._still_routed(deliveries, database)
            return handler(session, *more)

        with self._slot(database, first.consumer):
            inbox = self._use(database, first.consumer)
            with self._reaching(database, first.consumer):
                return inbox.process_batch(deliveries, routed, **kw)

    def bookkeep(self, op: Op) -> Any:
        if isinstance(op, ResolveRoute):
            return self.resolve(op.delivery)
        delivery = getattr(op, "delivery", None)
        if delivery is None:
            raise TypeError(f"not a bookkeeping operation of one delivery: {op!r}")
        if isinstance(op, CountHandBack) and op.unreachable:
            database = self.route(delivery)  # remembered in memory only, no connection
            return self.inbox(database).bookkeep(op)
        database = self.route(delivery)
        with self._slot(database, delivery.consumer):
            inbox = self._use(database, delivery.consumer)
            with self._reaching(database, delivery.consumer, pauses=False):
                return inbox.bookkeep(
                    op, before_commit=lambda: self._still_routed((delivery,), database)
                )

    def keep_output(self, session: Session, delivery: Delivery, output: Output) -> None:
        self.inbox(self.route(delivery)).keep_output(session, delivery, output)

    def transaction(self, handler: Callable[[Session], R]) -> R:
        raise ConfigurationError(
            "a routed inbox has no database for a message without an identity (its tenant "
            "says where it goes): use missing_identity='reject'"
        )

    def check(self, databases: Sequence[str] | None = None) -> None:
        """Check every database the map names (see the module for what a failure means)."""
        for database in databases or self.router.names():
            try:
                self.inbox(database).check()
            except Exception as exc:
                if not _unanswered(exc):
                    raise
                logger.warning(
                    "inbox database %s does not answer (%s): checked at its first delivery",
                    database,
                    exc,
                )
                continue
            self._checked.add(database)

    def dispose(self) -> None:
        for inbox in list(self._inboxes.values()):
            inbox.engine.dispose()


class AsyncRoutedInbox(_Routes):
    """`AsyncInbox` over the databases of a `DatabaseMap` (asyncpg); parameters as
    `RoutedInbox`."""

    def inbox(self, database: str) -> AsyncInbox:
        from sqlalchemy.ext.asyncio import create_async_engine

        from .aio import AsyncInbox

        with self._lock:
            found = self._inboxes.get(database)
            if found is None:
                url = database_url(self.router.url(database), asynchronous=True)
                engine = create_async_engine(url, **self._options(url))
                found = self._inboxes[database] = AsyncInbox(engine, **self.storage_options)
            return found

    @property
    def engines(self) -> dict[str, AsyncEngine]:
        return {name: inbox.engine for name, inbox in self._inboxes.items()}

    async def _use(self, database: str, consumer: str) -> AsyncInbox:
        """`RoutedInbox._use`, asynchronous."""
        self._refuse_if_down(database, consumer)
        inbox = self.inbox(database)
        for name in self._admit(database, self._busy):
            await self._inboxes[name].engine.dispose()
        if self.check_lazily and database not in self._checked:
            try:
                await inbox.check()
            except Exception as exc:
                raise self._unchecked_failure(database, exc) from exc
            self._checked.add(database)
        return inbox

    async def process(
        self, delivery: Delivery, handler: Callable[[AsyncSession], Awaitable[R]], **kw: Any
    ) -> Any:
        database = self.route(delivery)

        async def routed(session: AsyncSession) -> R:
            self._still_routed((delivery,), database)
            return await handler(session)

        async with self._aslot(database, delivery.consumer):
            inbox = await self._use(database, delivery.consumer)  # refused while it is down
            with self._reaching(database, delivery.consumer):
                return await inbox.process(delivery, routed, **kw)

    async def process_batch(
        self, deliveries: Sequence[Delivery], handler: Callable[..., Awaitable[R]], **kw: Any
    ) -> Any:
        first, database = _one_database(self, deliveries)

        async def routed(session: AsyncSession, *more: Any) -> R:
            self._still_routed(deliveries, database)
            return await handler(session, *more)

        async with self._aslot(database, first.consumer):
            inbox = await self._use(database, first.consumer)
            with self._reaching(database, first.consumer):
                return await inbox.process_batch(deliveries, routed, **kw)

    async def bookkeep(self, op: Op) -> Any:
        if isinstance(op, ResolveRoute):
            return self.resolve(op.delivery)
        delivery = getattr(op, "delivery", None)
        if delivery is None:
            raise TypeError(f"not a bookkeeping operation of one delivery: {op!r}")
        if isinstance(op, CountHandBack) and op.unreachable:
            return await self.inbox(self.route(delivery)).bookkeep(op)
        database = self.route(delivery)
        async with self._aslot(database, delivery.consumer):
            inbox = await self._use(database, delivery.consumer)
            with self._reaching(database, delivery.consumer, pauses=False):
                return await inbox.bookkeep(
                    op, before_commit=lambda: self._still_routed((delivery,), database)
                )

    def keep_output(self, session: Session, delivery: Delivery, output: Output) -> None:
        self.inbox(self.route(delivery)).keep_output(session, delivery, output)

    async def transaction(self, handler: Callable[[AsyncSession], Awaitable[R]]) -> R:
        raise ConfigurationError(
            "a routed inbox has no database for a message without an identity (its tenant "
            "says where it goes): use missing_identity='reject'"
        )

    async def check(self, databases: Sequence[str] | None = None) -> None:
        for database in databases or self.router.names():
            try:
                await self.inbox(database).check()
            except Exception as exc:
                if not _unanswered(exc):
                    raise
                logger.warning(
                    "inbox database %s does not answer (%s): checked at its first delivery",
                    database,
                    exc,
                )
                continue
            self._checked.add(database)

    async def dispose(self) -> None:
        for inbox in list(self._inboxes.values()):
            await inbox.engine.dispose()


def _unanswered(exc: BaseException) -> bool:
    """Whether ``exc`` says the database does not answer (left to the first delivery),
    not that it refuses (a schema, a setting: the start is refused)."""
    return isinstance(exc, TransientError) or classify(exc) is Failure.DISCONNECTED


def _one_database(routes: _Routes, deliveries: Sequence[Delivery]) -> tuple[Delivery, str]:
    """A batch is claimed in one transaction, so in one database: its deliveries must
    all route there (give each database's tenants their own queue or partition). Its
    first delivery, and that database."""
    if not deliveries:
        raise ConfigurationError("an empty batch")
    databases = {routes.route(delivery) for delivery in deliveries}
    if len(databases) > 1:
        raise RouteUnavailable(
            f"a batch spans databases {', '.join(sorted(databases))}: one transaction "
            "cannot claim in several (no two-phase commit)"
        )
    (database,) = databases
    return deliveries[0], database


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
