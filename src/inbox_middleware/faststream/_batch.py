"""A batch subscriber's messages: claimed, handled and committed as a whole.

The consumption core decides the batch's settlement (`consumption.settle_batch_steps`:
processed, handed back, or, when its attempts run out, each message kept as poison and
dead-lettered; after the commit, conflicts are quarantined and messages without a usable
identity dead-lettered one by one). This module performs the core's operations for the
batch and tells the broker what the core makes of the settlement
(`consumption.batch_operation`) in one place, `_tell_batch`.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.ext.asyncio import AsyncSession

from .._core import consumption as core
from .._core import faults
from .._core.consumption import (
    BatchArrival,
    BatchProcessed,
    BatchRejected,
    BatchSettlement,
    Op,
    ProcessBatch,
    Publish,
    Route,
    settle_batch_steps,
)
from .._core.exceptions import IdentityError, InboxError, PayloadNotHashable, TransientError
from .._core.protocol import Decision, Delivery, Verdict
from .._observe.instruments import metrics
from .._operate.tally import tally
from ._brokers import Item
from ._context import BatchItem
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
    from .._core.consumption import HandBackDelays
    from .._core.policy import ConsumerPolicy
    from .._observe.tracing import NoTracing, Tracing
    from .._storage.aio import AsyncInbox
    from .._storage.routed import AsyncRoutedInbox
    from ._brokers import BrokerAdapter
    from ._consumer import InboxConsumer

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
    storage: AsyncInbox | AsyncRoutedInbox
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


async def hold_batch(sub: BatchSubscription, message: Any, error: Exception) -> Any:
    """Hand a batch back, through the core, because the start-up check has not passed
    (run at the first message, without ``guard``): a hand-back counted for each of its
    messages; ends as `_tell_batch` does."""

    async def nothing(_: Any) -> Any:  # never called: a held batch is not claimed
        raise AssertionError("a held batch runs no handler")

    items = sub.adapter.items(message)
    with sub.tracing.delivery(sub.consumer.name, items[0].headers if items else None) as trace:
        trace.batch(len(items))
        return await _consume(sub, nothing, message, items, trace, held=error)


async def _consume(
    sub: BatchSubscription,
    call_next: CallNext,
    message: Any,
    items: list[Item],
    trace: Any,
    *,
    held: Exception | None = None,
) -> Any:
    deliveries: list[tuple[int, Delivery]] = []
    rejected: dict[int, InboxError] = {}
    for index, item in enumerate(items):
        try:
            deliveries.append((index, sub.delivery(item)))
        except (IdentityError, PayloadNotHashable) as exc:
            metrics.missing_identity(sub.consumer.name, core.identity_reason(exc), "rejected")
            rejected[index] = exc
    key = (
        "batch",
        deliveries[0][1].key if deliveries else bytes(items[0].body[: core.UNIDENTIFIED_KEY_BYTES]),
    )
    arrival = BatchArrival(
        tuple(deliveries),
        tuple(rejected.items()),
        len(items),
        declared_consumer=sub.consumer.name,
        source=sub.adapter.source,
        delivered=tuple(
            (index, item.deliveries) for index, item in enumerate(items) if item.deliveries
        ),
        held=held,
    )
    database = _database_of(sub, deliveries)
    if database:
        trace.database(database)

    def body(op: ProcessBatch) -> Callable[[AsyncSession, tuple[Verdict, ...]], Awaitable[Any]]:
        async def run(session: AsyncSession, verdicts: tuple[Verdict, ...]) -> Any:
            refused = core.first_seen_refusal(op, verdicts)
            if refused is not None:  # the core's refusal, after the claim: rolled back
                raise refused
            decided = dict(zip(op.items, verdicts, strict=True))
            first = [index for index in op.items if decided[index].runs_handler]
            view = await _view(message, first)
            seen = _batch_items(items, deliveries, decided, rejected)
            return await sub.body(call_next, view, seen, original=message)(session)

        return run

    async def perform(op: Op) -> Any:
        match op:
            case ProcessBatch(deliveries=claims):
                markers = [_repair_marker(items[index]) for index in op.items]
                return await sub.storage.process_batch(
                    list(claims), body(op), repair_markers=markers
                )
            case Publish(route=Route.QUARANTINE, details=details, item=index):
                assert index is not None
                faults.at("quarantine_publish", details.get("message_id"))
                await _publish(sub, sub.quarantine, items[index], CONFLICT_HEADER, details)
                return None
            case Publish(details=details, item=index):
                assert index is not None
                _log_dead_letter(sub, details)
                faults.at("dead_letter_publish", message_id_of(items[index].headers))
                if sub.dead_letter is None:
                    return None  # the broker's own dead-letter path: rejected in _tell_batch
                await _publish(sub, sub.dead_letter, items[index], REJECTED_HEADER, details)
                return None
        return await sub.storage.bookkeep(op)

    try:
        settlement = await core.drive_async(settle_batch_steps(arrival, sub.policy), perform)
    except Exception as exc:  # the inbox's own bug: the batch stays with the broker
        logger.exception("inbox consumer %s failed to settle a batch", sub.consumer.name)
        settlement = core.HandedBack(exc, counted=False)
    return await _tell_batch(
        sub,
        trace,
        message,
        key,
        settlement,
        size=len(items),
        quiet=held is not None,
        database=database,
    )


def _database_of(sub: BatchSubscription, deliveries: list[tuple[int, Delivery]]) -> str:
    """The map's database of the batch (a routed batch's messages are all in one: that of
    its first), for its span and its counts; "" with one database, or none (an unknown
    tenant's counts stay in memory, as one message's do)."""
    if not getattr(sub.storage, "routed", False) or not deliveries:
        return ""
    try:
        return str(sub.storage.route(deliveries[0][1]))  # type: ignore[union-attr]
    except Exception:
        return ""


def _repair_marker(item: Item) -> str | None:
    """The row a redriven or accepted message repairs (its ``x-inbox-repair`` header), as
    one message's arrival reads it."""
    marker = item.headers.get(REPAIR_HEADER)
    if isinstance(marker, bytes | bytearray):
        marker = bytes(marker).decode("utf-8", "replace")
    return marker if isinstance(marker, str) else None


async def _publish(
    sub: BatchSubscription, destination: str, item: Item, header: str, details: dict[str, Any]
) -> None:
    headers = {**item.headers, header: json.dumps(details)}
    await sub.adapter.publish(destination, item, headers)


def _log_dead_letter(sub: BatchSubscription, details: dict[str, Any]) -> None:
    logger.error(
        "rejecting a message for inbox consumer %s to %s: %s",
        sub.consumer.name,
        sub.dead_letter or f"the {sub.adapter.name} dead-letter path",
        details["detail"],
        extra={"inbox_event": "rejected", "inbox_consumer": sub.consumer.name},
    )


def _count(
    sub: BatchSubscription, settlement: BatchSettlement, size: int, database: str = ""
) -> None:
    """The batch's metrics and its messages' counts for ``inbox_counts`` (a message's are
    `outcomes.report`'s), under the batch's ``database`` over a map."""
    name = sub.consumer.name

    def count(outcome: str) -> None:
        tally.count(name, outcome, database)

    match settlement:
        case BatchProcessed(verdicts=verdicts, dead_lettered=indexes, poisoned=poisoned):
            for verdict in verdicts:
                if verdict.decision is Decision.CONFLICT and not verdict.shadow:
                    metrics.moved(name, "quarantine")
                count(_COUNTED[verdict.decision] if not verdict.shadow else "processed")
            for _ in settlement.expired:
                metrics.expired(name, "processed")
            for kind in settlement.recovered:
                metrics.recovered(name, kind)
            for kept in settlement.poison:
                if kept.reason == core.EXPIRED_REDELIVERY:
                    metrics.expired(name, "rejected")
                metrics.handler_failure(name, kept.reason)
                metrics.moved(name, "poison")
            for index in indexes:
                count("poisoned" if index in poisoned else "no_identity")
        case BatchRejected(reason=reason, records=records, quarantined=quarantined):
            for _ in records:
                metrics.moved(name, "poison")
            if records:
                metrics.handler_failure(name, reason)
            for _ in quarantined:
                metrics.moved(name, "quarantine")
                count("quarantined")
            for _ in range(size - len(quarantined)):
                count("poisoned" if records else "dead_lettered")
        case core.HandedBack(error=error, counted=counted):
            if counted:
                metrics.handler_failure(name, type(error).__name__)
            for _ in range(size):
                count("failed" if counted else "handed_back")


_COUNTED = {
    Decision.FIRST: "processed",
    Decision.DUPLICATE: "duplicate",
    Decision.CONFLICT: "quarantined",
}


async def _tell_batch(
    sub: BatchSubscription,
    trace: Any,
    message: Any,
    key: Hashable,
    settlement: BatchSettlement,
    *,
    size: int,
    quiet: bool = False,
    database: str = "",
) -> Any:
    """Tell the broker a batch's settlement: the one place that does, for batches.
    ``quiet``: a held batch, whose warning the start-up check prints once."""
    faults.at("settle", None)
    name = sub.consumer.name
    try:  # whatever happens here, the broker is still told
        _count(sub, settlement, size, database)
    except Exception:
        logger.exception("could not count a settlement of %s", name)
    match settlement:
        case core.HandedBack():
            trace.settled(settlement)
        case BatchProcessed(result=result):
            trace.settled(core.Processed(result))
        case BatchRejected():
            trace.settled(core.Processed())
    operation = core.batch_operation(
        settlement, dead_letter_destination=sub.dead_letter is not None
    )
    if operation.settled:
        sub.backoff.forget(key)
        if operation.rejected:  # to the broker's own dead-letter path, before the ack
            await sub.adapter.reject(message, list(operation.rejected))
        await sub.adapter.ack(message)
    else:
        assert isinstance(settlement, core.HandedBack)
        error = settlement.error
        wait = settlement.wait(key, lambda: sub.backoff.next(key))
        await sub.adapter.retry_later(message, wait)
        if not quiet:
            logger.warning(
                "inbox consumer %s rolled back a batch (%s: %s); it is handed back in %.1fs",
                name,
                type(error).__name__,
                error,
                wait,
            )
        if isinstance(error, TransientError) or not isinstance(error, Exception):
            raise NackForRedelivery(f"{type(error).__name__}: {error}") from error
        raise error
    # What FastStream is told of it: the handler's result, or why there is none.
    if isinstance(settlement, BatchProcessed) and settlement.ran and settlement.result is not ACKED:
        return settlement.result
    raise Skipped(f"batch for inbox consumer {name!r}: nothing first seen", logged=False)


def _batch_items(
    items: list[Item],
    deliveries: list[tuple[int, Delivery]],
    decided: dict[int, Verdict],
    rejected: dict[int, InboxError],
) -> tuple[BatchItem, ...]:
    identities = {index: delivery.identity for index, delivery in deliveries}
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
