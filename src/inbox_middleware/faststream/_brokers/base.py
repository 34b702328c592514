"""What the inbox needs from a broker, for one subscriber.

The processing in `..processing` is the same for every broker; what differs is here:
which subscribers can be protected at all, how a message is handed back for a later
redelivery, where a message is published when it is quarantined or rejected, and what
the broker itself keeps stable across redeliveries (for the ``broker_id`` opt-in).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

from faststream.response import Response

from ..._core.exceptions import TransientError
from ..._core.outputs import Output

__all__ = ["BrokerAdapter", "Item", "NotPublished", "Peer"]


class NotPublished(TransientError):
    """The broker did not take a quarantine, dead-letter or hand-back publish (it could
    not route it, refused it, or nothing confirmed it). The settlement hands the source
    message back instead of acknowledging it, so nothing is lost; it comes again."""


@dataclass(frozen=True, slots=True)
class Item:
    """One message as the inbox sees it (a batch has several)."""

    body: bytes
    headers: Mapping[str, Any]
    broker_id: tuple[str, str] | None = None
    """(producer name, id) the broker keeps stable across redeliveries, if it has one."""
    content_type: str | None = None
    earlier_id: tuple[str, str] | None = None
    """The form ``broker_id`` had before it told a re-created stream or topic apart (see
    `BrokerAdapter.earlier_broker_id`)."""
    stored_at: datetime | None = None
    """When the broker stored the message (the time in ``broker_id``)."""
    deliveries: int | None = None
    """How often the broker has delivered this item of a batch, this delivery included,
    where it counts per message of a batch (JetStream); else None."""


@dataclass(frozen=True, slots=True)
class Peer:
    """Another inbox subscriber on the same broker, for checks that span subscribers."""

    adapter: BrokerAdapter
    consumer: str


class BrokerAdapter:
    """The broker-specific half of one inbox subscriber.

    Subclasses implement the broker's answers; each method's docstring states its
    contract. ``broker`` and ``subscriber`` are FastStream's objects.
    """

    name: ClassVar[str]
    native_reject: ClassVar[bool] = False
    """Whether `reject` sends a message to a dead-letter path the broker itself has."""

    def __init__(self, broker: Any, subscriber: Any) -> None:
        self.broker = broker
        self.subscriber = subscriber

    @property
    def source(self) -> str:
        """The queue, stream, subject or topic messages come from."""
        raise NotImplementedError

    @property
    def batch(self) -> bool:
        """Whether the subscriber receives batches."""
        return False

    def describe(self) -> str:
        """The subscriber, for a log line: enough to tell two subscribers of one source
        apart."""
        return f"{self.name} subscriber {self.source!r}"

    def refusal(self, consumer: str, peers: Sequence[Peer]) -> str | None:
        """Why this subscriber (of inbox consumer ``consumer``) cannot be protected, with
        what to change; None if it can. ``peers`` are the broker's other inbox subscribers.

        Runs before the generic ack-policy checks, so it can explain a broker's own case
        (a Redis list reports itself as MANUAL, for instance).
        """
        return None

    async def prepare(self, destinations: Iterable[str]) -> None:
        """Declare the quarantine and dead-letter destinations durably, before consuming."""

    def declare_publisher(self, destination: str) -> None:
        """Declare ``destination`` as a publisher of the broker (a test broker gives each
        publisher an in-memory subscriber, so publishing there needs none of the test's)."""
        self.broker.publisher(destination)

    async def publish(self, destination: str, item: Item, headers: dict[str, Any]) -> None:
        """Publish ``item``'s body durably to ``destination`` with ``headers``; return only
        once the broker has it (confirmed), raise otherwise."""
        raise NotImplementedError

    def items(self, message: Any) -> list[Item]:
        """The messages in ``message``: one, or each of a batch, in order."""
        raw = message.raw_message
        return [
            Item(
                bytes(message.body),
                message.headers,
                self.broker_id(raw),
                message.content_type,
                self.earlier_broker_id(raw),
                self.stored_at(raw),
            )
        ]

    def broker_id(self, raw: Any) -> tuple[str, str] | None:
        """What the broker keeps stable across redeliveries of ``raw``, if anything."""
        return None

    def earlier_broker_id(self, raw: Any) -> tuple[str, str] | None:
        """The id earlier versions gave ``raw`` (a sequence number or offset alone, which
        restarts when the stream or topic is re-created), when `broker_id` has changed
        form since: a claim an earlier worker made under it, after the message was stored,
        is this message's (a rolling deploy). None when the form never changed."""
        return None

    def stored_at(self, raw: Any) -> datetime | None:
        """When the broker stored ``raw``, if it says."""
        return None

    def deliveries(self, message: Any) -> int | None:
        """How often the broker has delivered ``message``, counting this delivery, when
        it counts (a redelivery limit then needs no bookkeeping of ours); else None."""
        return None

    def redelivered(self, message: Any) -> bool:
        """Whether the broker says an earlier delivery of ``message`` ended without an
        outcome (its consumer died or lost the connection). False when it cannot tell."""
        return False

    def response(self, output: Output) -> Any:
        """What the handler returns to FastStream so that it publishes ``output``'s exact
        bytes, with its content type, to the subscriber's publishers and reply."""
        headers = dict(output.headers)
        if output.content_type:
            headers["content-type"] = output.content_type
        return Response(output.body, headers=headers)

    async def ack(self, message: Any) -> None:
        """Acknowledge ``message`` once the inbox has settled it (committed, skipped,
        quarantined or dead-lettered): the message's own ack. An adapter may absorb, and
        log, a failure that cannot lose the message (Kafka: an offset commit refused
        after a rebalance, which only makes the next owner see a duplicate)."""
        await message.ack()

    async def retry_later(self, message: Any, delay: float) -> None:
        """Hand ``message`` back for redelivery no sooner than about ``delay`` seconds.

        The default waits, then nacks: the message is held meanwhile, so a failing
        database never turns into a hot redelivery loop.
        """
        await _wait_then(message.nack(), delay)

    async def reject(self, message: Any, indexes: Sequence[int] | None = None) -> None:
        """Send ``message`` (or these items of a batch) to the broker's dead-letter path."""
        raise NotImplementedError

    async def reject_drops(self) -> str | None:
        """Why a message `reject` sends to the broker's own dead-letter path may be
        dropped there, as far as the start-up check can see (asked of a subscriber with
        ``dead_letter=None`` only); None when it is kept, or the broker has no such path
        (``dead_letter=None`` is refused then)."""
        return None


async def _wait_then(action: Any, delay: float) -> None:
    """Sleep, then run ``action`` (an awaitable); on cancellation run it at once."""
    try:
        await asyncio.sleep(delay)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await asyncio.shield(action)
        raise
    await action


def text_headers(headers: Mapping[str, Any]) -> dict[str, str]:
    """Headers for brokers that carry text only (Redis, NATS, Kafka)."""
    result: dict[str, str] = {}
    for name, value in headers.items():
        if isinstance(value, bytes | bytearray):
            text = bytes(value).decode("utf-8", "backslashreplace")
        else:
            text = value if isinstance(value, str) else str(value)
        result[str(name)] = text
    return result
