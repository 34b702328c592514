"""The explorer's Dramatiq worker: ``dramatiq tests.explore.app_dramatiq``.

Configured by environment variables (set by `tests.explore.run`): EXPLORE_DATABASE_URL
(SQLAlchemy, psycopg), EXPLORE_BROKER ("rabbitmq" or "redis"), EXPLORE_BROKER_URL,
EXPLORE_QUEUE (the actor's queue, and the Redis namespace), EXPLORE_CONCURRENCY (threads,
for the pool's size), EXPLORE_MISSING_IDENTITY, EXPLORE_MAX_ATTEMPTS and
EXPLORE_REDELIVERY_LIMIT ("" for None), EXPLORE_WORKER (the worker's name); the
workload's axes: EXPLORE_OUTPUTS ("result": an ``on_success`` callback to an inbox actor
downstream), EXPLORE_OUTBOX ("on": an outbox effect per intent), EXPLORE_HANDLERS
("extended": the actor has a time limit), EXPLORE_ACTOR ("async": the actors are
``async def``, with Dramatiq's AsyncIO middleware and an AsyncEngine, asyncpg).
Only the library's public API is used, so that it runs on older commits unchanged.
"""

from __future__ import annotations

import os
from typing import Any

import dramatiq
from dramatiq.middleware import AsyncIO

from inbox_middleware.dramatiq import InboxMiddleware, current_async_session, current_session

from . import domain, infra

ENV = os.environ
QUEUE = ENV["EXPLORE_QUEUE"]
ASYNC = ENV.get("EXPLORE_ACTOR", "sync") == "async"


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
engine = infra.engine(threads, f"explore-{ENV.get('EXPLORE_WORKER', 'w')}", asynchronous=ASYNC)
broker = _broker()
if ASYNC:
    broker.add_middleware(AsyncIO())
settings: dict[str, Any] = {
    "missing_identity": ENV.get("EXPLORE_MISSING_IDENTITY", "reject"),
    "max_attempts": _limit("EXPLORE_MAX_ATTEMPTS"),
    "redelivery_limit": _limit("EXPLORE_REDELIVERY_LIMIT"),
    **infra.inbox_settings(),
}
claims = "compact" if ENV.get("EXPLORE_CLAIMS", "library") != "library" else "library"
inbox = InboxMiddleware(**infra.storage(engine, threads), lock_timeout=5, claims=claims, **settings)
broker.add_middleware(inbox)
dramatiq.set_broker(broker)


OUTPUTS = ENV.get("EXPLORE_OUTPUTS", "none") == "result"
OUTBOX = ENV.get("EXPLORE_OUTBOX", "off") == "on"
options: dict[str, Any] = {}
if OUTPUTS:
    options["on_success"] = "explore_after"
if ENV.get("EXPLORE_HANDLERS", "basic") == "extended":
    options["time_limit"] = 5000


ACTOR: dict[str, Any] = {
    "queue_name": QUEUE,
    "max_retries": 8,
    "min_backoff": 100,
    "max_backoff": 1000,
}

if ASYNC:

    @dramatiq.actor(actor_name="explore", inbox_consumer="explore", **ACTOR, **options)
    async def explore(payload: dict[str, Any]) -> dict[str, Any]:
        session = current_async_session()
        return await domain.apply_async(session, payload, engine, outbox_on=OUTBOX)

else:

    @dramatiq.actor(actor_name="explore", inbox_consumer="explore", **ACTOR, **options)
    def explore(payload: dict[str, Any]) -> dict[str, Any]:
        return domain.apply(current_session(), payload, engine, outbox_on=OUTBOX)


if OUTPUTS and ASYNC:

    @dramatiq.actor(actor_name="explore_after", inbox_consumer="explore_after", **ACTOR)
    async def explore_after(message: dict[str, Any], result: dict[str, Any]) -> None:
        await domain.downstream_async(current_async_session(), result, "on_success")

elif OUTPUTS:

    @dramatiq.actor(actor_name="explore_after", inbox_consumer="explore_after", **ACTOR)
    def explore_after(message: dict[str, Any], result: dict[str, Any]) -> None:
        domain.downstream(current_session(), result, "on_success")
