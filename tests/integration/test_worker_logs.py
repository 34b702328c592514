"""What the real worker commands print: ``faststream run`` and ``dramatiq`` on the test
apps, in subprocesses, read as an operator reads them.

- Under ``faststream run`` the library's lines come out through FastStream's handler,
  with its timestamp and level (not Python's last-resort handler), and a guarded app
  never warns that the start-up check did not run.
- A duplicate is one line, at INFO, by the library: no Dramatiq "was skipped" warning,
  no FastStream line repeating the decision; under FastStream it carries the queue and
  the message id.
- A Dramatiq worker whose database is unreachable exits non-zero with a one-line reason
  instead of starting.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import dramatiq
import pytest
from dramatiq.brokers.redis import RedisBroker

from inbox_middleware.dramatiq import identity
from inbox_middleware.faststream import identity_headers

from ..apps.domain import effects
from ..support import services
from ..support.faststream_brokers import Harness, eventually
from ..support.faststream_worker import ROOT, FastStreamWorker
from ..support.workers import WorkerProcess, wait_for

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"


def applied(pg_engine, account_id: int = 7) -> int:
    with pg_engine.connect() as conn:
        return effects(conn, account_id)


async def test_faststream_run__library_lines_have_timestamps_and_a_decision_is_one_line(
    pg_async_url, pg_engine, tmp_path
):
    producer = Harness("rabbit", [])
    env = {
        "INBOX_TEST_DATABASE_URL": pg_async_url,
        "INBOX_TEST_BROKER": "rabbit",
        "INBOX_TEST_BROKER_URL": services.RABBITMQ,
        "INBOX_TEST_SOURCE": producer.source,
    }
    worker = FastStreamWorker("tests.apps.faststream_app:app", env, tmp_path / "worker.log")
    try:
        await eventually(worker.ready, timeout=60, what="the worker to start")
        # When one intent is delivered twice, and a message without identity once
        async with producer.broker:
            for _ in range(2):
                await producer.publish(
                    {"account": 7, "delta": 10},
                    identity_headers(producer="orders", message_id="o-1"),
                )
            await producer.publish({"account": 7, "delta": 10}, {})
        await eventually(
            lambda: "duplicate delivery" in worker.output() and "rejecting" in worker.output(),
            timeout=30,
            what="the duplicate and the rejection",
        )
    finally:
        worker.stop()
        await producer.cleanup()
    output = re.sub(r"\x1b\[[0-9;]*m", "", worker.output())  # FastStream's colours
    print(output)
    # Then the library's lines carry FastStream's timestamp and level
    assert re.search(rf"^{STAMP} INFO +- inbox consumer billing protects RabbitMQ", output, re.M)
    # And each decision is one line, by the library, at its level, with the queue and the
    # message id as FastStream's own lines have them (FastStream's "Processed" follows)
    queue = re.escape(producer.source)
    duplicates = [line for line in output.splitlines() if "duplicate delivery" in line]
    assert len(duplicates) == 1, output
    assert re.match(
        rf"{STAMP} INFO +- +\| {queue} +\| \w{{10}} - duplicate delivery skipped: "
        "consumer=billing",
        duplicates[0],
    )
    rejections = [line for line in output.splitlines() if "rejecting" in line or "rejected" in line]
    assert len(rejections) == 1, output
    assert re.match(
        rf"{STAMP} ERROR +- +\| {queue} +\| \w{{10}} - rejecting a message for inbox "
        "consumer billing",
        rejections[0],
    )
    assert "start-up check did not run" not in output
    assert applied(pg_engine) == 1


@pytest.fixture
def dramatiq_env(queue, pg_url):
    namespace = f"inbox-test-{queue}"
    yield {
        "INBOX_TEST_DATABASE_URL": pg_url,
        "INBOX_TEST_BROKER": "redis",
        "INBOX_TEST_BROKER_URL": services.REDIS,
        "INBOX_TEST_NAMESPACE": namespace,
        "INBOX_TEST_QUEUE": queue,
    }
    client = RedisBroker(url=services.REDIS, namespace=namespace).client
    for key in client.scan_iter(f"{namespace}*"):
        client.delete(key)


def test_dramatiq__a_duplicate_is_one_info_line_and_no_skipped_warning(
    dramatiq_env, queue, pg_engine, tmp_path
):
    services.require(services.REDIS, "Redis")
    broker = RedisBroker(url=services.REDIS, namespace=dramatiq_env["INBOX_TEST_NAMESPACE"])
    actor = dramatiq.actor(
        lambda account_id, delta: None, actor_name="add_credit", queue_name=queue, broker=broker
    )
    worker = WorkerProcess("tests.apps.dramatiq_app", dramatiq_env, tmp_path / "worker.log")
    try:
        wait_for(lambda: "is ready for action" in worker.output(), timeout=60, what="boot")
        for _ in range(2):
            actor.send_with_options(args=(7, 10), **identity(producer="orders", message_id="o-1"))
        wait_for(lambda: "duplicate delivery" in worker.output(), timeout=30, what="duplicate")
        time.sleep(1)  # a second line about the same message would show up here
    finally:
        worker.stop()
        broker.close()
    output = worker.output()
    print(output)
    lines = [line for line in output.splitlines() if "o-1" in line or "skipped" in line]
    assert len(lines) == 1, output
    assert re.search(r"\[(INFO|DEBUG)\] duplicate delivery skipped: consumer=billing", lines[0])
    assert "was skipped" not in output
    assert applied(pg_engine) == 1


def test_dramatiq__unreachable_database_exits_with_one_line_instead_of_starting(
    dramatiq_env, tmp_path
):
    services.require(services.REDIS, "Redis")
    # Given a database nobody listens on
    env = dramatiq_env | {
        "INBOX_TEST_DATABASE_URL": "postgresql+psycopg://postgres@127.0.0.1:9/x",
        "INBOX_TEST_STARTUP_PATIENCE": "0",  # not waited out: refused at once
    }
    ran = subprocess.run(
        [sys.executable, "-m", "dramatiq", "tests.apps.dramatiq_app", "--processes", "1"],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = ran.stdout + ran.stderr
    print(output)
    # Then the worker never starts, says why in one line, and the command exits with 3
    assert ran.returncode == 3
    assert "ready for action" not in output
    reasons = [line for line in output.splitlines() if "cannot reach its database" in line]
    assert len(reasons) == 1, output
    assert re.search(
        r"\[CRITICAL\] the inbox cannot reach its database, so the worker does not start: "
        r"connection failed: connection to server at \"127.0.0.1\", port 9 failed",
        reasons[0],
    )
    assert "Traceback" not in output
