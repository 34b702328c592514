"""A chain of two inbox services keeps the guarantee through SIGKILLs at random points.

Service A (`tests.apps.chain_app`, two ``faststream run`` processes) reserves each order
and returns an event that FastStream publishes; service B (two more) ships it. Each
process SIGKILLs itself at a random few of its messages, at the points where a crash
costs the most: A after its commit and before anything was published, and after the
publish and before the ack; B after its commit and before the ack. The test restarts
every process that died, until both services have settled every order.

The crash points are drawn at random per run (the seed is printed): every run is one
sample of the property "whatever the crash points, every order has exactly one effect
in A and exactly one in B". CI runs one seed at 300 orders; ``INBOX_TEST_CHAIN_SEEDS``
and ``INBOX_TEST_CHAIN_ORDERS`` run more.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import text

from inbox_middleware.faststream import identity_headers

from ..support import services
from ..support.faststream_worker import FastStreamWorker
from ..support.workers import wait_for

APP = "tests.apps.chain_app:app"
ORDERS = int(os.environ.get("INBOX_TEST_CHAIN_ORDERS", "300"))
# Without seeds given, one fresh seed drawn in the test (not at collection: the suite's
# two processes must collect the same tests).
SEEDS: list[int | None] = [
    int(seed) for seed in os.environ.get("INBOX_TEST_CHAIN_SEEDS", "").split(",") if seed
] or [None]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: "fresh" if s is None else str(s))
def test_chain__every_order_has_one_effect_in_each_service_through_kills(
    seed, pg_async_url, pg_engine, tmp_path: Path, capsys
):
    if seed is None:
        seed = random.randrange(10**6)
    services.require(services.RABBITMQ, "RabbitMQ")
    source = f"t{uuid.uuid4().hex[:10]}"
    env = {
        "INBOX_TEST_DATABASE_URL": pg_async_url,
        "INBOX_TEST_BROKER_URL": services.RABBITMQ,
        "INBOX_TEST_SOURCE": source,
        "INBOX_TEST_SEED": str(seed),
    }
    # A dies at two points, B at one: B's chance is twice A's, so that each has about 6
    # kills at 300 orders (and none in a run is a chance of about 1 in 400 for either).
    chance = float(os.environ.get("INBOX_TEST_CHAIN_KILL_CHANCE", "0.01"))
    chances = {"a": str(chance), "b": str(2 * chance)}
    kill_at = {"a": "after_commit,outputs_published", "b": "after_commit"}
    workers: dict[str, FastStreamWorker] = {}
    kills = {"a": 0, "b": 0}
    started = 0

    def start(name: str) -> None:
        nonlocal started
        role = name[0]
        workers[name] = FastStreamWorker(
            APP,
            env
            | {
                "INBOX_TEST_ROLE": role,
                "INBOX_TEST_KILL_AT": kill_at[role],
                "INBOX_TEST_KILL_CHANCE": chances[role],
            },
            tmp_path / f"{name}-{started}.log",
        )
        started += 1

    try:
        for name in ("a1", "a2", "b1", "b2"):
            start(name)
        wait_for(lambda: all(w.ready() for w in workers.values()), timeout=60, what="start-up")
        # When the orders arrive, each with its identity
        asyncio.run(_send(f"{source}.orders", ORDERS))

        # ... and every process that killed itself is started again, until all is settled
        def settled() -> bool:
            for name, worker in list(workers.items()):
                if worker.proc.poll() is not None:
                    kills[name[0]] += 1
                    start(name)
            return _ledger(pg_engine) == {"stock": ORDERS, "shipping": ORDERS}

        try:
            wait_for(settled, timeout=240, interval=0.5, what="both services to settle")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: ledger {_ledger(pg_engine)}, kills {kills}") from None
        time.sleep(3)  # an effect applied twice would show up here
        settled()
        doubled = _doubled(pg_engine)
        left = asyncio.run(_left(source))
    finally:
        for worker in workers.values():
            worker.kill()
        asyncio.run(_cleanup(source))
    ledger = _ledger(pg_engine)
    with capsys.disabled():
        print(
            f"\nchain seed={seed}: orders {ORDERS}, effects in A {ledger['stock']}, "
            f"in B {ledger['shipping']}, lost {2 * ORDERS - sum(ledger.values())}, "
            f"doubled {doubled}, SIGKILLs in A {kills['a']}, in B {kills['b']}"
        )
    # Then every order has exactly one effect in A and one in B, nothing is left unacked,
    # and the processes did die along the way
    assert ledger == {"stock": ORDERS, "shipping": ORDERS}
    assert doubled == 0
    assert left == 0
    assert kills["a"] >= 1 and kills["b"] >= 1


async def _send(queue: str, count: int) -> None:
    from faststream.rabbit import RabbitBroker, RabbitQueue

    broker = RabbitBroker(services.RABBITMQ)
    async with broker:
        await broker.declare_queue(RabbitQueue(queue, durable=True))
        for n in range(count):
            headers = identity_headers(producer="shop", message_id=f"order-{n}")
            await broker.publish({"order": n}, queue, headers=headers, persist=True)


def _ledger(engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT consumer, count(DISTINCT account_id) FROM ledger GROUP BY consumer")
        ).all()
    return {"stock": 0, "shipping": 0} | {consumer: int(n) for consumer, n in rows}


def _doubled(engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.scalar(
                text(
                    "SELECT count(*) FROM (SELECT consumer, account_id FROM ledger "
                    "GROUP BY consumer, account_id HAVING count(*) > 1) AS twice"
                )
            )
        )


async def _left(source: str) -> int:
    import aio_pika

    connection = await aio_pika.connect(services.RABBITMQ)
    async with connection:
        channel = await connection.channel()
        total = 0
        for name in (f"{source}.orders", f"{source}.events"):
            queue = await channel.declare_queue(name, durable=True)
            total += int(queue.declaration_result.message_count or 0)
        return total


async def _cleanup(source: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(services.RABBITMQ)
    async with connection:
        channel = await connection.channel()
        for suffix in (".orders", ".events", ".orders.quarantine", ".orders.dead-letter"):
            await channel.queue_delete(f"{source}{suffix}")
        for suffix in (".events.quarantine", ".events.dead-letter"):
            await channel.queue_delete(f"{source}{suffix}")
