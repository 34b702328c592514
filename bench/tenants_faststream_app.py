"""The FastStream app of `bench.tenants`: one subscriber on one shared RabbitMQ queue,
routed over the databases of a map file, each message applied (a ledger row) in its
tenant's database (``faststream run bench.tenants_faststream_app:app``).

BENCH_TENANTS_MAP        the database map file
BENCH_TENANTS_RABBITMQ   RabbitMQ's URL
BENCH_TENANTS_QUEUE      the queue
BENCH_TENANTS_PREFETCH   the subscriber's prefetch_count (16)
"""

from __future__ import annotations

import os

from faststream import FastStream
from faststream.rabbit import Channel, RabbitBroker, RabbitQueue
from sqlalchemy import text

from inbox_middleware import MapFile
from inbox_middleware.faststream import FastStreamInbox, InboxSession

ENV = os.environ

inbox = FastStreamInbox(
    router=MapFile(ENV["BENCH_TENANTS_MAP"]),
    pool_size=4,
    lock_timeout=5,
    retry_backoff=(0.2, 1.0),
    max_attempts=100_000,
    count_interval=None,
)
broker = RabbitBroker(ENV["BENCH_TENANTS_RABBITMQ"], middlewares=[inbox.middleware], logger=None)
app = FastStream(inbox.guard(broker))
bench = inbox.consumer("bench")


@broker.subscriber(
    RabbitQueue(ENV["BENCH_TENANTS_QUEUE"], durable=True),
    dependencies=[bench],
    channel=Channel(prefetch_count=int(ENV.get("BENCH_TENANTS_PREFETCH", "16"))),
)
async def apply(body: dict[str, object], session: InboxSession) -> None:
    await session.execute(
        text("INSERT INTO bench_ledger (message_id, tenant, sent_at) VALUES (:m, :t, :s)"),
        {"m": body["message_id"], "t": body["tenant"], "s": body["sent_at"]},
    )
