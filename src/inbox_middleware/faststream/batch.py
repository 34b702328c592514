"""A batch subscriber's messages: claimed, handled and committed as a whole.

The batch's settlement is the batch's own (processed, handed back, or, when its
attempts run out, each message kept as poison and dead-lettered); after the commit,
conflicts are quarantined and messages without a usable identity dead-lettered one by
one. `_tell_batch` is where the broker is told.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.ext.asyncio import AsyncSession

from .. import consumption as core
from .. import faults
from ..consumption import CountFailure, RecordPoison, RejectRequested, Unfit
from ..exceptions import (
    IdentityError,
    InboxError,
    PayloadNotHashable,
    SchemaError,
    TransientError,
)
from ..instruments import metrics
from ..protocol import Decision, Delivery, Verdict
from ..tally import tally
from .brokers import Item
from .context import BatchItem
from .outcome import ACKED, CONFLICT_HEADER, REJECTED_HEADER, HandedBack, Skipped, message_id_of

if TYPE_CHECKING:
    from ..consumption import HandBackDelays
    from ..policy import ConsumerPolicy
    from ..storage.aio import AsyncInbox
    from ..tracing import NoTracing, Tracing
    from .brokers import BrokerAdapter
    from .consumer import InboxConsumer

__all__ = ["BatchSubscription", "consume_batch"]

logger = logging.getLogger("inbox_middleware.faststream")

CallNext = Callable[[Any], Awaitable[Any]]


class BatchSubscription(Protocol):
    """What a batch needs of its subscriber's `processing.Subscription` (which calls it,
    so this module does not import it)."""

    adapter: BrokerAdapter
    backoff: HandBackDelays
    consumer: InboxConsumer
    dead_letter: str | None
    policy: ConsumerPolicy
    quarantine: str
    storage: AsyncInbox
    tracing: Tracing | NoTracing

    def delivery(self, item: Item) -> Delivery: ...

    def body(
        self,
        call_next: CallNext,
        message: Any,
        batch: tuple[BatchItem, ...] = (),
        keep: Delivery | None = None,
        original: Any = None,
    ) -> Callable[[Any], Awaitable[Any]]: ...


async def consume_batch(sub: BatchSubscription, call_next: CallNext, message: Any) -> Any:
    """A batch is claimed, handled and committed as a whole: the settlement is the
    batch's (processed, or handed back); conflicts are quarantined and messages
    without a usable identity dead-lettered one by one, after the commit."""
    items = sub.adapter.items(message)
    with sub.tracing.delivery(sub.consumer.name, items[0].headers if items else None) as trace:
        trace.batch(len(items))
        return await _consume(sub, call_next, message, items, trace)


async def _consume(
    sub: BatchSubscription, call_next: CallNext, message: Any, items: list[Item], trace: Any
) -> Any:
    claims: list[tuple[int, Delivery]] = []
    rejected: dict[int, InboxError] = {}
    for index, item in enumerate(items):
        try:
            claims.append((index, sub.delivery(item)))
        except (IdentityError, PayloadNotHashable) as exc:
            metrics.missing_identity(sub.consumer.name, core.identity_reason(exc), "rejected")
            rejected[index] = exc
    key = ("batch", claims[0][1].key if claims else bytes(items[0].body[:64]))

    async def body(session: AsyncSession, verdicts: tuple[Verdict, ...]) -> Any:
        decided = {index: verdict for (index, _), verdict in zip(claims, verdicts, strict=True)}
        first = [index for index, _ in claims if decided[index].runs_handler]
        view = await _view(message, first)
        seen = _batch_items(items, claims, decided, rejected)
        return await sub.body(call_next, view, seen, original=message)(session)

    outcome = None
    reject: InboxError | None = None
    gone = "dead_lettered"  # what a rejected batch's messages are counted as
    try:
        if claims:
            outcome = await sub.storage.process_batch([c for _, c in claims], body)
    except (RejectRequested, Unfit) as exc:
        reject = exc if isinstance(exc, Unfit) else InboxError(str(exc))
    except Exception as exc:
        reject = await _failed(sub, claims, exc)
        if reject is None:
            transient = isinstance(exc, TransientError | SchemaError)
            _count(sub, "handed_back" if transient else "failed", len(items))
            return await _tell_batch(sub, trace, message, key, error=exc)
        gone = "poisoned"
    try:
        if reject is not None:
            for index, item in enumerate(items):
                await _dead_letter(sub, message, item, index, reject)
            _count(sub, gone, len(items))
        else:
            verdicts = outcome.verdicts if outcome is not None else ()
            for (index, claim), verdict in zip(claims, verdicts, strict=True):
                if verdict.decision is Decision.CONFLICT and not verdict.shadow:
                    await _quarantine(sub, items[index], claim, verdict)
            for index, error in rejected.items():
                await _dead_letter(sub, message, items[index], index, error)
            for verdict in verdicts:
                _count(sub, _COUNTED[verdict.decision] if not verdict.shadow else "processed")
            _count(sub, "no_identity", len(rejected))
    except Exception as exc:
        _count(sub, "handed_back", len(items))
        return await _tell_batch(sub, trace, message, key, error=exc)
    if outcome is None or reject is not None:
        return await _tell_batch(sub, trace, message, key)
    ran = any(verdict.runs_handler for verdict in outcome.verdicts)
    return await _tell_batch(sub, trace, message, key, result=outcome.result, ran=ran)


_COUNTED = {
    Decision.FIRST: "processed",
    Decision.DUPLICATE: "duplicate",
    Decision.CONFLICT: "quarantined",
}


def _count(sub: BatchSubscription, outcome: str, times: int = 1) -> None:
    """Count a batch's messages for ``inbox_counts``, as `outcomes.report` counts one
    delivery's settlement (see `inbox_middleware.tally`)."""
    for _ in range(times):
        tally.count(sub.consumer.name, outcome)


async def _failed(
    sub: BatchSubscription, claims: list[tuple[int, Delivery]], exc: Exception
) -> InboxError | None:
    """Count a failed batch against each of its messages; when that was the last attempt
    (or the failure is permanent), keep each as poison and return why the batch goes to
    the dead-letter destination. None: hand it back (also when nothing could be counted)."""
    if isinstance(exc, TransientError | SchemaError) or not claims:
        return None
    code = core.reason_code(exc, sub.policy.permanent_errors)
    error = core.describe(exc)
    limit = sub.policy.max_attempts
    try:
        counts = [await sub.storage.bookkeep(CountFailure(claim, error)) for _, claim in claims]
        if code is None and (limit is None or max(counts) < limit):
            metrics.handler_failure(sub.consumer.name, type(exc).__name__)
            return None
        code = code or (core.INBOX_ERROR if isinstance(exc, InboxError) else core.RETRIES_EXHAUSTED)
        for (_, claim), attempts in zip(claims, counts, strict=True):
            await sub.storage.bookkeep(RecordPoison(claim, code, error, attempts))
            metrics.moved(sub.consumer.name, "poison")
    except Exception:
        logger.exception("could not record the failure of a batch of %s", sub.consumer.name)
        return None
    metrics.handler_failure(sub.consumer.name, code)
    return InboxError(
        f"a poison batch ({code}, {max(counts)} attempts): {error}; kept in the poison table"
    )


async def _tell_batch(
    sub: BatchSubscription,
    trace: Any,
    message: Any,
    key: Hashable,
    *,
    error: Exception | None = None,
    result: Any = None,
    ran: bool = False,
) -> Any:
    """Tell the broker a batch's settlement: the one place that does, for batches."""
    faults.at("settle", None)
    name = sub.consumer.name
    trace.settled(core.HandedBack(error, counted=False) if error else core.Processed(result))
    if error is not None:
        wait = sub.backoff.next(key)
        await sub.adapter.retry_later(message, wait)
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
    sub.backoff.forget(key)
    await sub.adapter.ack(message)
    if ran and result is not ACKED:
        return result
    raise Skipped(f"batch for inbox consumer {name!r}: nothing first seen", logged=False)


async def _quarantine(
    sub: BatchSubscription, item: Item, claim: Delivery, verdict: Verdict
) -> None:
    details = core.conflict_details(claim, verdict)
    faults.at("quarantine_publish", claim.identity.message_id)
    headers = {**item.headers, CONFLICT_HEADER: json.dumps(details)}
    await sub.adapter.publish(sub.quarantine, item, headers)
    metrics.moved(sub.consumer.name, "quarantine")


async def _dead_letter(
    sub: BatchSubscription, message: Any, item: Item, index: int, error: InboxError
) -> None:
    logger.error(
        "rejecting a message for inbox consumer %s to %s: %s",
        sub.consumer.name,
        sub.dead_letter or f"the {sub.adapter.name} dead-letter path",
        error,
        extra={"inbox_event": "rejected", "inbox_consumer": sub.consumer.name},
    )
    details = core.rejection_details(error, sub.consumer.name, sub.adapter.source)
    faults.at("dead_letter_publish", message_id_of(item.headers))
    if sub.dead_letter is None:
        await sub.adapter.reject(message, [index])
        return
    headers = {**item.headers, REJECTED_HEADER: json.dumps(details)}
    await sub.adapter.publish(sub.dead_letter, item, headers)


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
