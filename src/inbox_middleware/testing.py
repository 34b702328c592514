"""Check your own actor or subscriber in your test suite: one effect, however delivered.

A pytest plugin (installed with the library, no configuration): its ``inbox_check``
fixture runs your handler, through the real inbox and your real database, under the
deliveries that break handlers without one, and measures the effect with a function you
give::

    def test_add_credit_is_applied_once(inbox_check, engine):
        def credits() -> int:  # how often the effect happened
            with engine.connect() as conn:
                return conn.scalar(text("SELECT count(*) FROM credits"))

        check = inbox_check.dramatiq(add_credit, effect=credits)
        order = check.message(7, 10, producer="orders", message_id="o-1")
        check.redelivered(order, times=3).assert_one_effect()

Three scenarios, each on an intent not processed before (use a new message id for each):

``redelivered(message, times=3)``
    The same intent delivered again and again, one delivery after the other: a producer
    retrying after a lost confirmation, or a broker redelivering. Each is a new broker
    message with the same identity and payload.
``crash_between_commit_and_ack(message)``
    The worker commits, then dies before acknowledging; the broker delivers the very same
    message again. Emulated here by delivering it twice through the real inbox: what the
    second delivery finds is exactly what a redelivery after the crash finds (the commit
    is durable, the claim is there). The library's own test suite kills real workers
    with SIGKILL at that point.
``concurrent_duplicates(message, copies=8)``
    ``copies`` deliveries of the intent at once, in as many worker threads (Dramatiq) or
    tasks (FastStream). The first one to claim the intent holds its transaction open a
    moment before committing (``hold`` seconds), so that the others arrive while its claim
    is uncommitted and wait on it, as they do in a real race. Needs PostgreSQL: SQLite has
    a single writer, so there is no race to check.

Each returns a `ScenarioResult`: how often the handler committed, how many deliveries were
skipped as duplicates, which attempts failed, the growth of your effect. Its
`~ScenarioResult.assert_one_effect` fails with an explanation unless the effect grew by
exactly one, the handler committed once, and every other delivery was a duplicate.

Dramatiq: the actor's broker must have the `InboxMiddleware`; the check starts a worker
with ``threads`` threads on it for each scenario (or uses ``worker=``, one you run). A
stub broker is enough. FastStream: give the broker (inside ``TestRabbitBroker`` and the
like, or a real, started one); scenarios are coroutines.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import Engine, event, func, select

from .exceptions import ConfigurationError
from .identity import MessageIdentity
from .storage import InboxSchema

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = [
    "DramatiqCheck",
    "FastStreamCheck",
    "FastStreamMessage",
    "InboxCheck",
    "ScenarioResult",
    "inbox_check",
]

Effect = Callable[[], Any]
"""Returns a number that grows by one each time the handler's effect happens (a row count,
say); for FastStream it may be a coroutine function."""

REDELIVERED = "redelivered"
CRASH = "crash between commit and ack"
CONCURRENT = "concurrent duplicates"


@dataclass(frozen=True)
class ScenarioResult:
    """What one scenario did to one intent."""

    scenario: str
    intent: str
    deliveries: int
    processed: int
    """Deliveries whose handler ran and committed."""
    duplicates: int
    """Deliveries skipped because the intent was processed already."""
    conflicts: int
    """Deliveries quarantined as identity conflicts (the payload differed)."""
    poison: int
    """Deliveries kept as poison messages (a permanent failure)."""
    failures: tuple[str, ...]
    """The errors of attempts that rolled back (retried or not)."""
    claims: int
    """Inbox rows for the intent afterwards: one per consumer that processed it."""
    effect: float
    """How much your effect grew."""
    overlapped: int = 0
    """Concurrent scenario: deliveries that began while the first held its claim."""
    unsettled: int = 0
    """Deliveries with no outcome when the scenario gave up waiting."""

    def summary(self) -> str:
        clauses = [
            f"effect +{self.effect:g}",
            f"handler committed {self.processed}x",
            f"{self.duplicates} duplicates skipped",
        ]
        if self.conflicts:
            clauses.append(f"{self.conflicts} quarantined as conflicts")
        if self.poison:
            clauses.append(f"{self.poison} kept as poison")
        if self.failures:
            clauses.append(f"failed attempts: {', '.join(self.failures)}")
        if self.unsettled:
            clauses.append(f"{self.unsettled} never settled")
        if self.scenario == CONCURRENT:
            clauses.append(f"{self.overlapped} overlapped the first claim")
        head = f"{self.scenario} ({self.deliveries} deliveries of {self.intent})"
        return f"{head}: {', '.join(clauses)}"

    def assert_one_effect(self) -> ScenarioResult:
        """Fail unless the effect happened exactly once and every other delivery was
        recognised as a duplicate; returns the result, for chaining."""
        return self.assert_effect(1)

    def assert_effect(self, expected: float) -> ScenarioResult:
        """As `assert_one_effect`, for an effect that grows by ``expected`` per intent
        (a balance credited by the intent's amount, say)."""
        problems = []
        if self.effect != expected:
            problems.append(f"the effect grew by {self.effect:g}, not {expected:g}")
        if self.processed != 1:
            problems.append(
                f"the handler committed {self.processed} times: "
                + (
                    "is the actor or subscriber declared as an inbox consumer, and not in "
                    "shadow mode?"
                    if self.processed > 1
                    else "it never committed"
                )
            )
        if self.duplicates != self.deliveries - 1:
            problems.append(
                f"{self.duplicates} of the {self.deliveries - 1} later deliveries were "
                "skipped as duplicates"
            )
        if self.conflicts:
            problems.append(
                f"{self.conflicts} deliveries were identity conflicts: the payload's "
                "canonical form changes between sends (a timestamp? a random field?)"
            )
        if self.scenario == CONCURRENT and self.overlapped < 2:
            problems.append(
                f"only {self.overlapped} deliveries overlapped the first claim, so there "
                "was no race to check: give the worker as many threads as copies"
            )
        if self.unsettled:
            problems.append(f"{self.unsettled} deliveries were never settled")
        if problems:
            raise AssertionError(self.summary() + "\n  - " + "\n  - ".join(problems))
        return self


# -- shared ----------------------------------------------------------------------------------


@dataclass
class _Outcomes:
    """The outcomes of one wave of deliveries, as the framework reported them, and when
    each delivery began. Dramatiq's are told apart by message id; FastStream's by the
    intent's identity headers (``key`` None)."""

    expected: set[str] | None
    size: int
    processed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    started: list[float] = field(default_factory=list)
    settled: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ours(self, key: str | None) -> bool:
        return self.expected is None or key in self.expected

    def begin(self, key: str | None = None) -> None:
        with self.lock:
            self.started.append(time.monotonic())

    def end(self, outcome: str, key: str | None = None, final: bool = True) -> None:
        with self.lock:
            if outcome == "processed":
                self.processed += 1
            elif outcome == "skipped":
                self.skipped += 1
            else:
                self.failures.append(outcome)
            if final and key is not None:
                self.settled.add(key)

    @property
    def final(self) -> int:
        return self.processed + self.skipped


@dataclass
class _Tally:
    """The waves of one scenario, added up."""

    processed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    started: list[float] = field(default_factory=list)

    def add(self, wave: _Outcomes) -> None:
        self.processed += wave.processed
        self.skipped += wave.skipped
        self.failures += wave.failures
        self.started += wave.started

    def overlapped(self, first_done: float | None) -> int:
        if first_done is None:
            return 0
        return sum(1 for started in self.started if started < first_done)


class _Hold:
    """Delays every commit on an engine by ``seconds`` while installed, so that the first
    claim of an intent stays uncommitted while the other deliveries arrive."""

    def __init__(self, engine: Engine, seconds: float, asynchronous: bool) -> None:
        self.engine, self.seconds, self.asynchronous = engine, seconds, asynchronous
        self.first_done: float | None = None

    def __call__(self, conn: Any) -> None:
        if self.asynchronous:  # inside SQLAlchemy's greenlet: yield to the event loop
            from sqlalchemy.util import await_only

            await_only(asyncio.sleep(self.seconds))
        else:
            time.sleep(self.seconds)
        if self.first_done is None:
            self.first_done = time.monotonic()

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Hold]:
        event.listen(self.engine, "commit", self)
        try:
            yield self
        finally:
            event.remove(self.engine, "commit", self)


def _refuse_sqlite(engine: Engine) -> None:
    if engine.dialect.name == "sqlite":
        raise ConfigurationError(
            "concurrent duplicates need PostgreSQL: SQLite has a single writer, so "
            "deliveries never race for a claim there; run this scenario on PostgreSQL"
        )


def _claim_queries(
    naming: InboxSchema, identity: MessageIdentity, consumer: str | None
) -> tuple[Any, Any, Any]:
    tables = naming.tables
    queries = []
    for table in (tables.inbox, tables.quarantine, tables.poison):
        where = [
            table.c.producer_name == identity.producer,
            table.c.tenant == identity.tenant,
            table.c.message_id == identity.message_id,
        ]
        if consumer is not None:
            where.append(table.c.consumer_name == consumer)
        if table is tables.quarantine:
            queries.append(select(func.coalesce(func.sum(table.c.attempts), 0)).where(*where))
        else:
            queries.append(select(func.count()).select_from(table).where(*where))
    return queries[0], queries[1], queries[2]


def _name(identity: MessageIdentity) -> str:
    tenant = f"{identity.tenant}/" if identity.tenant else ""
    return f"{identity.producer}/{tenant}{identity.message_id}"


def _fresh(claims: int, identity: MessageIdentity) -> None:
    if claims:
        raise AssertionError(
            f"intent {_name(identity)} was processed before this scenario began; give each "
            "scenario a message id of its own"
        )


# -- Dramatiq ------------------------------------------------------------------------------


class DramatiqCheck:
    """Runs one inbox actor under the scenarios; see the module."""

    def __init__(
        self,
        actor: Any,
        effect: Effect,
        *,
        threads: int = 8,
        hold: float = 0.2,
        timeout: float = 30.0,
        worker: Any = None,
    ) -> None:
        from .dramatiq.middleware import InboxMiddleware

        self.actor, self.effect = actor, effect
        self.broker = actor.broker
        self.threads, self.hold, self.timeout = threads, hold, timeout
        self.worker = worker
        middleware = next(
            (m for m in self.broker.middleware if isinstance(m, InboxMiddleware)), None
        )
        if middleware is None:
            raise ConfigurationError(
                f"the broker of actor {actor.actor_name!r} has no InboxMiddleware: "
                "broker.add_middleware(InboxMiddleware(engine)) before declaring the actor"
            )
        bound = middleware._actors.get(actor.actor_name)
        if bound is None:
            raise ConfigurationError(
                f"actor {actor.actor_name!r} is not an inbox actor: declare it with "
                "inbox_consumer='...'"
            )
        self.consumer: str = bound.consumer
        self.asynchronous: bool = bound.is_async
        self._async_engine: AsyncEngine | None = None
        if bound.is_async:
            assert middleware.async_inbox is not None
            self.naming: InboxSchema = middleware.async_inbox.naming
            self._async_engine = middleware.async_inbox.engine
            self.engine: Engine = self._async_engine.sync_engine
        else:
            assert middleware.inbox is not None
            self.naming = middleware.inbox.naming
            self.engine = middleware.inbox.engine

    def message(
        self,
        *args: Any,
        producer: str,
        message_id: str,
        tenant: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """A message for the actor, carrying a producer intent id."""
        from .dramatiq.middleware import identity

        options = identity(producer=producer, message_id=message_id, tenant=tenant)
        return self.actor.message_with_options(args=args, kwargs=kwargs, **options)

    def redelivered(self, message: Any, times: int = 3) -> ScenarioResult:
        waves = [[_renamed(message)] for _ in range(times)]
        return self._run(REDELIVERED, message, waves)

    def crash_between_commit_and_ack(self, message: Any) -> ScenarioResult:
        return self._run(CRASH, message, [[message], [message]])

    def concurrent_duplicates(self, message: Any, copies: int = 8) -> ScenarioResult:
        _refuse_sqlite(self.engine)
        return self._run(CONCURRENT, message, [[_renamed(message) for _ in range(copies)]])

    # -- running -------------------------------------------------------------------------

    def _run(self, scenario: str, message: Any, waves: list[list[Any]]) -> ScenarioResult:
        from .dramatiq.payload import identity_options

        identity = identity_options(message.options)
        claims, quarantined, poisoned = _claim_queries(self.naming, identity, self.consumer)
        _fresh(self._count(claims), identity)
        before = self.effect()
        conflicts_before, poison_before = self._count(quarantined), self._count(poisoned)
        hold = _Hold(self.engine, self.hold, self.asynchronous)
        tally, unsettled = _Tally(), 0
        holding = hold.installed() if scenario == CONCURRENT else contextlib.nullcontext()
        with self._worker() as worker, self._recording() as recorder, holding:
            for wave in waves:
                outcomes = recorder.current = _Outcomes({m.message_id for m in wave}, len(wave))
                for copy in wave:
                    self.broker.enqueue(copy)
                unsettled += self._settle(outcomes)
                worker.join()  # acknowledged before the next wave is sent
                recorder.current = None
                tally.add(outcomes)
        conflicts = self._count(quarantined) - conflicts_before
        poison = self._count(poisoned) - poison_before
        return ScenarioResult(
            scenario=scenario,
            intent=_name(identity),
            deliveries=sum(len(wave) for wave in waves),
            processed=tally.processed,
            duplicates=tally.skipped - conflicts - poison,
            conflicts=conflicts,
            poison=poison,
            failures=tuple(tally.failures),
            claims=self._count(claims),
            effect=self.effect() - before,
            overlapped=tally.overlapped(hold.first_done),
            unsettled=unsettled,
        )

    def _settle(self, outcomes: _Outcomes) -> int:
        """Wait until every message of the wave is settled; how many were not."""
        assert outcomes.expected is not None
        deadline = time.monotonic() + self.timeout
        while len(outcomes.settled) < len(outcomes.expected):
            if time.monotonic() > deadline:
                return len(outcomes.expected) - len(outcomes.settled)
            time.sleep(0.01)
        return 0

    def _count(self, query: Any) -> int:
        if self._async_engine is None:
            with self.engine.connect() as conn:
                return int(conn.execute(query).scalar_one())
        from dramatiq.asyncio import get_event_loop_thread

        async_engine = self._async_engine

        async def count() -> int:
            async with async_engine.connect() as conn:
                return int((await conn.execute(query)).scalar_one())

        loop_thread = get_event_loop_thread()
        if loop_thread is None:
            raise ConfigurationError(
                f"actor {self.actor.actor_name!r} is async: its broker needs dramatiq's "
                "AsyncIO middleware, started (broker.emit_after('process_boot'))"
            )
        return int(loop_thread.run_coroutine(count()))

    @contextlib.contextmanager
    def _worker(self) -> Iterator[Any]:
        if self.worker is not None:
            yield self.worker
            return
        import dramatiq

        worker = dramatiq.Worker(self.broker, worker_threads=self.threads, worker_timeout=100)
        worker.start()
        try:
            yield worker
        finally:
            worker.stop()

    @contextlib.contextmanager
    def _recording(self) -> Iterator[Any]:
        recorder = _dramatiq_recorder()
        # First in the list: its after_* hooks run last, once Retries has decided.
        self.broker.middleware.insert(0, recorder)
        try:
            yield recorder
        finally:
            self.broker.middleware.remove(recorder)


def _renamed(message: Any) -> Any:
    """The same intent and payload as a new broker message (its own message id)."""
    return message.copy(message_id=str(uuid.uuid4()))


def _dramatiq_recorder() -> Any:
    """A Dramatiq middleware reporting the outcomes of the current wave's messages."""
    from dramatiq import Middleware

    class Recorder(Middleware):
        current: _Outcomes | None = None

        def before_process_message(self, broker: Any, message: Any) -> None:
            if self.current is not None and self.current.ours(message.message_id):
                self.current.begin(message.message_id)

        def after_process_message(
            self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
        ) -> None:
            if self.current is None or not self.current.ours(message.message_id):
                return
            if exception is None:
                self.current.end("processed", message.message_id)
            else:  # retried later, unless Retries gave up (then it failed the message)
                final = bool(getattr(message, "failed", False))
                self.current.end(type(exception).__name__, message.message_id, final)

        def after_skip_message(self, broker: Any, message: Any) -> None:
            if self.current is not None and self.current.ours(message.message_id):
                self.current.end("skipped", message.message_id)

    return Recorder()


# -- FastStream ----------------------------------------------------------------------------


@dataclass(frozen=True)
class FastStreamMessage:
    """A body and identity headers, and where to publish them."""

    body: Any
    headers: Mapping[str, str]
    publish: Mapping[str, Any]
    """Keyword arguments for ``broker.publish`` naming the destination (``queue=...``,
    ``stream=...``, ``subject=...``) and anything else it needs."""

    @property
    def identity(self) -> MessageIdentity:
        from .faststream.payload import headers_identity

        return headers_identity(self.headers)


class FastStreamCheck:
    """Runs a FastStream broker's inbox subscriber under the scenarios; see the module."""

    def __init__(
        self,
        broker: Any,
        effect: Effect,
        *,
        inbox: Any = None,
        hold: float = 0.2,
        timeout: float = 30.0,
    ) -> None:
        from .faststream.middleware import InboxMiddlewareFactory

        self.broker, self.effect = broker, effect
        self.hold, self.timeout = hold, timeout
        if inbox is None:
            factories = [
                m for m in broker.config.broker_middlewares if isinstance(m, InboxMiddlewareFactory)
            ]
            if not factories:
                raise ConfigurationError(
                    "the broker has no inbox middleware: create it with "
                    "middlewares=[inbox.middleware]"
                )
            inbox = factories[0].inbox
        self.inbox = inbox
        self.naming: InboxSchema = inbox.storage.naming
        self.async_engine: AsyncEngine = inbox.storage.engine

    def message(
        self,
        body: Any,
        *,
        producer: str,
        message_id: str,
        tenant: str | None = None,
        headers: Mapping[str, str] | None = None,
        **publish: Any,
    ) -> FastStreamMessage:
        """A message with identity headers; ``publish`` names its destination as
        ``broker.publish`` wants it (``queue="orders"``, ``stream="orders"``, ...)."""
        from .faststream.payload import identity_headers

        stamped = identity_headers(producer=producer, message_id=message_id, tenant=tenant)
        return FastStreamMessage(body, {**(headers or {}), **stamped}, publish)

    async def redelivered(self, message: FastStreamMessage, times: int = 3) -> ScenarioResult:
        return await self._run(REDELIVERED, message, [1] * times)

    async def crash_between_commit_and_ack(self, message: FastStreamMessage) -> ScenarioResult:
        return await self._run(CRASH, message, [1, 1])

    async def concurrent_duplicates(
        self, message: FastStreamMessage, copies: int = 8
    ) -> ScenarioResult:
        _refuse_sqlite(self.async_engine.sync_engine)
        return await self._run(CONCURRENT, message, [copies])

    # -- running -------------------------------------------------------------------------

    async def _run(
        self, scenario: str, message: FastStreamMessage, waves: list[int]
    ) -> ScenarioResult:
        await self.inbox.check(self.broker)  # what inbox.guard(broker) runs at start-up
        identity = message.identity
        claims, quarantined, poisoned = _claim_queries(self.naming, identity, None)
        _fresh(await self._count(claims), identity)
        before = await _call(self.effect)
        conflicts_before = await self._count(quarantined)
        poison_before = await self._count(poisoned)
        hold = _Hold(self.async_engine.sync_engine, self.hold, asynchronous=True)
        tally, unsettled = _Tally(), 0
        holding = hold.installed() if scenario == CONCURRENT else contextlib.nullcontext()
        with self._recording(identity) as recorder, holding:
            for size in waves:
                outcomes = recorder.current = _Outcomes(None, size)
                publish = [
                    self.broker.publish(
                        message.body, headers=dict(message.headers), **message.publish
                    )
                    for _ in range(size)
                ]
                await asyncio.gather(*publish)
                unsettled += await self._settle(outcomes)
                recorder.current = None
                tally.add(outcomes)
        conflicts = await self._count(quarantined) - conflicts_before
        poison = await self._count(poisoned) - poison_before
        return ScenarioResult(
            scenario=scenario,
            intent=_name(identity),
            deliveries=sum(waves),
            processed=tally.processed,
            duplicates=tally.skipped - conflicts - poison,
            conflicts=conflicts,
            poison=poison,
            failures=tuple(tally.failures),
            claims=await self._count(claims),
            effect=await _call(self.effect) - before,
            overlapped=tally.overlapped(hold.first_done),
            unsettled=unsettled,
        )

    async def _settle(self, outcomes: _Outcomes) -> int:
        """Wait until every delivery of the wave was processed or skipped; how many were
        not. A failed one is redelivered by a real broker; a test broker never redelivers,
        so once every delivery has some outcome and none arrives for a second, it is over."""
        deadline = time.monotonic() + self.timeout
        quiet_since, seen = time.monotonic(), -1
        while outcomes.final < outcomes.size:
            count = outcomes.final + len(outcomes.failures)
            if count != seen:
                seen, quiet_since = count, time.monotonic()
            elif count >= outcomes.size and time.monotonic() - quiet_since > 1:
                break
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        return outcomes.size - outcomes.final

    async def _count(self, query: Any) -> int:
        async with self.async_engine.connect() as conn:
            return int((await conn.execute(query)).scalar_one())

    @contextlib.contextmanager
    def _recording(self, identity: MessageIdentity) -> Iterator[Any]:
        recorder = _FastStreamRecorder(identity)
        middleware = recorder.middleware()
        self.broker.insert_middleware(middleware)  # outermost: it sees skipped ones too
        try:
            yield recorder
        finally:
            config = self.broker.config
            for part in getattr(config, "configs", (config,)):
                kept = tuple(m for m in part.broker_middlewares if m is not middleware)
                if len(kept) != len(part.broker_middlewares):
                    part.broker_middlewares = kept


class _FastStreamRecorder:
    """Reports the outcomes of the deliveries that carry the scenario's intent."""

    def __init__(self, identity: MessageIdentity) -> None:
        self.identity = identity
        self.current: _Outcomes | None = None

    def ours(self, headers: Mapping[str, Any]) -> bool:
        from .faststream.payload import headers_identity

        try:
            return headers_identity(headers).key("") == self.identity.key("")
        except Exception:
            return False

    def middleware(self) -> Any:
        from faststream import BaseMiddleware
        from faststream.exceptions import AckMessage

        recorder = self

        class Recorder(BaseMiddleware):
            async def consume_scope(self, call_next: Any, msg: Any) -> Any:
                outcomes = recorder.current
                if outcomes is None or not recorder.ours(msg.headers or {}):
                    return await call_next(msg)
                outcomes.begin()
                try:
                    result = await call_next(msg)
                except AckMessage:
                    outcomes.end("skipped")
                    raise
                except BaseException as exc:
                    outcomes.end(type(exc).__name__, final=False)
                    raise
                outcomes.end("processed")
                return result

        return Recorder


async def _call(effect: Effect) -> float:
    value = effect()
    if inspect.isawaitable(value):
        value = await value
    return float(value)


# -- the pytest plugin ---------------------------------------------------------------------


class InboxCheck:
    """What the ``inbox_check`` fixture gives: a factory of checks for your handlers."""

    def dramatiq(
        self,
        actor: Any,
        effect: Effect,
        *,
        threads: int = 8,
        hold: float = 0.2,
        timeout: float = 30.0,
        worker: Any = None,
    ) -> DramatiqCheck:
        """Check a Dramatiq actor declared with ``inbox_consumer``. ``effect`` counts what
        the actor did (synchronously); ``worker``: your running worker, else one is
        started per scenario with ``threads`` threads."""
        return DramatiqCheck(
            actor, effect, threads=threads, hold=hold, timeout=timeout, worker=worker
        )

    def faststream(
        self,
        broker: Any,
        effect: Effect,
        *,
        inbox: Any = None,
        hold: float = 0.2,
        timeout: float = 30.0,
    ) -> FastStreamCheck:
        """Check the inbox subscribers of a FastStream broker (give the `FastStreamInbox`
        when the broker has several). ``effect`` may be a coroutine function."""
        return FastStreamCheck(broker, effect, inbox=inbox, hold=hold, timeout=timeout)


@pytest.fixture
def inbox_check() -> InboxCheck:
    """Run your own actor or subscriber under redelivery, a crash between commit and ack,
    and concurrent duplicates, and assert one effect (`inbox_middleware.testing`)."""
    return InboxCheck()
