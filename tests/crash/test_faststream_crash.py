"""Real ``faststream run`` worker processes, killed with SIGKILL at named points.

Each test starts a worker on `tests.apps.faststream_app`, lets the first message reach a
point where that worker stops (it writes ``<point>.paused`` and waits), kills its whole
process group, starts a fresh worker, and checks that the message came back and was
applied exactly once:

    in_body        after the claim and the writes,   the server rolls the transaction back
                   before the commit
    after_commit   after the commit, before the ack  the redelivery must be a duplicate

RabbitMQ redelivers once the dead worker's connection drops; Redis once the message has
been pending for the reclaiming subscriber's idle time; NATS once JetStream's ack wait
has passed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from inbox_middleware.faststream import identity_headers

from ..apps.domain import balance, effects
from ..support import services
from ..support.faststream_brokers import KINDS, Harness, eventually
from ..support.faststream_worker import FastStreamWorker

APP = "tests.apps.faststream_app:app"
pytestmark = pytest.mark.slow

URLS = {
    "rabbit": services.RABBITMQ,
    "redis": services.REDIS,
    "nats": services.NATS,
    "kafka": services.KAFKA,
}


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def setup(kind: str, pg_async_url: str, pg_engine: Any, tmp_path: Path) -> Any:
    """A producer (the test's harness) and a way to start workers."""
    producer = Harness(kind, [])
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {
        "INBOX_TEST_DATABASE_URL": pg_async_url,
        "INBOX_TEST_BROKER": kind,
        "INBOX_TEST_BROKER_URL": URLS[kind],
        "INBOX_TEST_SOURCE": producer.source,
        "INBOX_TEST_MARKERS": str(markers),
        "INBOX_TEST_ARRIVALS": str(tmp_path / "arrivals.log"),
    }
    started: list[FastStreamWorker] = []

    async def start(wait: bool = True, **extra: str) -> FastStreamWorker:
        number = len(started) + 1
        worker = FastStreamWorker(
            APP,
            env | {"INBOX_TEST_WORKER": f"w{number}"} | extra,
            tmp_path / f"worker-{number}.log",
        )
        started.append(worker)
        if wait:
            await eventually(worker.ready, timeout=60, what="the worker to start")
        return worker

    yield start, producer, markers
    for worker in started:
        worker.kill()
    await producer.cleanup()


def inbox_rows(pg_engine: Any) -> int:
    with pg_engine.connect() as conn:
        return int(conn.scalar(text("SELECT count(*) FROM consumer_inbox")))


def applied(pg_engine: Any) -> int:
    with pg_engine.connect() as conn:
        return effects(conn, 7)


@pytest.mark.parametrize("point", ["in_body", "after_commit"])
async def test_faststream_crash__killed_worker_message_is_redelivered_and_applied_once(
    setup, pg_engine, point
):
    await _killed_at(setup, pg_engine, point)


@pytest.mark.parametrize("kind", ["kafka"])
async def test_faststream_crash__kafka_member_killed_before_the_claim_loses_nothing(
    setup, pg_engine, kind
):
    # Kafka reads ahead of the claim (the record is fetched, the offset not committed): a
    # member killed before the claim leaves the message to the next owner of the partition.
    await _killed_at(setup, pg_engine, "before_claim")


async def _killed_at(setup: Any, pg_engine: Any, point: str) -> None:
    start, producer, markers = setup
    # Given a worker that will stop at `point` on its first message
    first = await start(INBOX_TEST_PAUSE_AT=point)
    async with producer.broker:
        await producer.publish(
            {"account": 7, "delta": 10}, identity_headers(producer="orders", message_id="o-1")
        )
    await eventually((markers / f"{point}.paused").exists, timeout=30, what=point)
    committed = inbox_rows(pg_engine)
    # When it is killed there (after_commit: the commit is durable, the ack never sent)
    first.kill()
    assert committed == (1 if point == "after_commit" else 0)
    # Then a fresh worker gets the message again and the effect exists exactly once
    second = await start()
    if point == "after_commit":
        await eventually(
            lambda: "duplicate delivery skipped: consumer=billing" in second.output(),
            timeout=60,
            what="the redelivery, skipped as a duplicate",
        )
    else:
        await eventually(lambda: applied(pg_engine) == 1, timeout=60, what="the effect")
    await asyncio.sleep(1)  # a redelivery processed twice would show up here
    second.stop()
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
    assert inbox_rows(pg_engine) == 1
    assert await producer.leftover() == 0  # acknowledged by the second worker


@pytest.mark.parametrize("kind", ["nats"])
async def test_faststream_crash__a_batch_that_kills_its_worker_is_poison_per_message(
    setup, pg_engine, kind
):
    # Given a NATS batch subscriber with redelivery_limit=0, whose worker is killed in the
    # handler of the first batch of two messages (JetStream counts each one's deliveries)
    start, producer, markers = setup
    limits = {"INBOX_TEST_BATCH": "1", "INBOX_TEST_REDELIVERY_LIMIT": "0"}
    first = await start(INBOX_TEST_PAUSE_AT="in_body", **limits)
    async with producer.broker:
        for number in (1, 2):
            await producer.publish(
                {"account": 7, "delta": 10},
                identity_headers(producer="orders", message_id=f"b-{number}"),
            )
    await eventually((markers / "in_body.paused").exists, timeout=30, what="in_body")
    first.kill()
    # When a fresh worker gets the batch again (each message delivered a second time)
    second = await start(**limits)
    await eventually(
        lambda: poison(pg_engine) == [("b-1", "redelivery_limit"), ("b-2", "redelivery_limit")],
        timeout=60,
        what="each message of the batch kept as poison by the redelivery limit",
    )
    await asyncio.sleep(1)
    second.stop()
    # Then each message is kept as poison, none applied, none left with the broker
    assert applied(pg_engine) == 0
    assert inbox_rows(pg_engine) == 0
    assert await producer.leftover() == 0


def poison(pg_engine: Any) -> list[tuple[str, str]]:
    with pg_engine.connect() as conn:
        rows = conn.execute(text("SELECT message_id, reason_code FROM inbox_poison"))
        return sorted((str(row[0]), str(row[1])) for row in rows)


async def test_faststream_crash__worker_refuses_to_start_with_ack_first(setup, pg_engine):
    start, producer, _ = setup
    # Given a message waiting, and a worker whose inbox subscriber acks first
    await producer.prepare_source()
    async with producer.broker:
        await producer.publish(
            {"account": 7, "delta": 10}, identity_headers(producer="orders", message_id="o-1")
        )
    worker = await start(wait=False, INBOX_TEST_ACK_POLICY="ack_first")
    # When it starts, the guard stops it before any subscriber consumes
    await asyncio.to_thread(worker.proc.wait, 30)
    assert worker.proc.returncode != 0
    assert "the inbox refuses to start these subscribers" in worker.output()
    assert "ACK_FIRST" in worker.output()
    assert applied(pg_engine) == 0
    assert await producer.leftover() == 1
