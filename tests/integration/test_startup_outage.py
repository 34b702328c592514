"""A worker started while its database is down: the start-up check waits the outage out
for ``startup_patience`` before anything is consumed, then consumes and applies everything
once; kept down past the patience, the worker exits non-zero having consumed nothing, and
nothing is lost. Without ``guard`` (FastStream), the check runs at the first message: its
messages are handed back through the core, counted as hand-backs, the warning printed
once, and everything is applied once when the database returns.

Real ``dramatiq`` and ``faststream run`` processes, real Redis and RabbitMQ, and a
PostgreSQL of these tests alone that they stop and start (``scripts/services
postgres-outage``), never the shared one::

    .venv/bin/python -m pytest tests/integration/test_startup_outage.py
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from sqlalchemy import Engine, create_engine, text

from inbox_middleware.dramatiq import identity
from inbox_middleware.faststream import identity_headers

from ..apps.domain import balance, effects
from ..support import services
from ..support.faststream_brokers import Harness, eventually
from ..support.faststream_worker import FastStreamWorker
from ..support.outage import OutagePostgres
from ..support.workers import WorkerProcess, wait_for

pytestmark = pytest.mark.slow

INTENTS = 12  # each sent twice
WAITING = "the inbox's database is not ready (attempt"
GAVE_UP = "the inbox's database was not ready after"


@pytest.fixture
def db(outage_postgres: OutagePostgres) -> Iterator[Engine]:
    engine = create_engine(outage_postgres.url, pool_pre_ping=True)
    yield engine
    engine.dispose()


def _ledger(engine: Engine) -> tuple[int, int, int, int]:
    """(effects, balance, claims, poison rows) of account 7."""
    with engine.connect() as conn:
        claims = int(conn.scalar(text("SELECT count(*) FROM consumer_inbox")) or 0)
        poison = int(conn.scalar(text("SELECT count(*) FROM inbox_poison")) or 0)
        return effects(conn, 7), balance(conn, 7), claims, poison


APPLIED_ONCE = (INTENTS, INTENTS, INTENTS, 0)


# -- Dramatiq ---------------------------------------------------------------------------------


@pytest.fixture
def dramatiq_setup(outage_postgres: OutagePostgres, queue: str, tmp_path: Path) -> Any:
    services.require(services.REDIS, "Redis")
    namespace = f"inbox-test-{queue}"
    env = {
        "INBOX_TEST_DATABASE_URL": outage_postgres.url,
        "INBOX_TEST_BROKER": "redis",
        "INBOX_TEST_BROKER_URL": services.REDIS,
        "INBOX_TEST_NAMESPACE": namespace,
        "INBOX_TEST_QUEUE": queue,
        "INBOX_TEST_ARRIVALS": str(tmp_path / "arrivals.log"),
    }
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url=services.REDIS, namespace=namespace)
    actor = dramatiq.actor(
        lambda account_id, delta: None, actor_name="add_credit", queue_name=queue, broker=broker
    )
    started: list[WorkerProcess] = []

    def start(**extra: str) -> WorkerProcess:
        worker = WorkerProcess(
            "tests.apps.dramatiq_app",
            env | extra,
            tmp_path / f"worker-{len(started)}.log",
            processes=2,
            threads=2,
            # The command forwards its workers' lines once they booted, or after this
            # timeout (30 s by default): a worker waiting at boot is heard at once.
            options=("--worker-fork-timeout", "100"),
        )
        started.append(worker)
        return worker

    yield start, actor, tmp_path / "arrivals.log"
    for worker in started:
        worker.kill()
    for key in broker.client.scan_iter(f"{namespace}*"):
        broker.client.delete(key)
    broker.close()


def _send_twice(actor: Any) -> None:
    for _ in range(2):
        for number in range(INTENTS):
            options = identity(producer="orders", message_id=f"o-{number}")
            actor.send_with_options(args=(7, 1), **options)


def test_startup__a_dramatiq_worker_started_while_its_database_is_down_waits_then_applies_all_once(
    dramatiq_setup, outage_postgres, db
):
    start, actor, arrivals = dramatiq_setup
    # Given messages waiting, and the database down
    _send_twice(actor)
    outage_postgres.stop()
    # When two worker processes start, with a patience longer than the outage
    worker = start(INBOX_TEST_STARTUP_PATIENCE="60")
    wait_for(lambda: worker.output().count(WAITING) >= 4, timeout=30, what="waiting lines")
    # Then they wait, one line per attempt naming the fix, and consume nothing meanwhile
    assert worker.proc.poll() is None, worker.output()
    assert "start PostgreSQL, or check the host and port" in worker.output()
    assert not arrivals.exists()
    # And once the database is back, every intent is applied once
    outage_postgres.start()
    wait_for(lambda: _ledger(db)[0] >= INTENTS, timeout=60, what="every intent applied")
    time.sleep(1.5)  # a duplicate applied twice would show up here
    worker.stop()
    print(worker.output())
    assert _ledger(db) == APPLIED_ONCE
    assert "database is ready" in worker.output()


def test_startup__a_dramatiq_worker_whose_database_stays_down_exits_having_consumed_nothing(
    dramatiq_setup, outage_postgres, db
):
    start, actor, arrivals = dramatiq_setup
    _send_twice(actor)
    outage_postgres.stop()
    # When the worker's patience runs out before the database returns
    worker = start(INBOX_TEST_STARTUP_PATIENCE="3")
    status = worker.proc.wait(timeout=60)
    output = worker.output()
    print(output)
    # Then it exits non-zero, each worker process saying why in one CRITICAL line (both
    # give up at about the same time), and consumed nothing
    assert status == 3, output
    gave_up = [line for line in output.splitlines() if "CRITICAL" in line and GAVE_UP in line]
    assert 1 <= len(gave_up) <= 2, output
    assert all("startup_patience=3" in line for line in gave_up)
    assert "ready for action" not in output
    assert not arrivals.exists()
    # And nothing is lost: a worker started once the database is back applies it all once
    outage_postgres.start()
    again = start()
    wait_for(lambda: _ledger(db)[0] >= INTENTS, timeout=60, what="every intent applied")
    time.sleep(1.5)
    again.stop()
    assert _ledger(db) == APPLIED_ONCE


# -- FastStream -------------------------------------------------------------------------------


@pytest.fixture
async def faststream_setup(outage_postgres: OutagePostgres, tmp_path: Path) -> Any:
    services.require(services.RABBITMQ, "RabbitMQ")
    producer = Harness("rabbit", [])
    await producer.prepare_source()
    env = {
        "INBOX_TEST_DATABASE_URL": outage_postgres.async_url,
        "INBOX_TEST_BROKER": "rabbit",
        "INBOX_TEST_BROKER_URL": services.RABBITMQ,
        "INBOX_TEST_SOURCE": producer.name,
        "INBOX_TEST_ARRIVALS": str(tmp_path / "arrivals.log"),
    }
    started: list[FastStreamWorker] = []

    def start(**extra: str) -> FastStreamWorker:
        worker = FastStreamWorker(
            "tests.apps.faststream_app:app", env | extra, tmp_path / f"fs-{len(started)}.log"
        )
        started.append(worker)
        return worker

    yield start, producer, tmp_path / "arrivals.log"
    for worker in started:
        worker.kill()
    await producer.cleanup()


async def _publish_twice(producer: Harness) -> None:
    async with producer.broker:
        for _ in range(2):
            for number in range(INTENTS):
                headers = identity_headers(producer="orders", message_id=f"o-{number}")
                await producer.publish({"account": 7, "delta": 1}, headers)


async def test_startup__faststream_run_started_while_its_database_is_down_waits_then_applies_all_once(  # noqa: E501
    faststream_setup, outage_postgres, db
):
    start, producer, arrivals = faststream_setup
    await _publish_twice(producer)
    outage_postgres.stop()
    worker = start(INBOX_TEST_STARTUP_PATIENCE="60")
    await eventually(lambda: worker.output().count(WAITING) >= 3, timeout=30, what="waiting")
    # Then the app waits before its broker starts: nothing consumed, nothing held
    assert worker.proc.poll() is None, worker.output()
    assert "started successfully" not in worker.output()
    assert not arrivals.exists()
    outage_postgres.start()
    await eventually(worker.ready, timeout=60, what="the app to start")
    await eventually(lambda: _ledger(db)[0] >= INTENTS, timeout=60, what="every intent applied")
    await asyncio.sleep(1.5)
    worker.stop()
    print(worker.output())
    assert _ledger(db) == APPLIED_ONCE
    assert await producer.leftover() == 0


async def test_startup__faststream_run_whose_database_stays_down_exits_having_consumed_nothing(
    faststream_setup, outage_postgres, db
):
    start, producer, arrivals = faststream_setup
    await _publish_twice(producer)
    outage_postgres.stop()
    worker = start(INBOX_TEST_STARTUP_PATIENCE="3")
    status = await asyncio.to_thread(worker.proc.wait, 60)
    output = worker.output()
    print(output)
    assert status == 3, output
    assert GAVE_UP in output and "startup_patience=3" in output
    assert "started successfully" not in output
    assert not arrivals.exists()
    assert await producer.leftover() == 2 * INTENTS  # all still in the queue
    outage_postgres.start()
    again = start()
    await eventually(again.ready, timeout=60, what="the app to start")
    await eventually(lambda: _ledger(db)[0] >= INTENTS, timeout=60, what="every intent applied")
    await asyncio.sleep(1.5)
    again.stop()
    assert _ledger(db) == APPLIED_ONCE


async def test_startup__unguarded_faststream_hands_messages_back_through_the_core_until_the_database_returns(  # noqa: E501
    faststream_setup, outage_postgres, db
):
    start, producer, arrivals = faststream_setup
    outage_postgres.stop()
    # Given an app without guard: its start-up check can only run at the first message
    worker = start(INBOX_TEST_UNGUARDED="1")
    await eventually(worker.ready, timeout=60, what="the app to start")
    await _publish_twice(producer)
    await eventually(
        lambda: arrivals.exists() and len(arrivals.read_text().splitlines()) > 4 * INTENTS,
        timeout=60,
        what="messages handed back and redelivered",
    )
    # When the database returns
    outage_postgres.start()
    await eventually(lambda: _ledger(db)[0] >= INTENTS, timeout=60, what="every intent applied")
    await asyncio.sleep(1.5)
    worker.stop()
    output = worker.output()
    print(output)
    # Then everything is applied once, nothing poisoned, and the warning was printed once
    assert _ledger(db) == APPLIED_ONCE
    assert await producer.leftover() == 0
    assert output.count("the inbox start-up check did not run before this broker started") == 1
