"""The fault-injection rows' FastStream app for handler misuse and dynamic subscribers:
``faststream run tests.faults.app_paths:app --workers 2``.

FAULTS_PATH   "misuse": one inbox subscriber on INBOX_TEST_SOURCE whose handler credits
              the body's account, then does what the body's ``misuse`` names (`MISUSES`);
              NATS: also a batch subscriber on FAULTS_BATCH_SOURCE whose handler credits
              every item, then acks the message FastStream's context gives it.
              "dynamic": no subscriber at start-up; once the guarded broker started, it is
              given (each on its queue, FAULTS_QUEUES: four comma-separated names)
              an inbox subscriber (``broker.subscriber(...)`` at runtime), a router
              with one, included late, an inbox subscriber with ``AckPolicy.ACK_FIRST``
              (refused as it starts: it must consume nothing), and a plain subscriber,
              started, stopped and dropped, then an inbox subscriber on its queue.

The rest as `tests.apps.faststream_app`: INBOX_TEST_DATABASE_URL (asyncpg),
INBOX_TEST_BROKER ("rabbit" or "nats"), INBOX_TEST_BROKER_URL, INBOX_TEST_SOURCE.
Guarded; a hand-back backoff of 0.05 s to 0.3 s, ``max_attempts=3``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from faststream import AckPolicy, Context, FastStream
from sqlalchemy import text

from inbox_middleware._core.exceptions import ConfigurationError
from inbox_middleware.faststream import FastStreamInbox, InboxSession

from ..apps.domain import apply_credit_async
from ..support.engines import async_engine

ENV = os.environ
KIND = ENV["INBOX_TEST_BROKER"]
SOURCE = ENV["INBOX_TEST_SOURCE"]
logger = logging.getLogger("tests.faults.app_paths")

engine = async_engine(ENV["INBOX_TEST_DATABASE_URL"], pool_size=8)
inbox = FastStreamInbox(engine, lock_timeout=10, retry_backoff=(0.05, 0.3), max_attempts=3)
if KIND == "rabbit":
    from faststream.rabbit import RabbitBroker, RabbitQueue, RabbitRouter

    broker: Any = RabbitBroker(ENV["INBOX_TEST_BROKER_URL"], middlewares=[inbox.middleware])
else:
    from faststream.nats import ConsumerConfig, JStream, NatsBroker, PullSub

    broker = NatsBroker(ENV["INBOX_TEST_BROKER_URL"], middlewares=[inbox.middleware])
app = FastStream(inbox.guard(broker))
app.after_shutdown(engine.dispose)
billing = inbox.consumer("billing")
MESSAGE = Context("message")


async def _execute(session: InboxSession, sql: str) -> None:
    await session.execute(text(sql))


async def _connection_commit(session: InboxSession) -> None:
    await (await session.connection()).commit()


async def _connection_rollback(session: InboxSession) -> None:
    await (await session.connection()).rollback()


async def _raw_failure_caught(session: InboxSession) -> None:
    raw = await (await session.connection()).get_raw_connection()
    try:
        await raw.driver_connection.execute("SELECT 1/0")
    except Exception:
        logger.info("the driver's own statement failed, caught")


MISUSES: dict[str, Callable[[InboxSession, Any], Awaitable[Any]]] = {
    "none": lambda session, msg: _noop(),
    "sql_rollback": lambda session, msg: _execute(session, "ROLLBACK"),
    "sql_commit": lambda session, msg: _execute(session, "COMMIT"),
    "connection_commit": lambda session, msg: _connection_commit(session),
    "connection_rollback": lambda session, msg: _connection_rollback(session),
    "session_commit": lambda session, msg: session.commit(),
    "session_rollback": lambda session, msg: session.rollback(),
    "invalidate": lambda session, msg: session.invalidate(),
    "ack": lambda session, msg: msg.ack(),
    "nack": lambda session, msg: msg.nack(),
    "reject": lambda session, msg: msg.reject(),
    "ack_sync": lambda session, msg: msg.ack_sync(),  # NATS
    "raw_ack": lambda session, msg: msg.raw_message.ack(),
    "raw_failure_caught": lambda session, msg: _raw_failure_caught(session),
}


async def _noop() -> None:
    return None


async def misbehave(body: dict[str, Any], session: InboxSession, msg: Any = MESSAGE) -> None:
    await apply_credit_async(session, "billing", body["account"], body["delta"])
    await MISUSES[body["misuse"]](session, msg)


async def misbehave_batch(
    body: list[dict[str, Any]], session: InboxSession, msg: Any = MESSAGE
) -> None:
    for one in body:
        await apply_credit_async(session, "billing", one["account"], one["delta"])
    await msg.ack()  # the batch's message from FastStream's context


async def credit(body: dict[str, Any], session: InboxSession) -> None:
    await apply_credit_async(session, "billing", body["account"], body["delta"])


async def plain(body: dict[str, Any]) -> None:
    logger.info("a plain subscriber consumed %s", body)


def _subscriber(queue: str, target: Any = None, **options: Any) -> Any:
    on = target or broker
    if KIND == "rabbit":
        return on.subscriber(RabbitQueue(queue, durable=True), **options)
    return on.subscriber(
        queue,
        stream=JStream(queue.upper(), subjects=[queue]),
        durable=f"d{queue}",
        pull_sub=PullSub(batch_size=16, timeout=0.2),
        config=ConsumerConfig(ack_wait=3),
        **options,
    )


if ENV["FAULTS_PATH"] == "misuse":
    _subscriber(SOURCE, dependencies=[billing])(misbehave)
    if batch := ENV.get("FAULTS_BATCH_SOURCE"):  # NATS
        broker.subscriber(
            batch,
            stream=JStream(batch.upper(), subjects=[batch]),
            durable=f"d{batch}",
            pull_sub=PullSub(batch_size=4, timeout=0.2, batch=True),
            config=ConsumerConfig(ack_wait=3),
            dependencies=[inbox.consumer("billing-batch")],
        )(misbehave_batch)
else:
    added, routed, acking_first, replaced = ENV["FAULTS_QUEUES"].split(",")

    @app.after_startup
    async def add_subscribers() -> None:
        # An inbox subscriber added to the running broker
        first = _subscriber(added, dependencies=[billing], persistent=False)
        first(credit)
        await first.start()
        # A router with one, included late
        if KIND == "rabbit":
            router: Any = RabbitRouter()
        else:
            from faststream.nats import NatsRouter

            router = NatsRouter()
        late = _subscriber(routed, target=router, dependencies=[billing])
        late(credit)
        broker.include_router(router)
        await late.start()
        # An inbox subscriber acknowledging on delivery: refused before it consumes
        early = _subscriber(
            acking_first,
            dependencies=[billing],
            ack_policy=AckPolicy.ACK_FIRST,
            persistent=False,
        )
        early(credit)
        try:
            await early.start()
        except ConfigurationError as exc:
            logger.warning("refused as it started: %s", " ".join(str(exc).split()))
        # A plain subscriber, stopped and dropped, then an inbox subscriber on its queue
        gone = _subscriber(replaced, persistent=False)
        gone(plain)
        await gone.start()
        await gone.stop()
        broker._subscribers.discard(gone)
        again = _subscriber(replaced, dependencies=[billing], persistent=False)
        again(credit)
        await again.start()
        logger.warning("dynamic subscribers started")
