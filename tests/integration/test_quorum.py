"""RabbitMQ quorum queues, for Dramatiq (`QuorumRabbitmqBroker`) and FastStream
(``RabbitQueue(..., queue_type=QueueType.QUORUM)``): every queue the inbox declares is a
quorum queue when the source is, the broker's delivery count (``x-delivery-count``) is the
redelivery count, and hand-backs spend none of the queue's delivery limit. A RabbitMQ
restart under load: ``tests/chaos/test_topologies.py``."""

from __future__ import annotations

import subprocess
from typing import Any

import dramatiq
import pika
from sqlalchemy import create_engine, func, insert, select

from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity
from inbox_middleware.faststream import FastStreamInbox, InboxSession
from inbox_middleware.storage import InboxSchema

from ..apps.domain import apply_credit, apply_credit_async, balance, effects
from ..support import services
from ..support.dramatiq_worker import drain, running_worker
from ..support.faststream_brokers import Seen
from ..support.proxy import Proxy
from ..support.workers import wait_for
from .test_dramatiq import dead_letters, quarantined
from .test_settlement_faststream import harness

NAMING = InboxSchema()


def queue_types(*names: str) -> dict[str, str]:
    listing = subprocess.run(
        ["rabbitmqctl", "list_queues", "--quiet", "--no-table-headers", "name", "type"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    types = dict(line.split("\t")[:2] for line in listing.splitlines() if "\t" in line)
    return {name: types.get(name, "missing") for name in names}


def poison_rows(engine: Any) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(select(NAMING.tables.poison)).mappings().all()]


def send(actor: Any, *args: Any, message_id: str = "ord-1") -> Any:
    return actor.send_with_options(args=args, **identity(producer="orders", message_id=message_id))


def test_quorum__dramatiq_declares_quorum_queues_and_quarantines_to_one(
    quorum_broker, queue, pg_engine
):
    quorum_broker.add_middleware(InboxMiddleware(pg_engine))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    # Given a message, then another payload under the same identity
    with running_worker(quorum_broker) as worker:
        send(add_credit, 7, 10)
        drain(quorum_broker, queue, worker)
        send(add_credit, 7, 99)
        drain(quorum_broker, queue, worker)
    # Then the queues are quorum queues, the conflict's quarantine queue too
    names = (queue, f"{queue}.DQ", f"{queue}.XQ", f"{queue}.quarantine")
    assert queue_types(*names) == dict.fromkeys(names, "quorum")
    assert quarantined(quorum_broker, queue) == 1
    with pg_engine.connect() as conn:
        assert balance(conn, 7) == 10


def _crashed_deliveries(engine: Any, counted: int) -> None:
    """What deliveries that reached the database and died with the message leave: the
    redeliveries among them counted in the attempts row, no failure, no hand-back."""
    with engine.begin() as conn:
        conn.execute(
            insert(NAMING.tables.attempts).values(
                consumer_name="billing",
                producer_name="orders",
                tenant="",
                message_id="ord-1",
                attempts=0,
                redeliveries=counted,
                hand_backs=0,
                first_failure_at=func.now(),
                last_failure_at=func.now(),
            )
        )


def test_quorum__dramatiq_redelivery_count_is_the_brokers(quorum_broker, queue, pg_engine):
    # Given a redelivery limit of 1, and a message that went back to its queue three times
    # unacknowledged (three consumers died holding it, after it reached the database)
    quorum_broker.add_middleware(InboxMiddleware(pg_engine, redelivery_limit=1))
    _crashed_deliveries(pg_engine, counted=2)

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    send(add_credit, 7, 10)
    connection = pika.BlockingConnection(pika.URLParameters(services.RABBITMQ))
    try:
        channel = connection.channel()
        for _ in range(3):
            method = None
            while method is None:
                method, _, _ = channel.basic_get(queue)
            channel.basic_nack(method.delivery_tag, requeue=True)
    finally:
        connection.close()
    # When a worker receives it (x-delivery-count 3: its fourth delivery)
    with running_worker(quorum_broker) as worker:
        drain(quorum_broker, queue, worker)
    # Then the inbox counted the broker's redeliveries: kept as poison, never applied
    [row] = poison_rows(pg_engine)
    assert row["reason_code"] == "redelivery_limit"
    wait_for(lambda: dead_letters(quorum_broker, queue) == 1, timeout=10, what="the dead letter")
    with pg_engine.connect() as conn:
        assert effects(conn) == 0


def test_quorum__deliveries_that_never_reached_the_database_are_no_crashes(
    quorum_broker, queue, pg_engine
):
    # Given a redelivery limit of 1, and a message requeued three times by a consumer that
    # never reached the database (as every worker does while the database is down)
    quorum_broker.add_middleware(InboxMiddleware(pg_engine, redelivery_limit=1))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    send(add_credit, 7, 10)
    connection = pika.BlockingConnection(pika.URLParameters(services.RABBITMQ))
    try:
        channel = connection.channel()
        for _ in range(3):
            method = None
            while method is None:
                method, _, _ = channel.basic_get(queue)
            channel.basic_nack(method.delivery_tag, requeue=True)
    finally:
        connection.close()
    # When a worker receives it (x-delivery-count 3: its fourth delivery)
    with running_worker(quorum_broker) as worker:
        drain(quorum_broker, queue, worker)
    # Then the broker's count is no evidence that a worker died with it: applied once
    assert poison_rows(pg_engine) == []
    with pg_engine.connect() as conn:
        assert (effects(conn), balance(conn, 7)) == (1, 10)


def test_quorum__dramatiq_hand_backs_spend_no_delivery_limit(
    quorum_broker, queue, pg_url, pg_engine
):
    # Given a delivery limit of 5, and a worker whose database is down
    proxy = Proxy(("127.0.0.1", 5432))
    engine = create_engine(
        pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"), pool_pre_ping=True
    )
    middleware = InboxMiddleware(engine)
    quorum_broker.add_middleware(middleware)
    handed_back: list[int] = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=2)
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    backoff = middleware.backoffs[add_credit.actor_name]
    backoff.first = backoff.limit = 0.02
    original = middleware._hand_back_delay

    def counting(error: BaseException, pending: Any) -> float:
        handed_back.append(1)
        return original(error, pending)

    middleware._hand_back_delay = counting  # type: ignore[method-assign]
    try:
        with running_worker(quorum_broker) as worker:
            proxy.down()
            send(add_credit, 7, 10)
            # When the message is handed back 12 times
            wait_for(lambda: len(handed_back) >= 12, timeout=60, what="12 hand-backs")
            # Then, once the database is back, it is applied: not dead-lettered
            proxy.up()
            drain(quorum_broker, queue, worker)
            wait_for(lambda: _effects(pg_engine) == 1, timeout=20, what="the effect")
    finally:
        engine.dispose()
        proxy.close()
    assert dead_letters(quorum_broker, queue) == 0
    assert poison_rows(pg_engine) == []


def _effects(engine: Any) -> int:
    with engine.connect() as conn:
        return effects(conn)


async def test_quorum__faststream_quarantine_and_dead_letter_queues_are_quorum(
    pg_async_engine, pg_engine
):
    from faststream.rabbit import QueueType, RabbitQueue

    seen = Seen()
    inbox = FastStreamInbox(pg_async_engine)
    async with harness("rabbit", inbox, seen) as h:
        source = RabbitQueue(
            h.name, durable=True, queue_type=QueueType.QUORUM, arguments={"x-delivery-limit": 5}
        )

        @h.broker.subscriber(source, dependencies=[inbox.consumer("billing")])
        async def handle(body: dict[str, Any], session: InboxSession) -> None:
            await apply_credit_async(session, "billing", body["account"], body["delta"])

        # When the broker starts (the inbox declares its destinations)
        async with h.broker:
            await h.broker.start()
        names = (h.name, f"{h.name}.quarantine", f"{h.name}.dead-letter")
        # Then they are quorum queues, as the source is
        assert queue_types(*names) == dict.fromkeys(names, "quorum")
