"""A hand-back while the broker itself is down (Dramatiq on the persistent Redis).

The database is unreachable, so the inbox hands the message back: it enqueues the message
again with a delay and skips the delivered copy. If Redis is down at that moment too, the
enqueue fails; giving up at once would leave Retries to enqueue it, which fails as well,
and Dramatiq would then acknowledge a message that nothing holds any more.
"""

from __future__ import annotations

import threading
import uuid

import dramatiq
import pytest
from dramatiq.brokers.redis import RedisBroker

from inbox_middleware._core import faults
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity

from ..apps.domain import apply_credit, balance, effects
from ..support import engines, servers, services
from ..support.dramatiq_worker import drain, running_worker
from ..support.proxy import Proxy
from ..support.workers import wait_for

pytestmark = pytest.mark.slow


def test_dramatiq__a_hand_back_while_redis_restarts_waits_for_it_and_loses_nothing(
    pg_url, pg_engine, caplog
):
    services.require(services.REDIS_PERSISTENT, "The persistent Redis")
    namespace = f"inbox-test-{uuid.uuid4().hex[:8]}"
    broker = RedisBroker(url=services.REDIS_PERSISTENT, namespace=namespace)
    broker.add_middleware(dramatiq.middleware.AsyncIO())
    dramatiq.set_broker(broker)
    proxy = Proxy(services.postgres_address())
    engine = engines.sync_engine(services.via_port(pg_url, proxy.port), pool_pre_ping=True)
    broker.add_middleware(InboxMiddleware(engine))
    queue = f"q{uuid.uuid4().hex[:8]}"

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", min_backoff=100, max_backoff=500)
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    # Given a database that cannot be reached, and a Redis that goes down just as the
    # inbox hands the message back (SIGKILLed, then started again from its append-only file)
    restarted = threading.Event()
    down = threading.Event()
    trouble: list[BaseException] = []

    def redis_down_at_the_hand_back(point: str, message_id: str | None) -> None:
        if point != "settle" or restarted.is_set():
            return
        restarted.set()
        threading.Thread(target=_restart, daemon=True).start()
        try:
            if not down.wait(15):
                trouble.append(AssertionError("the persistent Redis did not go down"))
        finally:
            proxy.up()  # the database is back for the redelivery

    def _restart() -> None:
        try:
            servers.kill_persistent_redis(on_down=down.set)
        except BaseException as exc:
            trouble.append(exc)

    faults.hook = redis_down_at_the_hand_back
    try:
        with running_worker(broker) as worker:
            proxy.down()
            add_credit.send_with_options(
                args=(7, 10), **identity(producer="orders", message_id="o-1")
            )
            # When the hand-back's enqueue meets Redis down, then the message is enqueued
            # once Redis is back, and processed exactly once
            wait_for(lambda: _applied(pg_engine), timeout=60, what="the effect")
            drain(broker, queue, worker)
    finally:
        faults.hook = None
        wait_for(servers.persistent_redis_answers, timeout=60, what="the persistent Redis")
        for key in broker.client.scan_iter(f"{namespace}*"):
            broker.client.delete(key)
        broker.close()
        engine.dispose()
        proxy.close()
    assert trouble == []
    # ... the hand-back did meet the outage, and waited it out
    assert any("trying again" in r.getMessage() for r in caplog.records)
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)


def _applied(engine) -> bool:
    with engine.connect() as conn:
        return effects(conn, 7) >= 1
