"""The explorer's view of each broker: preparing a run's source, publishing to it, what
is left in it, and what reached its quarantine and dead-letter destinations.

RabbitMQ is the explorer's own node (5673): queues of the run's own (random names,
deleted at the end), durable, with persistent messages, so that it may be restarted.
Redis is the explorer's own (6390, no persistence: never restarted, since a restart
would lose what it acknowledged, a documented limit rather than a finding). NATS is a
server each run starts itself, with JetStream on file storage, which the explorer
restarts too. Kafka is the machine's tansu (9092), which keeps its topics in memory:
topics of the run's own, deleted at the end, and never restarted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from . import infra
from .schedule import Intent
from .tenants import tenant_of

__all__ = ["Broker", "make_broker"]

logger = logging.getLogger(__name__)

PRODUCER = "explore"


REDIS_URL = "redis://127.0.0.1:6390/0"
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5673/%2F"
"""The explorer's own RabbitMQ node (`scripts/services explore-rabbitmq`), which it
restarts."""
KAFKA_SERVERS = "127.0.0.1:9092"

Found = list[dict[str, Any]]
"""Payloads found at a destination."""


def _persist(publish: Callable[[], Any], patience: float = 60) -> int:
    """Retry ``publish`` through an outage (a NATS restart); attempts that failed."""
    failures = 0
    deadline = time.monotonic() + patience
    while True:
        try:
            publish()
            return failures
        except Exception:
            failures += 1
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Broker:
    framework: str
    kind: str

    def __init__(self, source: str, url: str, quorum: bool = False) -> None:
        self.source, self.url, self.quorum = source, url, quorum
        self.tenants = False
        """Whether each intent is sent for its tenant (`tenant_of`): over a map."""

    def tenant(self, identity: str) -> dict[str, str]:
        """The identity's tenant argument, when the intents are sent for tenants."""
        return {"tenant": tenant_of(identity)} if self.tenants else {}

    def prepare(self) -> None: ...
    def open_producer(self) -> None: ...
    def close_producer(self) -> None: ...
    def publish(
        self, payload: dict[str, Any], identity: str | None, produced_at: datetime | None = None
    ) -> int:
        raise NotImplementedError

    def leftover(self) -> dict[str, int]:
        raise NotImplementedError

    def destinations(self) -> dict[str, Found]:
        """``{"quarantine": [...], "dead-letter": [...]}``."""
        raise NotImplementedError

    def remaining(self) -> Found | None:
        """The payloads still in the source once the workers stopped (taken out of it);
        None where the broker cannot say."""
        return None

    def cleanup(self) -> None: ...

    def worker_env(self) -> dict[str, str]:
        return {
            "EXPLORE_BROKER": self.kind,
            "EXPLORE_BROKER_URL": self.url,
            "EXPLORE_QUEUE": self.source,
            "EXPLORE_QUORUM": str(+self.quorum),
        }


# -- RabbitMQ (the explorer's own node) --------------------------------------------------------


def _pika() -> Any:
    import pika

    return pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))


def _rabbit_ready(queues: list[str]) -> dict[str, int]:
    """Ready messages of each queue (a missing queue: 0); unacknowledged ones are not
    counted while their consumer lives."""
    import pika.exceptions

    counts = {}
    connection = _pika()
    try:
        for queue in queues:
            channel = connection.channel()
            try:
                counts[queue] = channel.queue_declare(queue, passive=True).method.message_count
                channel.close()
            except pika.exceptions.ChannelClosedByBroker:
                counts[queue] = 0
    finally:
        connection.close()
    return counts


def _rabbit_drain(queue: str) -> list[tuple[bytes, dict[str, Any]]]:
    import pika.exceptions

    connection = _pika()
    found = []
    try:
        channel = connection.channel()
        while True:
            try:
                method, properties, body = channel.basic_get(queue, auto_ack=True)
            except pika.exceptions.ChannelClosedByBroker:
                return found  # never declared: nothing reached it
            if method is None:
                return found
            found.append((body, dict(properties.headers or {})))
    finally:
        if connection.is_open:
            connection.close()


def _rabbit_delete(queues: list[str]) -> None:
    connection = _pika()
    try:
        channel = connection.channel()
        for queue in queues:
            channel.queue_delete(queue)
    finally:
        connection.close()


def _dramatiq_payloads(bodies: list[bytes]) -> Found:
    from dramatiq import Message

    return [dict(Message.decode(body).args[0]) for body in bodies]


class DramatiqBroker(Broker):
    framework = "dramatiq"

    def _broker(self) -> Any:
        raise NotImplementedError

    def open_producer(self) -> None:
        import dramatiq

        self.broker = self._broker()
        self.actor = dramatiq.actor(
            lambda payload: None, actor_name="explore", queue_name=self.source, broker=self.broker
        )

    def close_producer(self) -> None:
        self.broker.close()

    def publish(
        self, payload: dict[str, Any], identity: str | None, produced_at: datetime | None = None
    ) -> int:
        from inbox_middleware.dramatiq import identity as stamp

        options = (
            stamp(
                producer=PRODUCER,
                message_id=identity,
                produced_at=produced_at,
                **self.tenant(identity),
            )
            if identity
            else {}
        )
        return _persist(lambda: self.actor.send_with_options(args=(payload,), **options))


class DramatiqRabbitmq(DramatiqBroker):
    kind = "rabbitmq"

    def _broker(self) -> Any:
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        if self.quorum:  # the producer declares the queues too: as the workers do
            from inbox_middleware.dramatiq import QuorumRabbitmqBroker

            return QuorumRabbitmqBroker(
                url=self.url, confirm_delivery=True, delivery_limit=infra.QUORUM_DELIVERY_LIMIT
            )
        return RabbitmqBroker(url=self.url, confirm_delivery=True)

    def leftover(self) -> dict[str, int]:
        return _rabbit_ready([self.source, f"{self.source}.DQ"])

    def remaining(self) -> Found | None:
        queues = (self.source, f"{self.source}.DQ")
        return _dramatiq_payloads([b for q in queues for b, _ in _rabbit_drain(q)])

    def destinations(self) -> dict[str, Found]:
        return {
            "quarantine": _dramatiq_payloads(
                [b for b, _ in _rabbit_drain(f"{self.source}.quarantine")]
            ),
            "dead-letter": _dramatiq_payloads([b for b, _ in _rabbit_drain(f"{self.source}.XQ")]),
        }

    def cleanup(self) -> None:
        _rabbit_delete([self.source, *(f"{self.source}.{s}" for s in ("DQ", "XQ", "quarantine"))])


class DramatiqRedis(DramatiqBroker):
    kind = "redis"

    def _broker(self) -> Any:
        from dramatiq.brokers.redis import RedisBroker

        return RedisBroker(url=self.url, namespace=self.source)

    def _client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url)

    def leftover(self) -> dict[str, int]:
        # A message's data stays in "<queue>.msgs" until it is acknowledged.
        client = self._client()
        try:
            return {
                name: int(client.hlen(f"{self.source}:{name}.msgs"))
                for name in (self.source, f"{self.source}.DQ")
            }
        finally:
            client.close()

    def remaining(self) -> Found | None:
        client = self._client()
        try:
            bodies = [
                body
                for name in (self.source, f"{self.source}.DQ")
                for body in client.hvals(f"{self.source}:{name}.msgs")
            ]
        finally:
            client.close()
        return _dramatiq_payloads(bodies)

    def destinations(self) -> dict[str, Found]:
        client = self._client()
        try:
            quarantine = client.hvals(f"{self.source}:{self.source}.quarantine.msgs")
            dead = client.hvals(f"{self.source}:{self.source}.XQ.msgs")
        finally:
            client.close()
        return {
            "quarantine": _dramatiq_payloads(quarantine),
            "dead-letter": _dramatiq_payloads(dead),
        }

    def cleanup(self) -> None:
        client = self._client()
        try:
            keys = list(client.scan_iter(match=f"{self.source}*", count=1000))
            if keys:
                client.delete(*keys)
        finally:
            client.close()


# -- FastStream ------------------------------------------------------------------------------


class FastStreamBroker(Broker):
    framework = "faststream"

    def prepare(self) -> None:
        asyncio.run(self._prepare())

    async def _prepare(self) -> None: ...

    def _publishing_broker(self) -> Any:
        raise NotImplementedError

    async def _publish(self, body: Any, headers: dict[str, str]) -> None:
        raise NotImplementedError

    def open_producer(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.broker = self._publishing_broker()
        self.loop.run_until_complete(self.broker.connect())

    def close_producer(self) -> None:
        try:
            self.loop.run_until_complete(self.broker.stop())
        except OSError as exc:
            # Every send was confirmed before (JetStream's ack, RabbitMQ's confirm): a
            # connection a broker restart reset can fail its own closing (nats-py's drain
            # flushes on it: ConnectionResetError), which loses nothing.
            logger.info("the producer's connection failed as it closed: %r", exc)
        finally:
            # A closing that failed leaves the client's tasks (nats-py's reconnect) on the
            # loop: ended here, with their sockets, not destroyed pending with the loop
            # (whose garbage a later test would report as its own unraisable exceptions).
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                ended = asyncio.gather(*pending, return_exceptions=True)
                self.loop.run_until_complete(ended)
            self.loop.close()

    def publish(
        self, payload: dict[str, Any], identity: str | None, produced_at: datetime | None = None
    ) -> int:
        from inbox_middleware.faststream import identity_headers

        headers = (
            identity_headers(
                producer=PRODUCER,
                message_id=identity,
                produced_at=produced_at,
                **self.tenant(identity),
            )
            if identity
            else {}
        )

        def once() -> None:
            self.loop.run_until_complete(asyncio.wait_for(self._publish(payload, headers), 10))

        return _persist(once)


def _json_payloads(bodies: list[bytes]) -> Found:
    found = []
    for body in bodies:
        value = json.loads(body)
        found.append(value if isinstance(value, dict) else {"unreadable": repr(body[:80])})
    return found


class FastStreamRabbitmq(FastStreamBroker):
    kind = "rabbitmq"

    async def _prepare(self) -> None:
        import aio_pika

        connection = await aio_pika.connect(self.url)
        async with connection:
            channel = await connection.channel()
            arguments = None
            if self.quorum:  # as the workers' subscriber declares it
                arguments = {
                    "x-queue-type": "quorum",
                    "x-delivery-limit": infra.QUORUM_DELIVERY_LIMIT,
                }
            await channel.declare_queue(self.source, durable=True, arguments=arguments)

    def _publishing_broker(self) -> Any:
        from faststream.rabbit import RabbitBroker

        return RabbitBroker(self.url)

    async def _publish(self, body: Any, headers: dict[str, str]) -> None:
        await self.broker.publish(body, self.source, headers=headers, persist=True, mandatory=True)

    def leftover(self) -> dict[str, int]:
        return _rabbit_ready([self.source])

    def remaining(self) -> Found | None:
        return _json_payloads([b for b, _ in _rabbit_drain(self.source)])

    def destinations(self) -> dict[str, Found]:
        return {
            name: _json_payloads([b for b, _ in _rabbit_drain(f"{self.source}.{name}")])
            for name in ("quarantine", "dead-letter")
        }

    def cleanup(self) -> None:
        _rabbit_delete([self.source, f"{self.source}.quarantine", f"{self.source}.dead-letter"])


class FastStreamRedis(FastStreamBroker):
    kind = "redis"
    group = "explore"

    def _client(self) -> Any:
        from redis.asyncio import Redis

        return Redis.from_url(self.url)

    async def _prepare(self) -> None:
        client = self._client()
        try:
            await client.xgroup_create(self.source, self.group, id="0", mkstream=True)
        finally:
            await client.aclose()

    def _publishing_broker(self) -> Any:
        from faststream.redis import RedisBroker

        return RedisBroker(self.url)

    async def _publish(self, body: Any, headers: dict[str, str]) -> None:
        await self.broker.publish(body, stream=self.source, headers=headers)

    def leftover(self) -> dict[str, int]:
        async def count() -> int:
            client = self._client()
            try:
                groups = await client.xinfo_groups(self.source)
            finally:
                await client.aclose()
            group = next(g for g in groups if g["name"] in (self.group, self.group.encode()))
            return int(group["pending"]) + int(group.get("lag") or 0)

        return {self.source: asyncio.run(count())}

    def destinations(self) -> dict[str, Found]:
        from faststream.redis.parser import BinaryMessageFormatV1

        async def read(name: str) -> Found:
            client = self._client()
            try:
                entries = await client.xrange(f"{self.source}.{name}")
            finally:
                await client.aclose()
            bodies = [BinaryMessageFormatV1.parse(data[b"__data__"])[0] for _, data in entries]
            return _json_payloads(bodies)

        return {name: asyncio.run(read(name)) for name in ("quarantine", "dead-letter")}

    def cleanup(self) -> None:
        import redis

        client = redis.Redis.from_url(self.url)
        try:
            keys = list(client.scan_iter(match=f"{self.source}*", count=1000))
            if keys:
                client.delete(*keys)
        finally:
            client.close()


class FastStreamNats(FastStreamBroker):
    kind = "nats"

    @property
    def stream(self) -> str:
        return self.source.upper()

    async def _prepare(self) -> None:
        import nats

        client = await nats.connect(self.url)
        try:
            await client.jetstream().add_stream(name=self.stream, subjects=[self.source])
        finally:
            await client.close()

    def _publishing_broker(self) -> Any:
        from faststream.nats import NatsBroker

        return NatsBroker(self.url)

    async def _publish(self, body: Any, headers: dict[str, str]) -> None:
        # With stream=: JetStream acknowledges that it stored the message.
        await self.broker.publish(body, self.source, headers=headers, stream=self.stream)

    def leftover(self) -> dict[str, int]:
        async def count() -> int:
            import nats
            from nats.js.errors import NotFoundError

            client = await nats.connect(self.url)
            try:
                js = client.jetstream()
                try:
                    info = await js.consumer_info(self.stream, f"d{self.source}")
                except NotFoundError:
                    return int((await js.stream_info(self.stream)).state.messages)
            finally:
                await client.close()
            return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

        return {self.source: asyncio.run(count())}

    def destinations(self) -> dict[str, Found]:
        async def read() -> dict[str, Found]:
            import nats
            from nats.js.errors import NotFoundError

            client = await nats.connect(self.url)
            found: dict[str, Found] = {}
            try:
                js = client.jetstream()
                for name in ("quarantine", "dead-letter"):
                    subject = f"{self.source}.{name}"
                    bodies: list[bytes] = []
                    try:
                        stream = await js.find_stream_name_by_subject(subject)
                    except NotFoundError:
                        found[name] = []
                        continue
                    info = await js.stream_info(stream)
                    for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
                        try:
                            message = await js.get_msg(stream, seq)
                        except NotFoundError:
                            continue
                        if message.subject == subject:
                            bodies.append(message.data or b"")
                    found[name] = _json_payloads(bodies)
            finally:
                await client.close()
            return found

        return asyncio.run(read())


class FastStreamKafka(FastStreamBroker):
    """The machine's tansu: memory only, so never restarted; topics of the run's own
    (its destinations created beforehand, with the source's partitions, as the docs let a
    user do), deleted at the end. What the group has not committed is left over; the
    records themselves cannot be named without reading the whole topic, so `remaining`
    says nothing (``lost-or-left``)."""

    kind = "kafka"

    @property
    def group(self) -> str:
        return f"g{self.source}"

    def _names(self) -> list[str]:
        return [self.source, f"{self.source}.quarantine", f"{self.source}.dead-letter"]

    async def _prepare(self) -> None:
        from ..support import kafka

        for name in self._names():
            await kafka.create_topic(name, infra.KAFKA_PARTITIONS)

    def _publishing_broker(self) -> Any:
        from faststream.kafka import KafkaBroker

        return KafkaBroker(self.url)

    async def _publish(self, body: Any, headers: dict[str, str]) -> None:
        # Returns once the broker has the record.
        await self.broker.publish(body, self.source, headers=headers)

    def leftover(self) -> dict[str, int]:
        from ..support import kafka

        return {self.source: asyncio.run(kafka.uncommitted(self.group, self.source))}

    def destinations(self) -> dict[str, Found]:
        from ..support import kafka

        async def read(name: str) -> Found:
            return _json_payloads([body for body, _ in await kafka.read(f"{self.source}.{name}")])

        return {name: asyncio.run(read(name)) for name in ("quarantine", "dead-letter")}

    def cleanup(self) -> None:
        from ..support import kafka

        asyncio.run(kafka.delete_topics(self._names()))


KINDS: dict[str, type[Broker]] = {
    "dramatiq-rabbitmq": DramatiqRabbitmq,
    "dramatiq-redis": DramatiqRedis,
    "faststream-rabbitmq": FastStreamRabbitmq,
    "faststream-redis": FastStreamRedis,
    "faststream-nats": FastStreamNats,
    "faststream-kafka": FastStreamKafka,
}


def make_broker(target: str, source: str, url: str, quorum: bool = False) -> Broker:
    return KINDS[target](source, url, quorum)


def payload_key(payload: dict[str, Any]) -> str | None:
    return payload.get("key") if isinstance(payload.get("key"), str) else None


__all__ += ["Intent", "payload_key"]
