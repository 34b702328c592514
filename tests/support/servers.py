"""Restarting servers under a running test, and servers a test owns.

PostgreSQL and RabbitMQ are the machine's: a restart always ends with the server answering
again, even when the restart itself failed half-way (the ``finally`` starts it and waits).
Redis and NATS are started by the test on a free 127.0.0.1 port with their own data folder
and persistence (Redis: append-only file, fsync on every write; NATS: JetStream file
storage), because the machine's Redis keeps nothing across a restart.

Restart commands can be replaced through ``INBOX_TEST_POSTGRES_RESTART`` and
``INBOX_TEST_RABBITMQ_RESTART`` (shell commands) on machines laid out differently.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

from . import services

__all__ = [
    "OwnedNats",
    "OwnedRedis",
    "ensure_postgres",
    "ensure_rabbitmq",
    "free_port",
    "restart_postgres",
    "restart_rabbitmq",
]


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        return int(listener.getsockname()[1])


def answering(port: int, host: str = "127.0.0.1") -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def _wait(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if check():
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not answer within {timeout:.0f}s")
        time.sleep(0.1)


def _run(command: str, timeout: float) -> None:
    subprocess.run(command, shell=True, check=True, timeout=timeout, capture_output=True)


# -- PostgreSQL ---------------------------------------------------------------------------


def _postgres_port() -> int:
    return urlsplit(services.POSTGRES_SERVER).port or 5432


def _postgres_cluster() -> tuple[str, str]:
    """(version, name) of the local cluster listening on the tests' port."""
    listing = subprocess.run(
        ["pg_lsclusters", "--no-header"], check=True, capture_output=True, text=True
    ).stdout
    for line in listing.splitlines():
        version, name, port, *_ = line.split()
        if int(port) == _postgres_port():
            return version, name
    raise AssertionError(f"no local PostgreSQL cluster on port {_postgres_port()}")


def _pg_ctl(action: str) -> str:
    version, name = _postgres_cluster()
    return f"pg_ctlcluster --skip-systemctl-redirect {version} {name} {action}"


def postgres_answers() -> bool:
    import psycopg

    url = services.POSTGRES_SERVER.replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", connect_timeout=2) as conn:
        return conn.execute("SELECT 1").fetchone() == (1,)


def ensure_postgres(timeout: float = 60) -> None:
    """Start PostgreSQL if it does not answer, and wait until it does."""
    if not answering(_postgres_port()):
        with contextlib.suppress(Exception):
            _run(_pg_ctl("start"), timeout)
    _wait(postgres_answers, timeout, "PostgreSQL")


def restart_postgres(timeout: float = 60) -> float:
    """Restart the server (a fast shutdown: every session is ended); seconds it took.

    A checkpoint first, as an operator would before a planned restart: the shutdown's own
    checkpoint then has little left to write, which keeps the outage short.
    """
    import psycopg

    with contextlib.suppress(psycopg.Error):
        url = services.POSTGRES_SERVER.replace("postgresql+psycopg", "postgresql")
        with psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
            conn.execute("CHECKPOINT")
    started = time.monotonic()
    command = os.environ.get("INBOX_TEST_POSTGRES_RESTART") or _pg_ctl("restart -m fast")
    try:
        _run(command, timeout)
    finally:
        ensure_postgres(timeout)
    return time.monotonic() - started


# -- RabbitMQ -----------------------------------------------------------------------------


def rabbitmq_answers() -> bool:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(services.RABBITMQ))
    connection.close()
    return True


def ensure_rabbitmq(timeout: float = 120) -> None:
    """Start RabbitMQ's application if it is stopped, and wait until AMQP answers."""
    with contextlib.suppress(Exception):
        if rabbitmq_answers():
            return
    with contextlib.suppress(Exception):
        _run("rabbitmqctl start_app", timeout)
    _wait(rabbitmq_answers, timeout, "RabbitMQ")


def restart_rabbitmq(timeout: float = 120) -> float:
    """Stop and start RabbitMQ's application (durable queues and persistent messages are
    kept, every connection is closed); seconds it took."""
    started = time.monotonic()
    command = os.environ.get("INBOX_TEST_RABBITMQ_RESTART") or (
        "rabbitmqctl stop_app && rabbitmqctl start_app && rabbitmqctl await_startup"
    )
    try:
        _run(command, timeout)
    finally:
        ensure_rabbitmq(timeout)
    return time.monotonic() - started


def rabbitmq_queue_counts() -> dict[str, tuple[int, int]]:
    """Every queue's (ready, unacknowledged) message counts, as the server reports them."""
    listing = subprocess.run(
        [
            "rabbitmqctl",
            "list_queues",
            "--quiet",
            "--no-table-headers",
            "name",
            "messages_ready",
            "messages_unacknowledged",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    counts = {}
    for line in listing.splitlines():
        parts = line.split("\t")
        if len(parts) == 3:
            counts[parts[0]] = (int(parts[1]), int(parts[2]))
    return counts


# -- servers the test owns ----------------------------------------------------------------


class _Owned:
    """A server process in its own session, with its data in ``folder``."""

    name = "server"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def answers(self) -> bool:
        return answering(self.port)

    def start(self, timeout: float = 30) -> None:
        with open(self.folder / f"{self.name}.out", "ab") as out:
            self.proc = subprocess.Popen(
                self.command(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        _wait(self._alive_and_answering, timeout, f"the test's {self.name}")

    def _alive_and_answering(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"the test's {self.name} exited ({self.proc.returncode})")
        return self.answers()

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def restart(self) -> float:
        """A clean shutdown and a start on the same port and data; seconds it took."""
        started = time.monotonic()
        try:
            self.stop()
        finally:
            self.start()
        return time.monotonic() - started

    def close(self) -> None:
        self.stop()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OwnedRedis(_Owned):
    """redis-server with an append-only file fsynced on every write."""

    name = "redis"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.folder),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--daemonize",
            "no",
        ]

    def answers(self) -> bool:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)
        try:
            # LOADING is answered while the append-only file is replayed
            return bool(client.ping())
        finally:
            client.close()


class OwnedNats(_Owned):
    """nats-server with JetStream on file storage."""

    name = "nats"

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            "nats-server",
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-js",
            "-sd",
            str(self.folder / "jetstream"),
        ]

    def answers(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            return sock.recv(4).startswith(b"INFO")
