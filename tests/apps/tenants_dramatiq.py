"""The account-credit service over three tenant databases, as a Dramatiq app (``dramatiq
tests.apps.tenants_dramatiq``): one shared queue, each delivery claimed and applied in its
tenant's database (`tests.support.tenants`).

INBOX_TEST_MAP          the database map file (JSON)
INBOX_TEST_BROKER       "redis" or "rabbitmq";  INBOX_TEST_BROKER_URL its URL
INBOX_TEST_NAMESPACE    Redis key namespace (one per test)
INBOX_TEST_QUEUE        the actor's queue (one per test)
INBOX_TEST_SLEEP        seconds the actor body sleeps after its writes
"""

from __future__ import annotations

import os
import time

import dramatiq

from inbox_middleware import MapFile
from inbox_middleware.dramatiq import InboxMiddleware, current_session

from .domain import apply_credit

ENV = os.environ
QUEUE = ENV.get("INBOX_TEST_QUEUE", "accounts")
SLEEP = float(ENV.get("INBOX_TEST_SLEEP", "0"))

if ENV["INBOX_TEST_BROKER"] == "rabbitmq":
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    broker: dramatiq.Broker = RabbitmqBroker(
        url=ENV["INBOX_TEST_BROKER_URL"], confirm_delivery=True
    )
else:
    from dramatiq.brokers.redis import RedisBroker

    # A killed worker's messages come back once its heartbeat is 1 s old.
    broker = RedisBroker(
        url=ENV["INBOX_TEST_BROKER_URL"],
        namespace=ENV["INBOX_TEST_NAMESPACE"],
        heartbeat_timeout=1000,
        maintenance_chance=1_000_000,
    )
for middleware in broker.middleware:
    if isinstance(middleware, dramatiq.middleware.Retries):
        middleware.min_backoff, middleware.max_backoff = 100, 1000
broker.add_middleware(InboxMiddleware(router=MapFile(ENV["INBOX_TEST_MAP"]), lock_timeout=30))
dramatiq.set_broker(broker)


@dramatiq.actor(inbox_consumer="billing", queue_name=QUEUE, max_retries=1000)
def add_credit(account_id: int, delta: int) -> None:
    apply_credit(current_session(), "billing", account_id, delta)
    if SLEEP:
        time.sleep(SLEEP)
