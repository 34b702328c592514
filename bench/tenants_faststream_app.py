"""The FastStream app of `bench.tenants`: one subscriber on one shared RabbitMQ queue,
routed over the databases of a map file, each message applied (a ledger row) in its
tenant's database (``faststream run bench.tenants_faststream_app:app``).

BENCH_TENANTS_MAP        the database map file
BENCH_TENANTS_RABBITMQ   RabbitMQ's URL
BENCH_TENANTS_QUEUE      the queue
BENCH_TENANTS_PREFETCH   the subscriber's prefetch_count (16)
BENCH_TENANTS_TRACE      "1": a line a second in the worker's log: the event loop's longest
                         lag, the messages handled, and the routing outcomes by database
"""

from __future__ import annotations

import asyncio
import collections
import os
import time

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
handled = [0]  # handler calls since the last trace line


@broker.subscriber(
    RabbitQueue(ENV["BENCH_TENANTS_QUEUE"], durable=True),
    dependencies=[bench],
    channel=Channel(prefetch_count=int(ENV.get("BENCH_TENANTS_PREFETCH", "16"))),
)
async def apply(body: dict[str, object], session: InboxSession) -> None:
    handled[0] += 1
    await session.execute(
        text("INSERT INTO bench_ledger (message_id, tenant, sent_at) VALUES (:m, :t, :s)"),
        {"m": body["message_id"], "t": body["tenant"], "s": body["sent_at"]},
    )


if ENV.get("BENCH_TENANTS_TRACE") == "1":
    from inbox_middleware._observe.instruments import metrics

    routes: collections.Counter[str] = collections.Counter()
    recorded = metrics.route

    def route(consumer: str, database: str, outcome: str) -> None:
        routes[f"{database}:{outcome}"] += 1
        recorded(consumer, database, outcome)

    metrics.route = route  # type: ignore[method-assign]

    async def trace() -> None:
        while True:
            began, lag = time.monotonic(), 0.0
            while time.monotonic() - began < 1.0:
                before = time.monotonic()
                await asyncio.sleep(0.01)
                lag = max(lag, time.monotonic() - before - 0.01)
            print(
                f"trace {time.time():.1f} lag_ms={lag * 1000:.0f} handled={handled[0]} "
                + " ".join(f"{k}={v}" for k, v in sorted(routes.items())),
                flush=True,
            )
            routes.clear()
            handled[0] = 0

    @app.after_startup
    async def start_trace() -> None:
        asyncio.get_running_loop().create_task(trace())
