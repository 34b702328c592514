"""Running one schedule on real processes and servers, and recording its history.

    controller (this process)
    ├── supervisor thread   starts the worker commands, and starts again any that exited
    │                       (as systemd or Kubernetes would), half a second later
    ├── producer thread     publishes the sends at their times; a conflict once its
    │                       intent's first payload committed
    └── fault thread        the schedule's faults at their times: workers SIGKILLed or
                            SIGTERMed, the explorer's PostgreSQL stopped (fast, immediate)
                            and started (over a map, the second database's server alone
                            too), its sessions terminated, NATS restarted, the
                            workers' connections cut, delayed or black-holed by the proxy,
                            the explorer's PgBouncer and RabbitMQ restarted

    workers ─> [proxy, where the schedule has network faults] ─> [PgBouncer 6445, where
    the configuration's pooler is] ─> PostgreSQL 5445 (over a map, also 5447: the second
    database's; the proxy is between the workers and it only through PgBouncer)

Then it waits (a bounded time) until every intent is settled and the broker holds
nothing, stops the workers, and records the history: every send, every effect, the
inbox's durable records, what is left in the broker and at its destinations.

Everything runs on the explorer's own servers (PostgreSQL 5445 and 5447, its PgBouncer 6445, Redis
6390, RabbitMQ 5673, a NATS per run), except Kafka (tansu): the machine's, on topics of the
run's own, never restarted (it keeps nothing on disk).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psutil
import psycopg

from ..chaos.run import Admin
from ..support import servers
from ..support.cutting_proxy import CuttingProxy
from ..support.proxy import _pump as pump
from . import domain, workload
from .brokers import (
    KAFKA_SERVERS,
    PRODUCER,
    RABBITMQ_URL,
    REDIS_URL,
    Broker,
    make_broker,
)
from .mover import write_map
from .schedule import RETENTION, Fault, Schedule
from .tenants import tenant_of

__all__ = ["PG_PORT", "HarnessTrouble", "History", "run_schedule"]

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "scripts" / "services"
PG_PORT = 5445
PG_URL = f"postgresql://postgres@127.0.0.1:{PG_PORT}"
SECOND_PORT = 5447
"""The explorer's second PostgreSQL (`scripts/services explore-postgres`): the second
database of a run over a map, on a server of its own, which the ``db_one_*`` faults stop
while the first answers."""
RABBITMQ_PORT = 5673
RABBITMQ_NODE = "explore@localhost"
"""The explorer's RabbitMQ (`scripts/services explore-rabbitmq`), which it restarts."""
POOLER_PORT = 6445
"""The explorer's PgBouncer (`scripts/services explore-pgbouncer`): transaction pooling
in front of its PostgreSQL, which the explorer restarts."""
POOLER_DIR = Path(tempfile.gettempdir()) / "inbox-middleware-explore-pgbouncer"
POOLER_PID = POOLER_DIR / "pgbouncer.pid"
POOLER_DATABASES = POOLER_DIR / "databases.ini"
"""Included in the PgBouncer's ``[databases]``: the run's second database, on
`SECOND_PORT` (every other name goes to `PG_PORT`)."""
SETTLE_TIMEOUT = 60.0  # seconds after the last fault and send for everything to settle
READY = {"dramatiq": "ready for action", "faststream": "waiting for messages"}
"""A line each worker process logs once it consumes (a FastStream process forked by
`faststream run --workers` does not log "started successfully"; each subscriber logs this)."""


class HarnessTrouble(Exception):
    """The explorer itself failed (a server that did not come back, a publish that could
    not be made, CPU starvation): reported as such, never as a finding."""


@dataclass
class History:
    schedule: Schedule
    sent: list[tuple[float, str, str, int]] = field(default_factory=list)
    """(time, key, kind, n) of every publish the broker confirmed."""
    unsent_conflicts: list[str] = field(default_factory=list)
    effects: list[tuple[str, str | None, int]] = field(default_factory=list)
    claims: list[str] = field(default_factory=list)
    quarantine: list[tuple[str, str, str]] = field(default_factory=list)
    """(message id, decision, reason) of every quarantine row."""
    poison: list[tuple[str, str, str]] = field(default_factory=list)
    """(message id, reason, decision) of every poison row."""
    poison_lead: dict[str, float] = field(default_factory=dict)
    """For each pending poison row of an applied intent: how many seconds its last write
    came before the intent's first effect."""
    destinations: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    leftover: dict[str, int] = field(default_factory=dict)
    remaining: list[dict[str, Any]] | None = None
    """The payloads the broker still held once the workers stopped (None: not read, or
    the broker cannot say without consuming them: Redis streams, JetStream)."""
    settled: bool = False
    settle_seconds: float = 0.0
    events: list[str] = field(default_factory=list)
    worker_exits: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    """Start-up refusals the workers logged (a correct outcome, not a finding)."""
    load: float = 0.0
    folder: Path | None = None
    faults_missed: list[str] = field(default_factory=list)
    """Faults that could not happen as scheduled (reported with the verdict)."""
    placements: list[list[str]] = field(default_factory=list)
    """Over a map: the keys of the effects each database holds, in the map's order (empty
    with one database)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """What the workload axes' extras saw (`workload.Extras.collect`)."""
    workload: Any = None
    """The run's `workload.Extras`, while it runs."""

    def event(self, started: float, what: str) -> None:
        self.events.append(f"{time.monotonic() - started:6.1f}s {what}")


def library_env() -> dict[str, str]:
    """The environment of the workers and of the CLI: with ``EXPLORE_LIBRARY`` (a folder
    holding another commit's ``inbox_middleware`` package, ``python -m tests.explore
    --library``), that library is the one they import."""
    env = dict(os.environ)
    library = env.get("EXPLORE_LIBRARY")
    if library:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [library, env.get("PYTHONPATH")]))
    return env


# -- the explorer's PostgreSQL ---------------------------------------------------------------


def _cluster(server: int) -> tuple[str, str]:
    listing = subprocess.run(
        ["pg_lsclusters", "--no-header"], check=True, capture_output=True, text=True
    ).stdout
    for line in listing.splitlines():
        version, name, port, *_ = line.split()
        if int(port) == server:
            return version, name
    raise HarnessTrouble(
        f"no PostgreSQL cluster on port {server}: run scripts/services explore-postgres"
    )


def _pg_ctl(action: str, timeout: float = 60, server: int = PG_PORT) -> None:
    version, name = _cluster(server)
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, name, *action.split()],
        check=False,
        capture_output=True,
        timeout=timeout,
    )


def _pg_answers(server: int) -> bool:
    try:
        url = f"postgresql://postgres@127.0.0.1:{server}/postgres"
        with psycopg.connect(url, connect_timeout=2) as conn:
            return conn.execute("SELECT 1").fetchone() == (1,)
    except psycopg.Error:
        return False


def ensure_postgres(timeout: float = 60, server: int = PG_PORT) -> None:
    deadline = time.monotonic() + timeout
    while not _pg_answers(server):
        if not servers.answering(server):
            _pg_ctl("start", server=server)
        if time.monotonic() > deadline:
            raise HarnessTrouble(
                f"the explorer's PostgreSQL ({server}) did not answer within {timeout:.0f}s"
            )
        time.sleep(0.2)


def ensure_services() -> None:
    """The explorer's own PostgreSQL, Redis and RabbitMQ, started by scripts/services if
    down (its PgBouncer: `ensure_pooler`, where a configuration goes through it)."""
    if not all(servers.answering(port) for port in (PG_PORT, SECOND_PORT, 6390)):
        subprocess.run(
            [str(SERVICES), "explore-postgres", "explore-redis"], capture_output=True, timeout=180
        )
    ensure_postgres()
    ensure_postgres(server=SECOND_PORT)
    if not servers.answering(6390):
        raise HarnessTrouble(
            "the explorer's Redis (6390) does not answer: scripts/services explore-redis"
        )
    if not servers.answering(RABBITMQ_PORT):
        subprocess.run([str(SERVICES), "explore-rabbitmq"], capture_output=True, timeout=180)
    if not servers.answering(RABBITMQ_PORT):
        raise HarnessTrouble(
            f"the explorer's RabbitMQ ({RABBITMQ_PORT}) does not answer: "
            "scripts/services explore-rabbitmq"
        )


def ensure_pooler(timeout: float = 60) -> None:
    """The explorer's PgBouncer, started by scripts/services if down, answering."""
    deadline = time.monotonic() + timeout
    while True:
        if not servers.answering(POOLER_PORT):
            subprocess.run([str(SERVICES), "explore-pgbouncer"], capture_output=True, timeout=180)
        try:
            url = f"postgresql://postgres@127.0.0.1:{POOLER_PORT}/postgres"
            with psycopg.connect(url, connect_timeout=2, prepare_threshold=None) as conn:
                if conn.execute("SELECT 1").fetchone() == (1,):
                    return
        except psycopg.Error:
            pass
        if time.monotonic() > deadline:
            raise HarnessTrouble(
                f"the explorer's PgBouncer ({POOLER_PORT}) did not answer within "
                f"{timeout:.0f}s: scripts/services explore-pgbouncer"
            )
        time.sleep(0.2)


def restart_pooler() -> str:
    """Stop the explorer's PgBouncer at once (SIGTERM: its clients' connections dropped,
    their transactions with them) and start it again."""
    begun = time.monotonic()
    try:
        pid = int(POOLER_PID.read_text().split()[0])
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError, IndexError) as exc:
        raise HarnessTrouble(f"the explorer's PgBouncer could not be stopped: {exc!r}") from exc
    while psutil.pid_exists(pid) and time.monotonic() - begun < 30:
        time.sleep(0.05)
    ensure_pooler()
    return f"PgBouncer restarted in {time.monotonic() - begun:.1f}s"


def _rabbitmqctl(*args: str) -> None:
    command = ["rabbitmqctl", "-n", RABBITMQ_NODE, *args]
    if os.getuid() == 0:  # its Erlang cookie is the rabbitmq user's
        command = ["runuser", "-u", "rabbitmq", "--", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise HarnessTrouble(f"rabbitmqctl {' '.join(args)} failed: {done.stderr[-500:]}")


def restart_rabbitmq() -> str:
    """Stop and start the explorer's RabbitMQ node's application: every connection
    closed, durable queues and persistent messages kept."""
    begun = time.monotonic()
    _rabbitmqctl("stop_app")
    _rabbitmqctl("start_app")
    _rabbitmqctl("await_startup", "--timeout", "60")
    return f"RabbitMQ restarted in {time.monotonic() - begun:.1f}s"


class Network(CuttingProxy):
    """The proxy between the workers and PostgreSQL (or PgBouncer): `Proxy`'s cuts and
    black hole, and a delay on every chunk of bytes either way."""

    latency = 0.0

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        pump(source, _Late(sink, self), lambda: self._holed)  # type: ignore[arg-type]


class _Late:
    """A socket whose ``sendall`` waits the proxy's latency first."""

    def __init__(self, sock: socket.socket, network: Network) -> None:
        self.sock, self.network = sock, network

    def sendall(self, data: bytes) -> None:
        if self.network.latency:
            time.sleep(self.network.latency)
        self.sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """One schedule at a time on the explorer's servers (its faults stop them)."""
    with servers.file_lock("inbox-explore.lock"):
        yield


@contextlib.contextmanager
def database(name: str, server: int = PG_PORT) -> Iterator[str]:
    """A fresh database on one of the explorer's PostgreSQL servers, migrated with the
    project's CLI; its libpq URL. Dropped at the end."""
    ensure_postgres(server=server)
    base = f"postgresql://postgres@127.0.0.1:{server}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"{base}/{name}"
    try:
        cli = Path(sys.executable).with_name("inbox-middleware")
        done = subprocess.run(
            [str(cli), "migrate", "--database-url", url],
            env=library_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise HarnessTrouble(f"inbox-middleware migrate failed: {done.stderr[-2000:]}")
        with psycopg.connect(url, autocommit=True) as conn:
            for statement in domain.DDL:
                conn.execute(statement)
        yield url
    finally:
        with contextlib.suppress(Exception):
            ensure_postgres(server=server)
            with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def pooled(name: str, server: int) -> Iterator[None]:
    """The explorer's PgBouncer routes database ``name`` to ``server`` (its
    ``databases.ini``, reloaded), until the end."""

    def reload(entry: str) -> None:
        POOLER_DATABASES.write_text(entry)
        url = f"postgresql://postgres@127.0.0.1:{POOLER_PORT}/pgbouncer"
        with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
            conn.execute("RELOAD")
            shown = {row[0]: row[2] for row in conn.execute("SHOW DATABASES").fetchall()}
        if entry and shown.get(name) != server:
            raise HarnessTrouble(
                f"the explorer's PgBouncer does not route {name} to {server} after RELOAD: "
                "is it one of an earlier scripts/services (no databases.ini)? Stop it and "
                "run scripts/services explore-pgbouncer"
            )

    reload(f"{name} = host=127.0.0.1 port={server}\n")
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            reload("")


class Admins(Admin):
    """The explorer's connections to every database of a run: a query runs in each, and
    answers their rows together (over a map, each tenant's rows are in its database)."""

    def __init__(self, urls: Sequence[str]) -> None:
        super().__init__(urls[0])
        self.others = [Admin(url) for url in urls[1:]]

    def query(self, sql: str, params: Any = None, patience: float = 120) -> list[Any]:
        rows = super().query(sql, params, patience)
        for other in self.others:
            rows += other.query(sql, params, patience)
        return rows

    def each(self, sql: str, params: Any = None, patience: float = 120) -> list[list[Any]]:
        """The rows of each database, in order."""
        first = Admin.query(self, sql, params, patience)
        return [first, *(other.query(sql, params, patience) for other in self.others)]

    def close(self) -> None:
        super().close()
        for other in self.others:
            other.close()


# -- the workers, supervised -----------------------------------------------------------------


class Slot:
    """One supervised worker command (which may fork several worker processes)."""

    def __init__(
        self, name: str, command: list[str], env: dict[str, str], folder: Path, ready: str
    ) -> None:
        self.name, self.command, self.env, self.ready_line = name, command, env, ready
        self.log = folder / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.held = False  # stopped on purpose: the supervisor leaves it
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        with open(self.log, "ab") as out:
            out.write(f"--- start {self.starts} ---\n".encode())
            self.proc = subprocess.Popen(
                self.command,
                cwd=ROOT,
                env={**library_env(), **self.env, "PYTHONUNBUFFERED": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def readiness(self) -> int:
        return self.output().count(self.ready_line)

    def children(self) -> list[int]:
        """The worker processes the command forked (not multiprocessing's resource
        tracker, which a spawning command starts first)."""
        if self.proc is None:
            return []
        try:
            children = psutil.Process(self.proc.pid).children(recursive=False)
            return [c.pid for c in children if "resource_tracker" not in " ".join(c.cmdline())]
        except psutil.Error:
            return []

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def terminate(self, timeout: float = 20) -> None:
        """SIGTERM to the command (it forwards it to what it forked), SIGKILL after
        ``timeout`` seconds (the graceful-shutdown timeout)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        # whatever it forked and left behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.output().splitlines()[-lines:])


class Fleet:
    def __init__(self, schedule: Schedule, env: dict[str, str], folder: Path) -> None:
        config = schedule.config
        forked = config.layout == "forked"
        per_command = config.processes if forked else 1
        commands = 1 if forked else config.processes
        if config.framework == "dramatiq":
            command = [
                sys.executable,
                "-m",
                "dramatiq",
                "tests.explore.app_dramatiq",
                "--processes",
                str(per_command),
                "--threads",
                str(config.concurrency),
            ]
        else:
            command = [
                sys.executable,
                "-m",
                "faststream",
                "run",
                "tests.explore.app_faststream:app",
            ]
            if per_command > 1:
                command += ["--workers", str(per_command)]
        self.forked = forked
        self.slots = [
            Slot(
                f"w{k}", command, env | {"EXPLORE_WORKER": f"w{k}"}, folder, READY[config.framework]
            )
            for k in range(commands)
        ]
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.closed = threading.Event()
        self.exits: list[str] = []

    def start(self) -> None:
        for slot in self.slots:
            slot.start()
        threading.Thread(target=self._supervise, name="explore-supervisor", daemon=True).start()

    def _supervise(self) -> None:
        while not self.closed.is_set():
            with self.lock:
                for slot in self.slots:
                    code = slot.exited()
                    if code is not None and not slot.held and not self.stopping.is_set():
                        self.exits.append(f"{slot.name} exited ({code}) after start {slot.starts}")
                        time.sleep(0.5)
                        slot.start()
            time.sleep(0.2)

    def slot_of(self, worker: int) -> Slot:
        return self.slots[0] if self.forked else self.slots[worker % len(self.slots)]

    def kill(self, worker: int) -> str:
        """SIGKILL worker ``worker``: a command and all it forked, or (forked layout) one
        forked process, which its command replaces."""
        with self.lock:
            slot = self.slot_of(worker)
            if self.forked:
                children = slot.children()
                if children:
                    pid = children[worker % len(children)]
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    return f"SIGKILL process {pid} of {slot.name}"
            slot.kill()
            return f"SIGKILL {slot.name}"

    def terminate(self, worker: int) -> str:
        slot = self.slot_of(worker)
        with self.lock:
            slot.held = True
        started = time.monotonic()
        slot.terminate()
        with self.lock:
            slot.held = False
        return f"SIGTERM {slot.name}, exited in {time.monotonic() - started:.1f}s"

    def resume(self) -> None:
        """Start the stopped workers again, supervised."""
        with self.lock:
            self.stopping.clear()
            for slot in self.slots:
                slot.held = False
                slot.start()

    def stop(self) -> None:
        self.stopping.set()
        with self.lock:
            for slot in self.slots:
                slot.held = True
        for slot in self.slots:
            slot.terminate()

    def tails(self) -> str:
        return "\n".join(f"--- {s.name} (started {s.starts}x) ---\n{s.tail()}" for s in self.slots)


# -- the run -------------------------------------------------------------------------------


def _publish_all(
    schedule: Schedule,
    broker: Broker,
    admin_urls: Sequence[str],
    history: History,
    started: float,
    failure: list[BaseException],
) -> None:
    admin = Admins(admin_urls)
    # When each intent was created, by the producer's clock (copies carry the same).
    now = datetime.now(UTC)
    produced = {k: now + timedelta(seconds=skew) for k, skew in (schedule.skews or {}).items()}
    try:
        broker.open_producer()
        try:
            for send in schedule.sends:
                delay = started + send.at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                identity = send.intent.key if send.intent.identified else None
                stamp = produced.get(send.intent.key)
                if stamp is None:  # as older explorers called it
                    broker.publish(send.intent.payload(send.n), identity)
                else:
                    broker.publish(send.intent.payload(send.n), identity, stamp)
                history.sent.append(
                    (time.monotonic() - started, send.intent.key, send.kind, send.n)
                )
            # Conflicts: each once its intent's first payload committed (it may never).
            pending = {s.intent.key: s for s in schedule.conflicts}
            deadline = time.monotonic() + 20
            while pending and time.monotonic() < deadline:
                rows = admin.query(
                    "SELECT DISTINCT key FROM explore_effects WHERE key = ANY(%s)",
                    (sorted(pending),),
                )
                for (key,) in rows:
                    send = pending.pop(key)
                    stamp = produced.get(key)
                    if stamp is None:
                        broker.publish(send.intent.payload(send.n), key)
                    else:
                        broker.publish(send.intent.payload(send.n), key, stamp)
                    history.sent.append((time.monotonic() - started, key, "conflict", send.n))
                time.sleep(0.3)
            history.unsent_conflicts = sorted(pending)
        finally:
            broker.close_producer()
    except BaseException as exc:
        failure.append(exc)
    finally:
        admin.close()


class Faults:
    def __init__(
        self,
        schedule: Schedule,
        fleet: Fleet,
        admin_urls: Sequence[str],
        nats: Any,
        history: History,
        started: float,
        network: Network | None = None,
    ) -> None:
        self.schedule, self.fleet, self.admin_urls, self.nats = schedule, fleet, admin_urls, nats
        self.history, self.started, self.network = history, started, network
        self.failure: list[BaseException] = []
        # The servers of the run's databases: over a map, two (`SECOND_PORT`)
        self.servers = sorted({_server(url) for url in admin_urls})

    def run(self) -> None:
        try:
            for fault in self.schedule.faults:
                delay = self.started + fault.at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                self.history.event(self.started, f"{fault.describe()}: {self.apply(fault)}")
        except BaseException as exc:
            self.failure.append(exc)
        finally:
            if self.network is not None:
                self.network.latency = 0.0
                if self.network._holed:
                    self.network.unblackhole()
            for server in self.servers:
                ensure_postgres(server=server)
            if self.schedule.config.pooler == "pgbouncer":
                ensure_pooler()

    def _pg_stop(self, mode: str, seconds: float, servers: Sequence[int] = ()) -> str:
        """Stop ``servers`` (every server of the run's databases: none named) in ``mode``,
        start them again ``seconds`` later."""
        servers = servers or self.servers
        begun = time.monotonic()
        for server in servers:
            _pg_ctl(f"stop -m {mode}", server=server)
        time.sleep(seconds)
        for server in servers:
            _pg_ctl("start", server=server)
        for server in servers:
            ensure_postgres(server=server)
        which = "PostgreSQL" if len(servers) == len(self.servers) else f"PostgreSQL {servers[0]}"
        return f"{which} stopped ({mode}) and back after {time.monotonic() - begun:.1f}s"

    def apply(self, fault: Fault) -> str:
        kind = fault.kind
        if kind == "worker_kill":
            return self.fleet.kill(fault.worker)
        if kind == "worker_term":
            return self.fleet.terminate(fault.worker)
        if kind == "pg_fast":
            return self._pg_stop("fast", fault.seconds)
        if kind == "pg_immediate":
            return self._pg_stop("immediate", fault.seconds)
        if kind in ("pg_one_fast", "pg_one_immediate"):
            # over a map: one database's server, while the other's answers
            server = self.servers[fault.database % len(self.servers)]
            return self._pg_stop(kind.rsplit("_", 1)[1], fault.seconds, [server])
        if kind == "pg_terminate":
            admin = Admins(self.admin_urls)  # each database's sessions
            try:
                rows = admin.query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            finally:
                admin.close()
            return f"{len(rows)} sessions terminated"
        if kind == "pg_after_start":
            slot = self.fleet.slot_of(fault.worker)
            before = slot.readiness()
            starts, children = slot.starts, set(slot.children())
            what = self.fleet.kill(fault.worker)

            def replaced() -> bool:
                if fault.phase == "ready":
                    return slot.readiness() > before
                if slot.starts > starts:
                    return True  # the supervisor started the command again
                # a forked process replaced by its command
                return bool(set(slot.children()) - children) and slot.exited() is None

            deadline = time.monotonic() + 30
            while not replaced():
                if time.monotonic() > deadline:
                    self.history.faults_missed.append(fault.describe())
                    return f"{what}; it was not replaced within 30s"
                time.sleep(0.02)
            stop = self._pg_stop("fast", fault.seconds)
            return f"{what}; once it was {fault.phase} again: {stop}"
        if kind.startswith("net_"):
            return self._network(fault)
        if kind == "pooler_restart":
            if self.schedule.config.pooler != "pgbouncer":
                return "no PgBouncer in this configuration"
            return restart_pooler()
        if kind == "broker_restart":
            if self.schedule.config.broker == "rabbitmq":
                return restart_rabbitmq()
            if self.nats is None:
                return "no broker of the run's own to restart"
            return f"NATS restarted in {self.nats.restart():.1f}s"
        raise ValueError(f"unknown fault {kind}")

    def _network(self, fault: Fault) -> str:
        network = self.network
        assert network is not None  # a schedule with network faults has its proxy
        if fault.kind == "net_cut":
            links = network.links()
            network.cut()
            return f"{links} connections cut"
        if fault.kind == "net_delay":
            network.latency = fault.latency
            time.sleep(fault.seconds)
            network.latency = 0.0
            return f"every chunk delayed {fault.latency * 1000:.0f}ms for {fault.seconds:.1f}s"
        network.blackhole()
        time.sleep(fault.seconds)
        links = network.links()
        network.unblackhole()
        return f"black hole for {fault.seconds:.1f}s; then {links} connections reset"


def _unsettled(schedule: Schedule, admin: Admin, history: History) -> int:
    """Intents with neither an effect nor a durable record, and conflicts sent but not
    quarantined yet (a conflict whose first payload never committed is never sent)."""
    applied = {(k, n) for k, n in admin.query("SELECT DISTINCT key, n FROM explore_effects")}
    effects = {k for k, _ in applied}
    # A conflict applied as a message of its own (its intent's claim purged) is settled
    # too: whether the purge was allowed to is the checker's question.
    sent = {
        k for _, k, kind, n in list(history.sent) if kind == "conflict" and (k, n) not in applied
    }
    poison = {m for (m,) in admin.query("SELECT message_id FROM inbox_poison")}
    quarantined = {m for (m,) in admin.query("SELECT message_id FROM inbox_quarantine")}
    count = 0
    for intent in schedule.intents:
        if intent.behaviour == "invalid":
            continue  # dead-lettered without a record (validation): read at the end
        if intent.identified and intent.key not in effects | poison:
            count += 1
        elif intent.behaviour == "no-identity" and schedule.config.missing_identity == "process":
            count += intent.key not in effects
    extras = history.workload.unsettled(admin) if history.workload is not None else 0
    return count + len(sent - quarantined) + extras


def _patiently(call: Any, what: str, patience: float = 90) -> Any:
    """A look at the broker, retried through a moment when it does not answer (RabbitMQ
    is shared: another run may restart it); past ``patience``, the harness's trouble."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return call()
        except Exception as exc:
            if time.monotonic() > deadline:
                raise HarnessTrouble(f"{what} failed for {patience:.0f}s: {exc!r}") from exc
            time.sleep(1)


def _settle(
    schedule: Schedule,
    admin: Admin,
    broker: Broker,
    seconds: float,
    history: History,
    started: float,
) -> bool:
    """Wait until every intent is settled and the broker holds nothing ready, three
    looks in a row; whether that happened within ``seconds``."""
    deadline = time.monotonic() + seconds
    quiet = 0
    while True:
        unsettled = _unsettled(schedule, admin, history)
        leftover = _patiently(broker.leftover, "reading the broker")
        quiet = quiet + 1 if unsettled == 0 and not any(leftover.values()) else 0
        if quiet >= 3:
            return True
        if time.monotonic() > deadline:
            history.event(started, f"not settled: {unsettled} intents, broker {leftover}")
            return False
        time.sleep(0.7)


def run_schedule(schedule: Schedule, folder: Path, log: Any = print) -> History:
    """Run ``schedule`` (the caller holds `exclusive`); its history. Raises
    `HarnessTrouble` when the explorer itself failed."""
    config = schedule.config
    history = History(schedule, folder=folder)
    folder.mkdir(parents=True, exist_ok=True)
    source = f"explore_{schedule.seed}_{uuid.uuid4().hex[:8]}"
    nats = None
    network: Network | None = None
    if config.broker == "nats":
        nats = servers.OwnedNats(folder / "nats")
        nats.start()
    if config.broker == "kafka" and not servers.answering(9092):
        raise HarnessTrouble("Kafka (tansu, 9092) does not answer: scripts/services kafka")
    url = {"rabbitmq": RABBITMQ_URL, "redis": REDIS_URL, "kafka": KAFKA_SERVERS}.get(
        config.broker
    ) or nats.url  # type: ignore[union-attr]
    broker = make_broker(config.target, source, url, quorum=config.queues == "quorum")
    fleet: Fleet | None = None
    extras: workload.Extras | None = None
    try:
        with database(source) as admin_url, contextlib.ExitStack() as more:
            sync = config.framework == "dramatiq" and config.actor == "sync"
            driver = "postgresql+psycopg" if sync else "postgresql+asyncpg"
            # The workers' way to PostgreSQL: PgBouncer, the proxy, both or neither.
            port = PG_PORT
            if config.pooler == "pgbouncer":
                ensure_pooler()
                port = POOLER_PORT
            if schedule.proxied:
                network = Network(("127.0.0.1", port))
                port = network.port
            worker_url = _through(admin_url, [PG_PORT], port)
            env = broker.worker_env() | {
                "EXPLORE_DATABASE_URL": worker_url.replace("postgresql", driver, 1),
                "EXPLORE_POOLER": config.pooler,
                "EXPLORE_RETENTION": "" if schedule.skews is None else str(RETENTION),
                "EXPLORE_CONCURRENCY": str(config.concurrency),
                "EXPLORE_PREFETCH": str(
                    config.concurrency if schedule.prefetch is None else schedule.prefetch
                ),
                "EXPLORE_GUARD": config.guard,
                "EXPLORE_ACK_POLICY": config.ack_policy,
                "EXPLORE_MISSING_IDENTITY": config.missing_identity,
                "EXPLORE_MAX_ATTEMPTS": ""
                if config.max_attempts is None
                else str(config.max_attempts),
                "EXPLORE_REDELIVERY_LIMIT": ""
                if config.redelivery_limit is None
                else str(config.redelivery_limit),
            }
            available = workload.features(library_env())
            env |= workload.worker_env(config, available) | {"EXPLORE_OUTBOX_URL": admin_url}
            admin_urls = [admin_url]
            if env["EXPLORE_DATABASES"] == "map":  # a second database, tenant t1's
                # on a server of its own, which the pg_one_* faults stop alone
                second = f"{source}_b"
                reached = [PG_PORT]
                if config.pooler == "pgbouncer":
                    more.enter_context(pooled(second, SECOND_PORT))
                    reached.append(SECOND_PORT)
                admin_urls.append(more.enter_context(database(second, SECOND_PORT)))
                broker.tenants = True
                # The workers' map, through the pooler or the proxy where they are (to
                # the second server: through the pooler, or straight); the commands'
                # (the dispatchers, the purge, the repairs) straight to PostgreSQL, as
                # their --database-url is with one database.
                workers = [_through(url, reached, port) for url in admin_urls]
                env["EXPLORE_WORKERS_MAP"] = write_map(folder / "workers-map.json", workers)
                env["EXPLORE_MAP_FILE"] = write_map(folder / "map.json", admin_urls)
            if env["EXPLORE_CLAIMS"] == "compact":  # a new deployment: switched at once
                for url in admin_urls:
                    with psycopg.connect(url, autocommit=True) as conn:
                        conn.execute(
                            "INSERT INTO inbox_layout (name, value, changed_at, changed_by)"
                            " VALUES ('claims', 'compact', now(), 'explore')"
                        )
            extras = workload.Extras(
                schedule, admin_url, library_env() | env, folder, available, Slot
            )
            history.workload = extras
            _patiently(broker.prepare, "preparing the broker")
            fleet = Fleet(schedule, env, folder)
            started = time.monotonic()
            fleet.start()
            extras.start(started)
            failure: list[BaseException] = []
            producer = threading.Thread(
                target=_publish_all,
                args=(schedule, broker, admin_urls, history, started, failure),
                daemon=True,
            )
            faults = Faults(schedule, fleet, admin_urls, nats, history, started, network)
            faulting = threading.Thread(target=faults.run, daemon=True)
            producer.start()
            faulting.start()
            faulting.join(timeout=180)
            producer.join(timeout=180)
            if faulting.is_alive() or producer.is_alive():
                raise HarnessTrouble("the faults or the sends did not finish within 180s")
            if faults.failure:
                raise HarnessTrouble(f"a fault failed: {faults.failure[0]!r}") from faults.failure[
                    0
                ]
            if failure:
                raise HarnessTrouble(f"publishing failed: {failure[0]!r}") from failure[0]
            history.event(started, "sends and faults done; settling")
            extras.end_of_faults()
            admin = Admins(admin_urls)
            try:
                quiet_from = time.monotonic()
                patience = SETTLE_TIMEOUT * (3 if schedule.prefetch == 0 else 1)
                history.settled = _settle(schedule, admin, broker, patience, history, started)
                history.settle_seconds = time.monotonic() - quiet_from
                history.load = os.getloadavg()[0]
                fleet.stop()
                history.event(started, "workers stopped")
                leftover = _patiently(broker.leftover, "reading the broker")
                for _ in range(2):
                    if not history.settled or not any(leftover.values()):
                        break
                    # Unacknowledged while the workers ran (in a backoff, say), ready now:
                    # the workers are started again to settle them, as a supervisor would.
                    history.event(started, f"the broker holds {leftover}: workers started again")
                    fleet.resume()
                    history.settled = _settle(schedule, admin, broker, 30, history, started)
                    fleet.stop()
                    history.event(started, "workers stopped")
                    leftover = _patiently(broker.leftover, "reading the broker")
                extras.stop()
                history.extra = extras.collect(admin)
                history.worker_exits = list(fleet.exits)
                history.refused = [
                    line.strip()
                    for slot in fleet.slots
                    for line in slot.output().splitlines()
                    if "refus" in line.lower() and ("Error" in line or "error" in line)
                ][:5]
                history.leftover = leftover
                if any(leftover.values()):
                    history.remaining = _patiently(broker.remaining, "reading the broker")
                history.destinations = _patiently(broker.destinations, "reading the destinations")
                history.effects = [
                    tuple(r) for r in admin.query("SELECT key, message_id, n FROM explore_effects")
                ]  # type: ignore[misc]
                history.claims = _claims(admin, schedule, env["EXPLORE_CLAIMS"], broker.tenants)
                if broker.tenants:
                    history.placements = [
                        [k for (k,) in rows]
                        for rows in admin.each("SELECT DISTINCT key FROM explore_effects")
                    ]
                history.quarantine = [
                    tuple(r)
                    for r in admin.query(
                        "SELECT message_id, decision, reason_code FROM inbox_quarantine"
                    )  # type: ignore[misc]
                ]
                history.poison = [
                    tuple(r)
                    for r in admin.query(
                        "SELECT message_id, reason_code, decision FROM inbox_poison"
                    )  # type: ignore[misc]
                ]
                history.poison_lead = {
                    m: float(lead)
                    for m, lead in admin.query(
                        "SELECT p.message_id, extract(epoch FROM min(e.at) - p.last_failure_at)"
                        " FROM inbox_poison p JOIN explore_effects e ON e.key = p.message_id"
                        " WHERE p.decision = 'pending' GROUP BY p.message_id, p.last_failure_at"
                    )
                }
            finally:
                admin.close()
        (folder / "events.txt").write_text(
            "\n".join(history.events + history.extra.get("events", [])) + "\n\n" + fleet.tails()
        )
        return history
    except psycopg.OperationalError as exc:
        raise HarnessTrouble(f"the explorer's own connection failed: {exc}") from exc
    except HarnessTrouble:
        raise
    except Exception as exc:
        # The explorer's own code failed: its trouble, with the traceback kept.
        import traceback

        (folder / "harness-error.txt").write_text(traceback.format_exc())
        raise HarnessTrouble(f"the explorer failed: {exc!r} (see harness-error.txt)") from exc
    finally:
        if fleet is not None:
            fleet.closed.set()
            fleet.stopping.set()
            for slot in fleet.slots:
                slot.held = True
                slot.kill()
        if extras is not None:
            extras.kill()
        with contextlib.suppress(Exception):
            broker.cleanup()
            if extras is not None:
                extras.cleanup()
        if nats is not None:
            nats.close()
        if network is not None:
            network.close()


def _server(url: str) -> int:
    """The port of a libpq URL of the explorer's."""
    return int(url.rsplit(":", 1)[1].split("/", maxsplit=1)[0])


def _through(url: str, servers: Sequence[int], port: int) -> str:
    """``url`` on ``port`` (the pooler's, the proxy's) when its server is one of
    ``servers``; as it is otherwise."""
    server = _server(url)
    return url.replace(f":{server}/", f":{port}/", 1) if server in servers else url


def _claims(admin: Any, schedule: Schedule, claims: str, tenants: bool = False) -> list[str]:
    """The message ids the consumer holds a claim for, once per claim. In the compact
    table a claim keeps no text, nor its consumer: each id the run could have claimed
    (its intents, and those the operator's accepted conflicts were published under) is
    looked for by the key the library computes for it; the table's other keys are the
    downstream consumers' claims of the outputs. A key computed otherwise than the
    library's would leave an applied intent without its claim, which the check reports."""
    if claims != "compact":
        return [
            m
            for (m,) in admin.query(
                "SELECT message_id FROM consumer_inbox WHERE consumer_name = 'explore'"
            )
        ]
    from inbox_middleware._core.claims import claim_key

    candidates = {intent.key for intent in schedule.intents}
    candidates |= {
        m
        for (m,) in admin.query(
            "SELECT accepted_message_id FROM inbox_quarantine WHERE accepted_message_id IS NOT NULL"
        )
    }
    by_key = {
        claim_key("explore", PRODUCER, tenant_of(m) if tenants else "", m).hex(): m
        for m in candidates
    }
    stored = admin.query("SELECT replace(identity::text, '-', '') FROM inbox_claims")
    return [by_key[key] for (key,) in stored if key in by_key]
