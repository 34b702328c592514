"""The benchmark's Dramatiq worker: one actor, one account update, several ways to dedup.

    BENCH_MODE=inbox dramatiq bench.dramatiq_worker --processes 1 --threads 8

Modes:
  bare           the update in a transaction, no deduplication
  inbox          this library: the claim in the same transaction
  redis_setnx    SET NX on Redis before the transaction (fast, not atomic with the DB)
  select_insert  SELECT, then INSERT into a dedup table, then the update (the race-prone way)
  powertools     AWS Lambda Powertools' idempotency utility on Redis around the transaction
  justonce       the justonce library's PostgreSQL store around the transaction
  (these four as bench.peers writes them, the same code the correctness tests run)
  empty          the framework's ceiling: an actor that does nothing

BENCH_LOG_LEVEL sets the inbox's loggers' level (a duplicate's line is INFO, the level the
Dramatiq CLI configures): WARNING measures the duplicate path without it.

Each handled message's end-to-end latency (send to commit) is kept in memory and written
to BENCH_LATENCY_DIR/<pid>.txt when the worker shuts down.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import dramatiq
from dramatiq.middleware import Middleware
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from bench import peers
from bench.common import DATABASE, PG, RABBITMQ, REDIS, sqlalchemy_url
from inbox_middleware.dramatiq import InboxMiddleware, current_session

MODE = os.environ.get("BENCH_MODE", "inbox")
if "BENCH_LOG_LEVEL" in os.environ:
    logging.getLogger("inbox_middleware").setLevel(os.environ["BENCH_LOG_LEVEL"])
LATENCIES: list[float] = []
UPDATE = text("UPDATE bench_accounts SET balance = balance + 1 WHERE id = :account")


class Latencies(Middleware):
    def after_worker_shutdown(self, broker: Any, worker: Any) -> None:
        folder = os.environ.get("BENCH_LATENCY_DIR")
        if folder:
            Path(folder, f"{os.getpid()}.txt").write_text("\n".join(map(str, LATENCIES)))


def _broker() -> dramatiq.Broker:
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    return RabbitmqBroker(url=RABBITMQ, confirm_delivery=True)


broker = _broker()
broker.add_middleware(Latencies())
engine = create_engine(sqlalchemy_url(), pool_size=int(os.environ.get("BENCH_POOL", "10")))
if MODE == "inbox":
    broker.add_middleware(InboxMiddleware(engine))
dramatiq.set_broker(broker)
QUEUE = os.environ.get("BENCH_QUEUE", "bench")
options: dict[str, Any] = {"queue_name": QUEUE, "max_retries": 3, "min_backoff": 100}
if MODE == "inbox":
    options["inbox_consumer"] = "bench"


def _done(sent_at: float) -> None:
    LATENCIES.append(time.time() - sent_at)


if MODE == "inbox":

    @dramatiq.actor(**options)
    def credit(account: int, sent_at: float) -> None:
        current_session().execute(UPDATE, {"account": account})
        _done(sent_at)

elif MODE == "bare":

    @dramatiq.actor(**options)
    def credit(account: int, sent_at: float) -> None:
        with Session(engine) as session, session.begin():
            session.execute(UPDATE, {"account": account})
        _done(sent_at)

elif MODE in peers.WAYS:
    way = peers.make(MODE, engine, redis_url=REDIS, dsn=f"{PG}/{DATABASE}")

    @dramatiq.actor(**options)
    def credit(account: int, sent_at: float) -> None:
        message = dramatiq.middleware.CurrentMessage.get_current_message()
        if way.deliver(message.options["inbox_message_id"], account):
            _done(sent_at)

    broker.add_middleware(dramatiq.middleware.CurrentMessage())

else:

    @dramatiq.actor(**options)
    def credit(account: int, sent_at: float) -> None:
        _done(sent_at)
