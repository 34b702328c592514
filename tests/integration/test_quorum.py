"""RabbitMQ quorum queues, for Dramatiq (`QuorumRabbitmqBroker`) and FastStream
(``RabbitQueue(..., queue_type=QueueType.QUORUM)``): every queue the inbox declares is a
quorum queue when the source is, the broker's delivery count (``x-delivery-count``) is the
redelivery count, and hand-backs spend none of the queue's delivery limit. A RabbitMQ
restart under load: ``tests/chaos/test_topologies.py``."""

from __future__ import annotations

import contextlib
import subprocess
from typing import Any

import dramatiq
import pika
from sqlalchemy import create_engine, func, insert, select

from inbox_middleware._storage import InboxSchema
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity
from inbox_middleware.faststream import FastStreamInbox, InboxSession

from ..apps.domain import apply_credit, apply_credit_async, balance, effects
from ..support import services
from ..support.dramatiq_worker import drain, running_worker
from ..support.faststream_brokers import Seen, eventually
from ..support.proxy import Proxy
from ..support.workers import wait_for
from .test_dramatiq import dead_letters, quarantined
from .test_settlement_faststream import MESSAGE, harness

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

    def counting(settlement: Any, pending: Any) -> float:
        handed_back.append(1)
        return original(settlement, pending)

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


# -- a deleted quarantine queue comes back as a quorum queue; a hand-back keeps the request --


def delete_queue(name: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(services.RABBITMQ))
    try:
        connection.channel().queue_delete(name)
    finally:
        connection.close()


def queue_depth(name: str) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(services.RABBITMQ))
    try:
        return int(connection.channel().queue_declare(name, passive=True).method.message_count)
    finally:
        connection.close()


def test_quorum__dramatiq_deleted_quarantine_queue_is_declared_quorum_again(
    quorum_broker, queue, pg_engine
):
    quorum_broker.add_middleware(InboxMiddleware(pg_engine))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    with running_worker(quorum_broker) as worker:
        send(add_credit, 7, 10)
        send(add_credit, 7, 99)
        drain(quorum_broker, queue, worker)
        # Given an operator who deleted the quarantine queue
        delete_queue(f"{queue}.quarantine")
        # When another conflict is quarantined
        send(add_credit, 7, 98)
        drain(quorum_broker, queue, worker)
    # Then the queue is declared again, as a quorum queue, with the conflict in it
    assert queue_types(f"{queue}.quarantine") == {f"{queue}.quarantine": "quorum"}
    assert quarantined(quorum_broker, queue) == 1


async def test_quorum__faststream_deleted_quarantine_queue_is_declared_quorum_again(
    pg_async_engine, pg_engine
):
    from faststream.rabbit import QueueType, RabbitQueue

    from .test_faststream import ORDER, ident

    seen = Seen()
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.2))

    def app(h: Any) -> None:
        source = RabbitQueue(h.name, durable=True, queue_type=QueueType.QUORUM)

        @h.broker.subscriber(source, dependencies=[inbox.consumer("billing")])
        async def handle(body: dict[str, Any], session: InboxSession) -> None:
            await apply_credit_async(session, "billing", body["account"], body["delta"])

    async with harness("rabbit", inbox, seen) as h:
        app(h)
        async with h.broker:
            await h.broker.start()
            await h.publish(ORDER, ident())
            await eventually(lambda: seen.count("processed") == 1, what="the effect")
            # Given an operator who deleted the quarantine queue of the running app
            delete_queue(f"{h.name}.quarantine")
            # When a conflict is quarantined
            await h.publish({"account": 7, "delta": 99}, ident())
            await eventually(lambda: seen.count("Skipped") == 1, what="the quarantined conflict")
        # Then the queue came back as a quorum queue
        assert queue_types(f"{h.name}.quarantine") == {f"{h.name}.quarantine": "quorum"}
        # And the app starts again (its start-up declares the queue as quorum)
        again = type(h)("rabbit", [inbox.middleware])
        again.name = h.name
        inbox.guard(again.broker)
        app(again)
        async with again.broker:
            await again.broker.start()
        assert queue_depth(f"{h.name}.quarantine") == 1


async def test_quorum__faststream_handed_back_request_still_gets_its_reply(
    pg_async_engine, pg_engine
):
    from faststream.rabbit import QueueType, RabbitQueue

    from .test_faststream import ident

    seen = Seen()
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.2))
    attempts: list[int] = []
    async with harness("rabbit", inbox, seen) as h:
        source = RabbitQueue(h.name, durable=True, queue_type=QueueType.QUORUM)

        # Given a handler whose first attempt fails: the request is handed back, which on a
        # quorum queue is a new publish of it
        @h.broker.subscriber(source, dependencies=[inbox.consumer("billing")])
        async def handle(body: dict[str, Any], session: InboxSession) -> dict[str, Any]:
            attempts.append(1)
            if len(attempts) == 1:
                raise RuntimeError("the first attempt fails")
            await apply_credit_async(session, "billing", body["account"], body["delta"])
            return {"balance": body["delta"]}

        async with h.broker:
            await h.broker.start()
            # When a caller sends it as a request (direct reply-to) with a priority and a
            # time to live
            reply = await h.broker.request(
                {"account": 7, "delta": 10},
                h.name,
                headers=ident(),
                timeout=10,
                priority=3,
                message_type="credit",
                expiration=60,
            )
            # Then the caller gets the reply of the attempt that committed
            assert await reply.decode() == {"balance": 10}
    assert len(attempts) == 2
    assert _effects(pg_engine) == 1


async def test_quorum__faststream_request_whose_caller_timed_out_commits_once(
    pg_async_engine, pg_engine
):
    import asyncio

    from faststream.rabbit import QueueType, RabbitQueue

    from .test_faststream import ident

    seen = Seen()
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.2))
    attempts: list[int] = []
    async with harness("rabbit", inbox, seen) as h:
        source = RabbitQueue(h.name, durable=True, queue_type=QueueType.QUORUM)

        # Given a handler whose first attempt fails after the caller gave up waiting
        @h.broker.subscriber(source, dependencies=[inbox.consumer("billing")])
        async def handle(body: dict[str, Any], session: InboxSession) -> dict[str, Any]:
            attempts.append(1)
            await asyncio.sleep(1.0)
            if len(attempts) == 1:
                raise RuntimeError("the first attempt fails")
            await apply_credit_async(session, "billing", body["account"], body["delta"])
            return {"balance": body["delta"]}

        async with h.broker:
            await h.broker.start()
            with contextlib.suppress(TimeoutError):
                await h.broker.request(
                    {"account": 7, "delta": 10}, h.name, headers=ident(), timeout=0.5
                )
            # When the request is handed back and committed with nobody waiting
            await eventually(lambda: seen.count("processed") == 1, what="the commit")
            # Then the effect is applied once, nothing is poisoned, and the caller's
            # repeat gets the stored reply as a duplicate
            reply = await h.broker.request(
                {"account": 7, "delta": 10}, h.name, headers=ident(), timeout=10
            )
            assert await reply.decode() == {"balance": 10}
    assert len(attempts) == 2
    assert _effects(pg_engine) == 1
    assert poison_rows(pg_engine) == []


async def test_quorum__faststream_hand_back_keeps_the_properties_and_what_is_left_of_the_ttl(
    pg_async_engine, pg_engine
):
    from faststream.rabbit import QueueType, RabbitQueue

    from .test_faststream import ORDER, ident

    seen = Seen()
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.3, 0.3))
    attempts: list[dict[str, Any]] = []
    async with harness("rabbit", inbox, seen) as h:
        source = RabbitQueue(h.name, durable=True, queue_type=QueueType.QUORUM)

        # Given a handler whose first attempt fails, on a quorum queue
        @h.broker.subscriber(source, dependencies=[inbox.consumer("billing")])
        async def handle(
            body: dict[str, Any], session: InboxSession, message: Any = MESSAGE
        ) -> None:
            raw = message.raw_message
            attempts.append(
                {
                    "expiration": raw.expiration,
                    "expires_at": (raw.headers or {}).get("x-inbox-expires-at"),
                    "properties": (
                        raw.priority,
                        raw.type,
                        raw.user_id,
                        raw.app_id,
                        raw.correlation_id,
                    ),
                }
            )
            if len(attempts) == 1:
                raise RuntimeError("the first attempt fails")
            await apply_credit_async(session, "billing", body["account"], body["delta"])

        async with h.broker:
            await h.broker.start()
            # When a message with a priority, a type and a 60 s time to live arrives
            await h.broker.publish(
                ORDER,
                h.name,
                headers=ident(),
                persist=True,
                priority=3,
                message_type="credit",
                expiration=60,
                correlation_id="c-1",
                user_id="guest",  # the connection's user: RabbitMQ checks it
            )
            await eventually(lambda: seen.count("processed") == 1, what="the commit")
    # Then the copy handed back kept its properties, and its time to live went on from
    # the deadline the hand-back wrote down, not from 60 s again
    first, second = attempts
    assert first["expiration"] == 60 and first["expires_at"] is None
    assert second["properties"] == first["properties"]
    assert first["properties"][:3] == (3, "credit", "guest")
    assert second["expires_at"] is not None
    assert 55 < second["expiration"] < 60
    assert _effects(pg_engine) == 1
