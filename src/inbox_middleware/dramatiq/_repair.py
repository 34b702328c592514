"""Publishing a kept Dramatiq message again, for `repair.redrive` and `repair.accept`.

The message goes back to the queue it came from, which exists: its workers consumed from
it. So on RabbitMQ the repair path declares nothing (Dramatiq's broker would declare the
queue as a classic one, which RabbitMQ refuses for a quorum queue: PRECONDITION_FAILED on
``x-queue-type``); it checks that the queue exists (a passive declaration, whatever its
type) and publishes with publisher confirms and ``mandatory``, so the enqueue returns only
once RabbitMQ has the message in that queue. On Redis, the enqueue returns once Redis ran
it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dramatiq import Broker, Message
from dramatiq.common import q_name

from .._operate.repair import StoredMessage
from ._payload import OPTION_MESSAGE_ID

__all__ = ["OPTION_REPAIR", "DramatiqRepublisher", "broker_from_url"]

OPTION_REPAIR = "inbox_repair"
"""Message option naming the row a republished message repairs (``poison:12``)."""

# Options that belong to the failed deliveries, not to the message.
_DELIVERY_OPTIONS = frozenset(
    {"retries", "traceback", "requeue_timestamp", "redis_message_id", "eta", "inbox_conflict"}
)


class DramatiqRepublisher:
    """Enqueues the kept message on its original queue through ``broker``."""

    formats = ("dramatiq",)

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def republish(self, message: StoredMessage, *, message_id: str) -> None:
        original = Message.decode(message.payload)
        options: dict[str, Any] = {
            name: value for name, value in original.options.items() if name not in _DELIVERY_OPTIONS
        }
        options[OPTION_MESSAGE_ID] = message_id
        options["retries"] = 0  # Dramatiq's retry budget starts again, like the inbox's
        options[OPTION_REPAIR] = message.marker
        queue = q_name(message.source or original.queue_name)
        self.broker.enqueue(dataclasses.replace(original, queue_name=queue, options=options))


def broker_from_url(url: str, *, namespace: str = "dramatiq") -> Broker:
    """A Dramatiq broker for an ``amqp://`` or ``redis://`` URL (for the command line).

    On RabbitMQ it publishes to existing queues only, classic or quorum alike, and
    returns from an enqueue once RabbitMQ confirmed it (see the module docstring)."""
    if url.startswith(("amqp://", "amqps://")):
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        class ExistingQueuesBroker(RabbitmqBroker):
            """Checks that a queue exists instead of declaring it with arguments."""

            def _declare_queue(self, queue_name: str) -> Any:
                return self.channel.queue_declare(queue=queue_name, passive=True)

            def _declare_dq_queue(self, queue_name: str) -> Any:
                return None  # a redrive publishes without delay: to the queue itself

            def _declare_xq_queue(self, queue_name: str) -> Any:
                return None

        return ExistingQueuesBroker(url=url, confirm_delivery=True)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from dramatiq.brokers.redis import RedisBroker

        broker: Broker = RedisBroker(url=url, namespace=namespace)  # type: ignore[no-untyped-call]
        return broker
    raise ValueError(f"no Dramatiq broker for {url!r}: use an amqp:// or redis:// URL")
