"""The benchmark's FastStream app: one async handler, one account update.

    BENCH_MODE=inbox faststream run bench.faststream_worker:app

Modes on RabbitMQ (queue BENCH_QUEUE, prefetch BENCH_PREFETCH):
  bare     the update in a transaction, no deduplication
  inbox    this library
  floor    the least the guarantee adds to bare, written out in one handler: the identity
           from the headers and the payload hashed as the inbox reads them, the claim sent
           with BEGIN in one round trip, the update (awaited on the AsyncSession, as a
           handler awaits it) when first seen, the checked COMMIT; no core, no settlement,
           no metrics, no logs, no traces (`bench.floor`)
  floor_sync  the same, the whole transaction in one run_sync (the update too, which no
           async handler is written to do)
  inbox_result  this library, the handler's result published to BENCH_QUEUE.out: stored
           with the claim, published, then acked (what a duplicate publishes again)
  bare_result   no deduplication, the result published to BENCH_QUEUE.out by FastStream
  empty    the framework's ceiling: a handler that does nothing
Modes on NATS JetStream (subject BENCH_QUEUE, pull consumer):
  nats_inbox   the inbox, one message per call
  nats_batch   the inbox on a batch subscriber: one claim statement, one update and
               one commit per batch of BENCH_BATCH messages
"""

from __future__ import annotations

import os
from typing import Any

from faststream import FastStream
from sqlalchemy import text
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from bench.common import NATS, RABBITMQ, sqlalchemy_url
from bench.faststream_bench import WORKER_APPLICATION
from bench.floor import Floor
from inbox_middleware._core.protocol import Delivery
from inbox_middleware.faststream import FastStreamInbox, InboxSession
from inbox_middleware.faststream._payload import delivery as read_delivery
from inbox_middleware.faststream._payload import headers_identity

MODE = os.environ.get("BENCH_MODE", "inbox")
QUEUE = os.environ.get("BENCH_QUEUE", "bench")
PREFETCH = int(os.environ.get("BENCH_PREFETCH", "16"))
BATCH = int(os.environ.get("BENCH_BATCH", "50"))
UPDATE = text("UPDATE bench_accounts SET balance = balance + 1 WHERE id = :account")
# A batch handler writes its batch in one statement, as a batch subscriber is for; several
# messages may credit the same account, so each account gets its count.
MANY = text(
    "UPDATE bench_accounts AS a SET balance = a.balance + c.n FROM "
    "(SELECT id, count(*) AS n FROM unnest(CAST(:accounts AS integer[])) AS id GROUP BY id) AS c "
    "WHERE a.id = c.id"
)


def _delivery(message: Any) -> Delivery:
    """The floor's delivery, read from the message as the inbox's FastStream adapter reads
    it."""
    return read_delivery(
        consumer="bench",
        identity=headers_identity(message.headers),
        body=message.body,
        headers=message.headers,
        handler_version="",
        source=QUEUE,
        canonical=None,
        content_type=message.content_type,
    )


engine = create_async_engine(
    sqlalchemy_url("asyncpg"),
    pool_size=PREFETCH + 2,
    # named for the benchmark, which reads the server's CPU of these connections
    connect_args={"server_settings": {"application_name": WORKER_APPLICATION + MODE}},
)
inbox = FastStreamInbox(engine)
middlewares = [inbox.middleware] if "inbox" in MODE or "batch" in MODE else []

if MODE.startswith("nats"):
    from faststream.nats import JStream, NatsBroker, PullSub

    broker: Any = NatsBroker(NATS, middlewares=middlewares)
    stream = JStream(QUEUE.upper(), subjects=[QUEUE])
    batched = MODE == "nats_batch"
    subscriber = broker.subscriber(
        QUEUE,
        stream=stream,
        durable=f"d{QUEUE}",
        pull_sub=PullSub(batch_size=BATCH if batched else PREFETCH, batch=batched, timeout=0.2),
        dependencies=[inbox.consumer("bench")],
        max_workers=1 if batched else PREFETCH,
    )
    if batched:

        @subscriber
        async def handle_batch(bodies: list[dict[str, Any]], session: InboxSession) -> None:
            # The first-seen messages of the batch only: the inbox leaves duplicates out.
            await session.execute(MANY, {"accounts": [body["account"] for body in bodies]})

    else:

        @subscriber
        async def handle_one(body: dict[str, Any], session: InboxSession) -> None:
            await session.execute(UPDATE, {"account": body["account"]})

else:
    from faststream.rabbit import Channel, RabbitBroker, RabbitQueue

    broker = RabbitBroker(
        RABBITMQ, middlewares=middlewares, default_channel=Channel(prefetch_count=PREFETCH)
    )
    queue = RabbitQueue(QUEUE, durable=True)
    if MODE == "inbox":

        @broker.subscriber(queue, dependencies=[inbox.consumer("bench")])
        async def handle(body: dict[str, Any], session: InboxSession) -> None:
            await session.execute(UPDATE, {"account": body["account"]})

    elif MODE == "inbox_result":
        results = RabbitQueue(f"{QUEUE}.out", durable=True)

        @broker.publisher(results, persist=True)
        @broker.subscriber(queue, dependencies=[inbox.consumer("bench")])
        async def handle_result(body: dict[str, Any], session: InboxSession) -> dict[str, Any]:
            await session.execute(UPDATE, {"account": body["account"]})
            return {"credited": body["account"]}

    elif MODE == "bare_result":
        results = RabbitQueue(f"{QUEUE}.out", durable=True)
        result_sessions = async_sessionmaker(engine, expire_on_commit=False)

        @broker.publisher(results, persist=True)
        @broker.subscriber(queue)
        async def handle_bare_result(body: dict[str, Any]) -> dict[str, Any]:
            async with result_sessions() as session, session.begin():
                await session.execute(UPDATE, {"account": body["account"]})
            return {"credited": body["account"]}

    elif MODE in ("floor", "floor_sync"):
        floor_sessions = async_sessionmaker(engine, expire_on_commit=False)
        floor = Floor(engine.dialect)

        @broker.subscriber(queue)
        async def handle_floor(body: dict[str, Any]) -> None:
            # The message read from the context as the inbox's middleware reads it (a
            # `Context()` parameter would cost a worker thread's round trip a message).
            delivery = _delivery(broker.context.get_local("message"))
            account = {"account": body["account"]}

            async def update(session: Any) -> None:
                await session.execute(UPDATE, account)

            async with floor_sessions() as session:
                if MODE == "floor":  # the update awaited, as a handler awaits it
                    await floor.run_async(session, delivery, update)
                else:  # the whole transaction in one run_sync
                    await session.run_sync(
                        floor.run, delivery, lambda sync: sync.execute(UPDATE, account)
                    )

    elif MODE == "bare":
        sessions = async_sessionmaker(engine, expire_on_commit=False)

        @broker.subscriber(queue)
        async def handle_bare(body: dict[str, Any]) -> None:
            # What a handler without the inbox does: its own session and transaction.
            async with sessions() as session, session.begin():
                await session.execute(UPDATE, {"account": body["account"]})

    else:

        @broker.subscriber(queue)
        async def handle_empty(body: dict[str, Any]) -> None:
            return None


app = FastStream(inbox.guard(broker) if middlewares else broker)
app.after_shutdown(engine.dispose)
