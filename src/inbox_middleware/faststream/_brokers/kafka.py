"""Kafka (aiokafka, FastStream's `KafkaBroker`): subscribers with a committing ack policy.

Kafka's default, ACK_FIRST, commits offsets as messages are read, before the inbox
commits, so it is refused; with AckPolicy.ACK FastStream commits on ack and, on nack,
seeks the partition back to the message, which is how the inbox hands a message back.

How far an offset commit reaches. An ack commits the positions of every partition the
subscriber's consumer has read from. With a committing ack policy FastStream never gives
one consumer a message before the previous one is settled: a plain subscriber reads one
record at a time (``getone`` after the last one was processed), ``max_workers=N`` builds N
such consumers in one group (each owns its partitions, each commits only its own), and a
batch subscriber settles the whole batch in one transaction before its one commit. So a
commit never reaches past a message still in its transaction::

    consumer: getone(p0@5) ── claim, body, COMMIT ── ack: commit p0=6 ── getone(p0@6) ...
    (a hand-back seeks p0 back to 5 instead, so the next read is the same record)

A rebalance can take a partition from a member while one of its messages is in its
transaction: the inbox commits or rolls back as usual, and the new owner reads from the
last committed offset, so it gets that message again, as a duplicate (the commit won) or
as a retry (it rolled back). The old member's offset commit may then fail; `ack` logs it,
and the database commit stands (no rollback, no seek).

There is no dead-letter path in Kafka (a reject commits the offset), so rejected messages
are published to ``<topic>.dead-letter``, confirmed, and then committed. `prepare` creates
that topic and ``<topic>.quarantine`` before any message is consumed, with the source
topic's partition count, and refuses to start when it cannot.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from aiokafka.errors import IllegalStateError, KafkaError
from faststream.kafka.subscriber.usecase import BatchSubscriber
from faststream.message import AckStatus
from faststream.middlewares import AckPolicy

from ..._core.exceptions import ConfigurationError
from .base import BrokerAdapter, Item, Peer, _wait_then, text_headers

__all__ = ["KafkaAdapter"]

logger = logging.getLogger("inbox_middleware.faststream")

# What Kafka accepts as a topic name (some Kafka-protocol brokers accept more).
_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")
_ACK = (
    "Pass ack_policy=AckPolicy.ACK (the inbox then commits the offset after its "
    "transaction, and seeks back to retry)"
)


class KafkaAdapter(BrokerAdapter):
    name = "Kafka"

    @property
    def source(self) -> str:
        if self.subscriber.topics:
            return str(self.subscriber.topics[0].name)
        if self.subscriber.partitions:  # manual assignment: the partitions' topic
            return str(self.subscriber.partitions[0].topic)
        return str(self.subscriber.topic_names[0])

    @property
    def batch(self) -> bool:
        return isinstance(self.subscriber, BatchSubscriber)

    def refusal(self, consumer: str, peers: Sequence[Peer]) -> str | None:
        subscriber = self.subscriber
        # Without a group, Kafka keeps no offsets: every commit fails (IllegalOperation),
        # and a restarted subscriber reads from auto_offset_reset, skipping (latest) or
        # replaying (earliest) what came while it was down.
        group = (
            None
            if subscriber.group_id
            else "it has no group_id, so Kafka commits no offsets for it and a restart loses "
            "its place; pass group_id=... (a name kept across deployments)"
        )
        if subscriber.ack_policy is AckPolicy.ACK_FIRST:
            return (
                "Kafka subscribers default to AckPolicy.ACK_FIRST, which commits offsets as "
                f"messages are read, before the inbox commits. {_ACK}"
                + (f"; and {group}" if group else "")
            )
        if group:
            return group
        if subscriber.ack_policy is AckPolicy.MANUAL:
            return (
                "AckPolicy.MANUAL leaves the offset commit to the handler, but the inbox must "
                f"commit it only after its transaction, and settles every message itself. {_ACK}"
            )
        if subscriber.pattern is not None:
            return "an inbox Kafka subscriber reads one named topic, not a pattern"
        if (
            len({*(t.name for t in subscriber.topics), *(p.topic for p in subscriber.partitions)})
            > 1
        ):
            return "an inbox Kafka subscriber reads one topic (quarantine topics are per topic)"
        if subscriber._outer_config.consumer_only:
            return (
                "the broker is consumer_only=True, so it cannot publish conflicts and rejected "
                "messages to their topics; the inbox needs its producer"
            )
        return None

    async def prepare(self, destinations: Iterable[str]) -> None:
        from aiokafka.admin import NewTopic

        wanted = list(destinations)
        if bad := [name for name in wanted if not _TOPIC_NAME.fullmatch(name)]:
            raise ConfigurationError(
                f"the inbox cannot create the Kafka topics {', '.join(map(repr, bad))} for "
                f"{self.source!r}: a topic name is 1 to 249 characters of letters, digits, "
                "'.', '_' and '-'; choose another quarantine= or dead_letter="
            )
        admin = self.broker.config.admin.admin_client
        if admin is None:  # TestKafkaBroker connects no clients, and keeps no topics
            return
        try:
            # list_topics first: on a broker that creates topics on demand, describing
            # a missing topic would create it with the broker's defaults.
            existing = set(await admin.list_topics())
            missing = [name for name in wanted if name not in existing]
            if not missing:
                return
            partitions, replicas = await self._layout(admin, existing)
            response = await admin.create_topics(
                [NewTopic(name, partitions, replicas) for name in missing]
            )
            errors = {
                topic: (code, message)
                for topic, code, message in response.topic_errors
                if code not in (0, 36)  # 36: it exists (another worker created it first)
            }
        except Exception as exc:
            raise ConfigurationError(
                f"cannot create the Kafka topics {', '.join(wanted)} for {self.source!r}: "
                f"{type(exc).__name__}: {exc}; create them, or give the inbox a broker whose "
                "credentials may create topics"
            ) from exc
        if errors:
            detail = "; ".join(
                f"{topic}: error {code} {message or ''}".strip()
                for topic, (code, message) in sorted(errors.items())
            )
            raise ConfigurationError(
                f"cannot create the Kafka topics the inbox publishes to for {self.source!r} "
                f"({detail}); create them, or let the inbox's credentials create topics"
            )

    async def _layout(self, admin: Any, existing: set[str]) -> tuple[int, int]:
        """Partitions and replication factor for the inbox's topics: the source topic's
        when it exists, else what the subscriber declares for it (FastStream creates a
        declared source only when the subscriber starts, after this check)."""
        if self.source in existing:
            (topic,) = await admin.describe_topics([self.source])
            partitions = topic["partitions"]
            return len(partitions), max(1, len(partitions[0]["replicas"]))
        declared = next((t for t in self.subscriber.topics if t.name == self.source), None)
        if declared is not None and declared.declare:
            return int(declared.num_partitions), int(declared.replication_factor)
        return 1, 1

    async def publish(self, destination: str, item: Item, headers: dict[str, Any]) -> None:
        # Returns once the broker has the record (acks per the producer's setting).
        await self.broker.publish(item.body, destination, headers=text_headers(headers))

    def items(self, message: Any) -> list[Item]:
        if not self.batch:
            return super().items(message)
        return [
            Item(
                bytes(record.value or b""),
                headers,
                # A batch is claimed whole, by its items' ids: kept in the earlier form.
                self.earlier_broker_id(record),
                headers.get("content-type"),
            )
            for record, headers in zip(message.raw_message, message.batch_headers, strict=True)
        ]

    async def ack(self, message: Any) -> None:
        # The database has committed: a failed offset commit (the group rebalanced, the
        # partition moved) only means the next owner reads the message again, and skips
        # it as a duplicate. Logged, and the message counted as settled, so that nothing
        # downstream turns it into a rollback or a seek.
        try:
            await message.ack()
        except KafkaError as exc:
            message.committed = AckStatus.ACKED
            logger.warning(
                "the offset commit after the inbox committed failed (%s: %s); the message "
                "will come again to the partition's next owner, as a duplicate",
                type(exc).__name__,
                exc,
                extra={"inbox_event": "offset_commit_failed", "inbox_source": self.source},
            )

    async def retry_later(self, message: Any, delay: float) -> None:
        try:
            await _wait_then(message.nack(), delay)
        except IllegalStateError:
            # The partition was revoked meanwhile: its next owner reads the message again
            # from the last committed offset, which is what a hand-back wants.
            message.committed = AckStatus.NACKED

    def broker_id(self, raw: Any) -> tuple[str, str] | None:
        # Topic, partition and offset name one record while the topic lives; a topic
        # deleted and created again restarts its offsets, so the record's timestamp joins
        # them (the same on every read of the record).
        return (f"kafka:{raw.topic}", f"{raw.partition}:{raw.offset}@{raw.timestamp}")

    def earlier_broker_id(self, raw: Any) -> tuple[str, str] | None:
        return (f"kafka:{raw.topic}", f"{raw.partition}:{raw.offset}")

    def stored_at(self, raw: Any) -> datetime | None:
        stamp = getattr(raw, "timestamp", None)
        if not isinstance(stamp, int) or stamp < 0:
            return None
        return datetime.fromtimestamp(stamp / 1000, UTC)

    async def reject(self, message: Any, indexes: Sequence[int] | None = None) -> None:
        raise NotImplementedError("Kafka has no dead-letter path; the inbox publishes one")
