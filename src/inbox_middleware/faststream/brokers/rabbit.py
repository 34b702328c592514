"""RabbitMQ: every queue subscriber can be protected; the inbox settles each message."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from faststream.rabbit import QueueType, RabbitQueue, RabbitResponse

from ...outbox.confirms import unconfirmed
from ...outputs import Output
from .base import BrokerAdapter, Item, NotPublished, _wait_then

__all__ = ["RabbitAdapter", "unconfirmed"]

logger = logging.getLogger("inbox_middleware.faststream")


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
        # Durable, like the queues a repair tool would declare to read them back; quorum
        # queues (replicated) when the source is one, so that they survive what it does.
        for name in destinations:
            if self.quorum:
                queue = RabbitQueue(name, durable=True, queue_type=QueueType.QUORUM)
            else:
                queue = RabbitQueue(name, durable=True)
            await self.broker.declare_queue(queue)

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
        queue = await self.broker.declare_queue(RabbitQueue(name, durable=True))
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
        if not self.quorum:
            await _wait_then(message.nack(requeue=True), delay)
            return
        # A quorum queue counts every requeue against its delivery limit, and dead-letters
        # (or drops) the message when it is spent: a hand-back must spend none of it. So the
        # message goes back as a new publish, confirmed, before this delivery is acked; a
        # crash between the two leaves two copies, which the inbox tells apart.
        await _wait_then(self._publish_again(message), delay)

    async def _publish_again(self, message: Any) -> None:
        raw = message.raw_message
        headers = {k: v for k, v in (message.headers or {}).items() if k != "x-delivery-count"}
        result = await self.broker.publish(
            bytes(message.body),
            queue=self.source,
            persist=True,
            mandatory=True,
            headers=headers,
            content_type=message.content_type,
            message_id=getattr(raw, "message_id", None),  # the broker_id opt-in reads it
            correlation_id=getattr(raw, "correlation_id", None),
        )
        if problem := unconfirmed(result, self.broker):
            # Kept the classic way instead: this requeue counts against the delivery limit.
            logger.warning("requeueing a message of %s instead: %s", self.source, problem)
            await message.nack(requeue=True)
            return
        await message.ack()

    async def reject(self, message: Any, indexes: Sequence[int] | None = None) -> None:
        # Without requeue: to the queue's dead-letter exchange, if it has one.
        await message.reject(requeue=False)


def _returned(result: Any) -> bool:
    from pamqp.commands import Basic

    return isinstance(getattr(result, "delivery", None), Basic.Return)
