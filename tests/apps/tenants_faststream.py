"""The account-credit service over three tenant databases, as a FastStream app on RabbitMQ
(``faststream run tests.apps.tenants_faststream:app``): one shared queue, each delivery
claimed and applied in its tenant's database (`tests.support.tenants`).

INBOX_TEST_MAP          the database map file (JSON)
INBOX_TEST_BROKER_URL   RabbitMQ's URL
INBOX_TEST_SOURCE       the queue (one per test); dead letters go to "<queue>.dead-letter"
INBOX_TEST_SLEEP        seconds the handler sleeps after its writes
INBOX_TEST_PREFETCH     the subscriber's prefetch_count (none: RabbitMQ's unlimited)
INBOX_TEST_BACKOFF      the hand-back backoff, "first,limit" seconds (default "0.1,1.0")
"""

from __future__ import annotations

import asyncio
import os

from faststream import FastStream
from faststream.rabbit import Channel, RabbitBroker, RabbitQueue

from inbox_middleware import MapFile
from inbox_middleware.faststream import FastStreamInbox, InboxSession

from .domain import apply_credit_async

ENV = os.environ
SOURCE = ENV.get("INBOX_TEST_SOURCE", "accounts")
SLEEP = float(ENV.get("INBOX_TEST_SLEEP", "0"))
PREFETCH = int(ENV.get("INBOX_TEST_PREFETCH", "0")) or None
FIRST, LIMIT = (float(x) for x in ENV.get("INBOX_TEST_BACKOFF", "0.1,1.0").split(","))

inbox = FastStreamInbox(
    router=MapFile(ENV["INBOX_TEST_MAP"]),
    lock_timeout=30,
    retry_backoff=(FIRST, LIMIT),
    max_attempts=1000,
)
broker = RabbitBroker(ENV["INBOX_TEST_BROKER_URL"], middlewares=[inbox.middleware])
app = FastStream(inbox.guard(broker))
billing = inbox.consumer("billing")


@broker.subscriber(
    RabbitQueue(SOURCE, durable=True),
    dependencies=[billing],
    channel=Channel(prefetch_count=PREFETCH) if PREFETCH else None,
)
async def add_credit(body: dict[str, int], session: InboxSession) -> None:
    await apply_credit_async(session, "billing", body["account"], body["delta"])
    if SLEEP:
        await asyncio.sleep(SLEEP)
