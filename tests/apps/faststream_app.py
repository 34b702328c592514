"""The account-credit service as a FastStream app, for tests that run real worker
processes with ``faststream run tests.apps.faststream_app:app``.

Configured by environment variables:

INBOX_TEST_DATABASE_URL   SQLAlchemy URL of the run's database (asyncpg)
INBOX_TEST_BROKER         "rabbit", "redis", "nats" or "kafka";  INBOX_TEST_BROKER_URL its
                          URL (Kafka: host:port)
INBOX_TEST_SOURCE         the queue, stream, subject or topic (one per test); NATS: the
                          stream is its upper-case name, the durable consumer "d" + the
                          subject; Kafka: the consumer group is "g" + the topic
INBOX_TEST_WORKER         this process's Redis consumer name (one per process)
INBOX_TEST_PAUSE_AT       a named point where the first message to reach it stops and
                          waits to be killed: before_claim, in_body or after_commit
INBOX_TEST_MARKERS        folder where "<point>.paused" is written on reaching it
INBOX_TEST_ARRIVALS       file that gets one line per delivery: "<time> <pid>"
INBOX_TEST_ACK_POLICY     an AckPolicy value for the subscriber (to test the guard)
INBOX_TEST_INBOX_SCHEMA   the schema of the inbox tables (one never migrated: the start-up
                          check refuses to start)
INBOX_TEST_REDIS_LIST     "1": Redis only, read a list instead of a stream (refused)
INBOX_TEST_STARTUP_PATIENCE  the inbox's startup_patience in seconds (default: the
                          library's)
INBOX_TEST_UNGUARDED      "1": the broker is not wrapped with inbox.guard (the start-up
                          check runs at the first message)
INBOX_TEST_REDELIVERY_LIMIT  the consumers' redelivery_limit (default: the library's)
INBOX_TEST_RETRY_BACKOFF  "first,limit": the hand-back backoff in seconds (default 0.1,1.0)
INBOX_TEST_COUNT_INTERVAL seconds between two writes of the settlement counts (default 5)
INBOX_TEST_CLAIMS         the inbox's claims table, "library" (default) or "compact"
INBOX_TEST_BATCH          "1": NATS only, a batch subscriber (PullSub(batch=True))
INBOX_TEST_SLOW           "accounts:seconds" ("9,7:4"): a credit to one of those accounts
                          sleeps that long in its handler (after its writes), so that a
                          worker stopped then has it in hand
INBOX_TEST_GRACEFUL_TIMEOUT  the broker's graceful_timeout in seconds (FastStream's default:
                          15)
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from faststream import BaseMiddleware, FastStream

from inbox_middleware._storage import InboxSchema
from inbox_middleware.faststream import FastStreamInbox, InboxSession

from ..support.engines import async_engine
from .domain import apply_credit_async

ENV = os.environ
SOURCE = ENV.get("INBOX_TEST_SOURCE", "accounts")
PAUSE_AT = ENV.get("INBOX_TEST_PAUSE_AT", "")
MARKERS = ENV.get("INBOX_TEST_MARKERS", "")
RECLAIM_MS = 1000
NATS_ACK_WAIT = 3.0


async def pause_point(name: str) -> None:
    """Stop here, once across all processes, until the test kills this process."""
    if name != PAUSE_AT:
        return
    try:
        fd = os.open(os.path.join(MARKERS, f"{name}.paused"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)
    while True:
        await asyncio.sleep(60)


class CrashPoints(BaseMiddleware):
    """Named points around the inbox's transaction, and an arrival log. Outside the inbox
    middleware, so it sees the message before the claim, and its acknowledgement after
    the commit: the inbox acknowledges only once its transaction has committed."""

    async def consume_scope(self, call_next: Any, msg: Any) -> Any:
        if path := ENV.get("INBOX_TEST_ARRIVALS"):
            with open(path, "a") as log:
                log.write(f"{time.time()} {os.getpid()}\n")
        await pause_point("before_claim")
        ack = msg.ack

        async def ack_after_commit(*args: Any, **kwargs: Any) -> None:
            await pause_point("after_commit")
            await ack(*args, **kwargs)

        msg.ack = ack_after_commit
        return await call_next(msg)


def _broker(middlewares: list[Any]) -> Any:
    kind, url = ENV["INBOX_TEST_BROKER"], ENV["INBOX_TEST_BROKER_URL"]
    options: dict[str, Any] = {"middlewares": middlewares}
    if "INBOX_TEST_GRACEFUL_TIMEOUT" in ENV:
        options["graceful_timeout"] = float(ENV["INBOX_TEST_GRACEFUL_TIMEOUT"])
    if kind == "rabbit":
        from faststream.rabbit import RabbitBroker

        return RabbitBroker(url, **options)
    if kind == "redis":
        from faststream.redis import RedisBroker

        return RedisBroker(url, **options)
    if kind == "kafka":
        from faststream.kafka import KafkaBroker

        return KafkaBroker(url, **options)
    from faststream.nats import NatsBroker

    return NatsBroker(url, **options)


engine = async_engine(ENV["INBOX_TEST_DATABASE_URL"], pool_size=16)
naming = (
    InboxSchema(schema=ENV["INBOX_TEST_INBOX_SCHEMA"]) if "INBOX_TEST_INBOX_SCHEMA" in ENV else None
)
settings: dict[str, Any] = {}
if "INBOX_TEST_STARTUP_PATIENCE" in ENV:
    settings["startup_patience"] = float(ENV["INBOX_TEST_STARTUP_PATIENCE"])
if "INBOX_TEST_REDELIVERY_LIMIT" in ENV:
    settings["redelivery_limit"] = int(ENV["INBOX_TEST_REDELIVERY_LIMIT"])
first, limit = (float(s) for s in ENV.get("INBOX_TEST_RETRY_BACKOFF", "0.1,1.0").split(","))
inbox = FastStreamInbox(
    engine,
    naming=naming,
    lock_timeout=30,
    claims=ENV.get("INBOX_TEST_CLAIMS", "library"),
    retry_backoff=(first, limit),
    count_interval=float(ENV.get("INBOX_TEST_COUNT_INTERVAL", "5")),
    **settings,
)
broker = _broker([CrashPoints, inbox.middleware])
app = FastStream(broker if ENV.get("INBOX_TEST_UNGUARDED") == "1" else inbox.guard(broker))
app.after_shutdown(engine.dispose)
billing = inbox.consumer("billing")
options: dict[str, Any] = {"dependencies": [billing]}
if policy := ENV.get("INBOX_TEST_ACK_POLICY"):
    from faststream import AckPolicy

    options["ack_policy"] = AckPolicy(policy)


SLOW_ACCOUNTS, _, SLOW_SECONDS = ENV.get("INBOX_TEST_SLOW", "").partition(":")


async def add_credit(body: dict[str, int], session: InboxSession) -> None:
    await apply_credit_async(session, "billing", body["account"], body["delta"])
    if SLOW_SECONDS and str(body["account"]) in SLOW_ACCOUNTS.split(","):
        await asyncio.sleep(float(SLOW_SECONDS))
    await pause_point("in_body")


if ENV["INBOX_TEST_BROKER"] == "rabbit":
    from faststream.rabbit import RabbitQueue

    broker.subscriber(RabbitQueue(SOURCE, durable=True), **options)(add_credit)
elif ENV["INBOX_TEST_BROKER"] == "redis" and ENV.get("INBOX_TEST_REDIS_LIST") == "1":
    from faststream.redis import ListSub

    broker.subscriber(list=ListSub(SOURCE), **options)(add_credit)
elif ENV["INBOX_TEST_BROKER"] == "redis":
    from faststream.redis import StreamSub

    worker = ENV.get("INBOX_TEST_WORKER", "w1")
    reading = StreamSub(SOURCE, group="billing", consumer=worker)
    reclaiming = StreamSub(
        SOURCE, group="billing", consumer=f"{worker}-reclaim", min_idle_time=RECLAIM_MS
    )
    for stream in (reading, reclaiming):
        broker.subscriber(stream=stream, **options)(add_credit)
elif ENV["INBOX_TEST_BROKER"] == "kafka":
    from faststream import AckPolicy
    from faststream.kafka import Topic

    # A short session timeout: a killed member's partitions move to another within seconds.
    broker.subscriber(
        Topic(SOURCE, num_partitions=2),
        group_id=f"g{SOURCE}",
        auto_offset_reset="earliest",
        session_timeout_ms=3000,
        heartbeat_interval_ms=300,
        **({"ack_policy": AckPolicy.ACK} | options),
    )(add_credit)
else:
    from faststream.nats import ConsumerConfig, JStream, PullSub

    batch = ENV.get("INBOX_TEST_BATCH") == "1"

    async def add_credits(bodies: list[dict[str, int]], session: InboxSession) -> None:
        for body in bodies:
            await apply_credit_async(session, "billing", body["account"], body["delta"])
        await pause_point("in_body")

    broker.subscriber(
        SOURCE,
        stream=JStream(SOURCE.upper(), subjects=[SOURCE]),
        durable=f"d{SOURCE}",
        pull_sub=PullSub(batch_size=16, timeout=0.2, batch=batch),
        config=ConsumerConfig(ack_wait=NATS_ACK_WAIT),
        **options,
    )(add_credits if batch else add_credit)
