"""Restarting servers under a running test, and servers a test owns.

PostgreSQL and RabbitMQ are the machine's: a restart always ends with the server answering
again, even when the restart itself failed half-way (the ``finally`` starts it and waits).
NATS is started by the test on a free 127.0.0.1 port with its own data folder and
JetStream file storage.

The production topologies are the machine's too, started by ``scripts/services``: the
persistent Redis is SIGKILLed (whatever it acknowledged must be in its fsynced append-only
file) and started again by that script; the failover pair's primary is stopped in
immediate mode and its standby promoted, and ``scripts/services`` restores the pair as
it created it (the first cluster the primary again, the standby rebuilt from it).

Restart commands can be replaced through ``INBOX_TEST_POSTGRES_RESTART``,
``INBOX_TEST_RABBITMQ_RESTART``, ``INBOX_TEST_REDIS_PERSISTENT_RESTART`` (the command that
starts the killed Redis), ``INBOX_TEST_POSTGRES_STOP_PRIMARY``, ``INBOX_TEST_POSTGRES_PROMOTE``
and ``INBOX_TEST_POSTGRES_PAIR_RESTORE`` (shell commands) on machines laid out differently.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

from . import services

__all__ = [
    "OwnedNats",
    "checkpoint",
    "ensure_postgres",
    "ensure_rabbitmq",
    "failover_pair_locked",
    "failover_postgres",
    "free_port",
    "kill_persistent_redis",
    "restart_postgres",
    "restart_rabbitmq",
    "restore_failover_pair",
]

SERVICES_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "services"


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


def checkpoint(url: str) -> None:
    """A CHECKPOINT on the server of ``url``, as an operator makes before a planned restart:
    the shutdown's own checkpoint then has little left to write. Best effort."""
    import psycopg

    with contextlib.suppress(psycopg.Error):
        libpq = url.replace("postgresql+psycopg", "postgresql").rsplit("/", 1)[0] + "/postgres"
        with psycopg.connect(libpq, connect_timeout=5, autocommit=True) as conn:
            conn.execute("CHECKPOINT")


def restart_postgres(timeout: float = 60) -> float:
    """Restart the server (a fast shutdown: every session is ended); seconds it took.

    A checkpoint first, as an operator would before a planned restart: the shutdown's own
    checkpoint then has little left to write, which keeps the outage short.
    """
    checkpoint(services.POSTGRES_SERVER)
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


# -- the persistent Redis ------------------------------------------------------------------


def persistent_redis_answers() -> bool:
    import redis

    client = redis.Redis.from_url(services.REDIS_PERSISTENT, socket_timeout=2)
    try:
        # LOADING is answered (an error) while the append-only file is replayed
        return bool(client.ping())
    finally:
        client.close()


def kill_persistent_redis(timeout: float = 60, on_down: Callable[[], None] | None = None) -> float:
    """SIGKILL the persistent Redis, no shutdown, and start it again with
    ``scripts/services``; seconds until it answered again. ``on_down`` is called once its
    port is closed, before the restart begins."""
    import redis

    client = redis.Redis.from_url(services.REDIS_PERSISTENT, socket_timeout=5)
    try:
        pid = int(client.info("server")["process_id"])
    finally:
        client.close()
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    port = urlsplit(services.REDIS_PERSISTENT).port or 6379
    _wait(lambda: not answering(port), 10, "the killed Redis's port closing")
    if on_down is not None:
        on_down()
    command = os.environ.get("INBOX_TEST_REDIS_PERSISTENT_RESTART") or str(SERVICES_SCRIPT)
    _run(command, timeout)
    _wait(persistent_redis_answers, timeout, "the persistent Redis")
    return time.monotonic() - started


# -- the failover pair --------------------------------------------------------------------


def _pair_clusters() -> list[tuple[str, str]]:
    """(version, name) of the local clusters on the pair's ports: primary, then standby."""
    listing = subprocess.run(
        ["pg_lsclusters", "--no-header"], check=True, capture_output=True, text=True
    ).stdout
    by_port = {}
    for line in listing.splitlines():
        version, name, port, *_ = line.split()
        by_port[int(port)] = (version, name)
    return [by_port[port] for _, port in services.pair_addresses()]


def pair_roles() -> list[bool | None]:
    """For the primary then the standby as created: whether it is in recovery (None: it
    does not answer)."""
    import psycopg

    roles: list[bool | None] = []
    for host, port in services.pair_addresses():
        try:
            url = f"postgresql://postgres@{host}:{port}/postgres"
            with psycopg.connect(url, connect_timeout=2) as conn:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
                roles.append(bool(row[0]) if row else None)
        except psycopg.OperationalError:
            roles.append(None)
    return roles


def _wal_sender(host: str, port: int) -> int | None:
    """The process id of the primary's WAL sender (None: no standby is connected)."""
    import psycopg

    with psycopg.connect(f"postgresql://postgres@{host}:{port}/postgres") as conn:
        row = conn.execute("SELECT pid FROM pg_stat_replication LIMIT 1").fetchone()
    return int(row[0]) if row and row[0] else None


def failover_postgres(timeout: float = 60, lag: float = 1.0) -> float:
    """The standby falls ``lag`` seconds behind (the primary's WAL sender stopped with
    SIGSTOP, as a slow network would hold the WAL back), then the pair's primary crashes
    (that sender SIGKILLed, which ends every session, then an immediate stop: no shutdown
    checkpoint) and the standby is promoted; seconds from the crash until the standby
    accepts writes.

    With synchronous replication the primary's commits wait meanwhile, and none is
    reported that the standby lacks; with asynchronous replication those commits are
    reported, and lost with the old primary.
    """
    primary, standby = _pair_clusters()
    ctl = "pg_ctlcluster --skip-systemctl-redirect"
    sender = _wal_sender(*services.pair_addresses()[0]) if lag > 0 else None
    if sender is not None:
        os.kill(sender, signal.SIGSTOP)
    try:
        time.sleep(lag)
    finally:
        started = time.monotonic()
        if sender is not None:
            os.kill(sender, signal.SIGKILL)  # the postmaster ends every session at once
    _run(
        os.environ.get("INBOX_TEST_POSTGRES_STOP_PRIMARY")
        or f"{ctl} {primary[0]} {primary[1]} stop -m immediate",
        timeout,
    )
    _run(
        os.environ.get("INBOX_TEST_POSTGRES_PROMOTE") or f"{ctl} {standby[0]} {standby[1]} promote",
        timeout,
    )
    _wait(lambda: pair_roles()[1] is False, timeout, "the promoted standby")
    return time.monotonic() - started


@contextlib.contextmanager
def file_lock(name: str) -> Iterator[None]:
    """Hold the lock file ``name`` in the temporary folder, across processes."""
    path = Path(tempfile.gettempdir()) / name
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def failover_pair_locked() -> Iterator[None]:
    """Hold the pair's lock: ``scripts/services`` (another checkout's, say) waits instead
    of restoring the pair in the middle of a failover or a settings change."""
    with file_lock("inbox-middleware-failover-pair.lock"):
        yield


def restore_failover_pair(timeout: float = 180) -> None:
    """The pair as ``scripts/services`` creates it: the first cluster the primary, the
    second its synchronous standby (rebuilt from the primary after a promotion). Called
    with `failover_pair_locked` held."""
    command = os.environ.get("INBOX_TEST_POSTGRES_PAIR_RESTORE") or str(SERVICES_SCRIPT)
    subprocess.run(
        command,
        shell=True,
        check=True,
        timeout=timeout,
        capture_output=True,
        env=os.environ | {"INBOX_FAILOVER_PAIR_LOCKED": "1"},
    )
    if pair_roles() != [False, True]:
        raise AssertionError(f"the failover pair was not restored: {pair_roles()}")


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
