"""Publishing a kept FastStream message again, for `repair.redrive` and `repair.accept`.

The row keeps the body, the headers (with the content type) and the source: the queue,
stream, subject or topic. The broker is chosen by the URL: ``amqp://`` publishes a
persistent message to the RabbitMQ queue, ``redis://`` adds an entry to the stream,
``nats://`` publishes to the subject through JetStream and waits for its acknowledgement,
``kafka://host:port[,host:port...]`` produces to the topic and waits for the broker's.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

from .._core.headers import MESSAGE_ID
from .._operate.repair import RepairError, StoredMessage
from ._brokers.base import text_headers
from ._telling import CONFLICT_HEADER, REJECTED_HEADER, REPAIR_HEADER

__all__ = ["FastStreamRepublisher"]


class FastStreamRepublisher:
    formats = ("faststream",)

    def __init__(self, url: str) -> None:
        scheme = urlsplit(url).scheme
        if scheme not in ("amqp", "amqps", "redis", "rediss", "nats", "tls", "kafka"):
            raise RepairError(
                f"no FastStream broker for {url!r}: use amqp://, redis://, nats:// or kafka://"
            )
        self.url = url
        self.scheme = scheme

    def republish(self, message: StoredMessage, *, message_id: str) -> None:
        asyncio.run(self._publish(message, message_id))

    async def _publish(self, message: StoredMessage, message_id: str) -> None:
        headers: dict[str, Any] = {
            name: value
            for name, value in message.headers.items()
            if name not in (CONFLICT_HEADER, REJECTED_HEADER, REPAIR_HEADER)
        }
        headers[MESSAGE_ID] = message_id
        headers[REPAIR_HEADER] = message.marker
        body = message.payload
        if self.scheme.startswith("amqp"):
            from faststream.rabbit import RabbitBroker

            content_type = headers.pop("content-type", None)
            async with RabbitBroker(self.url) as broker:
                await broker.publish(
                    body,
                    queue=message.source,
                    headers=headers,
                    persist=True,
                    content_type=content_type,
                )
        elif self.scheme.startswith("redis"):
            from faststream.redis import RedisBroker

            async with RedisBroker(self.url) as broker:
                await broker.publish(body, stream=message.source, headers=text_headers(headers))
        elif self.scheme == "kafka":
            from faststream.kafka import KafkaBroker

            servers = urlsplit(self.url).netloc.split(",")
            async with KafkaBroker(servers) as broker:
                await broker.publish(body, message.source, headers=text_headers(headers))
        else:
            import nats

            connection = await nats.connect(self.url)
            try:  # JetStream's publish returns once the stream has stored the message
                await connection.jetstream().publish(
                    message.source, body, headers=text_headers(headers)
                )
            finally:
                await connection.close()
