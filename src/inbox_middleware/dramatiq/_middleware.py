"""The Dramatiq middleware: claim, body and commit inside the actor call.

The middleware wraps the function of every actor declared with ``inbox_consumer``
(`actor.InboxActor`). The worker acknowledges a message only after the actor call
returns, so the transaction drawn in `inbox_middleware._core.protocol` (BEGIN, claim, the actor's
body with `current_session`, COMMIT) runs inside the actor call and the ack follows it;
``before_process_message`` reads the identity and hashes the arguments first.

Every delivery ends in one settlement of the consumption core, and `settle` tells
Dramatiq what it means, in one place: return the result (processed; where something
consumes it, the stored result, after the inbox sent the pipeline step and the
``on_success`` callback itself, with derived identities, and a duplicate the same);
`SkipMessage` (a duplicate whose result nothing consumes, quarantined: acknowledged, and
no callback runs twice); ``fail()`` then `SkipMessage` (dead-lettered, poisoned);
re-raise the failure (a failed attempt: Dramatiq's Retries retries it, counted); or
enqueue the message again with a delay and skip this copy (a hand-back, which spends no
retry).

A failed message is acknowledged only once it is enqueued again: Dramatiq logs and
swallows a failure of Retries' enqueue and would then acknowledge it, so `before_ack`
enqueues it itself, and keeps it unacknowledged while that fails. A group of inbox actors
with completion callbacks is refused where it is sent, never where a message already
sent is enqueued again (a retry, a hand-back, a delayed message falling due, a pipeline's
next step).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Unpack

import dramatiq
import tenacity
from dramatiq import Broker
from dramatiq.broker import MessageProxy
from dramatiq.common import q_name
from dramatiq.errors import BrokerConnectionError
from dramatiq.middleware import MiddlewareError, Retries, SkipMessage, TimeLimit
from dramatiq.worker import ConsumerThread
from sqlalchemy import Engine

from .._core import direct, faults
from .._core.consumption import (
    DeadLettered,
    Duplicate,
    HandBackDelays,
    HandBackRequested,
    HandedBack,
    Poisoned,
    Processed,
    Quarantined,
    RetryBudget,
    Settlement,
    Tell,
    backoff_delay,
    broker_operation,
)
from .._core.exceptions import (
    ConfigurationError,
    DirectPublishRefused,
    IdentityError,
)
from .._core.identity import MAX_NAME_LENGTH, validate_name
from .._core.outputs import Output
from .._core.policy import SETTINGS, ConsumerPolicy, MissingIdentityPolicy, PolicySettings
from .._core.tenancy import DatabasePatience, Router
from .._observe.tracing import tracing_for
from .._operate.reporting import report
from .._operate.tally import (
    DEFAULT_COUNT_INTERVAL,
    CountFlusher,
    RoutedCountFlusher,
    check_interval,
)
from .._storage import Inbox, InboxSchema
from .._storage.executors import DEFAULT_LOCK_TIMEOUT, DEFAULT_SERIALIZATION_RETRIES
from .._storage.routed import (
    DEFAULT_CONNECTION_BUDGET,
    DEFAULT_POOL_SIZE,
    AsyncRoutedInbox,
    RoutedInbox,
)
from .._storage.startup import DEFAULT_STARTUP_PATIENCE, validate_patience
from ._actor import SKIPPED, InboxActor, Pending
from ._boot import QuietSkips, WorkerBootError, check_database, check_routed
from ._context import CONSUMER_INFO, current_async_session, current_session, identity, session_var
from ._counts import count_flusher
from ._payload import OPTION_MESSAGE_ID_FROM, OPTION_PRODUCER, CanonicalForm
from ._routing import QuarantinePublisher, publisher_for

if TYPE_CHECKING:  # SQLAlchemy's asyncio support needs greenlet: imported only when used
    from sqlalchemy.ext.asyncio import AsyncEngine

    from .._storage.aio import AsyncInbox

__all__ = [
    "ActorConfigurationError",
    "InboxMiddleware",
    "MissingIdentityPolicy",
    "WorkerBootError",
    "current_async_session",
    "current_session",
    "identity",
]

logger = logging.getLogger("inbox_middleware.dramatiq")

# Waits between tries to enqueue a handed-back message again while its broker is out:
# from a tenth of a second, doubling, at most five seconds apart.
_REENQUEUE_FIRST_WAIT = 0.1
_REENQUEUE_MAX_WAIT = 5.0

# The longest a hand-back waits, whatever Retries' max_backoff (days, by default) says.
_HAND_BACK_LIMIT = 300.0


class ActorConfigurationError(ConfigurationError, MiddlewareError):
    """An inbox actor is declared in a way that cannot work.

    A `MiddlewareError`, because Dramatiq logs and swallows any other exception raised
    while an actor is declared, which would leave the actor running unprotected.
    """


class RequeuePending(MiddlewareError, BrokerConnectionError):
    """A failed message is not enqueued again yet: the worker must not acknowledge it.

    A `BrokerConnectionError`, so that Dramatiq's worker keeps the message and tries its
    acknowledgement (and with it this enqueue) again a few seconds later."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)  # type: ignore[no-untyped-call]  # Dramatiq's, untyped


@dataclass(frozen=True, slots=True)
class _Requeue:
    message: MessageProxy
    delay: int  # milliseconds


class DirectSendRefused(DirectPublishRefused, MiddlewareError):
    """`DirectPublishRefused` for Dramatiq, which passes only a `MiddlewareError` raised
    while a message is enqueued on to the code that sent it."""


class InboxMiddleware(dramatiq.Middleware):
    """Deduplicates every actor declared with ``inbox_consumer`` in its own transaction.

    Parameters:
      engine: a sqlalchemy `Engine` for sync actors, or an `AsyncEngine` for async ones.
      async_engine: the `AsyncEngine`, when sync and async actors share the broker.
      naming: schema and table prefix of the inbox tables.
      lock_timeout: seconds a delivery waits on a concurrent delivery's claim before it is
        handed back (and the bound on any lock wait inside the transaction).
      serialization_retries: in-process reruns after a serialization failure or deadlock.
      claims: the claims table, ``"library"`` or ``"compact"`` (about 120 bytes a
        remembered message; see `Inbox` and the guide on the compact claim).
      quarantine_queue: the queue conflicting messages go to; ``{queue}`` is the actor's.
      quarantine_publisher: how to publish there; chosen from the broker by default.
      in_progress_delay: milliseconds before a message whose claim another delivery holds
        comes back; None uses the backoff of hand-backs (Retries' min and max backoff).
      canonical_form: a default `CanonicalForm` for hashing payloads.
      check_database: verify the database, the schema and its settings when a worker
        boots, before it consumes; a worker whose database is not fit refuses to start.
      startup_patience: seconds a booting worker waits out a database that does not
        answer yet, or a schema not migrated yet, before it refuses to start (0: refuse
        at once); a configuration error refuses at once.
      tracing: an OpenTelemetry span for every delivery (extra ``otel``): True for the
        global tracer provider, or a ``TracerProvider``; see `inbox_middleware._observe.tracing`.
        The producer's trace joins through `StampTraceContext`.
      hand_back_patience: seconds a hand-back keeps trying to enqueue the message again
        while the broker is unreachable, before it leaves the message to Retries.
      count_interval: seconds between two writes of the worker's settlement counts to
        ``inbox_counts`` (what ``inbox-middleware status`` shows); None: not written.
      policy: the consumer settings (`ConsumerPolicy`: missing identities, permanent
        errors, redeliveries, retention, shadow mode, outputs, direct sends), documented
        there once. Here ``max_attempts`` defaults to None: Dramatiq's Retries bounds
        the attempts, and the inbox keeps the last failure as poison when Retries gives
        up; ``retry_backoff`` does not apply (hand-backs wait as Retries' backoff says).
      **settings: any `ConsumerPolicy` setting by name, changing ``policy``
        (``redelivery_limit=5``, ``shadow=True``).
      router: instead of an engine, a `DatabaseMap` (or `MapFile`): each delivery is
        claimed and handled in the database of its tenant (docs/how-to/many-databases.md);
        ``pool_size`` connections per open database, ``connection_budget`` over all of them
        (`inbox_middleware._storage.routed`), and ``patience`` (`DatabasePatience`: the
        connect timeout, the pauses of a database that is down, the wait for a busy one).

    Actor options: ``inbox_consumer`` (the consumer name; required to opt in),
    ``inbox_handler_version``, ``inbox_canonical_form``, ``inbox_quarantine_queue``, and
    ``inbox_<setting>`` for any `ConsumerPolicy` setting (``inbox_shadow=True``,
    ``inbox_max_output_bytes=...``), overriding the middleware's for that actor;
    ``inbox_producer`` with ``inbox_message_id_from`` (the name of the argument that is the
    message id) for messages sent without identity options.

    Inside an inbox actor, Dramatiq's own instructions mean: ``raise SkipMessage`` "done"
    (the work commits, then the message is skipped); ``raise Retry`` a failed attempt
    (rolled back, retried after its delay, counted); ``message.fail()`` a rejection (rolled
    back, kept as poison, dead-lettered).
    """

    def __init__(
        self,
        engine: Engine | AsyncEngine | None = None,
        *,
        async_engine: AsyncEngine | None = None,
        naming: InboxSchema | None = None,
        lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT,
        serialization_retries: int = DEFAULT_SERIALIZATION_RETRIES,
        claims: str = "library",
        quarantine_queue: str = "{queue}.quarantine",
        quarantine_publisher: QuarantinePublisher | None = None,
        in_progress_delay: int | None = None,
        canonical_form: CanonicalForm | None = None,
        check_database: bool = True,
        tracing: Any = False,
        hand_back_patience: float = 60.0,
        startup_patience: float = DEFAULT_STARTUP_PATIENCE,
        count_interval: float | None = DEFAULT_COUNT_INTERVAL,
        policy: ConsumerPolicy | None = None,
        router: Router | None = None,
        pool_size: int = DEFAULT_POOL_SIZE,
        connection_budget: int = DEFAULT_CONNECTION_BUDGET,
        patience: DatabasePatience | None = None,
        **settings: Unpack[PolicySettings],
    ) -> None:
        if patience is not None and router is None:
            raise ConfigurationError("patience is for a router (a DatabaseMap): give one")
        if engine is not None and not isinstance(engine, Engine):  # an AsyncEngine
            if async_engine is not None:
                raise ConfigurationError("pass the AsyncEngine once")
            engine, async_engine = None, engine
        storage: dict[str, Any] = {
            "naming": naming,
            "lock_timeout": lock_timeout,
            "serialization_retries": serialization_retries,
            "claims": claims,
        }
        self.inbox: Inbox | RoutedInbox | None = (
            Inbox(engine, **storage) if engine is not None else None
        )
        self.async_inbox: AsyncInbox | AsyncRoutedInbox | None = None
        if async_engine is not None:
            from .._storage.aio import AsyncInbox

            self.async_inbox = AsyncInbox(async_engine, **storage)
        self.routed = router is not None
        if router is not None:
            if self.inbox is not None or self.async_inbox is not None:
                raise ConfigurationError("give InboxMiddleware an engine or a router, not both")
            budget: dict[str, Any] = {
                "pool_size": pool_size,
                "connection_budget": connection_budget,
                **(patience or DatabasePatience()).options(),
            }
            self.inbox = RoutedInbox(router, **storage, **budget)
            self.async_inbox = AsyncRoutedInbox(router, **storage, **budget)
        if self.inbox is None and self.async_inbox is None:
            raise ConfigurationError("InboxMiddleware needs an Engine, an AsyncEngine or a router")
        # Dramatiq's Retries bounds the attempts (see retry_budget), unless one is set here.
        self.policy = (policy or ConsumerPolicy(max_attempts=None)).override(**settings)
        self.quarantine_queue = quarantine_queue
        self.quarantine_publisher = quarantine_publisher
        self.in_progress_delay = in_progress_delay
        self.canonical_form = canonical_form
        self.check_database = check_database
        if hand_back_patience < 0:
            raise ConfigurationError("hand_back_patience must be zero or more seconds")
        self.hand_back_patience = hand_back_patience
        self.startup_patience = validate_patience(startup_patience)
        self.retries: Retries | None = None
        self.backoffs: dict[str, HandBackDelays] = {}
        self._actors: dict[str, InboxActor] = {}
        self._consumers: dict[str, str] = {}
        self._pending = threading.local()
        self._current = threading.local()  # the id of the message this thread processes
        self._continuing = threading.local()
        self._requeue = threading.local()  # a failed message Retries must enqueue again
        self._quiet = QuietSkips()
        self.tracing = tracing_for(tracing)
        self.count_interval = check_interval(count_interval)
        self._counts: CountFlusher | None = None

    if not TYPE_CHECKING:  # hidden from mypy, which would accept any attribute then

        def __getattr__(self, name: str) -> Any:
            # The consumer settings read as attributes (middleware.shadow): the policy's.
            if name in SETTINGS:
                return getattr(self.policy, name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def actor_options(self) -> set[str]:
        return {
            "inbox_consumer",
            "inbox_handler_version",
            "inbox_canonical_form",
            "inbox_quarantine_queue",
            *(f"inbox_{name}" for name in SETTINGS),  # a consumer setting, for this actor
            OPTION_PRODUCER,  # with OPTION_MESSAGE_ID_FROM: the identity is an argument
            OPTION_MESSAGE_ID_FROM,
        }

    # -- declaration ------------------------------------------------------------------------

    def before_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        # Wrapped before the declaration completes: an error raised here reaches the code
        # declaring the actor instead of being logged and skipped by the broker.
        if actor.options.get("inbox_consumer") is None or actor.actor_name in self._actors:
            return
        try:
            self._declare(broker, actor)
        except ConfigurationError as exc:
            raise ActorConfigurationError(str(exc)) from None

    def after_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        # Reached directly (not through the broker's error-swallowing signal) when the
        # middleware is added to a broker whose actors are already declared.
        self.before_declare_actor(broker, actor)

    def _declare(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        consumer = _option_name(actor, "inbox_consumer")
        if (owner := self._consumers.get(consumer)) not in (None, actor.actor_name):
            raise ConfigurationError(
                f"actors {owner!r} and {actor.actor_name!r} both declare inbox_consumer="
                f"{consumer!r}; each handler needs its own consumer name"
            )
        self.retries = next((m for m in broker.middleware if isinstance(m, Retries)), None)
        if self.retries is None:
            raise ConfigurationError(
                "InboxMiddleware needs Dramatiq's Retries middleware: without it a rolled-back "
                "attempt is acknowledged and its message lost"
            )
        # Hand-backs wait as the actor's retries would: its own backoff, else Retries'.
        first = max(actor.options.get("min_backoff", self.retries.min_backoff) / 1000, 0.001)
        limit = actor.options.get("max_backoff", self.retries.max_backoff) / 1000
        self.backoffs[actor.actor_name] = HandBackDelays(
            first, max(first, min(limit, _HAND_BACK_LIMIT))
        )
        if self.quarantine_publisher is None:
            self.quarantine_publisher = publisher_for(broker)
        self._actors[actor.actor_name] = InboxActor(self, actor, consumer)
        self._consumers[consumer] = actor.actor_name

    # -- a message --------------------------------------------------------------------------

    def before_enqueue(self, broker: Broker, message: dramatiq.Message[Any], delay: int) -> None:
        session = session_var.get()
        if session is not None:  # sent from inside an inbox actor's body, before its commit
            consumer, policy = session.info.get(CONSUMER_INFO, ("?", self.policy.direct_publish))
            try:
                direct.check(policy, consumer, f"a send to {message.actor_name!r}")
            except DirectPublishRefused as exc:
                raise DirectSendRefused(str(exc)) from None
        if self._accepted(message):
            return  # a retry or a hand-back of a message already sent, or its next step
        if (member := self._group_member(message)) is not None:
            raise ActorConfigurationError(
                f"actor {member!r} is an inbox actor: a group with completion callbacks "
                "cannot include it, not even as a step of a pipeline. Dramatiq's group barrier "
                "counts deliveries, not messages: a redelivery after a crash between the "
                "commit and the acknowledgement would count the member twice, or not at all; "
                "chain the steps with a pipeline instead, or give the group a plain actor "
                "that sends to the inbox actor"
            )

    def _accepted(self, message: dramatiq.Message[Any]) -> bool:
        """Whether ``message`` continues one already sent: the message this thread is
        processing (enqueued again by Retries or a hand-back), a delayed message a
        worker's consumer moves to its queue when it is due, or a pipeline step the inbox
        sends on its behalf. A refusal there would lose a message Dramatiq acks."""
        if getattr(self._continuing, "value", False):
            return True
        if isinstance(threading.current_thread(), ConsumerThread):
            return True
        return bool(message.message_id == getattr(self._current, "value", None))

    def _group_member(self, message: dramatiq.Message[Any]) -> str | None:
        """The inbox actor among ``message`` and its pipeline's later steps that carries
        a group's completion callbacks, if any (a group marks a pipeline's last step)."""
        step: dict[str, Any] | None = message.asdict()
        while step is not None:
            options = step.get("options") or {}
            if step.get("actor_name") in self._actors and "group_completion_uuid" in options:
                return str(step["actor_name"])
            step = options.get("pipe_target")
        return None

    @contextlib.contextmanager
    def continuing(self) -> Iterator[None]:
        """Messages enqueued inside continue the message being processed (its outputs)."""
        self._continuing.value = True
        try:
            yield
        finally:
            self._continuing.value = False

    def after_enqueue(self, broker: Broker, message: dramatiq.Message[Any], delay: int) -> None:
        requeue: _Requeue | None = getattr(self._requeue, "value", None)
        if requeue is not None and requeue.message.message_id == message.message_id:
            self._requeue.value = None  # Retries (or the hand-back) enqueued it again

    def before_ack(self, broker: Broker, message: MessageProxy) -> None:
        """Never acknowledge a message whose retry was not enqueued.

        Dramatiq's Retries enqueues a failed message again in ``after_process_message``,
        whose exceptions Dramatiq logs and swallows before acknowledging the delivery: a
        broker that refused that enqueue would lose the message. The inbox enqueues it
        here instead; while that fails too, the worker keeps the message unacknowledged
        and tries again (Dramatiq retries ``post_process_message`` after a
        `BrokerConnectionError`)."""
        requeue: _Requeue | None = getattr(self._requeue, "value", None)
        if requeue is None or requeue.message.message_id != message.message_id:
            return
        try:
            broker.enqueue(requeue.message._message, delay=requeue.delay)
        except Exception as exc:
            logger.warning(
                "message %s failed and could not be enqueued again (%s): not acknowledged; "
                "trying again",
                message.message_id,
                exc,
            )
            raise RequeuePending(
                f"message {message.message_id} was not enqueued again: {exc}"
            ) from exc
        self._requeue.value = None

    def _expect_requeue(self, message: MessageProxy, delay: float) -> None:
        self._requeue.value = _Requeue(message, round(delay * 1000))

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        self._pending.value = None
        inner = message._message  # its fields without the proxy's __getattr__
        self._current.value = inner.message_id
        self._requeue.value = None
        bound = self._actors.get(inner.actor_name)
        if bound is None:
            return
        try:
            self._pending.value = Pending(message, bound.arrival(message))
        except Exception as exc:
            # The broker would log and swallow this and call the actor anyway; hand it to
            # the actor call instead, which raises it, so the message is retried.
            self._pending.value = Pending(message, None, exc)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        self._pending.value = None

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self._pending.value = None

    def take_pending(self, actor_name: str) -> Pending | None:
        """The message prepared for this thread's actor call; each is taken once, so an
        actor called directly from inside another actor's body is not mistaken for it."""
        pending: Pending | None = getattr(self._pending, "value", None)
        if pending is None or pending.fields.actor_name != actor_name:
            return None
        self._pending.value = None
        return pending

    def settle(self, bound: InboxActor, pending: Pending, settlement: Settlement) -> Any:
        """Tell Dramatiq what ``settlement`` means: the one place that does."""
        assert pending.arrival is not None
        message = pending.message
        delivery = pending.arrival.delivery
        try:  # whatever happens here, the broker is still told
            report(
                pending.arrival,
                settlement,
                consumer=bound.consumer,
                where="the dead-letter queue",
                message=pending.fields.message_id,
                database=self._database_of(delivery),
            )
            faults.at("settle", delivery.identity.message_id if delivery else None)
        except Exception:
            logger.exception("could not report a settlement of %s", bound.consumer)
        # Dramatiq has no dead-letter destination of the inbox's: a message rejected goes
        # to the broker's own dead-letter queue (``message.fail()``).
        operation = broker_operation(settlement, dead_letter_destination=False)
        if operation.settled and delivery is not None:
            self.backoffs[bound.actor.actor_name].forget(delivery.key)
        match settlement, operation.tell:
            case ((DeadLettered(reason=reason) | Poisoned(reason=reason)), Tell.REJECT):
                if isinstance(settlement, Poisoned):  # Retries and Callbacks see no failure
                    bound.notify_failure(message, settlement)
                message.fail()
                self._quiet.mark(message)
                raise self._skip(bound, f"dead-lettered for {bound.consumer}: {reason}")
            case HandedBack(error=error), Tell.HAND_BACK if operation.counted:
                cause = error.cause if isinstance(error, HandBackRequested) else None
                self._expect_requeue(message, self.backoffs[message.actor_name].first)
                raise cause or error  # Retries retries it, and counts it
            case HandedBack(error=error), Tell.HAND_BACK:
                delay = self._hand_back_delay(settlement, pending)
                try:
                    self._enqueue_again(bound, message, delay)
                except Exception:
                    logger.exception("could not hand message %s back", message.message_id)
                    self._expect_requeue(message, delay)
                    raise error from None  # not re-enqueued: Retries takes it (counted)
                self._quiet.mark(message)
                raise self._skip(bound, f"handed back for {bound.consumer}: {type(error).__name__}")
        # Acked: what Dramatiq is told of it (the actor's result, or why it is skipped).
        match settlement:
            case Processed(result=result) if result is SKIPPED:
                self._quiet.mark(message)
                raise self._skip(
                    bound, f"the actor of {bound.consumer} skipped it after committing"
                )
            case Processed(result=Output() as output) | Duplicate(output=Output() as output):
                # Its pipeline step and on_success callback are sent already (the outputs).
                if isinstance(settlement, Duplicate):
                    _leave_the_barrier(message)
                return bound.decode(output)
            case Processed(result=result):
                return result
            case Duplicate():
                self._quiet.mark(message)
                raise self._skip(
                    bound, f"duplicate delivery for {bound.consumer}: already processed"
                )
            case Quarantined():
                self._quiet.mark(message)
                raise self._skip(
                    bound,
                    f"identity conflict for {bound.consumer}: quarantined to "
                    f"{bound.quarantine_queue}",
                )
        raise AssertionError(f"{settlement!r} told the broker {operation.tell}")

    def _skip(self, bound: InboxActor, reason: str) -> SkipMessage:
        """The SkipMessage that tells Dramatiq a message is settled (acked, not retried),
        once the thread's time limit is over. Dramatiq's TimeLimit raises its exception
        into the worker thread from another thread, wherever the thread is: landing in
        Dramatiq's handling of a SkipMessage, which no try covers, it kills the worker
        thread, and the process goes on with its messages and no thread to run them
        (Dramatiq issue 445). Ended here, in the actor call, a limit that runs out now
        lands in this call, whose exceptions Dramatiq handles (Retries)."""
        for middleware in self.broker_of(bound).middleware:
            if isinstance(middleware, TimeLimit):
                manager: Any = middleware.manager  # Dramatiq's, untyped
                manager.remove_timeout(threading.get_ident())
        return SkipMessage(reason)

    def _enqueue_again(self, bound: InboxActor, message: MessageProxy, delay: float) -> None:
        """Enqueue the handed-back message again, waiting out a broker outage for up to
        ``hand_back_patience`` seconds: the worker holds the message meanwhile. Giving up
        at once would leave Retries to enqueue it, which fails as well, and Dramatiq would
        then acknowledge a message that nothing holds any more."""
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_delay(self.hand_back_patience),
            wait=lambda state: backoff_delay(
                _REENQUEUE_FIRST_WAIT, _REENQUEUE_MAX_WAIT, state.attempt_number
            ),
            before_sleep=lambda state: logger.warning(
                "could not hand message %s back (%s); trying again",
                message.message_id,
                state.outcome.exception() if state.outcome else "?",
            ),
            reraise=True,
        )
        for attempt in retrying:
            with attempt:
                self.broker_of(bound).enqueue(message._message, delay=round(delay * 1000))

    def _hand_back_delay(self, settlement: HandedBack, pending: Pending) -> float:
        delivery = pending.arrival.delivery if pending.arrival else None
        backoff = self.backoffs[pending.message.actor_name]
        key = delivery.key if delivery else pending.message.message_id
        in_progress = None if self.in_progress_delay is None else self.in_progress_delay / 1000
        return settlement.wait(key, lambda: backoff.next(key), in_progress)

    def broker_of(self, bound: InboxActor) -> Broker:
        return bound.actor.broker

    def retry_budget(
        self, actor: dramatiq.Actor[Any, Any], message: dramatiq.Message[Any]
    ) -> RetryBudget:
        """Dramatiq's Retries' budget for ``message``, as Retries reads it (the consumption
        core decides whether a failure ends it)."""
        retries = self.retries
        if retries is None:
            return RetryBudget(0, 0)  # nothing retries: every failure is the last
        retry_when = actor.options.get("retry_when", retries.retry_when)
        options = message.options
        limit = options.get("max_retries", actor.options.get("max_retries", retries.max_retries))
        return RetryBudget(options.get("retries", 0), limit, retry_when)

    def quarantine(self, bound: InboxActor, message: MessageProxy, details: dict[str, Any]) -> None:
        """Publish a conflicting message to its actor's quarantine queue, with ``details``."""
        conflict = {**details, "source_queue": q_name(message.queue_name)}
        copy = message.copy(queue_name=bound.quarantine_queue, options={"inbox_conflict": conflict})
        assert self.quarantine_publisher is not None
        self.quarantine_publisher.publish(copy, bound.quarantine_queue)

    # -- worker boot ------------------------------------------------------------------------

    def before_worker_boot(self, broker: Broker, worker: Any) -> None:
        """Refuse to start a worker whose database would break the guarantee; warn when
        tracing is on but records nothing."""
        self._quiet.install()
        self.tracing.warn_if_inert()
        if not (self.check_database and self._actors):
            return
        if isinstance(self.inbox, RoutedInbox):
            check_routed(self.inbox)
            return
        assert not isinstance(self.async_inbox, AsyncRoutedInbox)
        check_database(self.inbox, self.async_inbox, worker.worker_threads, self.startup_patience)

    def _database_of(self, delivery: Any) -> str:
        """The map's database of ``delivery`` for the counts ("" with one database, or
        none: an unknown tenant's counts stay in memory)."""
        if not isinstance(self.inbox, RoutedInbox) or delivery is None:
            return ""
        try:
            return self.inbox.route(delivery)
        except Exception:
            return ""

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        if isinstance(self.inbox, RoutedInbox):
            if self._actors and self._counts is None and self.count_interval is not None:
                # each database's counts to that database
                self._counts = RoutedCountFlusher.for_routed(self.inbox, self.count_interval)
                self._counts.start()
            return
        assert not isinstance(self.inbox, RoutedInbox)
        assert not isinstance(self.async_inbox, AsyncRoutedInbox)
        if self._actors and self._counts is None:
            self._counts = count_flusher(self.inbox, self.async_inbox, self.count_interval)

    def after_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        counts, self._counts = self._counts, None
        if counts is not None:  # its last flush, while the event loop still runs
            counts.stop()
        # asyncpg connections belong to Dramatiq's event loop; close them on it while it
        # still runs (AsyncIO stops it in its own after_worker_shutdown, which runs after
        # this one when AsyncIO was added first, as usual).
        from dramatiq.asyncio import get_event_loop_thread

        loop_thread = get_event_loop_thread()
        if isinstance(self.inbox, RoutedInbox):
            self.inbox.dispose()
        if self.async_inbox is not None and loop_thread and loop_thread.loop.is_running():
            if isinstance(self.async_inbox, AsyncRoutedInbox):
                loop_thread.run_coroutine(self.async_inbox.dispose())
            else:
                loop_thread.run_coroutine(self.async_inbox.engine.dispose())


def _leave_the_barrier(message: MessageProxy) -> None:
    """A duplicate is no party to a group's barrier (GroupCallbacks counts deliveries):
    the first delivery counted, or its worker died before it could, and the group then
    never completes, which is why sending such a group to an inbox actor is refused."""
    message.options.pop("group_completion_uuid", None)
    message.options.pop("group_completion_callbacks", None)


def _option_name(actor: dramatiq.Actor[Any, Any], option: str) -> str:
    try:
        return validate_name(actor.options[option], option, max_length=MAX_NAME_LENGTH)
    except IdentityError as exc:
        raise ConfigurationError(f"actor {actor.actor_name!r}: {exc}") from None
