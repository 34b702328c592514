"""What the chaos run needs from an adapter on a broker: worker processes, a producer
that survives a broker restart, the restart itself, and a look at the broker's queues.

RabbitMQ is the machine's server (restarted with ``rabbitmqctl``, its durable queues and
persistent messages kept). Redis is the machine's persistent one (``scripts/services``,
an append-only file fsynced on every write), SIGKILLed and started again; the run's keys
carry its source's name. NATS is a server the run owns, with JetStream on file storage
(`tests.support.servers`). Kafka is the machine's tansu, which keeps its topics in memory
only: it is never restarted (``restartable = False``), the rest of the chaos is the same.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from inbox_middleware._core.headers import MESSAGE_ID

from ..support import servers, services
from ..support.faststream_worker import FastStreamWorker
from ..support.workers import WorkerProcess
from .plan import Send

__all__ = ["ADAPTERS", "BROKERS", "Found", "Producer", "Target", "make_target"]

ADAPTERS = ("dramatiq", "faststream")
BROKERS = {
    "dramatiq": ("rabbitmq", "rabbitmq-quorum", "redis"),
    "faststream": ("rabbitmq", "rabbitmq-quorum", "redis", "nats", "kafka"),
}
QUORUM_DELIVERY_LIMIT = 20  # above the inbox's redelivery limit (10)
PRODUCER = "orders"
SEND_PATIENCE = 180.0  # seconds a producer keeps retrying one message through an outage

Found = list[tuple[str | None, dict[str, Any]]]
"""Messages found at a destination: (message id, payload) each; None: it had no identity."""


class Worker(Protocol):
    proc: Any

    def kill(self) -> None: ...
    def stop(self) -> None: ...
    def output(self) -> str: ...


class Producer(Protocol):
    def send(self, send: Send) -> int:
        """Publish until the broker confirms; how many attempts failed first."""

    def close(self) -> None: ...


def _persist(publish: Callable[[], Any], what: str) -> int:
    """Retry ``publish`` through a broker outage. A publish whose confirmation was lost may
    have arrived: sending it again is a duplicate, which is what the inbox is for."""
    failures = 0
    deadline = time.monotonic() + SEND_PATIENCE
    while True:
        try:
            publish()
            return failures
        except Exception as exc:
            failures += 1
            if time.monotonic() > deadline:
                raise AssertionError(f"could not publish {what} for {SEND_PATIENCE}s") from exc
            time.sleep(0.2)


class Target:
    adapter: str
    broker: str
    restartable = True
    """Whether the chaos restarts the broker (a broker that keeps nothing on disk is not)."""
    kill_every: tuple[float, float] | None = None
    """Seconds between SIGKILLs, when the broker needs longer than the run's default."""
    cut_search = 0.0
    """Seconds a round of cuts keeps looking for an open transaction (see
    `CuttingProxy.cut_mid_transaction`), for a run whose transactions are short and few."""
    restart_workers_after_broker_restart = False
    """Whether the workers are restarted (gracefully, one after the other) once the broker
    was restarted: what a broker client that strands messages in a live worker needs."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.source = f"chaos_{uuid.uuid4().hex[:10]}"

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start what the run owns."""

    def close(self) -> None:
        """Delete what the run created; stop what it owns."""

    @property
    def broker_url(self) -> str:
        raise NotImplementedError

    def restart_broker(self) -> float:
        raise NotImplementedError

    # -- processes ------------------------------------------------------------------------

    def worker(self, env: dict[str, str], log: Path) -> Worker:
        raise NotImplementedError

    def worker_env(self) -> dict[str, str]:
        return {}

    def producer(self) -> Producer:
        """Created and used on the producing thread."""
        raise NotImplementedError

    # -- the broker's view ----------------------------------------------------------------

    def leftover(self) -> dict[str, int]:
        """Messages of the run's queues not yet acknowledged (ready, delayed, unacked)."""
        raise NotImplementedError

    def destinations(self) -> tuple[Found, Found]:
        """What reached the quarantine and the dead-letter destinations."""
        raise NotImplementedError


class PersistentRedis(Target):
    """A target on the machine's persistent Redis: the run's keys start with its source's
    name and are deleted at the end; the chaos SIGKILLs that Redis and starts it again."""

    def start(self) -> None:
        services.require(services.REDIS_PERSISTENT, "The persistent Redis")
        super().start()

    def close(self) -> None:
        import redis

        client = redis.Redis.from_url(self.broker_url)
        try:
            keys = list(client.scan_iter(match=f"{self.source}*", count=1000))
            if keys:
                client.delete(*keys)
        finally:
            client.close()

    @property
    def broker_url(self) -> str:
        return services.REDIS_PERSISTENT

    def restart_broker(self) -> float:
        return servers.kill_persistent_redis()


class OwnedServer(Target):
    """A target whose broker is a server the run starts itself (``owned``), on a folder
    of its own: started before the target, stopped at the end, restarted by the chaos."""

    owned: type[servers._Owned]

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.server = self.owned(folder / self.broker)

    def start(self) -> None:
        self.server.start()
        super().start()

    def close(self) -> None:
        self.server.close()

    @property
    def broker_url(self) -> str:
        return self.server.url

    def restart_broker(self) -> float:
        return self.server.restart()


# -- Dramatiq ---------------------------------------------------------------------------


class DramatiqTarget(Target):
    adapter = "dramatiq"
    app = "tests.apps.chaos_dramatiq"

    def worker(self, env: dict[str, str], log: Path) -> Worker:
        return WorkerProcess(self.app, env, log, processes=1, threads=4)

    def worker_env(self) -> dict[str, str]:
        return {
            "CHAOS_BROKER": self.broker,
            "CHAOS_BROKER_URL": self.broker_url,
            "CHAOS_QUEUE": self.source,
            "CHAOS_NAMESPACE": self.source,
        }

    def _dramatiq_broker(self) -> Any:
        raise NotImplementedError

    def producer(self) -> Producer:
        return DramatiqProducer(self._dramatiq_broker(), self.source)


class DramatiqProducer:
    def __init__(self, broker: Any, queue: str) -> None:
        import dramatiq

        self.broker = broker
        # The producer needs the actor's name and queue only, not its code or the inbox.
        self.actor = dramatiq.actor(
            lambda account_id, delta: None, actor_name="credit", queue_name=queue, broker=broker
        )

    def send(self, send: Send) -> int:
        from inbox_middleware.dramatiq import identity

        options = identity(producer=PRODUCER, message_id=send.message_id)
        args = (send.intent.account, send.delta)
        return _persist(lambda: self.actor.send_with_options(args=args, **options), "a message")

    def close(self) -> None:
        self.broker.close()


def _dramatiq_found(bodies: list[bytes]) -> Found:
    from dramatiq import Message

    found = []
    for body in bodies:
        message = Message.decode(body)
        account, delta = message.args
        found.append(
            (message.options.get("inbox_message_id"), {"account": account, "delta": delta})
        )
    return found


class DramatiqRabbitmq(DramatiqTarget):
    broker = "rabbitmq"
    quorum = False

    def start(self) -> None:
        services.require(services.RABBITMQ, "RabbitMQ")

    @property
    def broker_url(self) -> str:
        return services.RABBITMQ

    def worker_env(self) -> dict[str, str]:
        return super().worker_env() | {
            "CHAOS_BROKER": "rabbitmq",
            "CHAOS_QUORUM": str(+self.quorum),
        }

    def _dramatiq_broker(self) -> Any:
        if self.quorum:
            from inbox_middleware.dramatiq._quorum import QuorumRabbitmqBroker

            return QuorumRabbitmqBroker(
                url=self.broker_url, confirm_delivery=True, delivery_limit=QUORUM_DELIVERY_LIMIT
            )
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=self.broker_url, confirm_delivery=True)

    def restart_broker(self) -> float:
        return servers.restart_rabbitmq()

    def leftover(self) -> dict[str, int]:
        counts = servers.rabbitmq_queue_counts()
        return {name: sum(counts.get(name, (0, 0))) for name in (self.source, f"{self.source}.DQ")}

    def destinations(self) -> tuple[Found, Found]:
        quarantine = _dramatiq_found(_rabbitmq_drain(f"{self.source}.quarantine"))
        dead = _dramatiq_found(_rabbitmq_drain(f"{self.source}.XQ"))
        return quarantine, dead

    def close(self) -> None:
        _rabbitmq_delete([self.source, *(f"{self.source}.{s}" for s in ("DQ", "XQ", "quarantine"))])


class DramatiqRabbitmqQuorum(DramatiqRabbitmq):
    """On quorum queues (`QuorumRabbitmqBroker`), the worker's and the producer's."""

    broker = "rabbitmq-quorum"
    quorum = True


def _rabbitmq_drain(queue: str) -> list[bytes]:
    """Take every message from ``queue`` (it must exist)."""
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(services.RABBITMQ))
    try:
        channel = connection.channel()
        bodies = []
        while True:
            method, properties, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                return bodies
            assert properties.delivery_mode == 2, f"a message in {queue} is not persistent"
            bodies.append(body)
    finally:
        connection.close()


def _rabbitmq_delete(queues: list[str]) -> None:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(services.RABBITMQ))
    try:
        channel = connection.channel()
        for queue in queues:
            channel.queue_delete(queue)
    finally:
        connection.close()


class DramatiqRedis(PersistentRedis, DramatiqTarget):
    """Dramatiq's Redis broker keeps each fetched message in its worker's acknowledgement
    set until the ack; only when that worker's heartbeat stops (the process gone) are the
    set's messages enqueued again. A Redis outage strands there the messages a consumer
    had fetched and not yet handed out (the consumer is replaced) and those whose ack
    failed, for as long as the worker runs: after a Redis restart the workers are
    restarted, as an operator must."""

    broker = "redis"
    restart_workers_after_broker_restart = True

    def _dramatiq_broker(self) -> Any:
        from dramatiq.brokers.redis import RedisBroker

        return RedisBroker(url=self.broker_url, namespace=self.source)

    def _client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.broker_url)

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

    def destinations(self) -> tuple[Found, Found]:
        client = self._client()
        try:
            quarantine = client.hvals(f"{self.source}:{self.source}.quarantine.msgs")
            dead = client.hvals(f"{self.source}:{self.source}.XQ.msgs")
        finally:
            client.close()
        return _dramatiq_found(quarantine), _dramatiq_found(dead)


# -- FastStream -------------------------------------------------------------------------


class FastStreamTarget(Target):
    adapter = "faststream"
    app = "tests.apps.chaos_faststream:app"

    def worker(self, env: dict[str, str], log: Path) -> Worker:
        return FastStreamWorker(self.app, env, log)

    def worker_env(self) -> dict[str, str]:
        return {
            "CHAOS_BROKER": self.broker,
            "CHAOS_BROKER_URL": self.broker_url,
            "CHAOS_QUEUE": self.source,
        }

    def producer(self) -> Producer:
        return FastStreamProducer(self)

    def start(self) -> None:
        asyncio.run(self.prepare())

    async def prepare(self) -> None:
        """Create the source, so that messages wait there before any worker runs."""

    def publishing_broker(self) -> Any:
        raise NotImplementedError

    async def publish(self, broker: Any, body: Any, headers: dict[str, str]) -> None:
        raise NotImplementedError

    def leftover(self) -> dict[str, int]:
        return {self.source: asyncio.run(self._leftover())}

    async def _leftover(self) -> int:
        raise NotImplementedError

    def destinations(self) -> tuple[Found, Found]:
        found = asyncio.run(self._read([f"{self.source}.quarantine", f"{self.source}.dead-letter"]))
        return found[0], found[1]

    async def _read(self, destinations: list[str]) -> list[Found]:
        raise NotImplementedError


def _faststream_found(messages: list[tuple[bytes, dict[str, Any]]]) -> Found:
    return [
        (None if headers.get(MESSAGE_ID) is None else str(headers[MESSAGE_ID]), _json(body))
        for body, headers in messages
    ]


class FastStreamProducer:
    """Publishes on an event loop of its own (the producing thread's)."""

    def __init__(self, target: FastStreamTarget) -> None:
        self.target = target
        self.loop = asyncio.new_event_loop()
        self.broker = target.publishing_broker()
        self.loop.run_until_complete(self.broker.connect())

    def send(self, send: Send) -> int:
        from inbox_middleware.faststream import identity_headers

        headers = identity_headers(producer=PRODUCER, message_id=send.message_id)
        body = {"account": send.intent.account, "delta": send.delta}

        def publish() -> None:
            coroutine = self.target.publish(self.broker, body, headers)
            self.loop.run_until_complete(asyncio.wait_for(coroutine, 15))

        return _persist(publish, "a message")

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.broker.stop())
        finally:
            self.loop.close()


class FastStreamRabbitmq(FastStreamTarget):
    broker = "rabbitmq"
    quorum = False

    @property
    def broker_url(self) -> str:
        return services.RABBITMQ

    async def prepare(self) -> None:
        services.require(services.RABBITMQ, "RabbitMQ")
        import aio_pika

        connection = await aio_pika.connect(self.broker_url)
        async with connection:
            channel = await connection.channel()
            arguments = None
            if self.quorum:  # as the worker's subscriber declares it
                arguments = {"x-queue-type": "quorum", "x-delivery-limit": QUORUM_DELIVERY_LIMIT}
            await channel.declare_queue(self.source, durable=True, arguments=arguments)

    def worker_env(self) -> dict[str, str]:
        return super().worker_env() | {
            "CHAOS_BROKER": "rabbitmq",
            "CHAOS_QUORUM": str(+self.quorum),
        }

    def publishing_broker(self) -> Any:
        from faststream.rabbit import RabbitBroker

        return RabbitBroker(self.broker_url)

    async def publish(self, broker: Any, body: Any, headers: dict[str, str]) -> None:
        # persist: kept on disk through the broker's restart; mandatory: unroutable fails
        await broker.publish(body, self.source, headers=headers, persist=True, mandatory=True)

    def restart_broker(self) -> float:
        return servers.restart_rabbitmq()

    def leftover(self) -> dict[str, int]:
        counts = servers.rabbitmq_queue_counts()
        return {self.source: sum(counts.get(self.source, (0, 0)))}

    def destinations(self) -> tuple[Found, Found]:
        found = []
        for name in (f"{self.source}.quarantine", f"{self.source}.dead-letter"):
            found.append(_faststream_found(_rabbitmq_drain_with_headers(name)))
        return found[0], found[1]

    def close(self) -> None:
        _rabbitmq_delete([self.source, f"{self.source}.quarantine", f"{self.source}.dead-letter"])


class FastStreamRabbitmqQuorum(FastStreamRabbitmq):
    """On a quorum queue with a delivery limit; the inbox's destinations quorum too."""

    broker = "rabbitmq-quorum"
    quorum = True


def _rabbitmq_drain_with_headers(queue: str) -> list[tuple[bytes, dict[str, Any]]]:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(services.RABBITMQ))
    try:
        channel = connection.channel()
        found = []
        while True:
            method, properties, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                return found
            assert properties.delivery_mode == 2, f"a message in {queue} is not persistent"
            found.append((body, dict(properties.headers or {})))
    finally:
        connection.close()


class FastStreamRedis(PersistentRedis, FastStreamTarget):
    broker = "redis"
    group = "ledger"

    def _client(self) -> Any:
        from redis.asyncio import Redis

        return Redis.from_url(self.broker_url)

    async def prepare(self) -> None:
        client = self._client()
        try:
            await client.xgroup_create(self.source, self.group, id="0", mkstream=True)
        finally:
            await client.aclose()

    def publishing_broker(self) -> Any:
        from faststream.redis import RedisBroker

        return RedisBroker(self.broker_url)

    async def publish(self, broker: Any, body: Any, headers: dict[str, str]) -> None:
        await broker.publish(body, stream=self.source, headers=headers)

    async def _leftover(self) -> int:
        client = self._client()
        try:
            groups = await client.xinfo_groups(self.source)
        finally:
            await client.aclose()
        group = next(g for g in groups if g["name"] in (self.group, self.group.encode()))
        return int(group["pending"]) + int(group.get("lag") or 0)

    async def _read(self, destinations: list[str]) -> list[Found]:
        from faststream.redis.parser import BinaryMessageFormatV1

        client = self._client()
        try:
            found = []
            for name in destinations:
                entries = await client.xrange(name)
                found.append(
                    _faststream_found(
                        [BinaryMessageFormatV1.parse(data[b"__data__"]) for _, data in entries]
                    )
                )
            return found
        finally:
            await client.aclose()


class FastStreamNats(OwnedServer, FastStreamTarget):
    broker = "nats"

    owned = servers.OwnedNats

    @property
    def stream(self) -> str:
        return self.source.upper()

    async def prepare(self) -> None:
        import nats

        client = await nats.connect(self.broker_url)
        try:
            await client.jetstream().add_stream(name=self.stream, subjects=[self.source])
        finally:
            await client.close()

    def publishing_broker(self) -> Any:
        from faststream.nats import NatsBroker

        return NatsBroker(self.broker_url)

    async def publish(self, broker: Any, body: Any, headers: dict[str, str]) -> None:
        # With stream=: JetStream acknowledges that it stored the message.
        await broker.publish(body, self.source, headers=headers, stream=self.stream)

    async def _leftover(self) -> int:
        import nats
        from nats.js.errors import NotFoundError

        client = await nats.connect(self.broker_url)
        try:
            js = client.jetstream()
            try:
                info = await js.consumer_info(self.stream, f"d{self.source}")
            except NotFoundError:
                return int((await js.stream_info(self.stream)).state.messages)
        finally:
            await client.close()
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def _read(self, destinations: list[str]) -> list[Found]:
        import nats
        from nats.js.errors import NotFoundError

        client = await nats.connect(self.broker_url)
        try:
            js = client.jetstream()
            found = []
            for subject in destinations:
                messages: list[tuple[bytes, dict[str, Any]]] = []
                try:
                    stream = await js.find_stream_name_by_subject(subject)
                except NotFoundError:
                    found.append([])
                    continue
                info = await js.stream_info(stream)
                # an empty stream reports sequence 0 first, which get_msg refuses
                for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
                    try:
                        message = await js.get_msg(stream, seq)
                    except NotFoundError:
                        continue
                    if message.subject == subject:
                        messages.append((message.data or b"", dict(message.headers or {})))
                found.append(_faststream_found(messages))
            return found
        finally:
            await client.close()


class FastStreamKafka(FastStreamTarget):
    """The machine's tansu (memory only, so never restarted). Every SIGKILL costs the
    group a rebalance once the dead member's session times out (3 s), so workers are
    killed less often than on the other brokers."""

    broker = "kafka"
    restartable = False
    kill_every = (3.0, 5.0)
    # Its CI run is 1,000 messages between rebalances: a single look found no transaction
    # open in any of 9 rounds once in a few runs.
    cut_search = 0.5
    partitions = 8

    @property
    def group(self) -> str:
        return f"g{self.source}"

    @property
    def broker_url(self) -> str:
        return services.KAFKA

    async def prepare(self) -> None:
        from ..support import kafka

        await kafka.create_topic(self.source, self.partitions)

    def publishing_broker(self) -> Any:
        from faststream.kafka import KafkaBroker

        return KafkaBroker(self.broker_url)

    async def publish(self, broker: Any, body: Any, headers: dict[str, str]) -> None:
        # send_and_wait: returns once the broker has the record.
        await broker.publish(body, self.source, headers=headers)

    async def _leftover(self) -> int:
        from ..support import kafka

        return await kafka.uncommitted(self.group, self.source)

    async def _read(self, destinations: list[str]) -> list[Found]:
        from ..support import kafka

        return [_faststream_found(list(await kafka.read(name))) for name in destinations]

    def close(self) -> None:
        from ..support import kafka

        suffixes = ("", ".quarantine", ".dead-letter")
        asyncio.run(kafka.delete_topics(f"{self.source}{suffix}" for suffix in suffixes))


TARGETS: dict[tuple[str, str], type[Target]] = {
    ("dramatiq", "rabbitmq"): DramatiqRabbitmq,
    ("dramatiq", "rabbitmq-quorum"): DramatiqRabbitmqQuorum,
    ("dramatiq", "redis"): DramatiqRedis,
    ("faststream", "rabbitmq"): FastStreamRabbitmq,
    ("faststream", "rabbitmq-quorum"): FastStreamRabbitmqQuorum,
    ("faststream", "redis"): FastStreamRedis,
    ("faststream", "nats"): FastStreamNats,
    ("faststream", "kafka"): FastStreamKafka,
}


def make_target(adapter: str, broker: str, folder: Path) -> Target:
    try:
        kind = TARGETS[adapter, broker]
    except KeyError:
        raise ValueError(f"no chaos target for {adapter} on {broker}") from None
    return kind(folder)


def _json(body: bytes) -> dict[str, Any]:
    value = json.loads(body)
    assert isinstance(value, dict)
    return value
