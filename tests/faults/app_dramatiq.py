"""The fault-injection suite's Dramatiq worker: ``dramatiq tests.faults.app_dramatiq``.

The chaos run's worker (`tests.apps.chaos_dramatiq`: its domain, broker settings, actor
options and variables), with the hook set (`tests.faults.hook`), and:

FAULTS_ASYNC   "1": the actor is ``async def`` (CHAOS_DATABASE_URL with asyncpg)

Retries back off from 100 ms to 2 s, as the actor's options say, also for the inbox's own
hand-backs, which follow the Retries middleware's settings (15 s to 5 min by default):
the run waits for every message, and a hand-back of 15 s would make it a long wait.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import dramatiq
from dramatiq.middleware import AsyncIO, Retries
from sqlalchemy import create_engine

from inbox_middleware.dramatiq import InboxMiddleware, current_async_session, current_session
from tests.apps import chaos_domain
from tests.apps.chaos_dramatiq import Outcomes, _broker

from .hook import install

__all__ = ["broker", "credit"]

ENV = os.environ
ASYNC = ENV.get("FAULTS_ASYNC") == "1"
MIN_BACKOFF, MAX_BACKOFF = 100, 2000

logging.getLogger("inbox_middleware").setLevel(logging.WARNING)
broker = _broker()
for middleware in broker.middleware:
    if isinstance(middleware, Retries):
        middleware.min_backoff, middleware.max_backoff = MIN_BACKOFF, MAX_BACKOFF
broker.add_middleware(Outcomes())
application = f"chaos-{ENV.get('CHAOS_WORKER', 'w0')}"
pool: dict[str, Any] = {"pool_size": 8, "max_overflow": 0, "pool_pre_ping": True}
if ASYNC:
    from sqlalchemy.ext.asyncio import create_async_engine

    broker.add_middleware(AsyncIO())
    engine: Any = create_async_engine(
        ENV["CHAOS_DATABASE_URL"],
        connect_args={"server_settings": {"application_name": application}},
        **pool,
    )
else:
    engine = create_engine(
        ENV["CHAOS_DATABASE_URL"], connect_args={"application_name": application}, **pool
    )
broker.add_middleware(InboxMiddleware(engine, lock_timeout=10))
dramatiq.set_broker(broker)
options: dict[str, Any] = {
    "queue_name": ENV["CHAOS_QUEUE"],
    "inbox_consumer": "ledger",
    "max_retries": 50,
    "min_backoff": MIN_BACKOFF,
    "max_backoff": MAX_BACKOFF,
}

if ASYNC:

    @dramatiq.actor(**options)
    async def credit(account_id: int, delta: int) -> None:
        await chaos_domain.credit_async(current_async_session(), account_id, delta)

else:

    @dramatiq.actor(**options)
    def credit(account_id: int, delta: int) -> None:
        chaos_domain.credit(current_session(), account_id, delta)


install()
