"""One inbox actor: its settings, the wrapped function, and the I/O of its deliveries.

The wrapper replaces the actor's function, so the claim, the body and the commit all run
inside the actor call, before the worker acknowledges anything. It turns the message into
an `Arrival`, drives the consumption core with this actor's I/O (`perform`), and hands
the settlement to the middleware, which tells Dramatiq.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import inspect
import logging
import time
import traceback
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import dramatiq
from dramatiq.asyncio import get_event_loop_thread
from dramatiq.broker import MessageProxy
from dramatiq.common import q_name
from dramatiq.middleware import Interrupt, SkipMessage
from dramatiq.middleware.shutdown import Shutdown
from dramatiq.middleware.time_limit import TimeLimitExceeded
from dramatiq.results import Results
from sqlalchemy.orm import Session

from .._core import faults
from .._core.consumption import (
    Arrival,
    HandBackRequested,
    HandedBack,
    Op,
    Poisoned,
    Process,
    Processed,
    Publish,
    RejectRequested,
    RetryBudget,
    Route,
    RunUnprotected,
    SendOutputs,
    drive,
    settle_steps,
)
from .._core.exceptions import (
    ConfigurationError,
    IdentityError,
    InboxInterrupted,
    MissingIdentity,
    PayloadNotHashable,
)
from .._core.identity import MessageIdentity
from .._core.outputs import Output, derived_identity, unstorable
from .._core.policy import SETTINGS
from .._core.protocol import Delivery
from .._observe.instruments import metrics
from .._observe.tracing import TRACE_OPTION
from ._context import CONSUMER_INFO, identity, session_var
from ._payload import BROKER_ID_PRODUCER, OPTION_MESSAGE_ID, ActorPayload, actor_identity
from ._repair import OPTION_REPAIR

CALLBACK_HEADER = "dramatiq-on-success"
"""The stored output's header that holds the ``on_success`` callback message as first
sent (encoded by Dramatiq's encoder, in base64): a replay sends these bytes again."""

DELIVERIES = "inbox_deliveries"
"""The attribute of a message from a quorum queue (`QuorumRabbitmqBroker`) that holds the
broker's count of its deliveries, this one included."""

if TYPE_CHECKING:
    from dramatiq.middleware import Retries
    from sqlalchemy.ext.asyncio import AsyncSession

    from .._core.consumption import Settlement
    from .._core.policy import ConsumerPolicy
    from .._observe.tracing import NoTracing, Tracing
    from .._storage import Inbox
    from .._storage.aio import AsyncInbox
    from .._storage.routed import AsyncRoutedInbox, RoutedInbox

__all__ = ["SKIPPED", "ActorHost", "InboxActor", "Pending"]

R = TypeVar("R")
logger = logging.getLogger("inbox_middleware.dramatiq")


class _Skipped:
    def __repr__(self) -> str:
        return "SKIPPED"


SKIPPED = _Skipped()
"""The body raised `SkipMessage` after doing its work: commit it, then skip the message."""


class ActorHost(Protocol):
    """What an inbox actor needs of the `InboxMiddleware` that wraps it (which builds the
    actors, so this module does not import it)."""

    inbox: Inbox | RoutedInbox | None
    async_inbox: AsyncInbox | AsyncRoutedInbox | None
    policy: ConsumerPolicy
    canonical_form: Any
    quarantine_queue: str
    tracing: Tracing | NoTracing
    retries: Retries | None

    def continuing(self) -> contextlib.AbstractContextManager[None]: ...

    def take_pending(self, actor_name: str) -> Pending | None: ...

    def settle(self, bound: InboxActor, pending: Pending, settlement: Settlement) -> Any: ...

    def retry_budget(
        self, actor: dramatiq.Actor[Any, Any], message: dramatiq.Message[Any]
    ) -> RetryBudget: ...

    def quarantine(
        self, bound: InboxActor, message: MessageProxy, details: dict[str, Any]
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class Pending:
    """A message prepared by before_process_message for the actor call that follows."""

    message: MessageProxy
    arrival: Arrival | None
    error: Exception | None = None  # preparing failed unexpectedly: the call must fail

    @property
    def fields(self) -> dramatiq.Message[Any]:
        """The message the proxy wraps: its fields read without the proxy's __getattr__,
        which costs a few µs a read on the hot path."""
        return self.message._message


class InboxActor:
    """One inbox actor: settings, payload binding, the wrapped function and its I/O."""

    def __init__(
        self, middleware: ActorHost, actor: dramatiq.Actor[Any, Any], consumer: str
    ) -> None:
        options = actor.options
        self.middleware = middleware
        self.actor = actor
        self.consumer = consumer
        self.handler_version = str(options.get("inbox_handler_version", ""))
        overrides = {
            name: options[f"inbox_{name}"] for name in SETTINGS if f"inbox_{name}" in options
        }
        permanent = tuple(overrides.get("permanent_errors", middleware.policy.permanent_errors))
        throws = options.get("throws")
        if throws:  # Dramatiq never retries these: they fail permanently too
            permanent += tuple(throws) if isinstance(throws, tuple) else (throws,)
        self.policy = middleware.policy.override_set(overrides | {"permanent_errors": permanent})
        self.quarantine_queue = str(
            options.get("inbox_quarantine_queue", middleware.quarantine_queue)
        ).format(queue=q_name(actor.queue_name))
        # on_success callbacks of an inbox actor are sent by the inbox, before the ack, with
        # an identity derived from the message's, and again by a duplicate; Dramatiq's
        # Callbacks middleware (after the ack, with no identity) must not send them too.
        self.on_success: str | None = options.pop("on_success", None)
        self._results_found: tuple[Results | None] | None = None
        original = actor.fn
        self.target: Callable[..., Any] = getattr(original, "__wrapped__", original)
        self.payload = ActorPayload(
            actor.actor_name,
            self.target,
            options.get("inbox_canonical_form", middleware.canonical_form),
            actor_identity(actor.actor_name, self.target, options),
        )
        self.is_async = inspect.iscoroutinefunction(self.target)
        engine = middleware.async_inbox if self.is_async else middleware.inbox
        if engine is None:
            kind = "an AsyncEngine" if self.is_async else "an Engine"
            state = "async" if self.is_async else "not async"
            raise ConfigurationError(
                f"actor {actor.actor_name!r} is {state}: give InboxMiddleware {kind}"
            )

        @functools.wraps(self.target)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return self.call(args, kwargs)

        actor.fn = wrapper

    @property
    def shadow(self) -> bool:
        return self.policy.shadow

    # -- arrival ----------------------------------------------------------------------------

    def arrival(self, message: MessageProxy) -> Arrival:
        # What the broker set on its proxy (RabbitMQ's redelivered flag, the quorum
        # queue's count), read from the proxy's own attributes; the message's fields from
        # the message itself: the proxy forwards each read through __getattr__, which
        # costs a message several µs over the dozen fields read here.
        given = vars(message)
        inner = message._message
        common: dict[str, Any] = {
            "redelivered": bool(given.get("redelivered", False)),
            # RabbitMQ quorum queues count deliveries (QuorumRabbitmqBroker reads them)
            "deliveries": given.get(DELIVERIES),
            "repair_marker": inner.options.get(OPTION_REPAIR),
            "retry_budget": self.middleware.retry_budget(self.actor, inner),
            "interrupts": (TimeLimitExceeded,),
            "shutdowns": (Shutdown,),
            # Dramatiq retries a failure as a new message: only a delivery that ended
            # without an outcome comes back redelivered.
            "outcomes_redeliver": False,
            "keeps_outputs": self.keeps_outputs(inner),
            "sends_outputs": True,  # pipeline steps and on_success, before the ack
            "declared_consumer": self.consumer,
            "source": inner.queue_name,
            # Over many databases, the core chooses the delivery's database first.
            "routed": bool(getattr(self._storage, "routed", False)),
        }
        try:
            return Arrival(self.delivery(inner), **common)
        except (IdentityError, PayloadNotHashable) as exc:
            return Arrival(None, exc, **common)

    def delivery(self, message: dramatiq.Message[Any] | MessageProxy) -> Delivery:
        try:
            ident = self.payload.message_identity(message)
        except MissingIdentity:
            if self.policy.missing_identity != "broker_id":
                raise
            metrics.missing_identity(self.consumer, "missing", "broker_id")
            ident = MessageIdentity(BROKER_ID_PRODUCER, message.message_id)
        delivery = self.payload.delivery(
            message, ident, consumer=self.consumer, handler_version=self.handler_version
        )
        return replace(delivery, shadow=True) if self.policy.shadow else delivery

    # -- outputs ------------------------------------------------------------------------------

    def keeps_outputs(self, message: dramatiq.Message[Any] | MessageProxy) -> bool:
        """Whether something consumes this message's result: a pipeline step, an
        ``on_success`` callback, or the Results middleware storing it."""
        options = message.options
        if options.get("pipe_target") or options.get("on_success") or self.on_success:
            return True
        results = self._results()
        if results is None:
            return False
        stores = options.get("store_results")
        if stores is None:
            stores = self.actor.options.get("store_results", results.store_results)
        return bool(stores)

    def _results(self) -> Results | None:
        """The broker's Results middleware, looked up at the first message, not at each."""
        if self._results_found is None:
            middleware = self.actor.broker.middleware
            self._results_found = (next((m for m in middleware if isinstance(m, Results)), None),)
        return self._results_found[0]

    def encode(self, result: Any) -> Output:
        """The result as Dramatiq's encoder writes it into a message or a result backend."""
        if result is None:
            return Output(None)
        encoder = dramatiq.get_encoder()
        try:
            body = encoder.encode(result)
        except Exception as exc:
            raise unstorable(f"{type(exc).__name__}: {exc}") from exc
        json = isinstance(encoder, dramatiq.JSONEncoder)
        output = Output(body, "application/json" if json else None)
        return output.checked(self.policy.max_output_bytes)

    def decode(self, output: Output) -> Any:
        """The stored result, as the Results middleware and the next step receive it."""
        return dramatiq.get_encoder().decode(output.body) if output.body is not None else None

    def callback(self, message: MessageProxy, delivery: Delivery, result: Any) -> bytes | None:
        """The ``on_success`` callback of ``message``, built as Dramatiq's Callbacks builds
        it (the message as a dict, the result) with an identity derived from the
        delivery's, encoded for storage with the result: every replay sends these bytes."""
        name = message.options.get("on_success") or self.on_success
        if not name:
            return None
        callee = self.actor.broker.get_actor(name)
        options = _with_identity({}, delivery, "on_success")
        sent = callee.message_with_options(args=(message.asdict(), result), **options)
        return sent.encode()

    def replay(self, message: MessageProxy, delivery: Delivery, output: Output) -> None:
        """Send what follows the committed ``delivery``: its pipeline step and its
        ``on_success`` callback, each with an identity derived from the delivery's (the
        callback exactly as the first delivery stored it). Runs before the ack; the
        consumption core decides what a failure here means (`SendOutputs`)."""
        broker = self.actor.broker
        with self.middleware.continuing():
            target = message.options.get("pipe_target")
            if target is not None:
                step: dramatiq.Message[Any] = dramatiq.Message(**target)
                if not (step.options.get("pipe_ignore") or self.actor.options.get("pipe_ignore")):
                    step = step.copy(args=(*step.args, self.decode(output)))
                step = step.copy(options=_with_identity(step.options, delivery, "pipe"))
                broker.enqueue(step, delay=step.options.get("delay"))
                del message.options["pipe_target"]  # sent: Pipelines must not send it again
            if message.options.get("on_success") or self.on_success:
                stored = output.headers.get(CALLBACK_HEADER)
                if stored is not None:
                    callback = dramatiq.Message.decode(base64.b64decode(stored))
                else:  # the first delivery stored none (it asked for none, or its claim
                    # is older than stored callbacks): built from this copy
                    encoded = self.callback(message, delivery, self.decode(output))
                    assert encoded is not None
                    callback = dramatiq.Message.decode(encoded)
                broker.enqueue(callback, delay=callback.options.get("delay"))
                # sent: Dramatiq's Callbacks must not send it, nor Retries' copy again
                message.options.pop("on_success", None)

    def unprotected_callback(self, message: MessageProxy, result: Any) -> None:
        """The actor's own ``on_success`` after a delivery run without a claim (no
        identity, ``missing_identity="process"``): sent as Dramatiq's Callbacks sends it,
        best effort and without an identity. A callback named in the message's options is
        Callbacks' own business there."""
        if result is SKIPPED or not self.on_success or message.options.get("on_success"):
            return
        try:
            self.actor.broker.get_actor(self.on_success).send(message.asdict(), result)
        except Exception:
            logger.exception("could not send the on_success callback of %s", message.message_id)

    def notify_failure(self, message: MessageProxy, poisoned: Poisoned) -> None:
        """Send ``on_retry_exhausted`` and ``on_failure`` for a message kept as poison, as
        Dramatiq's Retries and Callbacks would have after its last failed attempt (which
        the inbox settles itself): with their arguments, in their order, best effort."""
        exc = poisoned.failure
        if exc is None:
            return
        if isinstance(exc, HandBackRequested) and exc.cause is not None:
            exc = exc.cause
        options, declared = message.options, self.actor.options
        sends: list[tuple[str, dict[str, Any]]] = []
        if poisoned.exhausted:  # what Retries writes into a message it gives up on
            retries = options.get("retries", 0)
            default = self.middleware.retries.max_retries if self.middleware.retries else None
            max_retries = options.get("max_retries", declared.get("max_retries", default))
            options["retries"] = retries + 1
            options["traceback"] = "".join(traceback.format_exception(exc, limit=30))
            options["requeue_timestamp"] = int(time.time() * 1000)
            target = options.get("on_retry_exhausted") or declared.get("on_retry_exhausted")
            if target:
                sends.append((target, {"retries": retries, "max_retries": max_retries}))
        target = options.get("on_failure") or declared.get("on_failure")
        if target:
            sends.append((target, {"type": type(exc).__name__, "message": str(exc)}))
        for name, detail in sends:
            try:
                self.actor.broker.get_actor(name).send(message.asdict(), detail)
            except Exception:
                logger.exception("could not send %s for message %s", name, message.message_id)

    # -- the call ---------------------------------------------------------------------------

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        pending = self.middleware.take_pending(self.actor.actor_name)
        if pending is None:  # called directly, not by a worker for a message
            return self._direct(args, kwargs)
        if pending.error is not None:
            raise pending.error
        assert pending.arrival is not None
        carrier = pending.fields.options.get(TRACE_OPTION)
        with self.middleware.tracing.delivery(self.consumer, carrier) as trace:
            try:
                steps = settle_steps(pending.arrival, self.policy)
                perform = functools.partial(self.perform, pending, args, kwargs)
                settlement = drive(steps, perform, trace.observer)
                if isinstance(settlement, Processed) and settlement.verdict is None:
                    self.unprotected_callback(pending.message, settlement.result)
            except Exception as exc:  # the inbox's own bug: a failed attempt, retried by Retries
                logger.exception("inbox consumer %s failed to settle a message", self.consumer)
                settlement = HandedBack(exc, counted=True)
            trace.settled(settlement)
            return self.middleware.settle(self, pending, settlement)

    def _direct(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if session_var.get() is not None:  # called from another inbox actor: join it
            return self.target(*args, **kwargs)
        if self.is_async:
            return self._on_loop(
                self._async_inbox.transaction(self._async_body(None, args, kwargs))
            )
        return self._inbox.transaction(self._body(None, args, kwargs))

    def perform(
        self, pending: Pending, args: tuple[Any, ...], kwargs: dict[str, Any], op: Op
    ) -> Any:
        """Perform one operation of the consumption core for this actor's message."""
        message_id = op.delivery.identity.message_id if isinstance(op, Process) else None
        match op:
            case Process(
                delivery=delivery,
                repair_marker=marker,
                keeps_outputs=keeps,
                refuse_first_seen=refusal,
            ):
                faults.at("before_claim", message_id)
                keep = delivery if keeps else None
                if self.is_async:
                    body = self._async_body(pending, args, kwargs, keep)
                    work = self._async_inbox.process(
                        delivery, body, repair_marker=marker, refuse_first_seen=refusal
                    )
                    return self._on_loop(work)
                return self._inbox.process(
                    delivery,
                    self._body(pending, args, kwargs, keep),
                    repair_marker=marker,
                    refuse_first_seen=refusal,
                )
            case RunUnprotected():
                if self.is_async:
                    work = self._async_inbox.transaction(self._async_body(pending, args, kwargs))
                    return self._on_loop(work)
                return self._inbox.transaction(self._body(pending, args, kwargs))
            case Publish(route=Route.QUARANTINE, details=details):
                faults.at("quarantine_publish", details.get("message_id"))
                return self.middleware.quarantine(self, pending.message, details)
            case SendOutputs(delivery=delivery, output=output):
                try:
                    return self.replay(pending.message, delivery, output)
                except Exception as exc:
                    logger.warning(
                        "inbox consumer %s could not send the outputs of %s: %s",
                        self.consumer,
                        pending.message.message_id,
                        exc,
                    )
                    raise
            case Publish():
                # Dramatiq's dead-letter path is the broker's own: the message is failed
                # when the middleware settles it.
                faults.at("dead_letter_publish", _message_id(pending))
                return None
        if self.is_async:
            return self._on_loop(self._async_inbox.bookkeep(op))
        return self._inbox.bookkeep(op)

    def _body(
        self,
        pending: Pending | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        keep: Delivery | None = None,
    ) -> Callable[[Session], Any]:
        """The actor's transaction body; with ``keep``, its result is stored with that
        claim and the body answers the `Output`."""

        def body(session: Session) -> Any:
            with _instructions(session, pending, self.consumer, self.policy) as ran:
                ran.result = self.target(*args, **kwargs)
            if keep is None or ran.result is SKIPPED:
                return ran.result
            output = self._output(pending, keep, ran.result)
            self._storage.keep_output(session, keep, output)
            return output

        return body

    def _output(self, pending: Pending | None, keep: Delivery, result: Any) -> Output:
        """The result to store, with the ``on_success`` callback as it is sent."""
        output = self.encode(result)
        if pending is None:
            return output
        callback = self.callback(pending.message, keep, result)
        if callback is None:
            return output
        headers = {**output.headers, CALLBACK_HEADER: base64.b64encode(callback).decode()}
        return replace(output, headers=headers)

    def _async_body(
        self,
        pending: Pending | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        keep: Delivery | None = None,
    ) -> Callable[[AsyncSession], Coroutine[Any, Any, Any]]:
        async def body(session: AsyncSession) -> Any:
            with _instructions(session, pending, self.consumer, self.policy) as ran:
                ran.result = await self.target(*args, **kwargs)
            if keep is None or ran.result is SKIPPED:
                return ran.result
            output = self._output(pending, keep, ran.result)
            self._storage.keep_output(session.sync_session, keep, output)
            return output

        return body

    @property
    def _storage(self) -> Any:
        return self._async_inbox if self.is_async else self._inbox

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def _inbox(self) -> Any:
        assert self.middleware.inbox is not None
        return self.middleware.inbox

    @property
    def _async_inbox(self) -> Any:
        assert self.middleware.async_inbox is not None
        return self.middleware.async_inbox

    def _on_loop(self, work: Coroutine[Any, Any, R]) -> R:
        loop_thread = get_event_loop_thread()
        if loop_thread is None:
            work.close()
            raise ConfigurationError(
                f"actor {self.actor.actor_name!r} is async: add dramatiq's AsyncIO middleware"
            )
        landed: list[BaseException] = []

        async def watched() -> R:
            try:
                return await work
            except BaseException as exc:
                landed.append(exc)
                raise

        try:
            return loop_thread.run_coroutine(watched())
        except Interrupt as interruption:
            # Dramatiq cancelled the coroutine where the interruption found it; where the
            # cancellation landed in the inbox's work (the claim, the COMMIT), storage
            # reported it, and that report, caused by this interruption, is what happened.
            if landed and isinstance(landed[0], InboxInterrupted):
                raise landed[0] from interruption
            raise


class _Result:
    result: Any = None


@contextlib.contextmanager
def _instructions(
    session: Session | AsyncSession, pending: Pending | None, consumer: str, policy: ConsumerPolicy
) -> Iterator[_Result]:
    """Run the actor's body with its session, and turn Dramatiq's own instructions into
    the core's: `SkipMessage` is "done" (commit, then skip), `Retry` a failed attempt,
    ``message.fail()`` a rejection."""
    ran = _Result()
    session.info[CONSUMER_INFO] = (consumer, policy.direct_publish)
    token = session_var.set(session)
    try:
        yield ran
    except SkipMessage:
        ran.result = SKIPPED
        return
    except dramatiq.Retry as exc:
        raise _hand_back(exc) from exc
    finally:
        session_var.reset(token)
    _check_failed(pending)


def _hand_back(exc: dramatiq.Retry) -> HandBackRequested:
    delay = exc.delay / 1000 if exc.delay is not None else None
    return HandBackRequested(delay, cause=exc)


def _check_failed(pending: Pending | None) -> None:
    """The actor called ``message.fail()`` (through CurrentMessage): a rejection, honoured
    after the rollback, with a poison record, so its work does not commit unnoticed."""
    if pending is not None and pending.message.failed:
        pending.message.failed = False  # the inbox fails it itself, once it has settled
        raise RejectRequested("the actor called message.fail()")


def _with_identity(options: dict[str, Any], delivery: Delivery, kind: str) -> dict[str, Any]:
    """``options`` with an identity derived from ``delivery``, unless they carry one."""
    if options.get(OPTION_MESSAGE_ID):
        return options
    derived = derived_identity(delivery, kind)
    return {
        **options,
        **identity(
            producer=derived.producer, message_id=derived.message_id, tenant=derived.tenant or None
        ),
    }


def _message_id(pending: Pending) -> str | None:
    delivery = pending.arrival.delivery if pending.arrival else None
    return delivery.identity.message_id if delivery else None
