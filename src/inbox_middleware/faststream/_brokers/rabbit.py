"""RabbitMQ: every queue subscriber can be protected; the inbox settles each message."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from aio_pika import DeliveryMode, Message
from faststream.rabbit import QueueType, RabbitQueue, RabbitResponse

from ..._core.outputs import Output
from ...outbox._confirms import unconfirmed
from .base import BrokerAdapter, Item, NotPublished, _wait_then

__all__ = ["RabbitAdapter", "unconfirmed"]

logger = logging.getLogger("inbox_middleware.faststream")

EXPIRES_AT = "x-inbox-expires-at"
"""On a message handed back with a time to live: when it expires (milliseconds since the
epoch), so that each hand-back publishes it with what is left, not the whole TTL again."""


class RabbitAdapter(BrokerAdapter):
    name = "RabbitMQ"
    native_reject = True

    @property
    def source(self) -> str:
        # The name queue.add_prefix() gives, without the deep copy of the queue it makes
        # (read for every message).
        queue: RabbitQueue = self.subscriber.queue
        return f"{self.subscriber._outer_config.prefix}{queue.name}"

    def response(self, output: Output) -> Any:
        # The content type is a message property on RabbitMQ, not a header.
        return RabbitResponse(
            output.body, headers=dict(output.headers), content_type=output.content_type
        )

    async def prepare(self, destinations: Iterable[str]) -> None:
        for name in destinations:
            await self.broker.declare_queue(self._destination(name))

    def _destination(self, name: str) -> RabbitQueue:
        # Durable, like the queues a repair tool would declare to read them back; quorum
        # queues (replicated) when the source is one, so that they survive what it does
        # (and a queue declared again after an operator deleted it keeps its type, or the
        # next start-up's declaration would fail with PRECONDITION_FAILED).
        if self.quorum:
            return RabbitQueue(name, durable=True, queue_type=QueueType.QUORUM)
        return RabbitQueue(name, durable=True)

    async def publish(self, destination: str, item: Item, headers: dict[str, Any]) -> None:
        # persist: FastStream publishes non-persistent messages unless asked. mandatory
        # makes RabbitMQ return what it cannot route; FastStream's channel does not raise
        # on a return (on_return_raises=False), it answers with the returned message, so
        # the answer is checked: only a publisher confirm means RabbitMQ has the message.
        result = await self.broker.publish(
            item.body,
            queue=destination,
            persist=True,
            mandatory=True,
            headers=headers,
            content_type=item.content_type,
        )
        if problem := unconfirmed(result, self.broker):
            if _returned(result):  # the queue was deleted: declared again for the retry
                await self._declare_again(destination)
            raise NotPublished(f"not published to {destination!r}: {problem}")

    async def _declare_again(self, name: str) -> None:
        # The broker caches what it declared, so the queue object declares itself anew.
        queue = await self.broker.declare_queue(self._destination(name))
        await queue.declare()

    def broker_id(self, raw: Any) -> tuple[str, str] | None:
        # The AMQP message-id property: FastStream's publisher fills it (one per publish),
        # so it identifies redeliveries of one publish, never a producer's second send.
        message_id = getattr(raw, "message_id", None)
        return ("rabbitmq.message_id", str(message_id)) if message_id else None

    def deliveries(self, message: Any) -> int | None:
        count = (message.headers or {}).get("x-delivery-count")  # quorum queues count
        return int(count) + 1 if isinstance(count, int) else None

    def redelivered(self, message: Any) -> bool:
        return bool(getattr(message.raw_message, "redelivered", False))

    @property
    def quorum(self) -> bool:
        arguments = getattr(self.subscriber.queue, "arguments", None) or {}
        return arguments.get("x-queue-type") == "quorum"

    async def retry_later(self, message: Any, delay: float) -> None:
        if not self.quorum and delay > 0 and await self._park(message, delay):
            return
        if not self.quorum:
            await _wait_then(message.nack(requeue=True), delay)
            return
        # A quorum queue counts every requeue against its delivery limit, and dead-letters
        # (or drops) the message when it is spent: a hand-back must spend none of it. So the
        # message goes back as a new publish, confirmed, before this delivery is acked; a
        # crash between the two leaves two copies, which the inbox tells apart.
        await _wait_then(self._publish_again(message), delay)

    async def _publish_again(self, message: Any) -> None:
        copy = self._copy(message.raw_message, message.headers or {})
        problem: str | None = copy if isinstance(copy, str) else None
        if not isinstance(copy, str):
            result = await self.broker.publish(copy, queue=self.source, mandatory=True)
            problem = unconfirmed(result, self.broker)
        if problem:
            # Kept the classic way instead: this requeue counts against the delivery limit.
            logger.warning("requeueing a message of %s instead: %s", self.source, problem)
            await message.nack(requeue=True)
            return
        await message.ack()

    async def _park(self, message: Any, delay: float) -> bool:
        """Hand ``message`` back out of the subscriber's prefetch window: a copy goes to
        the source's wait queue for ``delay`` (``<source>.inbox-wait.<ms>``: that queue's
        messages live ``ms`` milliseconds, then RabbitMQ dead-letters them back to the
        source), confirmed, then this delivery is acked. A copy sent first, then the ack:
        a crash between the two leaves two copies, which the inbox tells apart. So a
        message whose database is down waits in RabbitMQ, not in the worker: it holds no
        prefetch slot, and the other tenants' messages behind it on the shared queue flow.
        False: not parked (a message with a time to live of its own, whose expiry a
        dead-lettering would drop, or one that cannot be copied or published), to be
        handed back the classic way."""
        raw = message.raw_message
        if getattr(raw, "expiration", None) is not None:
            return False
        headers = {k: v for k, v in (message.headers or {}).items() if not _death(k)}
        copy = self._copy(raw, headers)
        if isinstance(copy, str):
            return False
        ms = _wait_step(delay)
        name = f"{self.source}.inbox-wait.{ms}"
        try:
            for attempt in range(2):
                key = (id(self.broker), name)
                if attempt or key not in _DECLARED:
                    queue = await self.broker.declare_queue(self._wait_queue(name, ms))
                    if attempt:
                        await queue.declare()  # the broker's cache says it exists; expired
                    _DECLARED.add(key)
                result = await self.broker.publish(copy, queue=name, mandatory=True)
                problem = unconfirmed(result, self.broker)
                if not problem:
                    await message.ack()
                    return True
                if not _returned(result):
                    break
        except Exception as exc:
            # The copy could not be sent (the broker's connection, or a test broker, which
            # has no consumer of the wait queue): handed back in place, as before parking.
            problem = f"{type(exc).__name__}: {exc}"
        logger.warning("handing a message of %s back in place: %s", self.source, problem)
        return False

    def _wait_queue(self, name: str, ms: int) -> RabbitQueue:
        return RabbitQueue(
            name,
            durable=True,
            arguments={
                "x-message-ttl": ms,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": self.source,
                "x-expires": max(10 * ms, 600_000),  # deleted when unused for that long
            },
        )

    def _copy(self, raw: Any, headers: Mapping[str, Any]) -> Message | str:
        """The message to publish again in ``raw``'s place: its body and every property
        (a request's ``reply_to`` and ``correlation_id``, the ``message_id`` the broker_id
        opt-in reads, priority, type, ...), persistent. A time to live goes on with what is
        left of it, from the deadline the first hand-back wrote down (``x-inbox-expires-at``,
        the first hand-back's clock plus the TTL: the time the message waited before its
        first delivery is not known, so it may live that much longer). A string: why it
        cannot be copied (a ``user_id`` RabbitMQ would refuse from this connection)."""
        user_id = getattr(raw, "user_id", None)
        if user_id and user_id != self._login():
            return f"its user_id {user_id!r} is not this connection's user"
        kept = {k: v for k, v in headers.items() if k != "x-delivery-count"}
        expiration = getattr(raw, "expiration", None)
        if expiration is not None:
            now = time.time()
            deadline = kept.get(EXPIRES_AT)
            if not isinstance(deadline, int | float) or isinstance(deadline, bool):
                deadline = int((now + float(expiration)) * 1000)
                kept[EXPIRES_AT] = deadline
            expiration = max(deadline / 1000 - now, 0.001)  # spent: expires at once
        return Message(
            bytes(raw.body),
            headers=kept,
            content_type=raw.content_type,
            content_encoding=raw.content_encoding,
            delivery_mode=DeliveryMode.PERSISTENT,
            priority=raw.priority,
            correlation_id=raw.correlation_id,
            reply_to=raw.reply_to,
            expiration=expiration,
            message_id=raw.message_id,
            timestamp=raw.timestamp,
            type=raw.type,
            user_id=user_id,
            app_id=raw.app_id,
        )

    def _login(self) -> str | None:
        url = getattr(getattr(self.broker, "_connection", None), "url", None)
        user = getattr(url, "user", None)
        return user if isinstance(user, str) else None

    async def reject_drops(self) -> str | None:
        arguments = getattr(self.subscriber.queue, "arguments", None) or {}
        if "x-dead-letter-exchange" in arguments:
            return None
        return (
            f"queue {self.source!r} is declared without x-dead-letter-exchange: RabbitMQ drops "
            "a message rejected without requeue unless a policy gives the queue a "
            "dead-letter exchange"
        )

    async def reject(self, message: Any, indexes: Sequence[int] | None = None) -> None:
        # Without requeue: to the queue's dead-letter exchange, if it has one.
        await message.reject(requeue=False)


_STEPS = (10, 12, 15, 20, 25, 30, 40, 50, 60, 70, 80)
"""A wait queue's delay, in a decade (``x 10^k`` ms): twelve queues a decade at most."""


def _wait_step(delay: float) -> int:
    """The wait queue for a ``delay`` in seconds: its milliseconds rounded up to the next
    step (so a hand-back never waits less than asked, and at most a quarter more), so
    that the few queues a source has serve every delay."""
    ms = max(1, math.ceil(delay * 1000))
    if ms <= 10:
        return ms
    scale = int(10 ** (len(str(ms)) - 2))  # ms / scale is in [10, 100)
    return next(step * scale for step in (*_STEPS, 100) if step * scale >= ms)


_DECLARED: set[tuple[int, str]] = set()
"""The wait queues declared so far, by broker (`RabbitAdapter._park`)."""


def _death(header: str) -> bool:
    """Whether ``header`` is one RabbitMQ writes when it dead-letters a message (a parked
    message coming back from its wait queue): not copied into the next copy."""
    return header == "x-death" or header.startswith(("x-first-death-", "x-last-death-"))


def _returned(result: Any) -> bool:
    from pamqp.commands import Basic

    return isinstance(getattr(result, "delivery", None), Basic.Return)
