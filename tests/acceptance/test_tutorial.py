"""The tutorial, followed as a reader follows it: an empty database, the commands the page
shows, a real worker process started the way it says, the snippet it runs; then what the
page says the reader sees (one credit, a duplicate skipped, a conflict quarantined)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import create_engine, text

from ..support import database, services

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = (ROOT / "docs" / "tutorial.md").read_text()
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


@pytest.fixture
def empty_database() -> Iterator[str]:
    """A database with nothing in it, as the tutorial's ``createdb`` makes."""
    services.require(services.POSTGRES, "PostgreSQL")
    name = f"inbox_tutorial_{uuid.uuid4().hex[:8]}"
    admin = services.with_database(services.POSTGRES, "postgres").replace("+psycopg", "")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield name
    database.drop_database(name)


def shown(command: str) -> str:
    """``command``, after checking the tutorial shows it (so the two cannot drift)."""
    assert command in TUTORIAL, f"the tutorial no longer shows {command!r}"
    return command


def run(command: list[str], cwd: Path, env: dict[str, str]) -> str:
    result = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@contextlib.contextmanager
def worker(command: list[str], cwd: Path, env: dict[str, str], log: Path) -> Iterator[None]:
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_until(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def settled(url: str) -> Callable[[], bool]:
    """True once the credit and the quarantine row are both there."""

    def check() -> bool:
        engine = create_engine(url)
        try:
            with engine.connect() as conn:
                credits = conn.scalar(text("SELECT count(*) FROM credits"))
                quarantined = conn.scalar(text("SELECT count(*) FROM inbox_quarantine"))
        finally:
            engine.dispose()
        return credits == 1 and quarantined == 1

    return check


def assert_one_credit_and_one_conflict(url: str, env: dict[str, str], cwd: Path) -> None:
    time.sleep(1)  # anything still arriving would show now
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            credits = conn.execute(text("SELECT account_id, amount FROM credits")).all()
            balance = conn.scalar(text("SELECT balance FROM accounts WHERE id = 1"))
            claims = conn.scalar(text("SELECT count(*) FROM consumer_inbox"))
    finally:
        engine.dispose()
    assert [tuple(row) for row in credits] == [(1, 25)]
    assert (balance, claims) == (25, 1)
    listing = run([str(BIN / "inbox-middleware"), "quarantine", "list"], cwd, env)
    # (the row up to its timestamp, which differs from the tutorial's)
    line = "│ 1 │ pending  │ billing  │ orders   │ order-1000 │ identity_conflict │        1 │"
    assert line in listing
    assert shown(line)


def test_tutorial_dramatiq__one_credit_a_duplicate_skipped_a_conflict_quarantined(
    empty_database: str, tmp_path: Path
):
    services.require(services.REDIS, "Redis")
    folder = ROOT / "examples" / "dramatiq"
    namespace = f"inbox-tutorial-{uuid.uuid4().hex[:8]}"
    plain_url = services.with_database(services.POSTGRES, empty_database).replace("+psycopg", "")
    env = os.environ | {
        "DATABASE_URL": services.with_database(services.POSTGRES, empty_database),
        "INBOX_DATABASE_URL": plain_url,  # what the page passes as --database-url
        "BROKER_URL": services.REDIS,
        "REDIS_NAMESPACE": namespace,
    }
    shown("createdb -h 127.0.0.1 -U postgres inbox_demo")
    shown("inbox-middleware migrate --database-url postgresql://postgres@127.0.0.1/inbox_demo")
    run([str(BIN / "inbox-middleware"), "migrate"], folder, env)  # --database-url: from env
    reset = "import accounts; accounts.reset_database(accounts.engine_from_env(), 5)"
    run([sys.executable, "-c", shown(reset)], folder, env)

    log = tmp_path / "worker.log"
    command = shown("dramatiq service --processes 2 --threads 4").split()
    try:
        with worker([str(BIN / command[0]), *command[1:]], folder, env, log):
            snippet = "../../docs/snippets/tutorial/dramatiq_one_order.py"
            run([sys.executable, shown(snippet)], folder, env)
            wait_until(settled(env["DATABASE_URL"]), "the order and the conflict")
            assert_one_credit_and_one_conflict(env["DATABASE_URL"], env, folder)
    finally:
        _delete_redis_keys(namespace)

    output = log.read_text()
    assert _logged("duplicate delivery skipped: consumer=billing producer=orders", output)
    assert _logged("identity conflict: same message id, different payload", output)


def test_tutorial_faststream__one_credit_a_duplicate_skipped_a_conflict_quarantined(
    empty_database: str, tmp_path: Path
):
    services.require(services.RABBITMQ, "RabbitMQ")
    folder = ROOT / "examples" / "faststream"
    queue = f"accounts-tutorial-{uuid.uuid4().hex[:8]}"
    plain_url = services.with_database(services.POSTGRES, empty_database).replace("+psycopg", "")
    env = os.environ | {
        "DATABASE_URL": services.with_database(services.POSTGRES, empty_database, "asyncpg"),
        "INBOX_DATABASE_URL": plain_url,
        "BROKER_URL": services.RABBITMQ,
        "ACCOUNTS_QUEUE": queue,
    }
    shown("createdb -h 127.0.0.1 -U postgres inbox_demo_faststream")
    shown("migrate --database-url postgresql://postgres@127.0.0.1/inbox_demo_faststream")
    run([str(BIN / "inbox-middleware"), "migrate"], folder, env)  # --database-url: from env
    reset = (
        "import asyncio, accounts; "
        "asyncio.run(accounts.reset_database(accounts.engine_from_env(), 5))"
    )
    run([sys.executable, "-c", shown(reset)], folder, env)

    log = tmp_path / "app.log"
    command = shown("faststream run service:app").split()
    try:
        with worker([str(BIN / command[0]), *command[1:]], folder, env, log):
            wait_until(lambda: "started successfully" in log.read_text(), "the app")
            snippet = "../../docs/snippets/tutorial/faststream_one_order.py"
            run([sys.executable, shown(snippet)], folder, env)
            read_url = services.with_database(services.POSTGRES, empty_database)
            wait_until(settled(read_url), "the order and the conflict")
            assert_one_credit_and_one_conflict(read_url, env, folder)
    finally:
        _delete_queues(queue)

    output = log.read_text()
    assert _logged(
        "duplicate delivery skipped: consumer=billing producer=orders message_id=order-1000",
        output,
    )
    assert _logged(
        "identity conflict: same message id, different payload: consumer=billing "
        "producer=orders message_id=order-1000",
        output,
    )


def _logged(line: str, output: str) -> bool:
    """``line`` is in the worker's log and in the tutorial's log excerpt."""
    return line in re.sub(r"\x1b\[[0-9;]*m", "", output) and line in TUTORIAL


def _delete_redis_keys(namespace: str) -> None:
    from redis import Redis

    client = Redis.from_url(services.REDIS)
    try:
        for key in client.scan_iter(f"{namespace}*"):
            client.delete(key)
    finally:
        client.close()


def _delete_queues(queue: str) -> None:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(services.RABBITMQ))
    try:
        channel = connection.channel()
        for name in (queue, f"{queue}.quarantine", f"{queue}.dead-letter"):
            channel.queue_delete(name)
    finally:
        connection.close()
