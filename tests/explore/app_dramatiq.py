"""The explorer's Dramatiq worker: ``dramatiq tests.explore.app_dramatiq``.

Configured by environment variables (set by `tests.explore.run`): EXPLORE_DATABASE_URL
(SQLAlchemy, psycopg), EXPLORE_BROKER ("rabbitmq" or "redis"), EXPLORE_BROKER_URL,
EXPLORE_QUEUE (the actor's queue, and the Redis namespace), EXPLORE_CONCURRENCY (threads,
for the pool's size), EXPLORE_MISSING_IDENTITY, EXPLORE_MAX_ATTEMPTS and
EXPLORE_REDELIVERY_LIMIT ("" for None), EXPLORE_WORKER (the worker's name); the
workload's axes: EXPLORE_OUTPUTS ("result": an ``on_success`` callback to an inbox actor
downstream), EXPLORE_OUTBOX ("on": an outbox effect per intent), EXPLORE_HANDLERS
("extended": the actor has a time limit).
Only the library's public API is used, so that it runs on older commits unchanged.
"""

from __future__ import annotations

import os
from typing import Any

import dramatiq
from sqlalchemy import create_engine

from inbox_middleware.dramatiq import InboxMiddleware, current_session

from . import domain, infra

ENV = os.environ
QUEUE = ENV["EXPLORE_QUEUE"]


def _limit(name: str) -> int | None:
    value = ENV.get(name, "")
    return int(value) if value else None


def _broker() -> dramatiq.Broker:
    url = ENV["EXPLORE_BROKER_URL"]
    if ENV["EXPLORE_BROKER"] == "rabbitmq":
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return infra.dramatiq_broker(url) or RabbitmqBroker(url=url, confirm_delivery=True)
    from dramatiq.brokers.redis import RedisBroker

    # A killed worker's messages come back once its heartbeat is this old.
    return RedisBroker(
        url=url, namespace=QUEUE, heartbeat_timeout=3000, maintenance_chance=1_000_000
    )


threads = int(ENV.get("EXPLORE_CONCURRENCY", "4"))
engine = create_engine(
    ENV["EXPLORE_DATABASE_URL"],
    pool_size=2 * threads + 2,
    max_overflow=0,
    pool_pre_ping=True,
    connect_args={
        "application_name": f"explore-{ENV.get('EXPLORE_WORKER', 'w')}",
        **infra.connect_args("psycopg"),
    },
)
broker = _broker()
settings: dict[str, Any] = {
    "missing_identity": ENV.get("EXPLORE_MISSING_IDENTITY", "reject"),
    "max_attempts": _limit("EXPLORE_MAX_ATTEMPTS"),
    "redelivery_limit": _limit("EXPLORE_REDELIVERY_LIMIT"),
    **infra.inbox_settings(),
}
claims = "compact" if ENV.get("EXPLORE_CLAIMS", "library") != "library" else "library"
broker.add_middleware(InboxMiddleware(engine, lock_timeout=5, claims=claims, **settings))
dramatiq.set_broker(broker)


OUTPUTS = ENV.get("EXPLORE_OUTPUTS", "none") == "result"
OUTBOX = ENV.get("EXPLORE_OUTBOX", "off") == "on"
options: dict[str, Any] = {}
if OUTPUTS:
    options["on_success"] = "explore_after"
if ENV.get("EXPLORE_HANDLERS", "basic") == "extended":
    options["time_limit"] = 5000


@dramatiq.actor(
    actor_name="explore",
    queue_name=QUEUE,
    inbox_consumer="explore",
    max_retries=8,
    min_backoff=100,
    max_backoff=1000,
    **options,
)
def explore(payload: dict[str, Any]) -> dict[str, Any]:
    return domain.apply(current_session(), payload, engine, outbox_on=OUTBOX)


if OUTPUTS:

    @dramatiq.actor(
        actor_name="explore_after",
        queue_name=QUEUE,
        inbox_consumer="explore_after",
        max_retries=8,
        min_backoff=100,
        max_backoff=1000,
    )
    def explore_after(message: dict[str, Any], result: dict[str, Any]) -> None:
        domain.downstream(current_session(), result, "on_success")
