"""Dramatiq on RabbitMQ quorum queues: `QuorumRabbitmqBroker`.

Dramatiq declares its queues itself (the queue, its delay queue ``.DQ`` and its
dead-letter queue ``.XQ``), always as classic queues, so a queue declared first as a
quorum queue fails Dramatiq's declaration with PRECONDITION_FAILED. This broker declares
all three as quorum queues, the queue and the delay queue with a delivery limit, and
reads the broker's count of deliveries (``x-delivery-count``) into each message, where
the inbox's redelivery limit finds it.

What spends the delivery limit is a message that went back to its queue unacknowledged:
a worker that died, a lost connection. Nothing the inbox does spends it: a hand-back is a
new publish (with its delay) and an ack, a failure is retried by Dramatiq's Retries as a
new message, a rejection is a nack without requeue (dead-lettered, and kept as poison).
Keep ``delivery_limit`` above the inbox's ``redelivery_limit`` (10 by default), so that
the inbox records a message that keeps killing its workers as poison before RabbitMQ
dead-letters it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dramatiq.brokers.rabbitmq import DEAD_MESSAGE_TTL, RabbitmqBroker, _RabbitmqConsumer
from dramatiq.common import xq_name

from .._core.exceptions import ConfigurationError
from ._actor import DELIVERIES

__all__ = ["QuorumRabbitmqBroker"]

DEFAULT_DELIVERY_LIMIT = 20


class QuorumRabbitmqBroker(RabbitmqBroker):
    """A `RabbitmqBroker` whose queues are quorum queues.

    ```python
    broker = QuorumRabbitmqBroker(url="amqp://...", confirm_delivery=True, delivery_limit=20)
    broker.add_middleware(InboxMiddleware(engine))
    ```

    Parameters:
      delivery_limit: deliveries of one message after which RabbitMQ dead-letters it to
        the ``.XQ`` queue (``x-delivery-limit``); above the inbox's ``redelivery_limit``.
      **options: `RabbitmqBroker`'s (``max_priority`` excepted: quorum queues have no
        priorities).
    """

    def __init__(self, *, delivery_limit: int = DEFAULT_DELIVERY_LIMIT, **options: Any) -> None:
        if options.get("max_priority"):
            raise ConfigurationError("quorum queues have no priorities: drop max_priority")
        if isinstance(delivery_limit, bool) or not isinstance(delivery_limit, int):
            raise ConfigurationError(f"delivery_limit must be an int, got {delivery_limit!r}")
        if delivery_limit < 1:
            raise ConfigurationError(f"delivery_limit must be at least 1, got {delivery_limit}")
        self.delivery_limit = delivery_limit
        super().__init__(**options)

    @property
    def consumer_class(self) -> type[_RabbitmqConsumer]:
        return _QuorumConsumer

    def _build_queue_arguments(self, queue_name: str) -> dict[str, Any]:
        arguments: dict[str, Any] = super()._build_queue_arguments(queue_name)  # type: ignore[no-untyped-call]
        arguments["x-queue-type"] = "quorum"
        arguments["x-delivery-limit"] = self.delivery_limit
        return arguments

    def _declare_xq_queue(self, queue_name: str) -> Any:
        return self.channel.queue_declare(
            queue=xq_name(queue_name),
            durable=True,
            arguments={"x-queue-type": "quorum", "x-message-ttl": DEAD_MESSAGE_TTL},
        )


class _QuorumConsumer(_RabbitmqConsumer):
    """Dramatiq's consumer, keeping the AMQP headers' ``x-delivery-count`` (deliveries
    before this one that went back to the queue) on each message it returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._last_count: Any = None
        self.iterator = self._counting(self.iterator)

    def _counting(self, frames: Iterator[Any]) -> Iterator[Any]:
        for method, properties, body in frames:
            headers = getattr(properties, "headers", None) or {}
            self._last_count = headers.get("x-delivery-count")
            yield method, properties, body

    def __next__(self) -> Any:
        message = super().__next__()  # type: ignore[no-untyped-call]
        if message is not None:
            count = self._last_count
            before = count if isinstance(count, int) and not isinstance(count, bool) else 0
            setattr(message, DELIVERIES, before + 1)
        return message
