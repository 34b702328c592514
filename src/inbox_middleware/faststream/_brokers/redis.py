"""Redis: only streams read through a consumer group, with idle-message reclaiming.

A list pops its message and a pub/sub channel forgets it: neither can hand a message back.
A stream read through a consumer group keeps every unacknowledged message in the group's
pending list, but FastStream reads new messages only (``>``): a pending message comes
back only through a reclaiming read (XAUTOCLAIM, ``min_idle_time``; or XREADGROUP CLAIM,
``claim_min_idle_time``, Redis 8.4+). So every inbox stream subscriber needs one, and the
reclaim delay is also the delay before a failed message is retried.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from faststream.redis.subscriber.usecases.channel_subscriber import ChannelSubscriber
from faststream.redis.subscriber.usecases.list_subscriber import _ListHandlerMixin
from faststream.redis.subscriber.usecases.stream_subscriber import (
    StreamBatchSubscriber,
    _StreamHandlerMixin,
)

from .base import BrokerAdapter, Item, Peer, text_headers

__all__ = ["RedisAdapter"]

_DATA = b"__data__"


class RedisAdapter(BrokerAdapter):
    name = "Redis"

    @property
    def source(self) -> str:
        subscriber = self.subscriber
        if isinstance(subscriber, _StreamHandlerMixin):
            return str(subscriber.stream_sub.name)
        if isinstance(subscriber, _ListHandlerMixin):
            return str(subscriber.list_sub.name)
        if isinstance(subscriber, ChannelSubscriber):
            return str(subscriber.channel.name)
        return str(getattr(subscriber, "name", "?"))

    @property
    def batch(self) -> bool:
        return isinstance(self.subscriber, StreamBatchSubscriber)

    def describe(self) -> str:
        subscriber = self.subscriber
        if not isinstance(subscriber, _StreamHandlerMixin):
            return super().describe()
        stream = subscriber.stream_sub
        if stream.min_idle_time is not None:
            role = f"reclaiming messages pending over {stream.min_idle_time} ms"
        elif stream.claim_min_idle_time is not None:
            role = f"reading, and claiming messages pending over {stream.claim_min_idle_time} ms"
        else:
            role = "reading new messages"
        return (
            f"Redis subscriber {self.source!r} (group {stream.group!r}, consumer "
            f"{stream.consumer!r}, {role})"
        )

    def refusal(self, consumer: str, peers: Sequence[Peer]) -> str | None:
        subscriber = self.subscriber
        if isinstance(subscriber, _ListHandlerMixin):
            return (
                "a Redis list cannot hand a message back: it is gone once popped, so a "
                "message whose transaction did not commit would be lost. Subscribe to a "
                "stream with a consumer group instead: stream=StreamSub(name, group=..., "
                "consumer=...) with a reclaiming subscriber"
            )
        if isinstance(subscriber, ChannelSubscriber):
            return (
                "Redis pub/sub delivers at most once and keeps nothing, so a message whose "
                "transaction did not commit would be lost. Subscribe to a stream with a "
                "consumer group instead: stream=StreamSub(name, group=..., consumer=...)"
            )
        if not isinstance(subscriber, _StreamHandlerMixin):
            return f"{type(subscriber).__name__} is not a Redis subscriber the inbox knows"
        stream = subscriber.stream_sub
        if not stream.group:
            return (
                f"the Redis stream {stream.name!r} is read without a consumer group: XREAD "
                "keeps no pending list, so nothing is ever redelivered. Pass group= and "
                "consumer= to StreamSub"
            )
        if stream.no_ack:
            return (
                f"the Redis stream {stream.name!r} is read with no_ack=True: messages are "
                "acknowledged on read. Remove no_ack"
            )
        if stream.min_idle_time is not None or stream.claim_min_idle_time is not None:
            return None
        if any(self._reclaims_for(peer, consumer) for peer in peers):
            return None
        return (
            f"nothing reclaims the pending messages of stream {stream.name!r}, group "
            f"{stream.group!r}: a message this consumer does not acknowledge (a crash, a "
            "failed transaction) would stay pending for ever. Add a reclaiming subscriber "
            "with the same handler and the same inbox.consumer(...): "
            f"StreamSub({stream.name!r}, group={stream.group!r}, "
            f"consumer={(stream.consumer or '') + '-reclaim'!r}, min_idle_time=30_000), "
            "or use claim_min_idle_time= (Redis 8.4 or newer)"
        )

    def _reclaims_for(self, peer: Peer, consumer: str) -> bool:
        other = peer.adapter.subscriber
        if not isinstance(other, _StreamHandlerMixin) or other is self.subscriber:
            return False
        mine, theirs = self.subscriber.stream_sub, other.stream_sub
        return (
            theirs.name == mine.name
            and theirs.group == mine.group
            and (theirs.min_idle_time is not None or theirs.claim_min_idle_time is not None)
            and peer.consumer == consumer
        )

    def declare_publisher(self, destination: str) -> None:
        self.broker.publisher(stream=destination)

    async def publish(self, destination: str, item: Item, headers: dict[str, Any]) -> None:
        # XADD to another stream. The inbox acks the original only after this returns.
        await self.broker.publish(item.body, stream=destination, headers=text_headers(headers))

    def items(self, message: Any) -> list[Item]:
        if not self.batch:
            return super().items(message)
        raw = message.raw_message
        parse = self.subscriber.parser.config.message_format.parse
        items = []
        for entry, entry_id in zip(raw["data"], raw["message_ids"], strict=True):
            data = (
                entry.get(_DATA)
                or json.dumps({k.decode(): v.decode() for k, v in entry.items()}).encode()
            )
            body, headers = parse(data)
            items.append(
                Item(
                    bytes(body),
                    headers,
                    self._stream_id(raw["channel"], entry_id),
                    headers.get("content-type"),
                )
            )
        return items

    def broker_id(self, raw: Any) -> tuple[str, str] | None:
        ids = raw.get("message_ids")
        if not ids:  # FastStream's TestRedisBroker delivers stream messages without an id
            return None
        return self._stream_id(raw["channel"], ids[0])

    @staticmethod
    def _stream_id(channel: str, entry_id: bytes) -> tuple[str, str]:
        # A stream entry id is unique in its stream and kept by every redelivery.
        return (f"redis-stream:{channel}", entry_id.decode())

    async def retry_later(self, message: Any, delay: float) -> None:
        # Left pending: the reclaiming subscriber takes it again once it has been idle for
        # its min_idle_time, which is this broker's retry delay.
        await message.nack()

    async def reject(self, message: Any, indexes: Sequence[int] | None = None) -> None:
        raise NotImplementedError("Redis has no dead-letter path; the inbox publishes one")
