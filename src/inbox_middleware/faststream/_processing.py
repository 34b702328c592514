"""One inbox subscriber's messages: from FastStream's message to a settlement, and back.

`Subscription.consume` turns each message into an `Arrival`, drives the consumption
core with this subscriber's I/O (`_perform`: the claim's transaction, the bookkeeping,
the quarantine and dead-letter publishes), and tells the broker what the core makes of
the settlement (`broker_operation`) in one place (`_tell`), before FastStream's
acknowledgement middleware gets to the message; that middleware then finds it settled
and does nothing, whatever the subscriber's ack policy.
The transaction and the ack follow the story drawn in `inbox_middleware._core.protocol`; what
the settlements mean here: a duplicate is acked with the handler skipped; a conflict is
published to ``<source>.quarantine`` (its row committed), then acked; a message without a
usable identity is published to ``<source>.dead-letter``, then acked; a failure waits a
bounded backoff, then is handed back (nacked).

While the handler runs, every settling method of the message is refused (``ack()``,
``nack()``, ``reject()``, NATS's ``ack_sync()``, a Redis entry's ``delete()``, and those of
the driver's message where it allows it): the inbox settles the message after its commit
or rollback; a driver's message settled anyway fails the attempt, kept as poison. The
handler asks with FastStream's exceptions instead: `AckMessage` means "done" (commit, then ack),
`NackMessage` a redelivery (rolled back, counted as a failed attempt), `RejectMessage` a
rejection (rolled back, kept as poison, dead-lettered).

Where the handler's result is published (the subscriber has publishers, or the message a
``reply_to``), the result is stored with the claim and returned for FastStream to publish,
for the first delivery and for every duplicate alike; the ack then waits for the publish
(`_after_publish`, from the middleware's exit). Other skipped messages leave through a
FastStream `AckMessage`, so no result is published for them; a failure re-raises the
handler's error, so FastStream logs it as usual.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from faststream.exceptions import AckMessage, NackMessage, RejectMessage
from faststream.message.utils import encode_message
from faststream.response import ensure_response
from sqlalchemy.ext.asyncio import AsyncSession

from .._core import consumption as core
from .._core import faults
from .._core.consumption import (
    Arrival,
    DeadLettered,
    Duplicate,
    HandBackDelays,
    HandBackRequested,
    Op,
    Poisoned,
    Process,
    Processed,
    Publish,
    Quarantined,
    RejectRequested,
    Route,
    RunUnprotected,
    Settlement,
    Unfit,
    drive_async,
    outputs_failed_steps,
    outputs_sent_steps,
    settle_steps,
)
from .._core.exceptions import (
    HandlerTransactionError,
    IdentityError,
    MissingIdentity,
    PayloadNotHashable,
    TransientError,
)
from .._core.headers import MESSAGE_ID, PRODUCER, TENANT
from .._core.identity import MessageIdentity
from .._core.outputs import Output, derived_identity, unstorable
from .._core.policy import ConsumerPolicy
from .._core.protocol import Delivery
from .._observe.instruments import metrics
from .._observe.tracing import OFF, NoTracing, Tracing
from .._operate.reporting import report, report_sent
from ._batch import consume_batch, hold_batch
from ._brokers import BrokerAdapter, Item
from ._consumer import InboxConsumer, _Unset, resolved_no_more
from ._context import (
    Attempt,
    BatchItem,
    ManualSettling,
    refuse_manual_settling,
    reset_attempt,
    set_attempt,
)
from ._payload import CanonicalForm, headers_identity
from ._payload import delivery as read_delivery
from ._telling import (
    ACKED,
    CONFLICT_HEADER,
    REJECTED_HEADER,
    REPAIR_HEADER,
    NackForRedelivery,
    Skipped,
    message_id_of,
)

if TYPE_CHECKING:
    from .._storage.aio import AsyncInbox
    from .._storage.routed import AsyncRoutedInbox

__all__ = ["Subscription"]

logger = logging.getLogger("inbox_middleware.faststream")

CallNext = Callable[[Any], Awaitable[Any]]
Finish = Callable[[BaseException | None], Awaitable[None]]


class Subscription:
    """One inbox subscriber: its consumer's settings and its broker's adapter."""

    def __init__(
        self,
        *,
        storage: AsyncInbox | AsyncRoutedInbox,
        consumer: InboxConsumer,
        adapter: BrokerAdapter,
        policy: ConsumerPolicy,
        canonical_form: CanonicalForm | None,
        quarantine: str,
        dead_letter: str | None,
        tracing: Tracing | NoTracing = OFF,
    ) -> None:
        self.tracing = tracing
        self.storage = storage
        self.consumer = consumer
        self.adapter = adapter
        self.policy = policy.override_set(consumer.settings)
        self.canonical_form = consumer.canonical_form or canonical_form
        source = adapter.source
        self.quarantine = (consumer.quarantine or quarantine).format(source=source)
        chosen = consumer.dead_letter
        if isinstance(chosen, _Unset):
            chosen = dead_letter
        self.dead_letter = chosen.format(source=source) if chosen is not None else None
        self.backoff = HandBackDelays(*self.policy.retry_backoff)
        subscriber = adapter.subscriber
        self.publishes = any(call.handler._publishers for call in getattr(subscriber, "calls", ()))
        self.replies = not getattr(subscriber, "_no_reply", False)
        self.resolves_consumer = True  # until `resolved_no_more` took it off its calls

    @property
    def missing_identity(self) -> str:
        return self.policy.missing_identity

    @property
    def shadow(self) -> bool:
        return self.policy.shadow

    @property
    def destinations(self) -> list[str]:
        return [self.quarantine] + ([self.dead_letter] if self.dead_letter else [])

    def describe(self) -> str:
        return self.adapter.describe()

    # -- one message --------------------------------------------------------------------------

    async def consume(
        self, call_next: CallNext, message: Any, finish: list[Finish] | None = None
    ) -> Any:
        """Settle one message. Where the handler's result is published (publishers, a
        reply), the ack waits for the publish: a ``finish`` callback is appended, which the
        middleware awaits once FastStream has published, with the error if it failed."""
        if self.resolves_consumer:
            self.resolves_consumer = not resolved_no_more(
                self.adapter.subscriber, self.consumer.inbox
            )
        if self.adapter.batch:
            return await consume_batch(self, call_next, message)
        (item,) = self.adapter.items(message)
        arrival = _UNREAD
        with self.tracing.delivery(self.consumer.name, item.headers) as trace:
            try:
                arrival = self.arrival(message, item)
                steps = settle_steps(arrival, self.policy)
                perform = partial(self._perform, call_next, message, item)
                settlement = await drive_async(steps, perform, trace.observer)
            except Exception as exc:  # the inbox's own bug: the message stays with the broker
                logger.exception("inbox consumer %s failed to settle a message", self.consumer.name)
                settlement = core.HandedBack(exc, counted=False)
            trace.settled(settlement)
            output = _published_output(settlement)
            if output is None or finish is None:
                return await self._tell(message, item, arrival, settlement)
            if arrival.delivery is not None:
                self.backoff.forget(arrival.delivery.key)
            self._report(message, item, arrival, settlement)
            finish.append(partial(self._after_publish, message, item, arrival, settlement))
            return self.adapter.response(output)

    async def hold(self, message: Any, error: Exception) -> Any:
        """Hand ``message`` back, through the core, because the start-up check has not
        passed (run at the first message, without ``guard``); ends as `_tell` does (a
        batch: as `_batch._tell_batch` does, a hand-back counted for each message)."""
        if self.adapter.batch:
            return await hold_batch(self, message, error)
        (item,) = self.adapter.items(message)
        arrival = replace(self.arrival(message, item), held=error)
        perform = partial(self._perform, _no_handler, message, item)
        try:
            settlement = await drive_async(settle_steps(arrival, self.policy), perform)
        except Exception as exc:  # the inbox's own bug: the message stays with the broker
            logger.exception("inbox consumer %s failed to settle a message", self.consumer.name)
            settlement = core.HandedBack(exc, counted=False)
        return await self._tell(message, item, arrival, settlement)

    async def _after_publish(
        self,
        message: Any,
        item: Item,
        arrival: Arrival,
        settled: Settlement,
        error: BaseException | None,
    ) -> None:
        """The outputs of a committed delivery were published (ack, once the core saw them
        sent), or not: then the message is handed back, and its redelivery, a duplicate,
        publishes them again."""
        perform = partial(self._perform, _no_handler, message, item)
        if error is None:
            faults.at("outputs_published", message_id_of(item.headers))
            try:
                sent = await drive_async(outputs_sent_steps(arrival, settled), perform)
                report_sent(sent, consumer=self.consumer.name)
            except Exception:  # the inbox's own bug: the outputs are out, ack all the same
                logger.exception("inbox consumer %s failed to settle a message", self.consumer.name)
            # the settlement committed before the publish (processed, or a duplicate
            # replaying its outputs): acked
            await self._perform_operation(message, item, arrival, settled)
            return
        try:
            steps = outputs_failed_steps(arrival, self.policy, error)
            settlement = await drive_async(steps, perform)
        except Exception as exc:
            logger.exception("inbox consumer %s failed to settle a message", self.consumer.name)
            settlement = core.HandedBack(exc, counted=False)
        with contextlib.suppress(Skipped, NackForRedelivery, type(error)):
            await self._tell(message, item, arrival, settlement)

    def arrival(self, message: Any, item: Item) -> Arrival:
        marker = item.headers.get(REPAIR_HEADER)
        if isinstance(marker, bytes | bytearray):
            marker = bytes(marker).decode("utf-8", "replace")
        common: dict[str, Any] = {
            "deliveries": self.adapter.deliveries(message),
            "redelivered": self.adapter.redelivered(message),
            "repair_marker": marker if isinstance(marker, str) else None,
            "keeps_outputs": self.publishes
            or (self.replies and bool(getattr(message, "reply_to", None))),
            "declared_consumer": self.consumer.name,
            "source": self.adapter.source,
            # Over many databases, the core chooses the delivery's database first.
            "routed": bool(getattr(self.storage, "routed", False)),
        }
        try:
            claim = self.delivery(item)
        except (IdentityError, PayloadNotHashable) as exc:
            return Arrival(None, exc, **common)
        earlier = None
        identity = claim.identity
        if item.earlier_id is not None and (identity.producer, identity.message_id) == (
            item.broker_id
        ):
            # Named by the broker: an earlier version's worker named it differently.
            earlier = replace(claim, identity=MessageIdentity(*item.earlier_id))
        return Arrival(claim, earlier_form=earlier, stored_at=item.stored_at, **common)

    def delivery(self, item: Item) -> Delivery:
        try:
            identity = headers_identity(item.headers)
        except MissingIdentity:
            if self.policy.missing_identity != "broker_id" or item.broker_id is None:
                raise
            metrics.missing_identity(self.consumer.name, "missing", "broker_id")
            identity = MessageIdentity(*item.broker_id)
        read = read_delivery(
            consumer=self.consumer.name,
            identity=identity,
            body=item.body,
            headers=item.headers,
            handler_version=self.consumer.handler_version,
            source=self.adapter.source,
            canonical=self.canonical_form,
            content_type=item.content_type,
        )
        return replace(read, shadow=True) if self.policy.shadow else read

    async def _perform(self, call_next: CallNext, message: Any, item: Item, op: Op) -> Any:
        """Perform one operation of the consumption core for this message."""
        match op:
            case Process(
                delivery=delivery,
                repair_marker=marker,
                keeps_outputs=keeps,
                refuse_first_seen=refusal,
            ):
                faults.at("before_claim", delivery.identity.message_id)
                body = self.body(call_next, message, keep=delivery if keeps else None)
                return await self.storage.process(
                    delivery, body, repair_marker=marker, refuse_first_seen=refusal
                )
            case RunUnprotected():
                return await self.storage.transaction(self.body(call_next, message))
            case Publish(route=Route.QUARANTINE, details=details):
                faults.at("quarantine_publish", details.get("message_id"))
                headers = {**item.headers, CONFLICT_HEADER: json.dumps(details)}
                return await self.adapter.publish(self.quarantine, item, headers)
            case Publish(details=details):
                faults.at("dead_letter_publish", message_id_of(item.headers))
                if self.dead_letter is None:
                    return None  # the broker's own dead-letter path: rejected in _tell
                headers = {**item.headers, REJECTED_HEADER: json.dumps(details)}
                return await self.adapter.publish(self.dead_letter, item, headers)
        return await self.storage.bookkeep(op)

    def body(
        self,
        call_next: CallNext,
        message: Any,
        batch: tuple[BatchItem, ...] = (),
        keep: Delivery | None = None,
        original: Any = None,
    ) -> Callable[[AsyncSession], Awaitable[Any]]:
        """The handler's transaction body; with ``keep``, its result is encoded and stored
        with that claim, and the body answers the `Output`. ``original``: the message in
        FastStream's context when the handler is given another (a batch's view)."""

        async def body(session: AsyncSession) -> Any:
            token = set_attempt(
                Attempt(session, batch, self.consumer.name, self.policy.direct_publish)
            )
            try:
                refused = refuse_manual_settling(message, original)
            except BaseException:
                reset_attempt(token)
                raise
            try:
                result = await _unsettled(refused, call_next(message))
                if keep is None or result is ACKED:
                    return result
                output = self.encode(result, keep)
                self.storage.keep_output(session.sync_session, keep, output)
                return output
            except (Skipped, NackForRedelivery):
                raise  # a nested inbox consumer's own settlement
            except AckMessage:
                return ACKED
            except NackMessage as exc:
                raise HandBackRequested(cause=exc) from exc
            except RejectMessage as exc:
                raise RejectRequested(str(exc) or "the handler rejected it") from exc
            except _INVALID as exc:
                if not _decoding_failed(exc):
                    raise  # the handler's own, or its return value's: an ordinary failure
                raise Unfit(f"the message does not fit the handler: {exc}") from exc
            finally:
                refused.restore()
                reset_attempt(token)

        return body

    def encode(self, result: Any, delivery: Delivery) -> Output:
        """``result`` as FastStream would publish it: the body its codec encodes, with the
        content type and the headers of a returned `Response`, and an identity derived
        from ``delivery`` (unless the handler gave one), so an inbox downstream deduplicates
        the copy a duplicate publishes."""
        response = ensure_response(result)
        headers = _text_headers(response.headers)
        if MESSAGE_ID not in headers:
            derived = derived_identity(delivery, "result")
            headers |= {PRODUCER: derived.producer, MESSAGE_ID: derived.message_id}
            if derived.tenant:
                headers[TENANT] = derived.tenant
        if response.body is None:
            return Output(None, None, headers)
        producer = getattr(self.adapter.broker.config, "producer", None)
        try:
            body, content_type = encode_message(
                response.body, getattr(producer, "serializer", None)
            )
        except Exception as exc:
            raise unstorable(f"{type(exc).__name__}: {exc}") from exc
        output = Output(bytes(body), content_type, headers)
        return output.checked(self.policy.max_output_bytes)

    def _database_of(self, arrival: Arrival) -> str:
        """The map's database of the delivery, for the counts ("" with one database, or
        none: an unknown tenant's counts stay in memory)."""
        if not getattr(self.storage, "routed", False) or arrival.delivery is None:
            return ""
        try:
            return str(self.storage.route(arrival.delivery))  # type: ignore[union-attr]
        except Exception:
            return ""

    async def _perform_operation(
        self, message: Any, item: Item, arrival: Arrival, settlement: Settlement
    ) -> None:
        """Perform on the broker the operation the core maps ``settlement`` to: the one
        place a single message is acked, rejected or handed back."""
        delivery = arrival.delivery
        key: Hashable = (
            delivery.key if delivery else ("unprotected", item.body[: core.UNIDENTIFIED_KEY_BYTES])
        )
        operation = core.broker_operation(
            settlement, dead_letter_destination=self.dead_letter is not None
        )
        if operation.settled:
            self.backoff.forget(key)
        match operation.tell:
            case core.Tell.ACK:
                await self.adapter.ack(message)
            case core.Tell.REJECT:
                await self.adapter.reject(message)
            case core.Tell.HAND_BACK:
                assert isinstance(settlement, core.HandedBack)
                wait = settlement.wait(key, lambda: self.backoff.next(key))
                await self.adapter.retry_later(message, wait)

    def _report(self, message: Any, item: Item, arrival: Arrival, settlement: Settlement) -> None:
        where = self.dead_letter or f"the {self.adapter.name} dead-letter path"
        try:  # whatever happens here, the broker is still told
            report(
                arrival,
                settlement,
                consumer=self.consumer.name,
                where=where,
                message=getattr(message, "message_id", None),
                database=self._database_of(arrival),
            )
            faults.at("settle", message_id_of(item.headers))
        except Exception:
            logger.exception("could not report a settlement of %s", self.consumer.name)

    async def _tell(
        self, message: Any, item: Item, arrival: Arrival, settlement: Settlement
    ) -> Any:
        """Tell the broker what ``settlement`` means (`_perform_operation`) and FastStream
        what became of the message (a settlement with outputs to publish is acknowledged
        after the publish, in `_after_publish`)."""
        self._report(message, item, arrival, settlement)
        await self._perform_operation(message, item, arrival, settlement)
        name = self.consumer.name
        # What FastStream is told of it: the handler's result, or why there is none.
        match settlement:
            case Processed(result=result):
                if result is ACKED:
                    raise Skipped(
                        f"acknowledged by the handler of inbox consumer {name!r}", logged=False
                    )
                return result
            case Duplicate():
                raise Skipped(f"duplicate delivery for inbox consumer {name!r}: already processed")
            case Quarantined():
                raise Skipped(f"conflict delivery for inbox consumer {name!r}: quarantined")
            case DeadLettered(error=error) | Poisoned(error=error):
                raise Skipped(f"rejected for inbox consumer {name!r}: {error}")
            case core.HandedBack(error=error):
                if isinstance(error, HandBackRequested) and error.cause is not None:
                    raise error.cause  # the handler's NackMessage: the message is nacked
                if isinstance(error, Exception) and not isinstance(error, TransientError):
                    raise error  # the handler's: FastStream logs it with its traceback
                raise NackForRedelivery(f"{type(error).__name__}: {error}") from error


async def _unsettled(refused: ManualSettling, call: Awaitable[Any]) -> Any:
    """Await the handler; whatever it did, a settlement of the driver's message made
    behind the inbox fails the attempt (a `HandlerTransactionError`, kept as poison)."""
    try:
        result = await call
    except Exception as exc:
        if behind := refused.settled_behind():
            raise HandlerTransactionError(behind) from exc
        raise
    if behind := refused.settled_behind():
        raise HandlerTransactionError(behind)
    return result


_UNREAD = Arrival(None)
"""The arrival of a message the inbox failed to read (frozen: one serves them all)."""


def _published_output(settlement: Settlement) -> Output | None:
    """The stored output this settlement publishes before the ack, if any."""
    match settlement:
        case Processed(result=Output() as output) | Duplicate(output=Output() as output):
            return output
    return None


async def _no_handler(message: Any) -> Any:  # pragma: no cover - never called
    raise AssertionError("the handler does not run when outputs failed to publish")


def _text_headers(headers: dict[str, Any]) -> dict[str, str]:
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in headers.items()}


def _validation_errors() -> tuple[type[Exception], ...]:
    from fast_depends.exceptions import ValidationError as Wrapped

    try:
        from pydantic import ValidationError
    except ImportError:  # pragma: no cover - FastStream installs pydantic
        return (Wrapped,)
    return (ValidationError, Wrapped)


_INVALID = _validation_errors()
_SOLVE = ("fast_depends.core.model", "_solve")
_FRAMEWORK = (
    "inbox_middleware",
    "faststream",
    "fast_depends",
    "anyio",
    "asyncio",
    "contextlib",
    "functools",
)


def _decoding_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (a validation error out of FastStream's call) is FastStream failing
    to decode the body into the handler's parameters (or a dependency's): only then does
    the message not fit the handler.

    FastStream's resolver (fast_depends) casts the arguments in its ``_solve`` step, which
    calls the serializer: that is the argument cast, when no code of the application's
    own ran before it. The same step checks the return value through ``_cast_response``
    (not a decoding); and a model the handler builds fails in the handler's own frame.
    """
    frames: list[tuple[str, str]] = []
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        frames.append((str(frame.f_globals.get("__name__", "")), frame.f_code.co_name))
        tb = tb.tb_next
    for index, (module, function) in enumerate(frames[1:], start=1):  # [0]: the body's own
        if (module, function) == _SOLVE:
            following = frames[index + 1] if index + 1 < len(frames) else ("", "")
            return following[0].startswith("fast_depends.") and following[1] == "__call__"
        if module.partition(".")[0] not in _FRAMEWORK:
            return False  # the application's code ran first: its error, not the body's
    return False
