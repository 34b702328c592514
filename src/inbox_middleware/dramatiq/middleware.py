"""The Dramatiq middleware: claim, body and commit inside the actor call.

The middleware wraps the function of every actor declared with ``inbox_consumer``. The
worker acknowledges a message only after the actor call returns, so the order is fixed::

    worker thread                    PostgreSQL                 broker
    -------------                    ----------                 ------
    before_process_message:
      read identity, hash args
    actor call:
      BEGIN; INSERT claim ───────────> row (first) or conflict
      actor body (current_session)
      COMMIT ────────────────────────> durable
    return ─────────────────────────────────────────────────────> ack
    (a crash before this line leaves the message unacked: redelivered, then a duplicate)

A failed commit is an actor failure, which Dramatiq's Retries middleware retries. A
duplicate or a conflict ends the call with `SkipMessage`, so no result, callback or
pipeline step runs twice; a message without a usable identity is failed, which sends it
to the dead-letter queue.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import dramatiq
from dramatiq import Broker
from dramatiq.asyncio import get_event_loop_thread
from dramatiq.broker import MessageProxy
from dramatiq.common import q_name
from dramatiq.middleware import MiddlewareError, Retries, SkipMessage
from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from ..exceptions import (
    ClaimInProgress,
    ConfigurationError,
    IdentityError,
    InboxError,
    MissingIdentity,
    PayloadNotHashable,
    TransientError,
)
from ..identity import MAX_NAME_LENGTH, MessageIdentity, validate_name
from ..metrics import metrics
from ..poison import (
    REDELIVERY_LIMIT,
    RETRIES_EXHAUSTED,
    FailureRecorder,
    PoisonRecord,
    describe,
    reason_code,
)
from ..protocol import Decision, Delivery
from ..repair import mark_recovered, parse_marker
from ..retention import ExpiredPolicy, check_expired
from ..storage import Inbox, InboxSchema, Outcome
from ..storage.errors import as_transient
from ..storage.executors import (
    DEFAULT_LOCK_TIMEOUT,
    DEFAULT_SERIALIZATION_RETRIES,
    shadow_verdict,
)
from .payload import (
    BROKER_ID_PRODUCER,
    OPTION_MESSAGE_ID,
    OPTION_MESSAGE_ID_FROM,
    OPTION_PRODUCED_AT,
    OPTION_PRODUCER,
    OPTION_TENANT,
    ActorPayload,
    CanonicalForm,
    actor_identity,
)
from .repair import OPTION_REPAIR
from .routing import QuarantinePublisher, publisher_for

if TYPE_CHECKING:  # SQLAlchemy's asyncio support needs greenlet: imported only when used
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

    from ..storage.aio import AsyncInbox

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
R = TypeVar("R")

MissingIdentityPolicy = Literal["reject", "process", "broker_id"]
"""What to do with a message that carries no identity.

``reject`` (default): fail it to the dead-letter queue with an error log line.
``process``: run the actor without deduplication, with a warning per message.
``broker_id``: deduplicate on Dramatiq's own message id. That id is generated per
``send``, so it catches redeliveries and retries but not a producer sending twice.
"""

_session: ContextVar[Session | AsyncSession | None] = ContextVar(  # AsyncSession: async actors
    "inbox_middleware_session", default=None
)


def current_session() -> Session:
    """The session of the running inbox actor's transaction (sync actors).

    Everything executed through it commits together with the message's claim.
    """
    session = _session.get()
    if isinstance(session, Session):
        return session
    if session is not None:
        raise InboxError("this actor is async; use current_async_session()")
    raise InboxError("current_session() works only inside an actor declared with inbox_consumer")


def current_async_session() -> AsyncSession:
    """The `AsyncSession` of the running inbox actor's transaction (``async def`` actors)."""
    session = _session.get()
    if isinstance(session, Session):
        raise InboxError("this actor is not async; use current_session()")
    if session is not None:
        return session
    raise InboxError(
        "current_async_session() works only inside an actor declared with inbox_consumer"
    )


def identity(
    *,
    producer: str,
    message_id: str,
    tenant: str | None = None,
    produced_at: datetime | str | None = None,
) -> dict[str, Any]:
    """Message options carrying a producer intent id; validated here, at the producer.

    Typed ``dict[str, Any]`` so that ``**identity(...)`` type-checks next to
    ``send_with_options``' other keyword arguments.

    >>> add_credit.send_with_options(args=(7, 10), **identity(producer="orders", message_id="o-42"))
    """
    parsed = MessageIdentity.parse(
        producer=producer, message_id=message_id, tenant=tenant, produced_at=produced_at
    )
    options = {OPTION_PRODUCER: parsed.producer, OPTION_MESSAGE_ID: parsed.message_id}
    if parsed.tenant:
        options[OPTION_TENANT] = parsed.tenant
    if parsed.produced_at is not None:
        options[OPTION_PRODUCED_AT] = parsed.produced_at.isoformat()
    return options


class ActorConfigurationError(ConfigurationError, MiddlewareError):
    """An inbox actor is declared in a way that cannot work.

    A `MiddlewareError`, because Dramatiq logs and swallows any other exception raised
    while an actor is declared, which would leave the actor running unprotected.
    """


class WorkerBootError(ConfigurationError, MiddlewareError):
    """The worker must not start: the inbox's schema or database settings are wrong."""


@dataclass(frozen=True, slots=True)
class _Pending:
    """A message prepared by before_process_message for the actor call that follows."""

    message: MessageProxy
    delivery: Delivery | None  # None: the missing-identity policy lets it run unprotected
    error: Exception | None = None  # preparing failed unexpectedly: the call must fail


class InboxMiddleware(dramatiq.Middleware):
    """Deduplicates every actor declared with ``inbox_consumer`` in its own transaction.

    Parameters:
      engine: a sqlalchemy `Engine` for sync actors, or an `AsyncEngine` for async ones.
      async_engine: the `AsyncEngine`, when sync and async actors share the broker.
      naming: schema and table prefix of the inbox tables.
      lock_timeout: seconds a delivery waits on a concurrent delivery's claim before it is
        retried later (and the bound on any lock wait inside the transaction).
      serialization_retries: in-process reruns after a serialization failure or deadlock.
      missing_identity: see `MissingIdentityPolicy`.
      quarantine_queue: the queue conflicting messages go to; ``{queue}`` is the actor's.
      quarantine_publisher: how to publish there; chosen from the broker by default.
      in_progress_delay: milliseconds before retrying a message whose claim is held by
        another delivery; None uses the actor's retry backoff.
      canonical_form: a default `CanonicalForm` for hashing payloads.
      permanent_errors: exception types that mean "retrying cannot help", besides
        `PermanentError`: such a failure goes to the poison table and the dead-letter
        queue at once.
      redelivery_limit: how often a message may come back from a broker redelivery (its
        worker died or lost the connection before an outcome) before it is treated as
        poison; RabbitMQ reports redeliveries, Dramatiq's Redis broker does not. None: no
        limit.
      retention_window: how long claims are kept (the purge window); a first-seen message
        whose producer timestamp (``inbox_produced_at``) is older may have been processed
        and purged already. None: no check.
      expired_redelivery: what to do with such a message: ``reject`` (kept as poison,
        reason ``expired_redelivery``) or ``process``; both are counted.
      check_database: verify the schema and database settings when a worker boots.
      shadow: shadow mode for every inbox actor (``inbox_shadow`` sets it per actor):
        claims are recorded and decided as usual, but nothing is skipped; a would-be
        duplicate or conflict runs the actor and is counted
        (``inbox_shadow_would_skip_total``) and logged, a conflict writes no quarantine
        row, and a message without a usable identity runs unprotected instead of being
        dead-lettered. Switching it off needs no migration: the claims mean the same.

    Actor options: ``inbox_consumer`` (the consumer name; required to opt in),
    ``inbox_handler_version``, ``inbox_missing_identity``, ``inbox_canonical_form``,
    ``inbox_quarantine_queue``, ``inbox_permanent_errors`` and ``inbox_shadow``, overriding
    the middleware's settings per actor.
    """

    def __init__(
        self,
        engine: Engine | AsyncEngine | None = None,
        *,
        async_engine: AsyncEngine | None = None,
        naming: InboxSchema | None = None,
        lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT,
        serialization_retries: int = DEFAULT_SERIALIZATION_RETRIES,
        missing_identity: MissingIdentityPolicy = "reject",
        quarantine_queue: str = "{queue}.quarantine",
        quarantine_publisher: QuarantinePublisher | None = None,
        in_progress_delay: int | None = None,
        canonical_form: CanonicalForm | None = None,
        permanent_errors: Sequence[type[BaseException]] = (),
        redelivery_limit: int | None = 10,
        retention_window: timedelta | None = None,
        expired_redelivery: ExpiredPolicy = "reject",
        check_database: bool = True,
        shadow: bool = False,
    ) -> None:
        if engine is not None and not isinstance(engine, Engine):  # an AsyncEngine
            if async_engine is not None:
                raise ConfigurationError("pass the AsyncEngine once")
            engine, async_engine = None, engine
        settings: dict[str, Any] = {
            "naming": naming,
            "lock_timeout": lock_timeout,
            "serialization_retries": serialization_retries,
        }
        self.inbox = Inbox(engine, **settings) if engine is not None else None
        self.async_inbox: AsyncInbox | None = None
        if async_engine is not None:
            from ..storage.aio import AsyncInbox

            self.async_inbox = AsyncInbox(async_engine, **settings)
        if self.inbox is None and self.async_inbox is None:
            raise ConfigurationError("InboxMiddleware needs an Engine or an AsyncEngine")
        self.missing_identity = _check_policy(missing_identity)
        self.quarantine_queue = quarantine_queue
        self.quarantine_publisher = quarantine_publisher
        self.in_progress_delay = in_progress_delay
        self.canonical_form = canonical_form
        self.permanent_errors = tuple(permanent_errors)
        self.redelivery_limit = redelivery_limit
        self.retention_window = retention_window
        self.expired_redelivery = expired_redelivery
        self.check_database = check_database
        self.shadow = shadow
        self.retries: Retries | None = None
        self._recorders: dict[str, FailureRecorder] = {}
        self._actors: dict[str, _InboxActor] = {}
        self._consumers: dict[str, str] = {}
        self._pending = threading.local()

    @property
    def actor_options(self) -> set[str]:
        return {
            "inbox_consumer",
            "inbox_handler_version",
            "inbox_missing_identity",
            "inbox_canonical_form",
            "inbox_quarantine_queue",
            "inbox_permanent_errors",
            "inbox_shadow",
            OPTION_PRODUCER,  # with OPTION_MESSAGE_ID_FROM: the identity is an argument
            OPTION_MESSAGE_ID_FROM,
        }

    # -- declaration ----------------------------------------------------------------------

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
        if self.quarantine_publisher is None:
            self.quarantine_publisher = publisher_for(broker)
        self._actors[actor.actor_name] = _InboxActor(self, actor, consumer)
        self._consumers[consumer] = actor.actor_name

    # -- processing ---------------------------------------------------------------------

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        self._pending.value = None
        bound = self._actors.get(message.actor_name)
        if bound is None:
            return
        try:
            self._pending.value = _Pending(message, bound.delivery(message))
        except (IdentityError, PayloadNotHashable) as exc:
            reason = _identity_reason(exc)
            missing = isinstance(exc, MissingIdentity)
            if bound.shadow or (missing and bound.missing_identity == "process"):
                metrics.missing_identity(bound.consumer, reason, "processed")
                policy = "shadow mode" if bound.shadow else "missing_identity='process'"
                logger.warning(
                    "processing message %s for %s WITHOUT deduplication: %s (%s)",
                    message.message_id,
                    bound.consumer,
                    exc,
                    policy,
                    extra={
                        "inbox_event": "unprotected",
                        "inbox_consumer": bound.consumer,
                        "inbox_identity": reason,
                        "inbox_shadow": bound.shadow,
                    },
                )
                self._pending.value = _Pending(message, None)
                return
            metrics.missing_identity(bound.consumer, reason, "rejected")
            hint = "; send it with **identity(producer=..., message_id=...)" if missing else ""
            self._reject(message, bound, exc, hint=hint)
        except Exception as exc:
            # The broker would log and swallow this and call the actor anyway; hand it to
            # the actor call instead, which raises it, so the message is retried.
            self._pending.value = _Pending(message, None, exc)

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

    def recorder(self, dialect: str) -> FailureRecorder:
        naming = (self.inbox or self.async_inbox).naming  # type: ignore[union-attr]
        if dialect not in self._recorders:
            self._recorders[dialect] = FailureRecorder(naming, dialect)
        return self._recorders[dialect]

    def take_pending(self, actor_name: str) -> _Pending | None:
        """The message prepared for this thread's actor call; each is taken once, so an
        actor called directly from inside another actor's body is not mistaken for it."""
        pending: _Pending | None = getattr(self._pending, "value", None)
        if pending is None or pending.message.actor_name != actor_name:
            return None
        self._pending.value = None
        return pending

    def _reject(
        self, message: MessageProxy, bound: _InboxActor, exc: InboxError, hint: str = ""
    ) -> None:
        logger.error(
            "rejecting message %s for consumer %s to the dead-letter queue: %s%s",
            message.message_id,
            bound.consumer,
            exc,
            hint,
            extra={
                "inbox_event": "rejected",
                "inbox_consumer": bound.consumer,
                "inbox_reason": type(exc).__name__,
                "inbox_identity": _identity_reason(exc),
            },
        )
        message.fail()
        raise SkipMessage(str(exc))

    # -- worker boot ----------------------------------------------------------------------

    def before_worker_boot(self, broker: Broker, worker: Any) -> None:
        """Refuse to start a worker whose database would break the guarantee."""
        if not (self.check_database and self._actors):
            return
        try:
            if self.inbox is not None:
                self.inbox.check()
                _check_pool(self.inbox.engine, worker.worker_threads)
            if self.async_inbox is not None:
                asyncio.run(_check_async(self.async_inbox))
                _check_pool(self.async_inbox.engine.sync_engine, worker.worker_threads)
        except InboxError as exc:
            # A MiddlewareError, or Dramatiq would log this and start the worker anyway.
            raise WorkerBootError(str(exc)) from exc

    def after_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        # asyncpg connections belong to Dramatiq's event loop; close them on it while it
        # still runs (AsyncIO stops it in its own after_worker_shutdown, which runs after
        # this one when AsyncIO was added first, as usual).
        loop_thread = get_event_loop_thread()
        if self.async_inbox is not None and loop_thread and loop_thread.loop.is_running():
            loop_thread.run_coroutine(self.async_inbox.engine.dispose())


async def _check_async(inbox: AsyncInbox) -> None:
    # Runs on a private event loop before Dramatiq's starts: its connections must not
    # outlive this loop, so the pool is emptied before returning.
    try:
        await inbox.check()
    finally:
        await inbox.engine.dispose()


class _InboxActor:
    """One inbox actor: its settings, payload binding and the wrapped function."""

    def __init__(
        self, middleware: InboxMiddleware, actor: dramatiq.Actor[Any, Any], consumer: str
    ) -> None:
        options = actor.options
        self.middleware = middleware
        self.actor = actor
        self.consumer = consumer
        self.handler_version = str(options.get("inbox_handler_version", ""))
        self.missing_identity = _check_policy(
            options.get("inbox_missing_identity", middleware.missing_identity)
        )
        self.quarantine_queue = str(
            options.get("inbox_quarantine_queue", middleware.quarantine_queue)
        ).format(queue=q_name(actor.queue_name))
        self.permanent = tuple(options.get("inbox_permanent_errors", middleware.permanent_errors))
        self.shadow = bool(options.get("inbox_shadow", middleware.shadow))
        throws = options.get("throws")
        if throws:  # Dramatiq never retries these: they fail permanently too
            self.permanent += tuple(throws) if isinstance(throws, tuple) else (throws,)
        original = actor.fn
        self.target: Callable[..., Any] = getattr(original, "__wrapped__", original)
        self.payload = ActorPayload(
            actor.actor_name,
            self.target,
            options.get("inbox_canonical_form", middleware.canonical_form),
            actor_identity(actor.actor_name, self.target, options),
        )
        if inspect.iscoroutinefunction(self.target):
            if middleware.async_inbox is None:
                raise ConfigurationError(
                    f"actor {actor.actor_name!r} is async: give InboxMiddleware an AsyncEngine"
                )
            call = self.call_async
            self.is_async = True
        else:
            if middleware.inbox is None:
                raise ConfigurationError(
                    f"actor {actor.actor_name!r} is not async: give InboxMiddleware an Engine"
                )
            call = self.call
            self.is_async = False

        @functools.wraps(self.target)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return call(*args, **kwargs)

        actor.fn = wrapper

    def delivery(self, message: MessageProxy) -> Delivery:
        try:
            ident = self.payload.message_identity(message)
        except MissingIdentity:
            if self.missing_identity != "broker_id":
                raise
            metrics.missing_identity(self.consumer, "missing", "broker_id")
            ident = MessageIdentity(BROKER_ID_PRODUCER, message.message_id)
        delivery = self.payload.delivery(
            message, ident, consumer=self.consumer, handler_version=self.handler_version
        )
        return replace(delivery, shadow=True) if self.shadow else delivery

    # -- sync actors ----------------------------------------------------------------------

    def call(self, *args: Any, **kwargs: Any) -> Any:
        inbox = self.middleware.inbox
        assert inbox is not None
        pending = self.middleware.take_pending(self.actor.actor_name)
        if pending is not None and pending.error is not None:
            raise pending.error
        if pending is None or pending.delivery is None:
            if _session.get() is not None:  # called from another inbox actor: join it
                return self.target(*args, **kwargs)
            return inbox.transaction(lambda session: self._body(session, args, kwargs))
        self._limit_redeliveries(pending)
        marker = pending.message.options.get(OPTION_REPAIR)
        delivery = pending.delivery

        def body(session: Session) -> Any:
            self._check_expired(delivery, session)
            result = self._body(session, args, kwargs)
            if marker is not None:  # a redriven or accepted message: recovered with this commit
                mark_recovered(session.connection(), inbox.naming, marker)
            return result

        try:
            outcome = inbox.process(pending.delivery, body)
        except ClaimInProgress as exc:
            raise dramatiq.Retry(str(exc), delay=self.middleware.in_progress_delay) from exc
        except TransientError:
            raise  # the database's trouble, not the message's: retried as it is
        except Exception as exc:
            self._failed(pending, exc)
            raise
        return self._settle(pending, outcome)

    def _body(self, session: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        token = _session.set(session)
        try:
            return self.target(*args, **kwargs)
        finally:
            _session.reset(token)

    # -- async actors ---------------------------------------------------------------------

    def call_async(self, *args: Any, **kwargs: Any) -> Any:
        pending = self.middleware.take_pending(self.actor.actor_name)
        if pending is not None and pending.error is not None:
            raise pending.error
        joined = _session.get() is not None
        loop_thread = get_event_loop_thread()
        if loop_thread is None:
            raise ConfigurationError(
                f"actor {self.actor.actor_name!r} is async: add dramatiq's AsyncIO middleware"
            )
        if pending is None or pending.delivery is None:
            return loop_thread.run_coroutine(self._run_async(pending, joined, args, kwargs))
        self._limit_redeliveries(pending)
        try:
            outcome = loop_thread.run_coroutine(self._run_async(pending, joined, args, kwargs))
        except ClaimInProgress as exc:
            raise dramatiq.Retry(str(exc), delay=self.middleware.in_progress_delay) from exc
        except TransientError:
            raise
        except Exception as exc:
            self._failed(pending, exc)
            raise
        # Settled here, on the worker thread, so publishing never blocks the event loop.
        return self._settle(pending, outcome)

    async def _run_async(
        self, pending: _Pending | None, joined: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        inbox = self.middleware.async_inbox
        assert inbox is not None

        async def body(session: AsyncSession) -> Any:
            token = _session.set(session)
            try:
                return await self.target(*args, **kwargs)
            finally:
                _session.reset(token)

        if pending is None or pending.delivery is None:
            if joined:
                return await self.target(*args, **kwargs)
            return await inbox.transaction(body)
        marker = pending.message.options.get(OPTION_REPAIR)
        delivery = pending.delivery

        async def repaired(session: AsyncSession) -> Any:
            self._check_expired(delivery, session.sync_session)
            result = await body(session)
            if marker is not None:
                await session.run_sync(
                    lambda sync: mark_recovered(sync.connection(), inbox.naming, marker)
                )
            return result

        return await inbox.process(pending.delivery, repaired)

    def _check_expired(self, delivery: Delivery, session: Session) -> None:
        policy = self.middleware.expired_redelivery
        if delivery.shadow:
            if shadow_verdict(session) is not None:
                return  # a would-be duplicate or conflict: its claim is there, not expired
            policy = "process"  # shadow mode skips nothing: counted, then processed
        check_expired(delivery, self.middleware.retention_window, policy, consumer=self.consumer)

    # -- failures -------------------------------------------------------------------------

    def _failed(self, pending: _Pending, exc: Exception) -> None:
        """Count the failure in its own transaction; a permanent one becomes poison and
        is dead-lettered here (SkipMessage), a transient one returns to be retried."""
        delivery, message = pending.delivery, pending.message
        assert delivery is not None
        code = reason_code(exc, self.permanent)
        last = code is None and self._last_attempt(message)
        reason = code or (RETRIES_EXHAUSTED if last else None)
        error = describe(exc)

        def record(conn: Connection) -> PoisonRecord | None:
            recorder = self.middleware.recorder(conn.dialect.name)
            attempts = recorder.count_failure(conn, delivery, error)
            if reason is None:
                return None
            return recorder.record_poison(
                conn, delivery, reason_code=reason, error=error, attempts=attempts
            )

        try:
            poison = self._in_own_transaction(record)
        except Exception:
            # Not recorded (the database may be down): the message must not be dropped,
            # so it takes the ordinary retry path whatever kind of failure this was.
            logger.exception(
                "could not record the failure of message %s; it will be retried",
                message.message_id,
            )
            return
        metrics.handler_failure(self.consumer, reason or type(exc).__name__)
        if poison is not None:
            metrics.moved(self.consumer, "poison")
            logger.error(
                "poison message %s for %s (%s, %d attempts): kept in the poison table as "
                "#%d, moved to the dead-letter queue",
                message.message_id,
                self.consumer,
                reason,
                poison.attempts,
                poison.id,
                extra={
                    "inbox_event": "poison",
                    "inbox_consumer": self.consumer,
                    "inbox_reason_code": reason,
                    "inbox_poison_id": poison.id,
                },
            )
        if code is not None:
            message.fail()
            raise SkipMessage(f"poison message for {self.consumer}: {code}") from exc

    def _last_attempt(self, message: MessageProxy) -> bool:
        """Will Dramatiq's Retries give up after this failure? (Unknown with retry_when.)"""
        retries = self.middleware.retries
        if retries is None or self.actor.options.get("retry_when") or retries.retry_when:
            return False
        limit = message.options.get(
            "max_retries", self.actor.options.get("max_retries", retries.max_retries)
        )
        return limit is not None and message.options.get("retries", 0) >= limit

    def _limit_redeliveries(self, pending: _Pending) -> None:
        """Bound crash loops: a message whose deliveries keep ending without an outcome
        (the worker is killed, runs out of memory) stops after `redelivery_limit`."""
        limit = self.middleware.redelivery_limit
        delivery, message = pending.delivery, pending.message
        if limit is None or delivery is None or not getattr(message, "redelivered", False):
            return
        error = "redelivered: an earlier delivery ended without an outcome"

        def count(conn: Connection) -> PoisonRecord | None:
            recorder = self.middleware.recorder(conn.dialect.name)
            # Dramatiq retries a failure as a new message, so every redelivery is a
            # delivery that ended without any outcome.
            redeliveries, _ = recorder.count_redelivery(conn, delivery)
            if redeliveries <= limit or recorder.claimed(conn, delivery):
                return None  # within the limit, or an ack lost after the commit: a duplicate
            return recorder.record_poison(
                conn, delivery, reason_code=REDELIVERY_LIMIT, error=error, attempts=redeliveries
            )

        try:
            poison = self._in_own_transaction(count)
        except Exception as exc:  # the database's trouble: retried like a failed claim
            raise as_transient(exc, delivery) from exc
        if poison is not None:
            metrics.moved(self.consumer, "poison")
            logger.error(
                "message %s for %s was redelivered %d times without an outcome: kept in "
                "the poison table as #%d, moved to the dead-letter queue",
                message.message_id,
                self.consumer,
                poison.attempts,
                poison.id,
            )
            message.fail()
            raise SkipMessage(f"poison message for {self.consumer}: {REDELIVERY_LIMIT}")

    def _in_own_transaction(self, work: Callable[[Connection], R]) -> R:
        """Run ``work`` in a short transaction of its own, never the failed attempt's."""
        if self.is_async:
            inbox = self.middleware.async_inbox
            loop_thread = get_event_loop_thread()
            assert inbox is not None
            assert loop_thread is not None

            async def run() -> R:
                async with inbox.engine.begin() as conn:
                    return await conn.run_sync(work)

            return loop_thread.run_coroutine(run())
        assert self.middleware.inbox is not None
        with self.middleware.inbox.engine.begin() as conn:
            return work(conn)

    # -- outcome --------------------------------------------------------------------------

    def _settle(self, pending: _Pending, outcome: Outcome[Any]) -> Any:
        if outcome.verdict.runs_handler:  # first seen, or anything in shadow mode
            repaired = parse_marker(pending.message.options.get(OPTION_REPAIR))
            if repaired is not None:
                metrics.recovered(self.consumer, repaired[0])
            return outcome.result
        if outcome.decision is Decision.CONFLICT:
            self._quarantine(pending, outcome)
            raise SkipMessage(
                f"identity conflict for {self.consumer}: quarantined to {self.quarantine_queue}"
            )
        raise SkipMessage(f"duplicate delivery for {self.consumer}: already processed")

    def _quarantine(self, pending: _Pending, outcome: Outcome[Any]) -> None:
        message, delivery = pending.message, pending.delivery
        assert delivery is not None
        verdict = outcome.verdict
        assert verdict.stored is not None
        assert verdict.quarantine is not None
        conflict = {
            "reason": "identity_conflict",
            "consumer": self.consumer,
            "quarantine_id": verdict.quarantine.id,
            "attempts": verdict.quarantine.attempts,
            "stored_sha256": verdict.stored.payload_sha256,
            "conflicting_sha256": delivery.payload_hash.sha256,
            "source_queue": q_name(message.queue_name),
        }
        copy = message.copy(queue_name=self.quarantine_queue, options={"inbox_conflict": conflict})
        publisher = self.middleware.quarantine_publisher
        assert publisher is not None
        # The quarantine row is already committed; if this publish fails the actor fails,
        # the message is retried, and the retry records the conflict again (attempts + 1).
        publisher.publish(copy, self.quarantine_queue)
        metrics.moved(self.consumer, "quarantine")


def _option_name(actor: dramatiq.Actor[Any, Any], option: str) -> str:
    try:
        return validate_name(actor.options[option], option, max_length=MAX_NAME_LENGTH)
    except IdentityError as exc:
        raise ConfigurationError(f"actor {actor.actor_name!r}: {exc}") from None


def _identity_reason(exc: Exception) -> str:
    """The ``reason`` label of a message without a usable identity."""
    if isinstance(exc, MissingIdentity):
        return "missing"
    return "unhashable" if isinstance(exc, PayloadNotHashable) else "invalid"


def _check_policy(value: object) -> MissingIdentityPolicy:
    if value not in ("reject", "process", "broker_id"):
        raise ConfigurationError(
            f"missing_identity must be 'reject', 'process' or 'broker_id', not {value!r}"
        )
    return value


def _check_pool(engine: Engine, threads: int) -> None:
    pool = engine.pool
    size = getattr(pool, "size", None)
    overflow = getattr(pool, "_max_overflow", 0)
    if callable(size) and overflow >= 0 and size() + overflow < threads:
        logger.warning(
            "the connection pool holds at most %d connections for %d worker threads: threads "
            "will wait for connections; set pool_size (plus max_overflow) to at least %d",
            size() + overflow,
            threads,
            threads,
        )
