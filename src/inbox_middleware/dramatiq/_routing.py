"""Publishing a conflicting message to its quarantine queue.

The quarantine queue is for people and repair tools, so a worker started the usual way
(``dramatiq my_module``) must never consume it. Dramatiq workers consume every queue the
broker declares, and ``broker.enqueue`` declares the queue it publishes to; so the
message is published here *without* declaring the queue to Dramatiq: on RabbitMQ to a
durable queue declared on the server only, on Redis through the broker's own enqueue
script, on the stub broker into a list kept by the middleware.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Protocol

from dramatiq import Broker, Message

from .._core.exceptions import ConfigurationError

__all__ = ["QuarantinePublisher", "publisher_for"]


class QuarantinePublisher(Protocol):
    def publish(self, message: Message[Any], queue_name: str) -> None:
        """Publish ``message`` durably to ``queue_name`` without declaring it to Dramatiq."""


class RabbitmqPublisher:
    """Publishes ``mandatory`` and persistent on a channel with publisher confirms, so
    that ``publish`` returns only once the queue has the message; pika raises otherwise
    (``UnroutableError``, ``NackError``), and the message is handed back, not acked.

    A broker with ``confirm_delivery=True`` lends its own channel; without it, each
    thread publishes on a confirm channel of its own, on the broker's connection.
    """

    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self._local = threading.local()

    def publish(self, message: Message[Any], queue_name: str) -> None:
        import pika

        channel = self._channel()
        # Declared exactly as Dramatiq declares its own queues, so that a repair tool built
        # on Dramatiq can consume this queue without a PRECONDITION_FAILED.
        arguments = self.broker._build_queue_arguments(queue_name)
        channel.queue_declare(queue=queue_name, durable=True, arguments=arguments)
        channel.basic_publish(
            exchange="",
            routing_key=queue_name,
            body=message.encode(),
            properties=pika.BasicProperties(delivery_mode=2),
            mandatory=True,
        )

    def _channel(self) -> Any:
        if getattr(self.broker, "confirm_delivery", False):
            return self.broker.channel  # the calling thread's, in confirm mode
        connection = self.broker.connection
        if not connection.is_open:  # closed under it: the broker opens another
            del self.broker.connection
            connection = self.broker.connection
        channel = getattr(self._local, "channel", None)
        if channel is None or not channel.is_open or channel.connection is not connection:
            channel = self._local.channel = connection.channel()
            channel.confirm_delivery()
        return channel


class RedisPublisher:
    def __init__(self, broker: Any) -> None:
        self.broker = broker

    def publish(self, message: Message[Any], queue_name: str) -> None:
        from uuid import uuid4

        redis_id = str(uuid4())
        message = message.copy(options={"redis_message_id": redis_id})
        self.broker.do_enqueue(queue_name, redis_id, message.encode())


class MemoryPublisher:
    """For the stub broker: quarantined messages stay in ``messages[queue_name]``."""

    def __init__(self) -> None:
        self.messages: defaultdict[str, list[Message[Any]]] = defaultdict(list)

    def publish(self, message: Message[Any], queue_name: str) -> None:
        self.messages[queue_name].append(message)


def publisher_for(broker: Broker) -> QuarantinePublisher:
    # By the module of Dramatiq's broker class it is (or derives from: a subclass such as
    # QuorumRabbitmqBroker), without importing a broker's client library.
    for kind in type(broker).__mro__:
        name = kind.__module__
        if name.startswith("dramatiq.brokers.rabbitmq"):
            return RabbitmqPublisher(broker)
        if name.startswith("dramatiq.brokers.redis"):
            return RedisPublisher(broker)
        if name.startswith("dramatiq.brokers.stub"):
            return MemoryPublisher()
    raise ConfigurationError(
        f"no quarantine publisher for {type(broker).__name__}; pass "
        "InboxMiddleware(quarantine_publisher=...) with a publish(message, queue_name) method"
    )
