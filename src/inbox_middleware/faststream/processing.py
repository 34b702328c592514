"""One inbox subscriber's messages: from FastStream's message to a settlement, and back.

`Subscription.consume` turns each message into an `Arrival`, drives the consumption
core with this subscriber's I/O (`_perform`: the claim's transaction, the bookkeeping,
the quarantine and dead-letter publishes), and tells the broker the settlement in one
place (`_tell`), before FastStream's acknowledgement middleware gets to the message; that
middleware then finds it settled and does nothing, whatever the subscriber's ack policy::

    inbox middleware                 PostgreSQL                    broker
    ----------------                 ----------                    ------
    headers -> identity, body -> hash
    BEGIN; INSERT claim ───────────> row (first) or conflict
    handler(body, session)
    COMMIT ────────────────────────> durable
    ack ──────────────────────────────────────────────────────────> settled
    (killed before this line: the message comes back, and is then a duplicate)

    duplicate ─────── COMMIT (nothing) ─────── ack, the handler skipped
    conflict ──────── COMMIT quarantine row ── publish to <source>.quarantine, ack
    no/bad identity ─ nothing written ──────── publish to <source>.dead-letter, ack
    failure ───────── ROLLBACK ─────────────── wait (bounded backoff), hand back (nack)

While the handler runs, the message's own ``ack()``, ``nack()`` and ``reject()`` are
refused: the inbox settles the message after its commit or rollback. The handler asks
with FastStream's exceptions instead: `AckMessage` means "done" (commit, then ack),
`NackMessage` a redelivery (rolled back, counted as a failed attempt), `RejectMessage` a
rejection (rolled back, kept as poison, dead-lettered).

Skipped messages leave through a FastStream `AckMessage`, so no result is published for
them; a failure re-raises the handler's error, so FastStream logs it as usual.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from faststream.exceptions import AckMessage, NackMessage, RejectMessage
from sqlalchemy.ext.asyncio import AsyncSession

from .. import consumption as core
from .. import faults
from ..consumption import (
    Arrival,
    Backoff,
    DeadLettered,
    Duplicate,
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
    settle_steps,
)
from ..exceptions import (
    HandlerTransactionError,
    IdentityError,
    InboxError,
    MissingIdentity,
    PayloadNotHashable,
    TransientError,
)
from ..identity import MessageIdentity
from ..metrics import metrics
from ..outcomes import report
from ..policy import ConsumerPolicy
from ..protocol import Decision, Delivery, Verdict
from ..tracing import OFF, NoTracing, Tracing
from .brokers import BrokerAdapter, Item
from .consumer import InboxConsumer, _Unset
from .context import Attempt, BatchItem, reset_attempt, set_attempt
from .payload import CanonicalForm, delivery, headers_identity

if TYPE_CHECKING:
    from ..storage.aio import AsyncInbox

__all__ = [
    "CONFLICT_HEADER",
    "REJECTED_HEADER",
    "REPAIR_HEADER",
    "Backoff",
    "HandedBack",
    "Skipped",
    "Subscription",
    "Unfit",
]

logger = logging.getLogger("inbox_middleware.faststream")

CONFLICT_HEADER = "x-inbox-conflict"
"""On a quarantined message: JSON with the conflict's details and its quarantine row id."""

REJECTED_HEADER = "x-inbox-rejected"
"""On a dead-lettered message: JSON with the consumer and the reason."""

REPAIR_HEADER = "x-inbox-repair"
"""On a redriven or accepted message: the row it repairs (``poison:12``, ``quarantine:7``)."""

CallNext = Callable[[Any], Awaitable[Any]]


class Skipped(AckMessage):
    """Settled by the inbox without running the handler (duplicate, conflict, rejected)."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class HandedBack(NackMessage):
    """Rolled back by the inbox and handed back to the broker for a later redelivery."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class _Acknowledged:
    """The handler raised `AckMessage`: its work commits, then the message is acked."""


_ACKED = _Acknowledged()


class Subscription:
    """One inbox subscriber: its consumer's settings and its broker's adapter."""

    def __init__(
        self,
        *,
        storage: AsyncInbox,
        consumer: InboxConsumer,
        adapter: BrokerAdapter,
        policy: ConsumerPolicy,
        canonical_form: CanonicalForm | None,
        quarantine: str,
        dead_letter: str | None,
        backoff: Backoff,
        tracing: Tracing | NoTracing = OFF,
    ) -> None:
        self.tracing = tracing
        self.storage = storage
        self.consumer = consumer
        self.adapter = adapter
        self.policy = policy.override(
            missing_identity=consumer.missing_identity, shadow=consumer.shadow
        )
        self.canonical_form = consumer.canonical_form or canonical_form
        source = adapter.source
        self.quarantine = (consumer.quarantine or quarantine).format(source=source)
        chosen = consumer.dead_letter
        if isinstance(chosen, _Unset):
            chosen = dead_letter
        self.dead_letter = chosen.format(source=source) if chosen is not None else None
        self.backoff = backoff

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
        return f"{self.adapter.name} subscriber {self.adapter.source!r}"

    # -- one message --------------------------------------------------------------------------

    async def consume(self, call_next: CallNext, message: Any) -> Any:
        if self.adapter.batch:
            return await self._consume_batch(call_next, message)
        (item,) = self.adapter.items(message)
        arrival = Arrival(None)
        with self.tracing.delivery(self.consumer.name, item.headers) as trace:
            try:
                arrival = self.arrival(message, item)
                steps = trace.steps(settle_steps(arrival, self.policy))
                perform = partial(self._perform, call_next, message, item)
                settlement = await drive_async(steps, perform)
            except Exception as exc:  # the inbox's own bug: the message stays with the broker
                logger.exception("inbox consumer %s failed to settle a message", self.consumer.name)
                settlement = core.HandedBack(exc, counted=False)
            trace.settled(settlement)
            return await self._tell(message, item, arrival, settlement)

    def arrival(self, message: Any, item: Item) -> Arrival:
        marker = item.headers.get(REPAIR_HEADER)
        if isinstance(marker, bytes | bytearray):
            marker = bytes(marker).decode("utf-8", "replace")
        common: dict[str, Any] = {
            "deliveries": self.adapter.deliveries(message),
            "redelivered": self.adapter.redelivered(message),
            "repair_marker": marker if isinstance(marker, str) else None,
        }
        try:
            return Arrival(self.delivery(item), **common)
        except (IdentityError, PayloadNotHashable) as exc:
            return Arrival(None, exc, **common)

    def delivery(self, item: Item) -> Delivery:
        try:
            identity = headers_identity(item.headers)
        except MissingIdentity:
            if self.policy.missing_identity != "broker_id" or item.broker_id is None:
                raise
            metrics.missing_identity(self.consumer.name, "missing", "broker_id")
            identity = MessageIdentity(*item.broker_id)
        claim = delivery(
            consumer=self.consumer.name,
            identity=identity,
            body=item.body,
            headers=item.headers,
            handler_version=self.consumer.handler_version,
            source=self.adapter.source,
            canonical=self.canonical_form,
            content_type=item.content_type,
        )
        return replace(claim, shadow=True) if self.policy.shadow else claim

    async def _perform(self, call_next: CallNext, message: Any, item: Item, op: Op) -> Any:
        """Perform one operation of the consumption core for this message."""
        match op:
            case Process(delivery=claim, before_handler=before, repair_marker=marker):
                faults.at("before_claim", claim.identity.message_id)
                body = self._body(call_next, message)
                return await self.storage.process(
                    claim, body, before_handler=before, repair_marker=marker
                )
            case RunUnprotected():
                return await self.storage.transaction(self._body(call_next, message))
            case Publish(route=Route.QUARANTINE, details=details):
                faults.at("quarantine_publish", details.get("message_id"))
                headers = {**item.headers, CONFLICT_HEADER: json.dumps(details)}
                return await self.adapter.publish(self.quarantine, item, headers)
            case Publish(details=details):
                faults.at("dead_letter_publish", _message_id(item))
                if self.dead_letter is None:
                    return None  # the broker's own dead-letter path: rejected in _tell
                headers = {**item.headers, REJECTED_HEADER: json.dumps(details)}
                return await self.adapter.publish(self.dead_letter, item, headers)
        return await self.storage.bookkeep(op)

    def _body(
        self, call_next: CallNext, message: Any, batch: tuple[BatchItem, ...] = ()
    ) -> Callable[[AsyncSession], Awaitable[Any]]:
        async def body(session: AsyncSession) -> Any:
            token = set_attempt(Attempt(session, batch))
            refused = _refuse_manual_settling(message)
            try:
                return await call_next(message)
            except (Skipped, HandedBack):
                raise  # a nested inbox consumer's own settlement
            except AckMessage:
                return _ACKED
            except NackMessage as exc:
                raise HandBackRequested(cause=exc) from exc
            except RejectMessage as exc:
                raise RejectRequested(str(exc) or "the handler rejected it") from exc
            except _INVALID as exc:
                raise Unfit(f"the message does not fit the handler: {exc}") from exc
            finally:
                refused.restore()
                reset_attempt(token)

        return body

    async def _tell(
        self, message: Any, item: Item, arrival: Arrival, settlement: Settlement
    ) -> Any:
        """Tell the broker what ``settlement`` means: the one place that does."""
        where = self.dead_letter or f"the {self.adapter.name} dead-letter path"
        try:  # whatever happens here, the broker is still told
            report(
                arrival,
                settlement,
                consumer=self.consumer.name,
                where=where,
                message=getattr(message, "message_id", None),
            )
            faults.at("settle", _message_id(item))
        except Exception:
            logger.exception("could not report a settlement of %s", self.consumer.name)
        claim = arrival.delivery
        key: Hashable = claim.key if claim else ("unprotected", item.body[:64])
        name = self.consumer.name
        match settlement:
            case Processed(result=result):
                self.backoff.forget(key)
                await self.adapter.ack(message)
                if result is _ACKED:
                    raise Skipped(f"acknowledged by the handler of inbox consumer {name!r}")
                return result
            case Duplicate():
                self.backoff.forget(key)
                await self.adapter.ack(message)
                raise Skipped(f"duplicate delivery for inbox consumer {name!r}: already processed")
            case Quarantined():
                self.backoff.forget(key)
                await self.adapter.ack(message)
                raise Skipped(f"conflict delivery for inbox consumer {name!r}: quarantined")
            case DeadLettered(error=error) | Poisoned(error=error):
                self.backoff.forget(key)
                if self.dead_letter is None:
                    await self.adapter.reject(message)
                else:
                    await self.adapter.ack(message)
                raise Skipped(f"rejected for inbox consumer {name!r}: {error}")
            case core.HandedBack(error=error, delay=delay):
                wait = delay if delay is not None else self.backoff.next(key)
                await self.adapter.retry_later(message, wait)
                if isinstance(error, HandBackRequested) and error.cause is not None:
                    raise error.cause  # the handler's NackMessage: the message is nacked
                if isinstance(error, Exception) and not isinstance(error, TransientError):
                    raise error  # the handler's: FastStream logs it with its traceback
                raise HandedBack(f"{type(error).__name__}: {error}") from error

    # -- a batch ------------------------------------------------------------------------------

    async def _consume_batch(self, call_next: CallNext, message: Any) -> Any:
        """A batch is claimed, handled and committed as a whole: the settlement is the
        batch's (processed, or handed back); conflicts are quarantined and messages
        without a usable identity dead-lettered one by one, after the commit."""
        items = self.adapter.items(message)
        claims: list[tuple[int, Delivery]] = []
        rejected: dict[int, InboxError] = {}
        for index, item in enumerate(items):
            try:
                claims.append((index, self.delivery(item)))
            except (IdentityError, PayloadNotHashable) as exc:
                metrics.missing_identity(self.consumer.name, core.identity_reason(exc), "rejected")
                rejected[index] = exc
        key = ("batch", claims[0][1].key if claims else bytes(items[0].body[:64]))

        async def body(session: AsyncSession, verdicts: tuple[Verdict, ...]) -> Any:
            decided = {index: verdict for (index, _), verdict in zip(claims, verdicts, strict=True)}
            first = [index for index, _ in claims if decided[index].runs_handler]
            view = await _view(message, first)
            seen = _batch_items(items, claims, decided, rejected)
            return await self._body(call_next, view, seen)(session)

        outcome = None
        reject: InboxError | None = None
        try:
            if claims:
                outcome = await self.storage.process_batch([c for _, c in claims], body)
        except (RejectRequested, Unfit) as exc:
            reject = exc if isinstance(exc, Unfit) else InboxError(str(exc))
        except Exception as exc:
            return await self._tell_batch(message, key, error=exc)
        try:
            if reject is not None:
                for index, item in enumerate(items):
                    await self._dead_letter(message, item, index, reject)
            else:
                verdicts = outcome.verdicts if outcome is not None else ()
                for (index, claim), verdict in zip(claims, verdicts, strict=True):
                    if verdict.decision is Decision.CONFLICT and not verdict.shadow:
                        await self._quarantine(items[index], claim, verdict)
                for index, error in rejected.items():
                    await self._dead_letter(message, items[index], index, error)
        except Exception as exc:
            return await self._tell_batch(message, key, error=exc)
        if outcome is None or reject is not None:
            return await self._tell_batch(message, key)
        ran = any(verdict.runs_handler for verdict in outcome.verdicts)
        return await self._tell_batch(message, key, result=outcome.result, ran=ran)

    async def _tell_batch(
        self,
        message: Any,
        key: Hashable,
        *,
        error: Exception | None = None,
        result: Any = None,
        ran: bool = False,
    ) -> Any:
        """Tell the broker a batch's settlement: the one place that does, for batches."""
        faults.at("settle", None)
        name = self.consumer.name
        if error is not None:
            wait = self.backoff.next(key)
            await self.adapter.retry_later(message, wait)
            logger.warning(
                "inbox consumer %s rolled back a batch (%s: %s); it is handed back in %.1fs",
                name,
                type(error).__name__,
                error,
                wait,
            )
            if isinstance(error, TransientError):
                raise HandedBack(f"{type(error).__name__}: {error}") from error
            raise error
        self.backoff.forget(key)
        await self.adapter.ack(message)
        if ran and result is not _ACKED:
            return result
        raise Skipped(f"batch for inbox consumer {name!r}: nothing first seen")

    async def _quarantine(self, item: Item, claim: Delivery, verdict: Verdict) -> None:
        details = core.conflict_details(claim, verdict)
        faults.at("quarantine_publish", claim.identity.message_id)
        headers = {**item.headers, CONFLICT_HEADER: json.dumps(details)}
        await self.adapter.publish(self.quarantine, item, headers)
        metrics.moved(self.consumer.name, "quarantine")

    async def _dead_letter(self, message: Any, item: Item, index: int, error: InboxError) -> None:
        logger.error(
            "rejecting a message for inbox consumer %s to %s: %s",
            self.consumer.name,
            self.dead_letter or f"the {self.adapter.name} dead-letter path",
            error,
            extra={"inbox_event": "rejected", "inbox_consumer": self.consumer.name},
        )
        details = core.rejection_details(error, self.consumer.name, self.adapter.source)
        faults.at("dead_letter_publish", _message_id(item))
        if self.dead_letter is None:
            await self.adapter.reject(message, [index])
            return
        headers = {**item.headers, REJECTED_HEADER: json.dumps(details)}
        await self.adapter.publish(self.dead_letter, item, headers)


class _ManualSettling:
    """While the handler runs, the message's ``ack``, ``nack`` and ``reject`` raise."""

    def __init__(self, message: Any) -> None:
        self.message = message
        self.saved = {
            name: message.__dict__[name]
            for name in ("ack", "nack", "reject")
            if name in getattr(message, "__dict__", {})
        }
        for name in ("ack", "nack", "reject"):
            setattr(message, name, partial(_refused, name))

    def restore(self) -> None:
        for name in ("ack", "nack", "reject"):
            if name in self.saved:
                setattr(self.message, name, self.saved[name])
            else:
                self.message.__dict__.pop(name, None)


def _refuse_manual_settling(message: Any) -> _ManualSettling:
    return _ManualSettling(message)


async def _refused(name: str, *args: Any, **kwargs: Any) -> None:
    exception = {"ack": "AckMessage", "nack": "NackMessage", "reject": "RejectMessage"}[name]
    raise HandlerTransactionError(
        f"the handler called message.{name}(), but the inbox settles this message itself, "
        f"after its commit or rollback: raise faststream.exceptions.{exception} instead"
    )


def _message_id(item: Item) -> str | None:
    value = item.headers.get("x-inbox-message-id")
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def _validation_errors() -> tuple[type[Exception], ...]:
    try:
        from pydantic import ValidationError
    except ImportError:  # pragma: no cover - FastStream installs pydantic
        return ()
    return (ValidationError,)


_INVALID = _validation_errors()


def _batch_items(
    items: list[Item],
    claims: list[tuple[int, Delivery]],
    decided: dict[int, Verdict],
    rejected: dict[int, InboxError],
) -> tuple[BatchItem, ...]:
    identities = {index: claim.identity for index, claim in claims}
    return tuple(
        BatchItem(
            index,
            decided[index].decision if index in decided else None,
            identities.get(index),
            str(rejected[index]) if index in rejected else None,
        )
        for index in range(len(items))
    )


async def _view(message: Any, first: list[int]) -> Any:
    """The batch as the handler sees it: its first-seen messages only, in order."""
    decoded = await message.decode()
    kept = [decoded[index] for index in first]

    async def decoder(_: Any) -> Any:
        return kept

    view = copy.copy(message)
    view.set_decoder(decoder)
    if message.batch_headers:
        view.batch_headers = [message.batch_headers[index] for index in first]
    return view
