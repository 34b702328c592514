"""The fault-injection suite's Dramatiq worker with an ``async def`` actor:
``dramatiq tests.faults.app_dramatiq_async``.

Configured as `tests.apps.chaos_dramatiq` (CHAOS_DATABASE_URL with the asyncpg driver;
Redis only), plus the hook's variables (`tests.faults.hook`).
"""

from __future__ import annotations

import logging
import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import AsyncIO
from sqlalchemy.ext.asyncio import create_async_engine

from inbox_middleware.dramatiq import InboxMiddleware, current_async_session
from tests.apps import chaos_domain

from .hook import install

__all__ = ["broker", "credit"]

ENV = os.environ
logging.getLogger("inbox_middleware").setLevel(logging.WARNING)
broker = RedisBroker(
    url=ENV["CHAOS_BROKER_URL"],
    namespace=ENV["CHAOS_NAMESPACE"],
    heartbeat_timeout=int(ENV.get("CHAOS_HEARTBEAT_MS", "5000")),
    maintenance_chance=1_000_000,
)
broker.add_middleware(AsyncIO())
engine = create_async_engine(
    ENV["CHAOS_DATABASE_URL"],
    pool_size=int(ENV.get("CHAOS_POOL_SIZE", "8")),
    max_overflow=0,
    pool_pre_ping=True,
    connect_args={"server_settings": {"application_name": f"chaos-{ENV.get('CHAOS_WORKER')}"}},
)
broker.add_middleware(InboxMiddleware(engine, lock_timeout=10))
dramatiq.set_broker(broker)


@dramatiq.actor(
    queue_name=ENV["CHAOS_QUEUE"],
    inbox_consumer="ledger",
    max_retries=50,
    min_backoff=100,
    max_backoff=2000,
)
async def credit(account_id: int, delta: int) -> None:
    await chaos_domain.credit_async(current_async_session(), account_id, delta)


install()
