"""Kafka (experimental): subscribers with a committing ack policy only.

Kafka's default, ACK_FIRST, commits offsets automatically as messages are read. With any
other policy FastStream commits on ack and, on nack, seeks the partition back to the
message, which is how the inbox hands a message back. Limits, documented: an ack commits
every offset consumed so far on the consumer (concurrent subscribers ack out of order),
and there is no dead-letter path, so rejected messages go to the dead-letter topic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from faststream.kafka.subscriber.usecase import BatchSubscriber
from faststream.middlewares import AckPolicy

from .base import BrokerAdapter, Item, Peer, text_headers

__all__ = ["KafkaAdapter"]


class KafkaAdapter(BrokerAdapter):
    name = "Kafka"

    @property
    def source(self) -> str:
        names = self.subscriber.topic_names or [str(self.subscriber.pattern)]
        return str(names[0])

    @property
    def batch(self) -> bool:
        return isinstance(self.subscriber, BatchSubscriber)

    def refusal(self, consumer: str, peers: Sequence[Peer]) -> str | None:
        if self.subscriber.ack_policy is AckPolicy.ACK_FIRST:
            return (
                "Kafka subscribers default to AckPolicy.ACK_FIRST, which commits offsets as "
                "messages are read, before the inbox commits. Pass ack_policy=AckPolicy.ACK "
                "(the inbox then commits the offset after its transaction, and seeks back "
                "to retry)"
            )
        if len(self.subscriber.topic_names) > 1:
            return "an inbox Kafka subscriber reads one topic (quarantine topics are per topic)"
        return None

    async def publish(self, destination: str, item: Item, headers: dict[str, Any]) -> None:
        await self.broker.publish(item.body, destination, headers=text_headers(headers))

    def items(self, message: Any) -> list[Item]:
        if not self.batch:
            return super().items(message)
        return [
            Item(
                bytes(record.value or b""),
                headers,
                self.broker_id(record),
                headers.get("content-type"),
            )
            for record, headers in zip(message.raw_message, message.batch_headers, strict=True)
        ]

    def broker_id(self, raw: Any) -> tuple[str, str] | None:
        # topic, partition and offset name one record for good.
        return (f"kafka:{raw.topic}", f"{raw.partition}:{raw.offset}")

    async def reject(self, message: Any, indexes: Sequence[int] | None = None) -> None:
        raise NotImplementedError("Kafka has no dead-letter path; the inbox publishes one")
