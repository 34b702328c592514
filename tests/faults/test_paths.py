"""The fault-injection matrix's rows for deployments and outages (issue 27): several real
worker processes, each row a few seconds on a PostgreSQL of its own that the row stops
and starts (``scripts/services postgres-outage``, port 5446), never the shared one.

multi-worker outage    2-3 workers consuming when PostgreSQL stops (``-m fast`` or
                       ``-m immediate``) for a few seconds, a small hand-back backoff and a
                       low ``redelivery_limit``: no valid message poisoned, none lost
start-up in a restart  PostgreSQL down before, or going down while, ``faststream run
                       --workers 2`` (guard on and off) or ``dramatiq --processes 2``
                       starts: the guarded workers wait before consuming anything, the
                       unguarded ones hold at the first message without counting it, and
                       everything is applied once when it returns
backlog at start-up    issue 27, item 1: FastStream on RabbitMQ, no guard, ``--workers 2``,
                       the default ack policy, 405 intents with duplicates waiting,
                       PostgreSQL stopped for 3 s as the workers start, a worker SIGKILLed
                       and respawned, PostgreSQL stopped for 3 s again right after

For each row's messages, once settled: every intent applied exactly once, no poison row,
nothing left in the broker. Run under the fault lock::

    flock /tmp/inbox-fault.lock .venv/bin/pytest tests/faults/test_paths.py

``FAULTS_CPU_BURN=2`` runs that many CPU burners beside the row (the outside report's
"heavy CPU load"); ``FAULTS_BACKLOG_INTENTS`` changes the backlog row's 405.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from sqlalchemy import Engine, create_engine, text

from inbox_middleware.dramatiq import identity
from inbox_middleware.faststream import identity_headers

from ..support import services
from ..support.faststream_brokers import Harness, eventually
from ..support.faststream_worker import FastStreamWorker
from ..support.outage import OutagePostgres
from ..support.workers import WorkerProcess, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(300)]

APP = "tests.apps.faststream_app:app"
WAITING = "the inbox's database is not ready (attempt"
UNCHECKED = "the inbox start-up check did not run before this broker started"
LIMIT = 2  # a low redelivery_limit: an outage's hand-backs must not reach it
BACKOFF = "0.05,0.3"  # a small hand-back backoff cap: many hand-backs per outage


@pytest.fixture(autouse=True)
def cpu_load() -> Iterator[None]:
    """``FAULTS_CPU_BURN=n``: n processes spinning on the CPU during the row."""
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(int(os.environ.get("FAULTS_CPU_BURN", "0")))
    ]
    yield
    for burner in burners:
        burner.kill()
        burner.wait()


@pytest.fixture
def db(outage_postgres: OutagePostgres) -> Iterator[Engine]:
    engine = create_engine(outage_postgres.url, pool_pre_ping=True)
    yield engine
    engine.dispose()


def _settlement(engine: Engine, ids: set[str]) -> dict[str, Any]:
    """What became of the row's intents: applied (with how many effects), poisoned."""
    with engine.connect() as conn:
        claimed = {m for (m,) in conn.execute(text("SELECT message_id FROM consumer_inbox"))}
        poison = dict(conn.execute(text("SELECT message_id, reason_code FROM inbox_poison")).all())
        effects = int(conn.scalar(text("SELECT count(*) FROM ledger")) or 0)
    return {
        "claimed": claimed & ids,
        "poison": poison,
        "effects": effects,
        "missing": ids - claimed - set(poison),
    }


def _settled(engine: Engine, ids: set[str]) -> bool:
    with contextlib.suppress(Exception):  # the database may be down
        return not _settlement(engine, ids)["missing"]
    return False


def _assert_applied_once(engine: Engine, ids: set[str], output: str) -> None:
    found = _settlement(engine, ids)
    assert found["poison"] == {}, f"valid messages poisoned: {found['poison']}\n{output}"
    assert found["missing"] == set(), (
        f"{len(found['missing'])} of {len(ids)} intents neither applied nor poisoned: "
        f"{sorted(found['missing'])[:20]}\n{output}"
    )
    assert found["effects"] == len(ids), f"{found['effects']} effects for {len(ids)} intents"


def _arrivals(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


# -- FastStream ------------------------------------------------------------------------------


class FastStreamRow:
    def __init__(self, broker: str, outage: OutagePostgres, folder: Path) -> None:
        self.producer = Harness(broker, [])
        self.folder = folder
        self.arrivals = folder / "arrivals.log"
        self.env = {
            "INBOX_TEST_DATABASE_URL": outage.async_url,
            "INBOX_TEST_BROKER": broker,
            "INBOX_TEST_BROKER_URL": services.RABBITMQ if broker == "rabbit" else services.NATS,
            "INBOX_TEST_ARRIVALS": str(self.arrivals),
            "INBOX_TEST_REDELIVERY_LIMIT": str(LIMIT),
            "INBOX_TEST_RETRY_BACKOFF": BACKOFF,
        }
        self.workers: list[FastStreamWorker] = []

    async def prepare(self) -> None:
        await self.producer.prepare_source()
        self.env["INBOX_TEST_SOURCE"] = self.producer.name

    def start(self, *options: str, **extra: str) -> FastStreamWorker:
        n = len(self.workers)
        worker = FastStreamWorker(
            APP, self.env | extra, self.folder / f"fs-{n}.log", options=options
        )
        self.workers.append(worker)
        return worker

    async def publish(self, ids: list[str]) -> None:
        async with self.producer.broker:
            for message_id in ids:
                headers = identity_headers(producer="orders", message_id=message_id)
                await self.producer.publish({"account": 7, "delta": 1}, headers)

    def output(self) -> str:
        return "\n".join(
            f"-- worker {n}\n" + "\n".join(w.output().splitlines()[-60:])
            for n, w in enumerate(self.workers)
        )

    async def close(self) -> None:
        """Stop the workers (SIGTERM): the broker's queue is read after."""
        for worker in self.workers:
            worker.stop()


@pytest.fixture
async def fs_row(outage_postgres: OutagePostgres, tmp_path: Path, request: Any) -> Any:
    broker = request.param
    services.require(services.RABBITMQ if broker == "rabbit" else services.NATS, broker)
    row = FastStreamRow(broker, outage_postgres, tmp_path)
    await row.prepare()
    yield row
    for worker in row.workers:
        worker.kill()
    await row.producer.cleanup()


def _ids(tag: str, count: int) -> list[str]:
    return [f"{tag}-{n:04d}" for n in range(count)]


@pytest.mark.parametrize(
    ("fs_row", "workers", "mode"),
    [("nats", 3, "fast"), ("nats", 3, "immediate"), ("rabbit", 2, "immediate")],
    ids=["nats-3-fast", "nats-3-immediate", "rabbit-2-immediate"],
    indirect=["fs_row"],
)
async def test_paths__multi_worker_outage_poisons_and_loses_nothing(
    fs_row: FastStreamRow, workers: int, mode: str, outage_postgres: OutagePostgres, db: Engine
) -> None:
    ids = _ids("mw", 24)
    started = [fs_row.start() for _ in range(workers)]
    for worker in started:
        await eventually(worker.ready, timeout=60, what="the workers to start")
    # Given the workers consuming, each message sent twice
    await fs_row.publish(ids[:12] + ids[:12])
    # When PostgreSQL stops mid-run, the rest arriving meanwhile
    outage_postgres.stop(mode)
    await fs_row.publish(ids[12:] + ids[12:])
    # And the workers hand them back, from one worker then another, past the limit
    before = _arrivals(fs_row.arrivals)
    await eventually(
        lambda: _arrivals(fs_row.arrivals) - before > 12 * (LIMIT + 1) * 2,
        timeout=30,
        what="hand-backs past the redelivery limit",
    )
    outage_postgres.start()
    # Then every message is applied once, none poisoned, the broker empty
    await eventually(lambda: _settled(db, set(ids)), timeout=60, what="every intent settled")
    await asyncio.sleep(1.5)  # a poisoned or twice-applied message would show here
    await fs_row.close()
    _assert_applied_once(db, set(ids), fs_row.output())
    assert await fs_row.producer.leftover() == 0


@pytest.mark.parametrize(
    ("fs_row", "guarded", "when"),
    [
        ("rabbit", True, "before"),
        ("rabbit", True, "while"),
        ("rabbit", False, "before"),
        ("rabbit", False, "while"),
    ],
    ids=["guard-down-before", "guard-down-while", "unguarded-down-before", "unguarded-down-while"],
    indirect=["fs_row"],
)
async def test_paths__faststream_workers_started_during_a_restart_wait_and_lose_nothing(
    fs_row: FastStreamRow, guarded: bool, when: str, outage_postgres: OutagePostgres, db: Engine
) -> None:
    ids = _ids("st", 16)
    # Given messages waiting (each twice), and PostgreSQL going down as the workers start
    await fs_row.publish(ids + ids)
    if when == "before":
        outage_postgres.stop()
    worker = fs_row.start(
        "--workers",
        "2",
        INBOX_TEST_UNGUARDED="0" if guarded else "1",
        INBOX_TEST_STARTUP_PATIENCE="60",
    )
    if when == "while":
        await eventually(lambda: len(worker.children()) == 2, timeout=30, what="two workers")
        outage_postgres.stop()
    if guarded and when == "before":
        # Then the guarded workers wait, each attempt logged, with nothing consumed
        await eventually(
            lambda: worker.output().count(WAITING) >= 4, timeout=30, what="waiting lines"
        )
        assert worker.proc.poll() is None, worker.output()
        assert _arrivals(fs_row.arrivals) == 0
        assert "started successfully" not in worker.output()
    else:
        await asyncio.sleep(3)
        assert worker.proc.poll() is None, worker.output()
    outage_postgres.start()
    # And once PostgreSQL is back every intent is applied once, none poisoned
    await eventually(lambda: _settled(db, set(ids)), timeout=60, what="every intent settled")
    await asyncio.sleep(1.5)
    await fs_row.close()
    output = worker.output()
    _assert_applied_once(db, set(ids), fs_row.output())
    assert await fs_row.producer.leftover() == 0
    # The unguarded check's warning: once per worker process at most
    assert output.count(UNCHECKED) <= 2, output
    if guarded:
        assert UNCHECKED not in output


@pytest.mark.parametrize("fs_row", ["rabbit"], indirect=True)
async def test_paths__item_1_backlog_unguarded_workers_restart_and_outages_lose_nothing(
    fs_row: FastStreamRow, outage_postgres: OutagePostgres, db: Engine
) -> None:
    count = int(os.environ.get("FAULTS_BACKLOG_INTENTS", "405"))
    rng = random.Random(os.environ.get("FAULTS_SEED", "27"))
    ids = _ids("bl", count)
    sends = list(ids) + [i for i in ids if rng.random() < 0.25]  # duplicates
    rng.shuffle(sends)
    later = len(sends) // 3
    # Given a backlog of intents with duplicates waiting for the workers
    await fs_row.publish(sends[later:])
    # When `faststream run --workers 2` starts without guard, default ack policy, and
    # PostgreSQL stops for 3 s as its workers start: their start-up check fails at the
    # first messages, which they hold
    worker = fs_row.start("--workers", "2", INBOX_TEST_UNGUARDED="1")
    await eventually(lambda: len(worker.children()) == 2, timeout=30, what="two workers")
    outage_postgres.stop()
    await asyncio.sleep(3)
    outage_postgres.start()
    # And a worker is SIGKILLed while the backlog is worked off, respawned by the
    # command, the rest of the intents sent, and PostgreSQL stops for 3 s again right
    # after the new worker starts
    await asyncio.sleep(rng.uniform(0.2, 1.5))
    victim = rng.choice(worker.children())
    os.kill(victim, signal.SIGKILL)
    await fs_row.publish(sends[:later])
    await eventually(
        lambda: len(worker.children()) == 2 and victim not in worker.children(),
        timeout=30,
        what="the killed worker respawned",
    )
    outage_postgres.stop()
    await asyncio.sleep(3)
    outage_postgres.start()
    # Then every intent is applied once, none poisoned, nothing left in the queue
    started = time.monotonic()
    await eventually(lambda: _settled(db, set(ids)), timeout=150, what="every intent settled")
    print(f"settled {time.monotonic() - started:.0f}s after the last outage")
    await asyncio.sleep(2)
    await fs_row.close()
    _assert_applied_once(db, set(ids), fs_row.output())
    assert await fs_row.producer.leftover() == 0


# -- Dramatiq ---------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["before", "while"])
def test_paths__dramatiq_processes_started_during_a_restart_wait_and_lose_nothing(
    when: str, outage_postgres: OutagePostgres, db: Engine, queue: str, tmp_path: Path
) -> None:
    services.require(services.REDIS, "Redis")
    namespace = f"inbox-test-{queue}"
    arrivals = tmp_path / "arrivals.log"
    env = {
        "INBOX_TEST_DATABASE_URL": outage_postgres.url,
        "INBOX_TEST_BROKER": "redis",
        "INBOX_TEST_BROKER_URL": services.REDIS,
        "INBOX_TEST_NAMESPACE": namespace,
        "INBOX_TEST_QUEUE": queue,
        "INBOX_TEST_ARRIVALS": str(arrivals),
        "INBOX_TEST_STARTUP_PATIENCE": "60",
    }
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url=services.REDIS, namespace=namespace)
    actor = dramatiq.actor(
        lambda account_id, delta: None, actor_name="add_credit", queue_name=queue, broker=broker
    )
    ids = _ids("dq", 16)
    worker = None
    try:
        for _ in range(2):
            for message_id in ids:
                actor.send_with_options(
                    args=(7, 1), **identity(producer="orders", message_id=message_id)
                )
        if when == "before":
            outage_postgres.stop()
        worker = WorkerProcess(
            "tests.apps.dramatiq_app",
            env,
            tmp_path / "worker.log",
            processes=2,
            threads=2,
            options=("--worker-fork-timeout", "100"),
        )
        if when == "while":
            time.sleep(0.3)
            outage_postgres.stop()
            time.sleep(3)
        else:
            wait_for(lambda: worker.output().count(WAITING) >= 4, timeout=30, what="waiting")
            assert not arrivals.exists()
        assert worker.proc.poll() is None, worker.output()
        outage_postgres.start()
        wait_for(lambda: _settled(db, set(ids)), timeout=60, what="every intent settled")
        time.sleep(1.5)
        worker.stop()
        _assert_applied_once(db, set(ids), worker.output())
    finally:
        if worker is not None:
            worker.kill()
        for key in broker.client.scan_iter(f"{namespace}*"):
            broker.client.delete(key)
        broker.close()
