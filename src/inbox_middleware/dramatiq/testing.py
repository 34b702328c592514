"""The Dramatiq half of the users' pytest plugin (`inbox_middleware.testing`): runs one
inbox actor under the scenarios, on the actor's broker and a worker of its own."""

from __future__ import annotations

import contextlib
import inspect
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine

from .._core.exceptions import ConfigurationError
from .._operate.harness import (
    CONCURRENT,
    CRASH,
    REDELIVERED,
    ROLLED_BACK,
    Effect,
    Hold,
    Rollback,
    RolledBackByCheck,
    ScenarioResult,
    Tally,
    Wave,
    fresh,
    intent_name,
    refuse_sqlite,
    rollback_at_commit,
    timed_out,
)
from .._storage import InboxSchema
from .._storage.inspection import claim_queries
from .._storage.routed import AsyncRoutedInbox, RoutedInbox

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["DramatiqCheck"]

_IDENTITY_NAMES = {"producer", "message_id", "tenant"}


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
        from ._middleware import InboxMiddleware

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
        if isinstance(middleware.inbox, RoutedInbox) or isinstance(
            middleware.async_inbox, AsyncRoutedInbox
        ):
            raise ConfigurationError("this test tool serves a middleware of one database")
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
        """A message for the actor, carrying a producer intent id: ``args`` and ``kwargs``
        are the actor's. For an actor with a parameter named ``producer``,
        ``message_id`` or ``tenant``, which this form would take for the identity, use
        `message_with` (this form is refused there)."""
        shadowed = sorted(_IDENTITY_NAMES & self._parameters)
        if shadowed:
            raise TypeError(
                f"actor {self.actor.actor_name!r} has a parameter named "
                f"{', '.join(map(repr, shadowed))}, which check.message(...) takes for the "
                "identity: use check.message_with(args=(...), kwargs={...}, producer=..., "
                "message_id=...)"
            )
        return self.message_with(
            args=args, kwargs=kwargs, producer=producer, message_id=message_id, tenant=tenant
        )

    def message_with(
        self,
        *,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        producer: str,
        message_id: str,
        tenant: str | None = None,
    ) -> Any:
        """A message for the actor with these arguments, carrying a producer intent id;
        like Dramatiq's ``actor.message_with_options(args=, kwargs=)``, so no argument of
        the actor is ever taken for the identity."""
        from ._middleware import identity

        options = identity(producer=producer, message_id=message_id, tenant=tenant)
        return self.actor.message_with_options(args=args, kwargs=dict(kwargs or {}), **options)

    @property
    def _parameters(self) -> set[str]:
        try:
            return set(inspect.signature(self.actor.fn).parameters)
        except (TypeError, ValueError):
            return set()

    def redelivered(self, message: Any, times: int = 3) -> ScenarioResult:
        waves = [[_renamed(message)] for _ in range(times)]
        return self._run(REDELIVERED, message, waves)

    def crash_between_commit_and_ack(self, message: Any) -> ScenarioResult:
        return self._run(CRASH, message, [[message], [message]])

    def rolled_back(self, message: Any) -> ScenarioResult:
        """The handler runs and writes, then the inbox's transaction rolls back instead of
        committing (a failed COMMIT, a worker dead before it); then the intent is delivered
        again. Nothing the first attempt wrote may survive: a handler writing through a
        session or connection of its own fails here."""
        once = _renamed(message)
        # Retried at once by Retries, as a redelivery after a lost commit would come.
        once.options.update(min_backoff=1, max_backoff=1)
        return self._run(ROLLED_BACK, message, [[once]])

    def concurrent_duplicates(self, message: Any, copies: int = 8) -> ScenarioResult:
        refuse_sqlite(self.engine)
        return self._run(CONCURRENT, message, [[_renamed(message) for _ in range(copies)]])

    # -- running -------------------------------------------------------------------------

    def _run(self, scenario: str, message: Any, waves: list[list[Any]]) -> ScenarioResult:
        from ._payload import identity_options

        # One deadline bounds the whole scenario: the deliveries, their retries, and the
        # wait for the worker's queues to empty (Dramatiq's own worker.join() has no bound,
        # and Retries' backoff or a message left in the delay queue can outlast any test).
        deadline = time.monotonic() + self.timeout
        identity = identity_options(message.options)
        claims, quarantined, poisoned = claim_queries(self.naming, identity, self.consumer)
        fresh(self._count(claims), identity)
        before = self.effect()
        conflicts_before, poison_before = self._count(quarantined), self._count(poisoned)
        hold = Hold(self.engine, self.hold, self.asynchronous)
        tally = Tally()
        ours = {m.message_id for wave in waves for m in wave}
        with contextlib.ExitStack() as stack:
            worker = stack.enter_context(self._worker(deadline))
            recorder = stack.enter_context(self._recording())
            if scenario == CONCURRENT:
                stack.enter_context(hold.installed())
            if scenario == ROLLED_BACK:  # once: the first attempt to reach its commit
                probe = stack.enter_context(rollback_at_commit(identity.message_id))
                recorder.rollback = (probe, lambda: self.effect() - before, deadline)
            for wave in waves:
                outcomes = recorder.current = Wave({m.message_id for m in wave}, len(wave))
                for copy in wave:
                    self.broker.enqueue(copy)
                # Acknowledged before the next wave is sent.
                if not (_settled(outcomes, deadline) and _drained(worker, self.broker, deadline)):
                    pending = _pending(worker, self.broker, ours)
                    tally.add(outcomes)
                    raise AssertionError(
                        timed_out(
                            scenario,
                            identity,
                            waves,
                            tally,
                            timeout=self.timeout,
                            ending="so the worker was stopped"
                            if self.worker is None
                            else "(your worker keeps running)",
                            pending=pending,
                        )
                    )
                recorder.current = None
                tally.add(outcomes)
        conflicts = self._count(quarantined) - conflicts_before
        poison = self._count(poisoned) - poison_before
        failures = [f for f in tally.failures if f != RolledBackByCheck.__name__]
        rolled_back = len(tally.failures) - len(failures)  # each came back: a redelivery
        return ScenarioResult(
            scenario=scenario,
            intent=intent_name(identity),
            deliveries=sum(len(wave) for wave in waves) + rolled_back,
            processed=tally.processed,
            duplicates=tally.skipped - conflicts - poison,
            conflicts=conflicts,
            poison=poison,
            failures=tuple(failures),
            claims=self._count(claims),
            effect=self.effect() - before,
            overlapped=tally.overlapped(hold.first_done),
            rolled_back=rolled_back,
            survived=recorder.rollback[0].survived if recorder.rollback else 0,
        )

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
    def _worker(self, deadline: float) -> Iterator[Any]:
        if self.worker is not None:
            yield self.worker
            return
        import dramatiq

        worker = dramatiq.Worker(self.broker, worker_threads=self.threads, worker_timeout=100)
        worker.start()
        try:
            yield worker
        finally:
            # Bounded too: a handler still running past the deadline gets a second to end.
            remaining = max(deadline - time.monotonic(), 1.0)
            worker.stop(timeout=int(remaining * 1000))

    @contextlib.contextmanager
    def _recording(self) -> Iterator[Any]:
        recorder = _dramatiq_recorder()
        # First in the list: its after_* hooks run last, once Retries has decided.
        self.broker.middleware.insert(0, recorder)
        try:
            yield recorder
        finally:
            self.broker.middleware.remove(recorder)


def _settled(outcomes: Wave, deadline: float) -> bool:
    """Wait until every message of the wave is settled (processed, skipped, or failed for
    good once Retries gave up); False at the deadline."""
    assert outcomes.expected is not None
    while len(outcomes.settled) < len(outcomes.expected):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _drained(worker: Any, broker: Any, deadline: float) -> bool:
    """Dramatiq's ``worker.join()``, bounded: wait until the worker holds no message (its
    work queue, its consumers' delay queues) and, on the stub broker, the queues are
    empty; False at the deadline. Empty twice in a row, as join checks: a due delayed
    message passes through the broker on its way from the delay queue to the work queue."""
    empty_once = False
    while time.monotonic() <= deadline:
        if _holds_nothing(worker, broker):
            if empty_once:
                return True
            empty_once = True
        else:
            empty_once = False
        time.sleep(0.05)
    return False


def _holds_nothing(worker: Any, broker: Any) -> bool:
    if worker.work_queue.unfinished_tasks:
        return False
    if any(consumer.delay_queue.unfinished_tasks for consumer in worker.consumers.values()):
        return False
    queues = getattr(broker, "queues", None)  # the stub broker's own, in memory
    return not isinstance(queues, dict) or all(q.empty() for q in queues.values())


def _pending(worker: Any, broker: Any, ours: set[str]) -> list[str]:
    """Each message the worker or the stub broker still holds, one line each: its queue,
    its retries, when it is due."""
    import dramatiq

    found: list[tuple[str, Any]] = []
    for consumer in list(worker.consumers.values()):
        found += [("delayed", item.message) for item in _snapshot(consumer.delay_queue)]
    found += [("due", item.message) for item in _snapshot(worker.work_queue)]
    queues = getattr(broker, "queues", None)
    if isinstance(queues, dict):
        for queue in list(queues.values()):
            found += [("queued", dramatiq.Message.decode(data)) for data in _snapshot(queue)]
    lines = [_describe(state, message, ours) for state, message in found]
    running = worker.work_queue.unfinished_tasks - worker.work_queue.qsize()
    if running > 0:
        lines.append(f"{running} message(s) still being processed by the actor")
    return lines


def _snapshot(queue: Any) -> list[Any]:
    with queue.mutex:
        return list(queue.queue)


def _describe(state: str, message: Any, ours: set[str]) -> str:
    whose = "this scenario's" if message.message_id in ours else "not this scenario's"
    retries = message.options.get("retries", 0)
    eta = message.options.get("eta")
    if state == "delayed" and isinstance(eta, int | float):
        due = datetime.fromtimestamp(eta / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        when = f"eta {due} (in {max(eta / 1000 - time.time(), 0):.1f}s)"
    else:
        when = "due now" if state == "due" else "waiting in the broker's queue"
    return (
        f"message {message.message_id} (actor {message.actor_name}, {whose}): "
        f"queue {message.queue_name}, retries {retries}, {when}"
    )


def _renamed(message: Any) -> Any:
    """The same intent and payload as a new broker message (its own message id)."""
    return message.copy(message_id=str(uuid.uuid4()))


def _dramatiq_recorder() -> Any:
    """A Dramatiq middleware reporting the outcomes of the current wave's messages."""
    from dramatiq import Middleware

    class Recorder(Middleware):
        current: Wave | None = None
        rollback: tuple[Rollback, Callable[[], float], float] | None = None

        def before_process_message(self, broker: Any, message: Any) -> None:
            if self.current is not None and self.current.ours(message.message_id):
                if self.rollback is not None:  # the redelivery waits for the measure
                    probe, _, deadline = self.rollback
                    if probe.owes_measure():
                        probe.measured.wait(max(deadline - time.monotonic(), 0))
                self.current.begin(message.message_id)

        def after_process_message(
            self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
        ) -> None:
            if self.current is None or not self.current.ours(message.message_id):
                return
            if self.rollback is not None and self.rollback[0].owes_measure():
                # The rolled-back attempt is over: what survived it was written outside
                # the inbox's transaction.
                probe, measure, _ = self.rollback
                probe.survived = measure()
                probe.measured.set()
            if exception is None:
                self.current.end("processed", message.message_id)
            else:  # retried later, unless Retries gave up (then it failed the message)
                final = bool(getattr(message, "failed", False))
                self.current.end(type(exception).__name__, message.message_id, final)

        def after_skip_message(self, broker: Any, message: Any) -> None:
            if self.current is not None and self.current.ours(message.message_id):
                self.current.end("skipped", message.message_id)

    return Recorder()
