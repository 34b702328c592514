"""Two services in a chain, for the chain test: ``faststream run tests.apps.chain_app:app``.

Service A (``INBOX_TEST_ROLE=a``, inbox consumer ``stock``) takes an order from
``<source>.orders``, records its effect and returns an event, which FastStream publishes
to ``<source>.events`` (the inbox stores it with the claim, publishes it, then acks).
Service B (``INBOX_TEST_ROLE=b``, inbox consumer ``shipping``) takes the event and
records its own effect. Both on RabbitMQ, in one database (each ledger row names its
consumer).

INBOX_TEST_DATABASE_URL   SQLAlchemy URL of the run's database (asyncpg)
INBOX_TEST_BROKER_URL     RabbitMQ's URL
INBOX_TEST_SOURCE         the prefix of the two queues (one per test)
INBOX_TEST_ROLE           "a" or "b"
INBOX_TEST_KILL_AT        comma-separated fault points (`inbox_middleware._core.faults`) where
                          this process SIGKILLs itself, each with INBOX_TEST_KILL_CHANCE
INBOX_TEST_KILL_CHANCE    the chance per message and point (default 0.02)
INBOX_TEST_SEED           seeds the choice of the messages to die on
"""

from __future__ import annotations

import os
import random
import signal
from typing import Any

from faststream import FastStream
from faststream.rabbit import Channel, RabbitBroker, RabbitQueue

from inbox_middleware._core import faults
from inbox_middleware.faststream import FastStreamInbox, InboxSession

from ..support.engines import async_engine
from .domain import apply_credit_async

ENV = os.environ
SOURCE = ENV["INBOX_TEST_SOURCE"]
ROLE = ENV["INBOX_TEST_ROLE"]
KILL_AT = {point for point in ENV.get("INBOX_TEST_KILL_AT", "").split(",") if point}
CHANCE = float(ENV.get("INBOX_TEST_KILL_CHANCE", "0.02"))
_dice = random.Random(f"{ENV.get('INBOX_TEST_SEED', '0')}-{os.getpid()}")


def _die_sometimes(point: str, message_id: str | None) -> None:
    if point in KILL_AT and _dice.random() < CHANCE:
        os.kill(os.getpid(), signal.SIGKILL)


faults.hook = _die_sometimes

engine = async_engine(ENV["INBOX_TEST_DATABASE_URL"], pool_size=8)
# No redelivery limit: this app kills itself far more often than any real crash loop
# would, and each kill redelivers every message the process held, innocent or not.
inbox = FastStreamInbox(engine, lock_timeout=30, retry_backoff=(0.1, 1.0), redelivery_limit=None)
# A prefetch of 16 per process: a kill redelivers what the process held.
broker = RabbitBroker(
    ENV["INBOX_TEST_BROKER_URL"],
    middlewares=[inbox.middleware],
    default_channel=Channel(prefetch_count=16),
)
app = FastStream(inbox.guard(broker))
app.after_shutdown(engine.dispose)
orders = RabbitQueue(f"{SOURCE}.orders", durable=True)
events = RabbitQueue(f"{SOURCE}.events", durable=True)

if ROLE == "a":

    @broker.publisher(events, persist=True)
    @broker.subscriber(orders, dependencies=[inbox.consumer("stock")])
    async def reserve(body: dict[str, int], session: InboxSession) -> dict[str, Any]:
        await apply_credit_async(session, "stock", body["order"], 1)
        return {"order": body["order"], "reserved": 1}

else:

    @broker.subscriber(events, dependencies=[inbox.consumer("shipping")])
    async def ship(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "shipping", body["order"], 1)
