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
"heavy CPU load"); ``FAULTS_BACKLOG_INTENTS`` changes the backlog row's 405,
``FAULTS_BACKLOG_LIMIT`` its redelivery_limit (10), ``FAULTS_SEED`` its draws.
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
        poison = {
            m: f"{reason} after {attempts} ({error})"
            for m, reason, attempts, error in conn.execute(
                text("SELECT message_id, reason_code, attempts, error FROM inbox_poison")
            )
        }
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


@pytest.mark.parametrize(
    ("fs_row", "ending"),
    [("rabbit", "kill"), ("rabbit", "term-while-held")],
    ids=["kill", "term-while-held"],
    indirect=["fs_row"],
)
async def test_paths__item_1_backlog_unguarded_workers_restart_and_outages_lose_nothing(
    fs_row: FastStreamRow, ending: str, outage_postgres: OutagePostgres, db: Engine
) -> None:
    """``kill``: a worker SIGKILLed once PostgreSQL is back; ``term-while-held``: a worker
    SIGTERMed (a graceful stop) while the outage has it holding messages.

    With the reported run's ``redelivery_limit`` (10, the default), not the low limit of
    the multi-worker rows: a worker ended during an outage takes the memory of the
    hand-backs it made meanwhile with it (the database was down: nothing durable), and
    two outages with two workers in flight may each leave one such redelivery per
    message (the window `docs/explanation/limits.md` counts); a limit of 2 poisons a
    few valid messages here, as documented."""
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
    worker = fs_row.start(
        "--workers",
        "2",
        INBOX_TEST_UNGUARDED="1",
        INBOX_TEST_REDELIVERY_LIMIT=os.environ.get("FAULTS_BACKLOG_LIMIT", "10"),
    )
    await eventually(lambda: len(worker.children()) == 2, timeout=30, what="two workers")
    outage_postgres.stop()
    if ending == "term-while-held":
        await asyncio.sleep(1.5)
        victim = rng.choice(worker.children())
        os.kill(victim, signal.SIGTERM)
        await asyncio.sleep(1.5)
        outage_postgres.start()
    else:
        await asyncio.sleep(3)
        outage_postgres.start()
        await asyncio.sleep(rng.uniform(0.2, 1.5))
        victim = rng.choice(worker.children())
        os.kill(victim, signal.SIGKILL)
    # And the worker ended is respawned by the command, the rest of the intents sent,
    # and PostgreSQL stops for 3 s again right after the new worker starts
    await fs_row.publish(sends[:later])
    await eventually(
        lambda: len(worker.children()) == 2 and victim not in worker.children(),
        timeout=30,
        what="the ended worker respawned",
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


# -- handler misuse, dynamic subscribers ------------------------------------------------------

PATHS_APP = "tests.faults.app_paths:app"
REFUSED = "handler_transaction"
COMMON_MISUSES = (
    "sql_rollback",
    "sql_commit",
    "connection_commit",
    "connection_rollback",
    "session_commit",
    "session_rollback",
    "invalidate",
    "ack",
    "nack",
    "reject",
)
MISUSES = {
    # RabbitMQ: aio-pika's own message settled behind the inbox, detected after the handler
    "rabbit": (*COMMON_MISUSES, "raw_ack"),
    # NATS: ack_sync, and nats-py's own message, refused
    "nats": (*COMMON_MISUSES, "ack_sync", "raw_ack"),
}


def _accounts(engine: Engine) -> dict[int, int]:
    with engine.connect() as conn:
        return dict(
            conn.execute(text("SELECT account_id, count(*) FROM ledger GROUP BY account_id")).all()
        )


def _poison(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT message_id, reason_code FROM inbox_poison")).all())


def _settled_or_poisoned(engine: Engine, ids: set[str]) -> bool:
    return not _settlement(engine, ids)["missing"]


async def _misuse_row(
    kind: str,
    misuses: tuple[str, ...],
    outage_postgres: OutagePostgres,
    db: Engine,
    tmp_path: Path,
    *,
    batched: int = 0,
    reason: str | None = REFUSED,
    patience: float = 30,
) -> None:
    """Two workers; for each misuse, two messages whose handler credits an account of its
    own then misuses the session or the message (and two well-behaved ones); ``batched``
    messages to a batch subscriber acking FastStream's context message (NATS). Each
    misuse must be refused: no effect, a poison row (``reason``; None: any), nothing left."""
    services.require(services.RABBITMQ if kind == "rabbit" else services.NATS, kind)
    source, batch = Harness(kind, []), Harness(kind, [])
    await source.prepare_source()
    if batched:
        await batch.prepare_source()
    env = {
        "INBOX_TEST_DATABASE_URL": outage_postgres.async_url,
        "INBOX_TEST_BROKER": kind,
        "INBOX_TEST_BROKER_URL": services.RABBITMQ if kind == "rabbit" else services.NATS,
        "INBOX_TEST_SOURCE": source.name,
        "FAULTS_BATCH_SOURCE": batch.name if batched else "",
        "FAULTS_PATH": "misuse",
    }
    worker = FastStreamWorker(PATHS_APP, env, tmp_path / "fs.log", options=("--workers", "2"))
    kinds = ("none", *misuses)
    plan = {f"mu-{n:02d}-{m}": (m, 100 + n) for n, m in enumerate(kinds * 2)}
    batch_plan = {f"mb-{n}": 900 + n for n in range(batched)}
    try:
        subscribers = 2 if batched else 1
        await eventually(
            lambda: worker.output().count("waiting for messages") >= 2 * subscribers,
            timeout=60,
            what="two workers",
        )
        async with source.broker:
            for message_id, (misuse, account) in plan.items():
                headers = identity_headers(producer="orders", message_id=message_id)
                await source.publish({"account": account, "delta": 1, "misuse": misuse}, headers)
        if batch_plan:
            async with batch.broker:
                for message_id, account in batch_plan.items():
                    headers = identity_headers(producer="orders", message_id=message_id)
                    await batch.publish({"account": account, "delta": 1}, headers)
        ids = set(plan) | set(batch_plan)
        await eventually(
            lambda: _settled_or_poisoned(db, ids), timeout=patience, what="every message settled"
        )
        await asyncio.sleep(1.5)
    finally:
        worker.stop()
    output = worker.output()
    accounts, poison = _accounts(db), _poison(db)
    # Then each misuse is refused: rolled back (no effect), kept as poison at once
    wrong = {
        message_id: (misuse, accounts.get(account, 0), poison.get(message_id))
        for message_id, (misuse, account) in plan.items()
        if (
            (accounts.get(account, 0), poison.get(message_id)) != (1, None)
            if misuse == "none"
            else accounts.get(account, 0) != 0
            or poison.get(message_id) is None
            or reason not in (None, poison[message_id])
        )
    }
    wrong |= {
        message_id: ("batch msg.ack()", accounts.get(account, 0), poison.get(message_id))
        for message_id, account in batch_plan.items()
        if accounts.get(account, 0) != 0 or message_id not in poison
    }
    assert wrong == {}, f"(misuse, effects, poison) not as documented: {wrong}\n{output[-6000:]}"
    # And nothing is left with the broker: every poison went to the dead letters
    assert await source.leftover() == 0
    if batch_plan:
        assert await batch.leftover() == 0
    await source.cleanup()
    if batch_plan:
        await batch.cleanup()


@pytest.mark.parametrize("kind", ["rabbit", "nats"])
async def test_paths__handler_misuse_is_refused_without_loss(
    kind: str, outage_postgres: OutagePostgres, db: Engine, tmp_path: Path
) -> None:
    batched = 4 if kind == "nats" else 0
    await _misuse_row(kind, MISUSES[kind], outage_postgres, db, tmp_path, batched=batched)


async def test_paths__a_failure_caught_on_the_drivers_own_connection_is_never_acked(
    outage_postgres: OutagePostgres, db: Engine, tmp_path: Path
) -> None:
    # A failed attempt each time (the attempt's COMMIT did not commit): poison once
    # max_attempts is spent, never an ack without a record
    await _misuse_row(
        "rabbit", ("raw_failure_caught",), outage_postgres, db, tmp_path, reason=None, patience=15
    )


@pytest.mark.parametrize("kind", ["rabbit", "nats"])
async def test_paths__dynamic_subscribers_are_checked_and_guarded_without_loss(
    kind: str, outage_postgres: OutagePostgres, db: Engine, tmp_path: Path
) -> None:
    services.require(services.RABBITMQ if kind == "rabbit" else services.NATS, kind)
    queues = [Harness(kind, []) for _ in range(4)]
    for queue in queues:
        await queue.prepare_source()
    added, routed, acking_first, replaced = queues
    env = {
        "INBOX_TEST_DATABASE_URL": outage_postgres.async_url,
        "INBOX_TEST_BROKER": kind,
        "INBOX_TEST_BROKER_URL": services.RABBITMQ if kind == "rabbit" else services.NATS,
        "INBOX_TEST_SOURCE": added.name,
        "FAULTS_PATH": "dynamic",
        "FAULTS_QUEUES": ",".join(q.name for q in queues),
    }
    # Given two workers of a guarded broker whose subscribers are added once it runs
    worker = FastStreamWorker(PATHS_APP, env, tmp_path / "fs.log", options=("--workers", "2"))
    ids: dict[str, set[str]] = {}
    try:
        await eventually(
            lambda: worker.output().count("dynamic subscribers started") >= 2,
            timeout=60,
            what="the dynamic subscribers of both workers",
        )
        # When each queue gets its messages, each twice
        for n, queue in enumerate(queues):
            ids[queue.name] = {f"dy-{n}-{k:02d}" for k in range(8)}
            async with queue.broker:
                for message_id in sorted(ids[queue.name]) * 2:
                    headers = identity_headers(producer="orders", message_id=message_id)
                    await queue.publish({"account": 7, "delta": 1}, headers)
        protected = ids[added.name] | ids[routed.name] | ids[replaced.name]
        await eventually(
            lambda: _settled(db, protected), timeout=60, what="the protected queues settled"
        )
        await asyncio.sleep(1.5)
    finally:
        worker.stop()
    output = worker.output()
    # Then the added, the routed and the replacing subscribers apply every message once
    _assert_applied_once(db, protected, output[-6000:])
    # And the ACK_FIRST one was refused as it started, in both workers, having consumed
    # nothing: its messages all wait in its queue
    assert output.count("refused as it started") == 2, output[-6000:]
    assert "AckPolicy.ACK_FIRST" in output
    assert _settlement(db, ids[acking_first.name])["claimed"] == set()
    assert await acking_first.leftover() == 16
    for queue in (added, routed, replaced):
        assert await queue.leftover() == 0, queue.name
    for queue in queues:
        await queue.cleanup()
