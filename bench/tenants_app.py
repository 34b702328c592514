"""The Dramatiq app of `bench.tenants`: one actor on one shared queue, routed over the
databases of a map file, each message applied (a ledger row) in its tenant's database.

BENCH_TENANTS_MAP        the database map file
BENCH_TENANTS_REDIS      Redis's URL;  BENCH_TENANTS_NAMESPACE its key namespace
BENCH_TENANTS_QUEUE      the queue
"""

from __future__ import annotations

import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from sqlalchemy import text

from inbox_middleware import MapFile
from inbox_middleware.dramatiq import InboxMiddleware, current_session

ENV = os.environ

broker = RedisBroker(
    url=ENV["BENCH_TENANTS_REDIS"],
    namespace=ENV["BENCH_TENANTS_NAMESPACE"],
    heartbeat_timeout=5000,
)
broker.add_middleware(
    InboxMiddleware(
        router=MapFile(ENV["BENCH_TENANTS_MAP"]), pool_size=4, lock_timeout=5, count_interval=None
    )
)
dramatiq.set_broker(broker)


@dramatiq.actor(
    inbox_consumer="bench",
    queue_name=ENV["BENCH_TENANTS_QUEUE"],
    max_retries=100_000,
    min_backoff=200,
    max_backoff=1000,
)
def apply(message_id: str, tenant: str, sent_at: float) -> None:
    current_session().execute(
        text("INSERT INTO bench_ledger (message_id, tenant, sent_at) VALUES (:m, :t, :s)"),
        {"m": message_id, "t": tenant, "s": sent_at},
    )
