"""The four real brokers the FastStream adapter is tested on, behind one small interface.

Each test gets its own source (a RabbitMQ queue, a Redis stream, a NATS subject and
JetStream stream, a Kafka topic of two partitions read by its own consumer group),
declares its inbox subscriber the way that broker needs it (Redis: a reading subscriber
and a reclaiming one; Kafka: a committing ack policy), publishes, and reads what reached
the quarantine and dead-letter destinations straight from the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from faststream import BaseMiddleware

from . import kafka, services

KINDS = ("rabbit", "redis", "nats", "kafka")
RECLAIM_MS = 1000  # Redis: how long a message stays pending before it is reclaimed
NATS_ACK_WAIT = 3.0  # NATS: seconds before JetStream redelivers an unacknowledged message


@dataclass
class Seen:
    """What happened to each delivery, as a middleware outside the inbox saw it."""

    arrivals: list[float] = field(default_factory=list)
    outcomes: list[str] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes if o == outcome)


def recorder(seen: Seen) -> Callable[..., BaseMiddleware]:
    class Recorder(BaseMiddleware):
        async def consume_scope(self, call_next: Any, msg: Any) -> Any:
            seen.arrivals.append(time.monotonic())
            try:
                result = await call_next(msg)
            except BaseException as exc:
                seen.outcomes.append(type(exc).__name__)
                raise
            seen.outcomes.append("processed")
            return result

    return Recorder


class Harness:
    """One broker of ``kind`` with a fresh source; create it inside the test's loop."""

    def __init__(self, kind: str, middlewares: Sequence[Any]) -> None:
        self.kind = kind
        self.name = f"t{uuid.uuid4().hex[:10]}"
        self.stream = self.name.upper()  # NATS JetStream stream
        self.group = f"g{self.name}"  # Kafka consumer group
        self.partition: int | None = None  # Kafka: publish to this partition (None: any)
        if kind == "rabbit":
            from faststream.rabbit import RabbitBroker

            services.require(services.RABBITMQ, "RabbitMQ")
            self.broker: Any = RabbitBroker(services.RABBITMQ, middlewares=middlewares)
        elif kind == "redis":
            from faststream.redis import RedisBroker

            services.require(services.REDIS, "Redis")
            self.broker = RedisBroker(services.REDIS, middlewares=middlewares)
        elif kind == "kafka":
            from faststream.kafka import KafkaBroker

            services.require(services.KAFKA, "Kafka")
            self.broker = KafkaBroker(services.KAFKA, middlewares=middlewares)
        else:
            from faststream.nats import NatsBroker

            services.require(services.NATS, "NATS")
            self.broker = NatsBroker(services.NATS, middlewares=middlewares)

    @property
    def source(self) -> str:
        return self.name

    def subscribe(
        self,
        *dependencies: Any,
        batch: bool = False,
        max_workers: int | None = None,
        **options: Any,
    ) -> Callable[[Callable[..., Awaitable[Any]]], Any]:
        """Declare the inbox subscriber(s) for a handler, as this broker needs them."""
        deps = list(dependencies)
        extra = {"max_workers": max_workers} if max_workers else {}
        if self.kind == "rabbit":
            from faststream.rabbit import RabbitQueue

            assert not batch, "RabbitMQ has no batch subscriber"
            return self.broker.subscriber(
                RabbitQueue(self.name, durable=True), dependencies=deps, **options
            )
        if self.kind == "redis":
            from faststream.redis import StreamSub

            reading = self.broker.subscriber(
                stream=StreamSub(
                    self.name,
                    group="billing",
                    consumer="c1",
                    batch=batch,
                    max_records=10 if batch else None,
                ),
                dependencies=deps,
                **extra,
                **options,
            )
            reclaiming = self.broker.subscriber(
                stream=StreamSub(
                    self.name,
                    group="billing",
                    consumer="c1-reclaim",
                    min_idle_time=RECLAIM_MS,
                    batch=batch,
                ),
                dependencies=deps,
                **options,
            )

            def both(handler: Callable[..., Awaitable[Any]]) -> Any:
                return reclaiming(reading(handler))

            return both
        if self.kind == "kafka":
            from faststream import AckPolicy
            from faststream.kafka import Topic

            # ACK: the offset is committed after the inbox settled the message.
            settings = {"ack_policy": AckPolicy.ACK, **kafka.GROUP_OPTIONS} | options
            if batch:
                settings |= {"batch": True, "max_records": 10}
            return self.broker.subscriber(
                Topic(self.name, num_partitions=kafka.PARTITIONS),
                group_id=self.group,
                dependencies=deps,
                **extra,
                **settings,
            )
        from faststream.nats import ConsumerConfig, JStream, PullSub

        # Pull, with a durable consumer: what FastStream recommends for JetStream.
        return self.broker.subscriber(
            self.name,
            stream=JStream(self.stream, subjects=[self.name]),
            durable=f"d{self.name}",
            pull_sub=PullSub(batch_size=16, batch=batch, timeout=0.2),
            config=ConsumerConfig(ack_wait=NATS_ACK_WAIT),
            dependencies=deps,
            **extra,
            **options,
        )

    async def publish(self, body: Any, headers: dict[str, str] | None = None) -> None:
        if self.kind == "rabbit":
            await self.broker.publish(body, self.name, headers=headers, persist=True)
        elif self.kind == "redis":
            await self.broker.publish(body, stream=self.name, headers=headers)
        elif self.kind == "kafka":
            await self.broker.publish(body, self.name, headers=headers, partition=self.partition)
        else:
            await self.broker.publish(body, self.name, headers=headers, stream=self.stream)

    def publisher(self, destination: str) -> Any:
        """A publisher of this broker to ``destination`` (see `prepare_destination`)."""
        if self.kind == "rabbit":
            from faststream.rabbit import RabbitQueue

            return self.broker.publisher(RabbitQueue(destination, durable=True), persist=True)
        if self.kind == "redis":
            return self.broker.publisher(stream=destination)
        if self.kind == "kafka":
            return self.broker.publisher(destination)
        return self.broker.publisher(destination, stream=f"{self.stream}_OUT")

    async def prepare_destination(self, destination: str) -> None:
        """Create ``destination``, so that what is published there can be read back."""
        if self.kind == "rabbit":
            import aio_pika

            connection = await aio_pika.connect(services.RABBITMQ)
            async with connection:
                channel = await connection.channel()
                await channel.declare_queue(destination, durable=True)
        elif self.kind == "nats":
            import nats

            client = await nats.connect(services.NATS)
            try:
                await client.jetstream().add_stream(
                    name=f"{self.stream}_OUT", subjects=[destination]
                )
            finally:
                await client.close()

    async def request(self, body: Any, headers: dict[str, str]) -> Any:
        """Send ``body`` as a request to the source and wait for the reply."""
        if self.kind == "rabbit":
            return await self.broker.request(body, self.name, headers=headers, timeout=10)
        if self.kind == "nats":
            return await self.broker.request(
                body, self.name, headers=headers, stream=self.stream, timeout=10
            )
        raise AssertionError(f"no request-reply on {self.kind}")

    async def read(self, destination: str) -> list[tuple[bytes, dict[str, Any]]]:
        """Every message at ``destination`` (a quarantine or dead-letter one), oldest first.
        RabbitMQ: consumed by reading; call once, at the end of the test."""
        if self.kind == "rabbit":
            from faststream.rabbit import RabbitQueue

            queue = await self.broker.declare_queue(RabbitQueue(destination, durable=True))
            found = []
            while (message := await queue.get(no_ack=True, fail=False)) is not None:
                assert message.delivery_mode == 2, "destination messages must be persistent"
                found.append((message.body, dict(message.headers)))
            return found
        if self.kind == "redis":
            from faststream.redis.parser import BinaryMessageFormatV1

            entries = await self.broker._connection.xrange(destination)
            return [BinaryMessageFormatV1.parse(data[b"__data__"]) for _, data in entries]
        if self.kind == "kafka":
            return [(body, dict(headers)) for body, headers in await kafka.read(destination)]
        from nats.js.errors import BadRequestError, NotFoundError

        js = self.broker.config.connection_state.stream
        try:
            stream = await js.find_stream_name_by_subject(destination)
        except (NotFoundError, BadRequestError):  # no stream keeps that subject (yet)
            return []
        info = await js.stream_info(stream)
        found = []
        for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
            with contextlib.suppress(NotFoundError):
                message = await js.get_msg(stream, seq)
                if message.subject == destination:
                    found.append((message.data or b"", dict(message.headers or {})))
        return found

    async def read_at_least(
        self, destination: str, count: int, *, timeout: float = 15
    ) -> list[tuple[bytes, dict[str, Any]]]:
        """Wait until ``destination`` holds ``count`` messages, and return them all: a
        settlement records its row before it publishes, so a row can be seen first."""
        found: list[tuple[bytes, dict[str, Any]]] = []

        async def enough() -> bool:
            nonlocal found
            read = await self.read(destination)
            found = found + read if self.kind == "rabbit" else read  # RabbitMQ consumes
            return len(found) >= count

        await eventually(enough, timeout=timeout, what=f"{count} messages at {destination}")
        return found

    async def leftover(self) -> int:
        """Messages of the source not acknowledged (ready, pending or in flight), asked on a
        connection of its own. RabbitMQ: only accurate once the broker under test has
        stopped (its unacknowledged messages are then ready again)."""
        if self.kind == "rabbit":
            import aio_pika

            connection = await aio_pika.connect(services.RABBITMQ)
            async with connection:
                channel = await connection.channel()
                queue = await channel.declare_queue(self.name, passive=True)
                return int(queue.declaration_result.message_count or 0)
        if self.kind == "redis":
            from redis.asyncio import Redis

            client = Redis.from_url(services.REDIS)
            try:
                groups = await client.xinfo_groups(self.name)
            finally:
                await client.aclose()
            group = next(g for g in groups if g["name"] in (b"billing", "billing"))
            return int(group["pending"]) + int(group.get("lag") or 0)
        if self.kind == "kafka":
            return await kafka.uncommitted(self.group, self.name)
        import nats
        from nats.js.errors import NotFoundError

        client = await nats.connect(services.NATS)
        try:
            js = client.jetstream()
            try:
                info = await js.consumer_info(self.stream, f"d{self.name}")
            except NotFoundError:  # never subscribed: everything in the stream is left
                return int((await js.stream_info(self.stream)).state.messages)
        finally:
            await client.close()
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def prepare_source(self) -> None:
        """Create the source, so that a message can wait there before any subscriber runs."""
        if self.kind == "rabbit":
            import aio_pika

            connection = await aio_pika.connect(services.RABBITMQ)
            async with connection:
                channel = await connection.channel()
                await channel.declare_queue(self.name, durable=True)
        elif self.kind == "redis":
            from redis.asyncio import Redis

            client = Redis.from_url(services.REDIS)
            try:
                await client.xgroup_create(self.name, "billing", id="0", mkstream=True)
            finally:
                await client.aclose()
        elif self.kind == "kafka":
            await kafka.create_topic(self.name)
        else:
            import nats

            client = await nats.connect(services.NATS)
            try:
                await client.jetstream().add_stream(name=self.stream, subjects=[self.name])
            finally:
                await client.close()

    async def cleanup(self) -> None:
        """Delete what the test created, on connections of its own."""
        if self.kind == "rabbit":
            import aio_pika

            connection = await aio_pika.connect(services.RABBITMQ)
            async with connection:
                channel = await connection.channel()
                for suffix in ("", ".quarantine", ".dead-letter", ".out"):
                    await channel.queue_delete(f"{self.name}{suffix}")
        elif self.kind == "redis":
            from redis.asyncio import Redis

            client = Redis.from_url(services.REDIS)
            try:
                for key in await client.keys(f"{self.name}*"):
                    await client.delete(key)
            finally:
                await client.aclose()
        elif self.kind == "kafka":
            suffixes = ("", ".quarantine", ".dead-letter", ".out")
            await kafka.delete_topics(f"{self.name}{suffix}" for suffix in suffixes)
        else:
            import nats
            from nats.js.errors import NotFoundError

            client = await nats.connect(services.NATS)
            try:
                for stream in (self.stream, f"{self.stream}_inbox", f"{self.stream}_OUT"):
                    with contextlib.suppress(NotFoundError):
                        await client.jetstream().delete_stream(stream)
            finally:
                await client.close()


async def eventually(
    check: Callable[[], Awaitable[Any] | Any], *, timeout: float = 15, what: str = "condition"
) -> Any:
    """Poll ``check`` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)
