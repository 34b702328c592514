"""The account-credit service as a Dramatiq app, for tests that run real worker processes.

Started with the ``dramatiq`` command line, configured by environment variables:

INBOX_TEST_DATABASE_URL   SQLAlchemy URL of the run's database (psycopg)
INBOX_TEST_BROKER         "redis" or "rabbitmq";  INBOX_TEST_BROKER_URL its URL
INBOX_TEST_NAMESPACE      Redis key namespace (one per test)
INBOX_TEST_QUEUE          the actors' queue (one per test)
INBOX_TEST_PAUSE_AT       a named point where the first message to reach it stops and
                          waits to be killed: before_claim, in_body, before_barrier or
                          after_commit
INBOX_TEST_MARKERS        folder where "<point>.paused" is written on reaching it
INBOX_TEST_ARRIVALS       file that gets one line per delivery: "<time> <pid> <id>"
INBOX_TEST_SLEEP          seconds the actor body sleeps after its writes
INBOX_TEST_LOCK_TIMEOUT   the inbox's lock_timeout in seconds
INBOX_TEST_SCHEMA         the schema of the inbox tables (default: public)
INBOX_TEST_REDIS_URL      Redis for the group barriers (GroupCallbacks) and the results
                          (Results) of either broker
INBOX_TEST_STARTUP_PATIENCE  the inbox's startup_patience in seconds (default: the
                          library's)
INBOX_TEST_COUNT_INTERVAL seconds between two writes of the settlement counts (default 5)
INBOX_TEST_REDELIVERY_LIMIT  the inbox's redelivery_limit (default: the library's)
INBOX_TEST_CLAIMS         the inbox's claims table, "library" (default) or "compact"
"""

from __future__ import annotations

import os
import time
from typing import Any

import dramatiq
from dramatiq.middleware import CurrentMessage, GroupCallbacks, Middleware
from dramatiq.rate_limits.backends import RedisBackend as RedisLimits
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend
from sqlalchemy.orm import Session

from inbox_middleware._storage import InboxSchema
from inbox_middleware.dramatiq import InboxMiddleware, current_session

from ..support.engines import sync_engine
from .domain import apply_credit

ENV = os.environ
QUEUE = ENV.get("INBOX_TEST_QUEUE", "accounts")
PAUSE_AT = ENV.get("INBOX_TEST_PAUSE_AT", "")
MARKERS = ENV.get("INBOX_TEST_MARKERS", "")
SLEEP = float(ENV.get("INBOX_TEST_SLEEP", "0"))


def pause_point(name: str, message_id: str) -> None:
    """Stop here, once across all processes, until the test kills this process."""
    if name != PAUSE_AT:
        return
    try:
        fd = os.open(os.path.join(MARKERS, f"{name}.paused"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, f"{os.getpid()} {message_id}\n".encode())
    os.close(fd)
    while True:
        time.sleep(60)


class CrashPoints(Middleware):
    """Named points around the inbox's transaction, and an arrival log."""

    def before_process_message(self, broker: Any, message: Any) -> None:
        if path := ENV.get("INBOX_TEST_ARRIVALS"):
            with open(path, "a") as log:
                log.write(f"{time.time()} {os.getpid()} {message.message_id}\n")
        pause_point("before_claim", message.message_id)

    def after_process_message(self, broker: Any, message: Any, *, result=None, exception=None):
        # Runs after the actor call returned (the commit is done) and before the ack.
        if exception is None:
            pause_point("after_commit", message.message_id)


class BeforeBarrier(Middleware):
    """Added after GroupCallbacks, so its after_process_message runs first: the commit is
    done, the group's barrier has not counted the delivery yet."""

    def after_process_message(self, broker: Any, message: Any, *, result=None, exception=None):
        if exception is None:
            pause_point("before_barrier", message.message_id)


def _broker() -> dramatiq.Broker:
    url = ENV["INBOX_TEST_BROKER_URL"]
    if ENV.get("INBOX_TEST_BROKER") == "rabbitmq":
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=url, confirm_delivery=True)
    from dramatiq.brokers.redis import RedisBroker

    # A dead worker's messages come back once its heartbeat is 1 s old; maintenance runs
    # on every command so that happens promptly.
    return RedisBroker(
        url=url,
        namespace=ENV["INBOX_TEST_NAMESPACE"],
        heartbeat_timeout=1000,
        maintenance_chance=1_000_000,
    )


_settings: dict[str, Any] = (
    {"startup_patience": float(ENV["INBOX_TEST_STARTUP_PATIENCE"])}
    if "INBOX_TEST_STARTUP_PATIENCE" in ENV
    else {}
)
if "INBOX_TEST_REDELIVERY_LIMIT" in ENV:
    _settings["redelivery_limit"] = int(ENV["INBOX_TEST_REDELIVERY_LIMIT"])
broker = _broker()
broker.add_middleware(CrashPoints())
# Added after CrashPoints, so its after_process_message runs before the after_commit pause:
# a kill there comes after the group's barrier counted the delivery, before the ack.
REDIS_URL = ENV.get("INBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
broker.add_middleware(GroupCallbacks(RedisLimits(url=REDIS_URL)))
broker.add_middleware(BeforeBarrier())
broker.add_middleware(
    Results(backend=RedisBackend(url=REDIS_URL, namespace=ENV.get("INBOX_TEST_NAMESPACE", "")))
)
broker.add_middleware(CurrentMessage())
engine = sync_engine(ENV["INBOX_TEST_DATABASE_URL"], pool_size=16)
broker.add_middleware(
    InboxMiddleware(
        engine,
        naming=InboxSchema(schema=ENV.get("INBOX_TEST_SCHEMA") or None),
        lock_timeout=float(ENV.get("INBOX_TEST_LOCK_TIMEOUT", "30")),
        claims=ENV.get("INBOX_TEST_CLAIMS", "library"),
        **_settings,
        count_interval=float(ENV.get("INBOX_TEST_COUNT_INTERVAL", "5")),
    )
)
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=QUEUE, inbox_consumer="billing", min_backoff=100, max_backoff=1000)
def add_credit(account_id: int, delta: int) -> None:
    apply_credit(current_session(), "billing", account_id, delta)
    message = CurrentMessage.get_current_message()
    pause_point("in_body", message.message_id if message else "?")
    time.sleep(SLEEP)


# A pipeline of two inbox actors: reserve's result is ship's argument.
@dramatiq.actor(queue_name=QUEUE, inbox_consumer="stock", min_backoff=100, max_backoff=1000)
def reserve(account_id: int, delta: int) -> dict[str, int]:
    apply_credit(current_session(), "stock", account_id, delta)
    return {"account_id": account_id + 1, "delta": delta * 2}


@dramatiq.actor(queue_name=QUEUE, inbox_consumer="shipping", min_backoff=100, max_backoff=1000)
def ship(order: dict[str, int]) -> None:
    apply_credit(current_session(), "shipping", order["account_id"], order["delta"])


# A group member whose result is stored, and the group's completion callback.
@dramatiq.actor(
    queue_name=QUEUE,
    inbox_consumer="members",
    store_results=True,
    min_backoff=100,
    max_backoff=1000,
)
def member(account_id: int) -> int:
    apply_credit(current_session(), "members", account_id, 1)
    return account_id


@dramatiq.actor(queue_name=QUEUE, min_backoff=100, max_backoff=1000)
def group_done(account_id: int) -> None:
    with Session(engine) as session, session.begin():
        apply_credit(session, "group_done", account_id, 1)
