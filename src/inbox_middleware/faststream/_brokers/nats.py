"""NATS: JetStream subscribers only (push or pull); core NATS keeps nothing to redeliver.

A failed message is nacked with JetStream's own redelivery delay (``nak(delay=...)``), so
nothing is held in the worker meanwhile. Quarantined and rejected messages are published
to subjects that a JetStream stream keeps: the inbox creates ``<stream>_inbox`` for them
when no stream captures those subjects yet.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from .base import BrokerAdapter, Item, Peer, text_headers

__all__ = ["NatsAdapter", "subject_matches"]

logger = logging.getLogger("inbox_middleware.faststream")

# FastStream's NATS classes are imported where they are used: the inbox imports this
# module for every app, and an app on another broker has no NATS client installed
# (inbox-middleware[faststream-rabbit]). An adapter only exists for a NATS subscriber.


class NatsAdapter(BrokerAdapter):
    name = "NATS"
    native_reject = True

    def __init__(self, broker: Any, subscriber: Any) -> None:
        super().__init__(broker, subscriber)
        self.streams: dict[str, str] = {}  # destination subject -> the stream keeping it

    @property
    def source(self) -> str:
        return str(self.subscriber.subject.broker_address)

    @property
    def batch(self) -> bool:
        from faststream.nats.subscriber.usecases.stream_pull_subscriber import (
            BatchPullStreamSubscriber,
        )

        return isinstance(self.subscriber, BatchPullStreamSubscriber)

    def refusal(self, consumer: str, peers: Sequence[Peer]) -> str | None:
        from faststream.nats.subscriber.usecases.core_subscriber import CoreSubscriber
        from faststream.nats.subscriber.usecases.key_value_subscriber import (
            KeyValueWatchSubscriber,
        )
        from faststream.nats.subscriber.usecases.object_storage_subscriber import (
            ObjStoreWatchSubscriber,
        )
        from faststream.nats.subscriber.usecases.stream_basic import StreamSubscriber
        from faststream.nats.subscriber.usecases.stream_pull_subscriber import (
            BatchPullStreamSubscriber,
        )

        subscriber = self.subscriber
        if isinstance(subscriber, KeyValueWatchSubscriber | ObjStoreWatchSubscriber):
            return "a key-value or object-store watch has no acknowledgement to control"
        if isinstance(subscriber, CoreSubscriber) or not isinstance(
            subscriber, StreamSubscriber | BatchPullStreamSubscriber
        ):
            return (
                f"core NATS subject {self.source!r} delivers at most once and keeps "
                "nothing, so a message whose transaction did not commit would be lost. "
                "Subscribe through JetStream: stream=JStream(...) (push) or also "
                "pull_sub=PullSub(...)"
            )
        if subscriber.extra_options.get("manual_ack") is False:
            return (
                "AckPolicy.ACK_FIRST: JetStream acknowledges the message on delivery, "
                "before the inbox commits, so a crash would lose it. Remove ack_policy "
                "(the inbox acks after the commit itself)"
            )
        return None

    def captures(self, destination: str) -> bool:
        """Whether this subscriber would consume ``destination`` itself."""
        return subject_matches(self.source, destination)

    async def prepare(self, destinations: Iterable[str]) -> None:
        from nats.js.api import StorageType, StreamConfig
        from nats.js.errors import NotFoundError

        js = self.subscriber.jetstream
        missing = []
        for subject in destinations:
            try:
                self.streams[subject] = await js.find_stream_name_by_subject(subject)
            except NotFoundError:
                missing.append(subject)
        if not missing:
            return
        name = f"{self.subscriber.stream.name}_inbox"
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            await js.add_stream(StreamConfig(name, subjects=missing, storage=StorageType.FILE))
        else:
            subjects = sorted({*(info.config.subjects or ()), *missing})
            await js.update_stream(StreamConfig(name, subjects=subjects, storage=StorageType.FILE))
        self.streams |= dict.fromkeys(missing, name)

    async def publish(self, destination: str, item: Item, headers: dict[str, Any]) -> None:
        # Through JetStream: returns once the stream has stored the message.
        await self.broker.publish(
            item.body,
            destination,
            headers=text_headers(headers),
            stream=self.streams.get(destination),
        )

    def items(self, message: Any) -> list[Item]:
        if not self.batch:
            return super().items(message)
        return [
            Item(
                bytes(raw.data),
                raw.headers or {},
                # A batch is claimed whole, by its items' ids: kept in the earlier form.
                self.earlier_broker_id(raw) or self.broker_id(raw),
                (raw.headers or {}).get("content-type"),
                # JetStream counts each message's deliveries: the redelivery limit applies
                # to each message of the batch.
                deliveries=_delivered(raw),
            )
            for raw in message.raw_message
        ]

    def broker_id(self, raw: Any) -> tuple[str, str] | None:
        # The publisher's deduplication id when it set one, else the stream sequence with
        # the time the stream stored the message: both stay the same on every redelivery,
        # and a stream deleted and created again, whose sequences restart at 1, stores its
        # messages at other times.
        metadata = raw.metadata
        if msg_id := (raw.headers or {}).get("Nats-Msg-Id"):
            return (f"nats-msg-id:{metadata.stream}", str(msg_id))
        stored = _microseconds(metadata.timestamp)
        return (f"nats-stream:{metadata.stream}", f"{metadata.sequence.stream}@{stored}")

    def earlier_broker_id(self, raw: Any) -> tuple[str, str] | None:
        metadata = raw.metadata
        if (raw.headers or {}).get("Nats-Msg-Id"):
            return None  # that form never changed
        return (f"nats-stream:{metadata.stream}", str(metadata.sequence.stream))

    def stored_at(self, raw: Any) -> datetime | None:
        stored = getattr(getattr(raw, "metadata", None), "timestamp", None)
        return stored if isinstance(stored, datetime) else None

    def deliveries(self, message: Any) -> int | None:
        # JetStream counts every delivery, those after a hand-back included.
        return _delivered(message.raw_message)

    async def retry_later(self, message: Any, delay: float) -> None:
        await message.nack(delay=delay)

    async def reject_drops(self) -> str | None:
        retention = await self._retention()
        if retention in (None, "limits"):
            return None  # a stream with limits retention keeps a terminated message
        return (
            f"stream {self.subscriber.stream.name!r} has {retention} retention: "
            "JetStream removes a message it is told to terminate, as one acknowledged, "
            "and leaves only its MSG_TERMINATED advisory"
        )

    async def _retention(self) -> str | None:
        """The source stream's retention: the server's when the stream exists (it keeps
        it whatever the subscriber declares), else the one the subscriber will declare
        (None: limits); None as well when it cannot be read."""
        from nats.js.errors import NotFoundError

        stream = self.subscriber.stream
        try:
            retention = (await self.subscriber.jetstream.stream_info(stream.name)).config.retention
        except NotFoundError:
            retention = getattr(getattr(stream, "config", None), "retention", None)
        except Exception:  # only a warning reads it: the check goes on without it
            logger.debug("could not read the retention of %s", stream.name, exc_info=True)
            return None
        return None if retention is None else str(getattr(retention, "value", retention))

    async def reject(self, message: Any, indexes: Sequence[int] | None = None) -> None:
        # TERM: JetStream stops redelivering and publishes a MSG_TERMINATED advisory.
        if indexes is None:
            await message.reject()
            return
        for index in indexes:
            await message.raw_message[index].term()


def _delivered(raw: Any) -> int | None:
    """JetStream's count of deliveries of ``raw``, this one included."""
    metadata = getattr(raw, "metadata", None)
    return int(metadata.num_delivered) if metadata is not None else None


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    want, have = pattern.split("."), subject.split(".")
    for index, token in enumerate(want):
        if token == ">":
            return len(have) > index
        if index >= len(have) or (token not in ("*", have[index])):
            return False
    return len(want) == len(have)


def _microseconds(stored: datetime) -> int:
    """The stored time as whole microseconds since the epoch (exact, unlike a float)."""
    return (stored - _EPOCH) // timedelta(microseconds=1)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
