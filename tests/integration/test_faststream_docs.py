"""The FastStream guide's code, run: the example service through its demo (real
``faststream run`` workers on RabbitMQ), the Redis stream, NATS JetStream and Kafka
examples."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from faststream.rabbit.annotations import RabbitMessage
from sqlalchemy import text

from inbox_middleware._core.protocol import Decision
from inbox_middleware.faststream import identity_headers
from inbox_middleware.faststream._payload import payload_hash

from ..apps.domain import balance
from ..support import services
from ..support.faststream_brokers import Harness, eventually

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "faststream"


def load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_faststream_example__demo_applies_each_effect_once_and_shows_the_contrast():
    services.require(services.POSTGRES, "PostgreSQL")
    services.require(services.RABBITMQ, "RabbitMQ")
    result = subprocess.run(
        [sys.executable, "demo.py"], cwd=EXAMPLE, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "a `faststream run` worker" in result.stdout
    assert "60 credits applied, one per order (20 duplicates skipped)" in result.stdout
    assert "6 conflicting messages quarantined" in result.stdout
    assert "86 credits applied for 60 orders" in result.stdout  # without the inbox
    assert "each effect happened exactly once with the inbox" in result.stdout


async def test_faststream_redis_example__guard_accepts_it_and_it_applies_once(
    pg_async_engine, pg_engine
):
    snippet = load("redis_stream")
    stream = Harness("redis", []).source
    _, broker = snippet.build(pg_async_engine, services.REDIS, stream, "w1")
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (7, 0)"))
    order = {"account_id": 7, "amount": 10}
    headers = identity_headers(producer="orders", message_id="o-1")
    try:
        async with broker:
            await broker.start()  # guarded: the check accepts the reclaiming pair
            await broker.publish(order, stream=stream, headers=headers)
            await broker.publish(order, stream=stream, headers=headers)
            await eventually(lambda: _balance(pg_engine) == 10, what="the credit")
            await eventually(lambda: _pending(broker, stream), what="both acknowledged")
    finally:
        async with broker:
            await broker._connection.delete(stream)
    assert _balance(pg_engine) == 10


async def test_faststream_kafka_example__guard_accepts_it_and_it_applies_once(
    pg_async_engine, pg_engine
):
    from ..support import kafka

    snippet = load("kafka")
    topic = Harness("kafka", []).source
    _, broker = snippet.build(pg_async_engine, services.KAFKA, topic)
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (7, 0)"))
    order = {"account_id": 7, "amount": 10}
    headers = identity_headers(producer="orders", message_id="o-1")
    try:
        async with broker:
            # Published before the group exists: auto_offset_reset="earliest" reads it
            await broker.publish(order, topic, headers=headers)
            await broker.publish(order, topic, headers=headers)
            await broker.start()  # guarded: creates the quarantine and dead-letter topics
            await eventually(lambda: _balance(pg_engine) == 10, timeout=30, what="the credit")
            await eventually(lambda: _nothing_uncommitted(topic), timeout=15, what="both committed")
            assert await kafka.partitions(f"{topic}.quarantine") >= 1
    finally:
        await kafka.delete_topics([topic, f"{topic}.quarantine", f"{topic}.dead-letter"])
    assert _balance(pg_engine) == 10


async def test_faststream_nats_example__guard_accepts_it_and_it_applies_once(
    pg_async_engine, pg_engine
):
    snippet = load("nats_jetstream")
    subject = Harness("nats", []).source
    stream = f"S{subject}".upper()
    _, broker = snippet.build(pg_async_engine, services.NATS, subject, stream)
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (7, 0)"))
    order = {"account_id": 7, "amount": 10}
    headers = identity_headers(producer="orders", message_id="o-1")
    conflict = {"account_id": 7, "amount": 99}
    try:
        async with broker:
            await broker.start()  # guarded: the check accepts a durable JetStream consumer
            # The order first, alone: a pull subscriber runs the messages of a fetch at
            # once, and the copy that claims first is the one applied. Its duplicate and
            # the conflict are then both decided against it, in whichever order.
            await broker.publish(order, subject, headers=headers, stream=stream)
            await eventually(lambda: _balance(pg_engine) == 10, what="the credit")
            for body in (order, conflict):
                await broker.publish(body, subject, headers=headers, stream=stream)
            await eventually(lambda: _quarantined(pg_engine), what="the conflict")
            await eventually(lambda: _nothing_pending(broker, stream), what="all three acked")
    finally:
        async with broker:
            for name in (stream, f"{stream}_inbox"):
                with contextlib.suppress(Exception):
                    await broker.config.connection_state.stream.delete_stream(name)
    assert _balance(pg_engine) == 10


def _quarantined(engine: Any) -> bool:
    with engine.connect() as conn:
        return conn.scalar(text("SELECT count(*) FROM inbox_quarantine")) == 1


async def _nothing_pending(broker: Any, stream: str) -> bool:
    info = await broker.config.connection_state.stream.consumer_info(stream, "billing")
    return info.num_ack_pending == 0 and info.num_pending == 0


async def _nothing_uncommitted(topic: str) -> bool:
    from ..support import kafka

    return await kafka.uncommitted("billing", topic) == 0


def _balance(engine: Any) -> int:
    with engine.connect() as conn:
        return balance(conn, 7)


async def _pending(broker: Any, stream: str) -> bool:
    info = await broker._connection.xinfo_groups(stream)
    return bool(info) and int(info[0]["pending"]) == 0 and int(info[0]["lag"]) == 0


async def test_faststream_options_example__stamp_identity_on_orders_only():
    from faststream.rabbit import TestRabbitBroker

    options = load("options")
    broker = options.stamping_broker(services.RABBITMQ)
    received: list[dict[str, Any]] = []

    @broker.subscriber("orders")
    async def orders(body: dict[str, Any], message: RabbitMessage) -> None:
        received.append(dict(message.headers))

    @broker.subscriber("replies")
    async def replies(body: dict[str, Any], message: RabbitMessage) -> None:
        received.append(dict(message.headers))

    async with TestRabbitBroker(broker):
        await broker.publish({"id": 42}, "orders")
        await broker.publish({"id": 42}, "replies")
    assert received[0]["x-inbox-message-id"] == "order-42"
    assert "x-inbox-message-id" not in received[1]


async def test_faststream_options_example__batch_subscriber_is_accepted_and_decides(
    pg_async_engine, pg_engine
):
    options = load("options")
    _, broker = options.batch_service(pg_async_engine, services.REDIS, "w1")
    from redis.asyncio import Redis

    client = Redis.from_url(services.REDIS)
    await client.delete("orders")
    await client.xgroup_create("orders", "billing", id="0", mkstream=True)
    try:
        async with broker:
            for message_id in ("o-1", "o-1", "o-2"):
                headers = identity_headers(producer="orders", message_id=message_id)
                await broker.publish({"amount": 1}, stream="orders", headers=headers)
            await broker.start()
            await eventually(lambda: broker.seen, what="the batch")
    finally:
        await client.delete("orders")
        await client.aclose()
    (orders, decisions), *_ = broker.seen
    assert decisions == [Decision.FIRST, Decision.DUPLICATE, Decision.FIRST]
    assert orders == [{"amount": 1}, {"amount": 1}]


def test_faststream_options_example__canonical_form_ignores_the_send_time(pg_async_engine):
    options = load("options")
    inbox = options.canonical_inbox(pg_async_engine)
    first = payload_hash(b'{"id": 1, "sent_at": "10:00"}', {}, inbox.canonical_form)[0]
    again = payload_hash(b'{"sent_at": "10:05", "id": 1}', {}, inbox.canonical_form)[0]
    other = payload_hash(b'{"id": 2, "sent_at": "10:00"}', {}, inbox.canonical_form)[0]
    assert first == again != other
    assert first.scheme == "custom.v2:orders.v1"
