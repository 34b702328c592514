"""The explorer's FastStream worker: ``faststream run tests.explore.app_faststream:app``.

Configured by environment variables (set by `tests.explore.run`): EXPLORE_DATABASE_URL
(SQLAlchemy, asyncpg), EXPLORE_BROKER ("rabbitmq", "redis" or "nats"), EXPLORE_BROKER_URL,
EXPLORE_QUEUE (the queue, stream or subject; NATS: stream = its upper-case name, durable
consumer "d" + the subject), EXPLORE_CONCURRENCY (RabbitMQ: prefetch, unless
EXPLORE_PREFETCH says otherwise, 0 for no limit; Redis streams and NATS: ``max_workers``),
EXPLORE_GUARD ("on"/"off"), EXPLORE_ACK_POLICY ("default" or "nack_on_error"),
EXPLORE_MISSING_IDENTITY, EXPLORE_MAX_ATTEMPTS and
EXPLORE_REDELIVERY_LIMIT ("" for None), EXPLORE_WORKER (the worker's name).
Only the library's public API is used, so that it runs on older commits unchanged.
"""

from __future__ import annotations

import os
from typing import Any

from faststream import FastStream
from sqlalchemy.ext.asyncio import create_async_engine

from inbox_middleware.faststream import FastStreamInbox, InboxSession

from . import domain, infra

ENV = os.environ
SOURCE = ENV["EXPLORE_QUEUE"]
WORKER = f"{ENV.get('EXPLORE_WORKER', 'w')}-{os.getpid()}"
CONCURRENCY = int(ENV.get("EXPLORE_CONCURRENCY", "4"))


def _limit(name: str) -> int | None:
    value = ENV.get(name, "")
    return int(value) if value else None


def _broker(middlewares: list[Any]) -> Any:
    kind, url = ENV["EXPLORE_BROKER"], ENV["EXPLORE_BROKER_URL"]
    if (other := infra.faststream_broker(kind, url, middlewares)) is not None:
        return other
    if kind == "rabbitmq":
        from faststream.rabbit import Channel, RabbitBroker

        prefetch = int(ENV.get("EXPLORE_PREFETCH", str(CONCURRENCY)))
        if not prefetch:  # FastStream's default channel: no prefetch limit
            return RabbitBroker(url, middlewares=middlewares)
        return RabbitBroker(
            url, middlewares=middlewares, default_channel=Channel(prefetch_count=prefetch)
        )
    if kind == "redis":
        from faststream.redis import RedisBroker

        return RedisBroker(url, middlewares=middlewares)
    from faststream.nats import NatsBroker

    return NatsBroker(url, middlewares=middlewares)


engine = create_async_engine(
    ENV["EXPLORE_DATABASE_URL"],
    pool_size=2 * CONCURRENCY + 2,
    max_overflow=0,
    pool_pre_ping=True,
    connect_args={
        "server_settings": {"application_name": f"explore-{WORKER}"},
        **infra.connect_args("asyncpg"),
    },
)
inbox = FastStreamInbox(
    engine,
    lock_timeout=5,
    retry_backoff=(0.1, 1.0),
    missing_identity=ENV.get("EXPLORE_MISSING_IDENTITY", "reject"),
    max_attempts=_limit("EXPLORE_MAX_ATTEMPTS"),
    redelivery_limit=_limit("EXPLORE_REDELIVERY_LIMIT"),
    **infra.inbox_settings(),
)
broker = _broker([inbox.middleware])
app = FastStream(inbox.guard(broker) if ENV.get("EXPLORE_GUARD", "on") == "on" else broker)
app.after_shutdown(engine.dispose)

options: dict[str, Any] = {"dependencies": [inbox.consumer("explore")]}
if ENV.get("EXPLORE_ACK_POLICY", "default") == "nack_on_error":
    from faststream import AckPolicy

    options["ack_policy"] = AckPolicy.NACK_ON_ERROR


async def explore(body: dict[str, Any], session: InboxSession) -> None:
    await domain.apply_async(session, body, engine)


if infra.faststream_subscribe(broker, ENV["EXPLORE_BROKER"], SOURCE, CONCURRENCY, options, explore):
    pass  # quorum queues, Kafka: tests.explore.infra
elif ENV["EXPLORE_BROKER"] == "rabbitmq":
    from faststream.rabbit import RabbitQueue

    broker.subscriber(RabbitQueue(SOURCE, durable=True), **options)(explore)
elif ENV["EXPLORE_BROKER"] == "redis":
    from faststream.redis import StreamSub

    reading = StreamSub(SOURCE, group="explore", consumer=WORKER)
    reclaiming = StreamSub(SOURCE, group="explore", consumer=f"{WORKER}-r", min_idle_time=3000)
    for stream in (reading, reclaiming):  # sharing the concurrency
        broker.subscriber(stream=stream, max_workers=max(1, CONCURRENCY // 2), **options)(explore)
else:
    from faststream.nats import ConsumerConfig, JStream, PullSub

    broker.subscriber(
        SOURCE,
        stream=JStream(SOURCE.upper(), subjects=[SOURCE]),
        durable=f"d{SOURCE}",
        pull_sub=PullSub(batch_size=CONCURRENCY, timeout=0.2),
        config=ConsumerConfig(ack_wait=3),
        max_workers=CONCURRENCY,
        **options,
    )(explore)
