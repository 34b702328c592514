"""The explorer's FastStream worker: ``faststream run tests.explore.app_faststream:app``.

Configured by environment variables (set by `tests.explore.run`): EXPLORE_DATABASE_URL
(SQLAlchemy, asyncpg), EXPLORE_BROKER ("rabbitmq", "redis", "nats" or "kafka"), EXPLORE_BROKER_URL,
EXPLORE_QUEUE (the queue, stream or subject; NATS: stream = its upper-case name, durable
consumer "d" + the subject), EXPLORE_CONCURRENCY (RabbitMQ: prefetch, unless
EXPLORE_PREFETCH says otherwise, 0 for no limit; Redis streams and NATS: ``max_workers``),
EXPLORE_GUARD ("on"/"off"), EXPLORE_ACK_POLICY ("default" or "nack_on_error"),
EXPLORE_MISSING_IDENTITY, EXPLORE_MAX_ATTEMPTS and
EXPLORE_REDELIVERY_LIMIT ("" for None), EXPLORE_WORKER (the worker's name); the
workload's axes: EXPLORE_BATCH ("on": a batch subscriber, Redis streams and NATS),
EXPLORE_OUTPUTS ("result": a publisher on the handler to ``<source>.out``, consumed by
an inbox subscriber downstream), EXPLORE_OUTBOX ("on": an outbox effect per intent),
EXPLORE_HANDLERS ("extended": the body is validated by a pydantic model, and the handler
has its message at hand).
Only the library's public API is used, so that it runs on older commits unchanged.
"""

from __future__ import annotations

import os
from typing import Any

from faststream import FastStream

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


engine = infra.engine(CONCURRENCY, f"explore-{WORKER}", asynchronous=True)
inbox = FastStreamInbox(
    **infra.storage(engine, CONCURRENCY),
    lock_timeout=5,
    claims="compact" if ENV.get("EXPLORE_CLAIMS", "library") != "library" else "library",
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


BATCH = ENV.get("EXPLORE_BATCH", "off") == "on"
OUTPUTS = ENV.get("EXPLORE_OUTPUTS", "none") == "result"
OUTBOX = ENV.get("EXPLORE_OUTBOX", "off") == "on"
EXTENDED = ENV.get("EXPLORE_HANDLERS", "basic") == "extended"
KIND = ENV["EXPLORE_BROKER"]


if BATCH:

    async def explore_batch(bodies: list[dict[str, Any]], session: InboxSession) -> None:
        for body in bodies:
            await domain.apply_async(
                session, body, engine, outbox_on=OUTBOX, effect_id=domain.batch_effect_id(body)
            )

    handler: Any = explore_batch
elif EXTENDED:
    from faststream import Context
    from pydantic import BaseModel, field_validator

    class Body(BaseModel):
        key: str
        do: str
        n: int

        @field_validator("do")
        @classmethod
        def _refuse_invalid(cls, value: str) -> str:
            if value == "invalid":
                raise ValueError("an invalid body, refused by validation")
            return value

    MESSAGE = Context("message")

    async def explore_validated(
        body: Body, session: InboxSession, message: Any = MESSAGE
    ) -> dict[str, Any]:
        return await domain.apply_async(
            session, body.model_dump(), engine, outbox_on=OUTBOX, message=message
        )

    handler = explore_validated
else:

    async def explore(body: dict[str, Any], session: InboxSession) -> dict[str, Any]:
        return await domain.apply_async(session, body, engine, outbox_on=OUTBOX)

    handler = explore


async def explore_downstream(output: dict[str, Any], session: InboxSession) -> None:
    await domain.downstream_async(session, output, "publisher")


OUT = f"{SOURCE}.out"
down: dict[str, Any] = {"dependencies": [inbox.consumer("explore_downstream")]}
if KIND == "rabbitmq" and OUTPUTS:  # the publisher whichever queue type the source has
    from faststream.rabbit import RabbitQueue

    handler = broker.publisher(RabbitQueue(OUT, durable=True), persist=True)(handler)
    broker.subscriber(RabbitQueue(OUT, durable=True), **down)(explore_downstream)
# Quorum queues and Kafka: tests.explore.infra (Kafka has no outputs nor batches: `space.valid`)
if infra.faststream_subscribe(broker, KIND, SOURCE, CONCURRENCY, options, handler):
    pass
elif KIND == "rabbitmq":
    from faststream.rabbit import RabbitQueue

    broker.subscriber(RabbitQueue(SOURCE, durable=True), **options)(handler)
elif KIND == "redis":
    from faststream.redis import StreamSub

    if OUTPUTS:
        handler = broker.publisher(stream=OUT)(handler)
        for stream in (
            StreamSub(OUT, group="down", consumer=WORKER),
            StreamSub(OUT, group="down", consumer=f"{WORKER}-r", min_idle_time=3000),
        ):
            broker.subscriber(stream=stream, **down)(explore_downstream)
    reading = StreamSub(SOURCE, group="explore", consumer=WORKER, batch=BATCH)
    reclaiming = StreamSub(
        SOURCE, group="explore", consumer=f"{WORKER}-r", min_idle_time=3000, batch=BATCH
    )
    for stream in (reading, reclaiming):  # sharing the concurrency
        broker.subscriber(stream=stream, max_workers=max(1, CONCURRENCY // 2), **options)(handler)
else:
    from faststream.nats import ConsumerConfig, JStream, PullSub

    if OUTPUTS:
        out_stream = JStream(f"{SOURCE.upper()}_OUT", subjects=[OUT])
        handler = broker.publisher(OUT, stream=out_stream)(handler)
        broker.subscriber(
            OUT,
            stream=out_stream,
            durable=f"d{SOURCE}out",
            pull_sub=PullSub(batch_size=CONCURRENCY, timeout=0.2),
            config=ConsumerConfig(ack_wait=3),
            **down,
        )(explore_downstream)
    broker.subscriber(
        SOURCE,
        stream=JStream(SOURCE.upper(), subjects=[SOURCE]),
        durable=f"d{SOURCE}",
        pull_sub=PullSub(batch_size=CONCURRENCY, timeout=0.2, batch=BATCH),
        config=ConsumerConfig(ack_wait=3),
        # FastStream ignores a PullSub's batch with max_workers (it warns): one at a time
        max_workers=1 if BATCH else CONCURRENCY,
        **options,
    )(handler)
