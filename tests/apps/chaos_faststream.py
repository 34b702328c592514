"""The chaos run's FastStream worker: ``faststream run tests.apps.chaos_faststream:app``.

Configured by environment variables:

CHAOS_DATABASE_URL   SQLAlchemy URL (asyncpg) of the run's database, through the proxy
CHAOS_BROKER         "rabbitmq", "redis", "nats" or "kafka";  CHAOS_BROKER_URL its URL
CHAOS_QUORUM         "1": the RabbitMQ queue is a quorum queue, delivery limit 20
CHAOS_QUEUE          the queue, stream, subject or topic (NATS: stream = its upper-case
                     name, durable consumer "d" + the subject; Kafka: group "g" + the topic)
CHAOS_STATS          folder for the statistics files (see `chaos_domain.Stats`)
CHAOS_WORKER         this worker's name (its Redis consumer and database sessions too)
CHAOS_CONCURRENCY    messages a worker handles at once (default 16)
CHAOS_GUARD          "0": start the broker without ``inbox.guard`` (default: with it)
CHAOS_RECLAIM_MS     Redis: idle milliseconds before a pending message is reclaimed
CHAOS_ACK_WAIT       NATS: seconds before JetStream redelivers an unacknowledged message
"""

from __future__ import annotations

import logging
import os
from typing import Any

from faststream import BaseMiddleware, FastStream
from faststream.exceptions import AckMessage

from inbox_middleware.faststream import FastStreamInbox, InboxSession

from ..support.engines import async_engine
from . import chaos_domain

ENV = os.environ
SOURCE = ENV["CHAOS_QUEUE"]
WORKER = ENV.get("CHAOS_WORKER", "w0")
CONCURRENCY = int(ENV.get("CHAOS_CONCURRENCY", "16"))
# Redis: a message pending this long (its worker died) is taken over
RECLAIM_MS = int(ENV.get("CHAOS_RECLAIM_MS", "3000"))
# NATS: seconds before JetStream redelivers an unacknowledged message
NATS_ACK_WAIT = float(ENV.get("CHAOS_ACK_WAIT", "5"))
KAFKA_CONSUMERS = 4  # Kafka: group members per worker (the topic has 8 partitions)
stats = chaos_domain.Stats(ENV["CHAOS_STATS"], WORKER)


class Outcomes(BaseMiddleware):
    """Outside the inbox: counts what happened to each delivery."""

    async def consume_scope(self, call_next: Any, msg: Any) -> Any:
        try:
            result = await call_next(msg)
        except AckMessage:
            stats.count("skipped")
            raise
        except BaseException as exc:
            # A handed-back message carries the inbox's reason as its cause.
            stats.count(type(exc.__cause__ or exc).__name__)
            raise
        stats.count("processed")
        return result


def _broker(middlewares: list[Any]) -> Any:
    kind, url = ENV["CHAOS_BROKER"], ENV["CHAOS_BROKER_URL"]
    if kind == "rabbitmq":
        from faststream.rabbit import Channel, RabbitBroker

        channel = Channel(prefetch_count=CONCURRENCY)
        return RabbitBroker(url, middlewares=middlewares, default_channel=channel)
    if kind == "redis":
        from faststream.redis import RedisBroker

        return RedisBroker(url, middlewares=middlewares)
    if kind == "kafka":
        from faststream.kafka import KafkaBroker

        return KafkaBroker(url, middlewares=middlewares)
    from faststream.nats import NatsBroker

    return NatsBroker(url, middlewares=middlewares)


# One line per skipped duplicate would dominate the log; conflicts still log a warning.
logging.getLogger("inbox_middleware").setLevel(logging.WARNING)
engine = async_engine(
    ENV["CHAOS_DATABASE_URL"],
    pool_size=CONCURRENCY + 2,  # a connection per message in hand, and failure records
    max_overflow=0,
    pool_pre_ping=True,
    connect_args={"server_settings": {"application_name": f"chaos-{WORKER}"}},
)
stats.engines.append(engine.sync_engine)
inbox = FastStreamInbox(engine, lock_timeout=10, retry_backoff=(0.1, 2.0))
broker = _broker([Outcomes, inbox.middleware])
app = FastStream(broker if ENV.get("CHAOS_GUARD") == "0" else inbox.guard(broker))
app.after_shutdown(engine.dispose)


@app.after_startup
async def write_statistics() -> None:
    stats.run_in_thread()


options: dict[str, Any] = {"dependencies": [inbox.consumer("ledger")]}


async def credit(body: dict[str, int], session: InboxSession) -> None:
    await chaos_domain.credit_async(session, body["account"], body["delta"])


if ENV["CHAOS_BROKER"] == "rabbitmq":
    from faststream.rabbit import QueueType, RabbitQueue

    if ENV.get("CHAOS_QUORUM") == "1":
        queue = RabbitQueue(
            SOURCE,
            durable=True,
            queue_type=QueueType.QUORUM,
            arguments={"x-delivery-limit": 20},
        )
    else:
        queue = RabbitQueue(SOURCE, durable=True)
    broker.subscriber(queue, **options)(credit)
elif ENV["CHAOS_BROKER"] == "redis":
    from faststream.redis import StreamSub

    reading = StreamSub(SOURCE, group="ledger", consumer=WORKER)
    reclaiming = StreamSub(
        SOURCE, group="ledger", consumer=f"{WORKER}-reclaim", min_idle_time=RECLAIM_MS
    )
    for stream in (reading, reclaiming):  # sharing the concurrency
        broker.subscriber(stream=stream, max_workers=CONCURRENCY // 2, **options)(credit)
elif ENV["CHAOS_BROKER"] == "kafka":
    from faststream import AckPolicy

    # One sequential consumer per worker slot, each in the group, each committing only
    # its own partitions; a short session so a killed worker's partitions move quickly.
    broker.subscriber(
        SOURCE,
        group_id=f"g{SOURCE}",
        ack_policy=AckPolicy.ACK,
        auto_offset_reset="earliest",
        session_timeout_ms=3000,
        heartbeat_interval_ms=300,
        max_workers=KAFKA_CONSUMERS,
        **options,
    )(credit)
else:
    from faststream.nats import ConsumerConfig, JStream, PullSub

    broker.subscriber(
        SOURCE,
        stream=JStream(SOURCE.upper(), subjects=[SOURCE]),
        durable=f"d{SOURCE}",
        pull_sub=PullSub(batch_size=CONCURRENCY, timeout=0.2),
        config=ConsumerConfig(ack_wait=NATS_ACK_WAIT),
        max_workers=CONCURRENCY,
        **options,
    )(credit)
