"""The chaos run's Dramatiq worker: ``dramatiq tests.apps.chaos_dramatiq``.

Configured by environment variables:

CHAOS_DATABASE_URL   SQLAlchemy URL (psycopg) of the run's database, through the proxy
CHAOS_BROKER         "rabbitmq" or "redis";  CHAOS_BROKER_URL its URL
CHAOS_QUORUM         "1": RabbitMQ quorum queues (QuorumRabbitmqBroker, delivery limit 20)
CHAOS_NAMESPACE      Redis key namespace
CHAOS_QUEUE          the actor's queue
CHAOS_STATS          folder for the statistics files (see `chaos_domain.Stats`)
CHAOS_WORKER         this worker's name (its database connections carry it too)
CHAOS_POOL_SIZE      connections in the pool (default 8)
CHAOS_HEARTBEAT_MS   Redis: how old a dead worker's heartbeat is when its messages come back
"""

from __future__ import annotations

import logging
import os
from typing import Any

import dramatiq
from dramatiq.middleware import Middleware

from inbox_middleware.dramatiq import InboxMiddleware, current_session

from ..support.engines import sync_engine
from . import chaos_domain

ENV = os.environ
WORKER = ENV.get("CHAOS_WORKER", "w0")
stats = chaos_domain.Stats(ENV["CHAOS_STATS"], WORKER)


class _HandBacks(logging.Handler):
    """Counts the inbox's hand-backs by their cause: a hand-back ends its delivery with a
    skip (the message enqueued again), so the worker does not see an exception."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "inbox_event", None) == "handed_back":
            stats.count(str(getattr(record, "inbox_error", "handed_back")))


_library = logging.getLogger("inbox_middleware")
_library.addHandler(_HandBacks())
_library.setLevel(min(_library.getEffectiveLevel(), logging.INFO))


class Outcomes(Middleware):
    """Counts what happened to each delivery, and starts the statistics writer."""

    def after_worker_boot(self, broker: Any, worker: Any) -> None:
        stats.run_in_thread()

    def after_process_message(self, broker: Any, message: Any, *, result=None, exception=None):
        stats.count("processed" if exception is None else type(exception).__name__)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        stats.count("skipped")


def _broker() -> dramatiq.Broker:
    url = ENV["CHAOS_BROKER_URL"]
    if ENV["CHAOS_BROKER"] == "rabbitmq" and ENV.get("CHAOS_QUORUM") == "1":
        from inbox_middleware.dramatiq._quorum import QuorumRabbitmqBroker

        return QuorumRabbitmqBroker(url=url, confirm_delivery=True, delivery_limit=20)
    if ENV["CHAOS_BROKER"] == "rabbitmq":
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=url, confirm_delivery=True)
    from dramatiq.brokers.redis import RedisBroker

    # A killed worker's messages come back once its heartbeat is this old.
    return RedisBroker(
        url=url,
        namespace=ENV["CHAOS_NAMESPACE"],
        heartbeat_timeout=int(ENV.get("CHAOS_HEARTBEAT_MS", "5000")),
        maintenance_chance=1_000_000,
    )


# One line per skipped duplicate would dominate the log; conflicts still log a warning.
logging.getLogger("inbox_middleware").setLevel(logging.WARNING)
broker = _broker()
broker.add_middleware(Outcomes())
engine = sync_engine(
    ENV["CHAOS_DATABASE_URL"],
    pool_size=int(ENV.get("CHAOS_POOL_SIZE", "8")),
    max_overflow=0,
    pool_pre_ping=True,
    connect_args={"application_name": f"chaos-{WORKER}"},
)
stats.engines.append(engine)
broker.add_middleware(InboxMiddleware(engine, lock_timeout=10))
dramatiq.set_broker(broker)


@dramatiq.actor(
    queue_name=ENV["CHAOS_QUEUE"],
    inbox_consumer="ledger",
    max_retries=50,
    min_backoff=100,
    max_backoff=2000,
)
def credit(account_id: int, delta: int) -> None:
    chaos_domain.credit(current_session(), account_id, delta)
