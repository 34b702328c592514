"""The settlement counts real workers write to ``inbox_counts``, and what
``inbox-middleware status`` shows of them with no metrics set-up at all.

Dramatiq workers on Redis and a FastStream app on RabbitMQ, each a real process: first
deliveries, duplicates and messages without identity go through them; after the flush
interval the real command line (no PROMETHEUS_MULTIPROC_DIR) shows the counts from the
database alone; each worker process writes rows of its own; a SIGKILLed worker's flushed
counts remain.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from sqlalchemy import text

from inbox_middleware._operate.retention import purge
from inbox_middleware._operate.tally import CountFlusher, Tally
from inbox_middleware._storage import InboxSchema
from inbox_middleware._storage.counts import flush_counts
from inbox_middleware.dramatiq import identity
from inbox_middleware.faststream import identity_headers

from ..support import services
from ..support.engines import sync_engine
from ..support.faststream_brokers import Harness, eventually
from ..support.faststream_worker import FastStreamWorker
from ..support.proxy import Proxy
from ..support.workers import WorkerProcess, wait_for

INTERVAL = "0.5"  # seconds between two flushes: the test waits a few of them


def status(pg_url: str) -> tuple[dict[str, Any], str]:
    """``inbox-middleware status`` as an operator runs it, without any metrics set-up."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env["COLUMNS"] = "250"  # one line per table row
    command = [str(Path(sys.executable).parent / "inbox-middleware"), "status"]
    runs = [
        subprocess.run(
            [*command, *extra, "--database-url", pg_url],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        for extra in (["--json"], [])
    ]
    return json.loads(runs[0]), runs[1]


def counted(data: dict[str, Any], consumer: str) -> dict[str, int]:
    return next(c["counted"] for c in data["consumers"] if c["consumer"] == consumer)


def count_rows(pg_engine: Any) -> dict[str, dict[str, int]]:
    """Per worker: its rows' counts by outcome, for consumer billing."""
    rows: dict[str, dict[str, int]] = {}
    with pg_engine.connect() as conn:
        found = conn.execute(
            text("SELECT worker, outcome, count FROM inbox_counts WHERE consumer_name = 'billing'")
        )
        for worker, outcome, count in found:
            rows.setdefault(worker, {})[outcome] = count
    return rows


# -- Dramatiq on Redis ------------------------------------------------------------------------


@pytest.fixture
def dramatiq_setup(queue: str, pg_url: str, pg_engine: Any, tmp_path: Path) -> Any:
    services.require(services.REDIS, "redis")
    namespace = f"inbox-test-{queue}"
    env = {
        "INBOX_TEST_DATABASE_URL": pg_url,
        "INBOX_TEST_BROKER": "redis",
        "INBOX_TEST_BROKER_URL": services.REDIS,
        "INBOX_TEST_NAMESPACE": namespace,
        "INBOX_TEST_QUEUE": queue,
        "INBOX_TEST_COUNT_INTERVAL": INTERVAL,
    }
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url=services.REDIS, namespace=namespace)
    actor = dramatiq.actor(
        lambda account_id, delta: None, actor_name="add_credit", queue_name=queue, broker=broker
    )
    started: list[WorkerProcess] = []

    def start() -> WorkerProcess:
        log = tmp_path / f"worker-{len(started)}.log"
        started.append(WorkerProcess("tests.apps.dramatiq_app", env, log, threads=2))
        return started[-1]

    yield start, actor
    for worker in started:
        worker.kill()
    for key in broker.client.scan_iter(f"{namespace}*"):
        broker.client.delete(key)
    broker.close()


@pytest.mark.slow
def test_counts__dramatiq_workers_on_redis_show_in_status_from_the_database_alone(
    dramatiq_setup: Any, pg_url: str, pg_engine: Any
) -> None:
    start, actor = dramatiq_setup

    def send(message_id: str | None, account: int = 7) -> None:
        options = identity(producer="orders", message_id=message_id) if message_id else {}
        actor.send_with_options(args=(account, 10), **options)

    # Given a worker that settled 2 first deliveries, 1 duplicate and 1 message without
    # identity, and flushed them
    first = start()
    for message_id in ("o-1", "o-2", "o-1", None):
        send(message_id)
    expected = {"processed": 2, "duplicate": 1, "no_identity": 1}
    wait_for(
        lambda: list(count_rows(pg_engine).values()) == [expected],
        timeout=60,
        what=f"the first worker's counts\n{first.output()}",
    )
    # When it is killed with SIGKILL, then its flushed counts remain
    first.kill()
    (killed,) = count_rows(pg_engine)
    # And a second worker process counts in rows of its own (2 duplicates, 1 first
    # delivery, 1 without identity), written on a graceful stop at the latest
    second = start()
    for message_id in ("o-1", "o-2", "o-3", None):
        send(message_id)
    wait_for(lambda: len(count_rows(pg_engine)) == 2, timeout=60, what="the second worker's rows")
    second.stop()
    rows = count_rows(pg_engine)
    assert rows.pop(killed) == expected
    assert list(rows.values()) == [{"processed": 1, "duplicate": 2, "no_identity": 1}]

    # Then status, from the database alone, shows the sums, approximate, with their span
    data, shown = status(pg_url)
    billing = counted(data, "billing")
    assert (billing["processed"], billing["duplicate"], billing["no_identity"]) == (3, 3, 2)
    assert data["counted"]["workers"] == 2
    assert data["counted"]["approximate"] is True
    assert data["counted"]["since"] is not None
    row = next(line for line in shown.splitlines() if " billing " in line)
    assert "≈3" in row and "needs metrics" not in row, shown  # the consumer's duplicates
    assert "settlements counted by the workers, approximate" in " ".join(shown.split())
    assert "need the workers' metrics" in " ".join(shown.split())


# -- FastStream on RabbitMQ -------------------------------------------------------------------


@pytest.mark.slow
async def test_counts__faststream_app_on_rabbitmq_shows_in_status_from_the_database_alone(
    pg_async_url: str, pg_url: str, pg_engine: Any, tmp_path: Path
) -> None:
    services.require(services.RABBITMQ, "rabbitmq")
    producer = Harness("rabbit", [])
    env = {
        "INBOX_TEST_DATABASE_URL": pg_async_url,
        "INBOX_TEST_BROKER": "rabbit",
        "INBOX_TEST_BROKER_URL": services.RABBITMQ,
        "INBOX_TEST_SOURCE": producer.source,
        "INBOX_TEST_COUNT_INTERVAL": INTERVAL,
    }
    worker = FastStreamWorker("tests.apps.faststream_app:app", env, tmp_path / "worker.log")
    try:
        await eventually(worker.ready, timeout=60, what="the worker to start")
        # Given 2 first deliveries, 2 duplicates and 1 message without identity
        async with producer.broker:
            for delta in (1, 2, 1, 2):  # one payload per identity: duplicates, no conflict
                headers = identity_headers(producer="orders", message_id=f"o-{delta}")
                await producer.publish({"account": 7, "delta": delta}, headers)
            await producer.publish({"account": 7, "delta": 3})
        # When the flush interval passes, then one row per outcome holds the counts
        expected = {"processed": 2, "duplicate": 2, "no_identity": 1}
        seen: list[dict[str, int]] = []

        def flushed() -> bool:
            seen[:] = count_rows(pg_engine).values()
            return seen == [expected]

        try:
            await eventually(flushed, timeout=60, what="the counts")
        except AssertionError:
            raise AssertionError(f"counted {seen}; the worker's log:\n{worker.output()}") from None
        # and status shows them from the database alone
        data, shown = status(pg_url)
        billing = counted(data, "billing")
        assert (billing["processed"], billing["duplicate"], billing["no_identity"]) == (2, 2, 1)
        assert data["counted"]["workers"] == data["counted"]["live_workers"] == 1
        waiting = [line for line in shown.splitlines() if " billing " in line]
        assert "≈1" in waiting[1], shown  # the "no identity" column
    finally:
        worker.kill()
        await producer.cleanup()


# -- retention ---------------------------------------------------------------------------------


@pytest.mark.parametrize("consumer", [None, "billing"])
def test_counts__purge_deletes_the_rows_of_workers_gone_longer_than_its_window(
    pg_engine: Any, consumer: str | None
) -> None:
    # Given a worker gone for 40 days and one that wrote a minute ago
    with pg_engine.begin() as conn:
        now = datetime.now(UTC)
        for worker, when in (("gone", now - timedelta(days=40)), ("live", now)):
            flush_counts(conn, InboxSchema(), worker, when, {("billing", "duplicate"): 2})
            flush_counts(conn, InboxSchema(), worker, when, {("shipping", "duplicate"): 1})
        conn.execute(text("UPDATE inbox_counts SET updated_at = since WHERE worker = 'gone'"))
    # When the claims older than 30 days are purged (of one consumer, or all)
    purge(pg_engine, InboxSchema(), timedelta(days=30), consumer=consumer)
    # Then the gone worker's rows go (that consumer's only), the live one's stay
    with pg_engine.connect() as conn:
        left = {
            tuple(r) for r in conn.execute(text("SELECT worker, consumer_name FROM inbox_counts"))
        }
    kept = {("gone", "shipping")} if consumer else set()
    assert left == {("live", "billing"), ("live", "shipping")} | kept


# -- a database outage ---------------------------------------------------------------------------


def test_counts__a_database_outage_is_logged_once_and_loses_no_count(
    pg_engine: Any, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a worker's flusher that reaches PostgreSQL through a proxy we can break
    proxy = Proxy(services.postgres_address())
    engine = sync_engine(services.via_port(pg_url, proxy.port), pool_pre_ping=True)
    counts = Tally()
    flusher = CountFlusher.for_engine(engine, InboxSchema(), 60.0, source=counts)
    caplog.set_level(logging.INFO, logger="inbox_middleware")
    try:
        counts.count("billing", "duplicate")
        flusher.flush()
        # When the database is unreachable for three flushes while counts grow
        proxy.down()
        proxy.cut()
        for _ in range(3):
            counts.count("billing", "duplicate")
            counts.count("billing", "no_identity")
            flusher.flush()
        # Then the outage is logged once, and the first flush after it writes everything
        proxy.up()
        flusher.flush()
    finally:
        engine.dispose()
        proxy.close()
    assert list(count_rows(pg_engine).values()) == [{"duplicate": 4, "no_identity": 3}]
    lines = [r.getMessage() for r in caplog.records]
    failed = [line for line in lines if "could not write the inbox's settlement counts" in line]
    assert len(failed) == 1, lines
    assert "[SQL" not in failed[0]
    assert sum("written again" in line for line in lines) == 1
