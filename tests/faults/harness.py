"""One worker run of the fault-injection matrix: a broker set-up, a fault, every row.

    harness (this process)                 worker process (tests.faults.app_*)
    ----------------------                 -----------------------------------
    plan: a message per row, its fault ──> the hook fires each fault once, at its point
    send the messages; a duplicate or
    a conflicting copy once the first
    has committed
    restart PostgreSQL when asked     <─── restart: the hook asks and blocks
    start a replacement worker        <─── kill: the worker SIGKILLs itself
    wait until every message settled
    (bounded), stop the worker
    read the database and the broker: each row's message applied once, or a durable
    record of why not (poison, quarantine, dead-letter copy); never lost, never twice;
    and the row's fault fired.

The worker apps are the chaos run's (`tests.apps.chaos_*`), the targets the chaos run's
(`tests.chaos.targets`): the same producer, queue inspection and destinations.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from ..chaos.plan import Intent, Send
from ..chaos.run import Admin, _reset
from ..chaos.targets import Target, Worker, _persist, make_target
from .hook import Fault, read_fired, read_reached, write_plan
from .matrix import ROWS, Cell, Row, Setup, not_applicable

__all__ = ["run_group"]

APPLICATION = "chaos-"  # the workers' database sessions: chaos-<name> (tests.apps.chaos_*)
WORKERS = ("w0", "w1")
APPS = {"dramatiq": "tests.faults.app_dramatiq", "faststream": "tests.faults.app_faststream:app"}
SETTLE = {"raise": 40.0, "cut": 40.0, "restart": 90.0, "kill": 120.0}
"""Seconds a run may take to settle once every message is sent."""
FAST_REDELIVERY = {
    "CHAOS_HEARTBEAT_MS": "2000",  # Dramatiq on Redis: a dead worker's messages come back
    "CHAOS_RECLAIM_MS": "1500",  # FastStream on Redis streams: pending entries reclaimed
    "CHAOS_ACK_WAIT": "3",  # FastStream on NATS JetStream: unacknowledged redelivered
}


@dataclass
class Message:
    row: Row
    message_id: str | None
    account: int
    delta: int
    conflicting_delta: int | None = None
    sent: bool = False
    follow_up_sent: bool = False

    @property
    def refused(self) -> bool:
        return self.row.message == "refused"

    @property
    def send(self) -> Send:
        assert self.message_id is not None
        intent = Intent(self.message_id, self.account, self.delta, self.refused)
        return Send(intent, "first", self.delta)


@dataclass
class Run:
    setup: Setup
    fault: str
    folder: Path
    target: Target
    admin: Admin
    env: dict[str, str]
    log: Any
    restart: Callable[[], float]
    """Restarts the run's PostgreSQL; the seconds it took."""
    messages: list[Message] = field(default_factory=list)
    workers: dict[str, Worker] = field(default_factory=dict)
    generations: int = 0
    restarts: int = 0
    producer: Any = None

    # -- the workers ---------------------------------------------------------------------

    def start_worker(self, name: str) -> None:
        """Start (or replace) worker ``name``; its sessions are named ``chaos-<name>``."""
        self.generations += 1
        path = self.folder / f"{name}-{self.generations}.log"
        (self.folder / "stats" / name).mkdir(parents=True, exist_ok=True)
        env = self.env | {
            "CHAOS_WORKER": name,
            "CHAOS_STATS": str(self.folder / "stats" / name),
            "FAULTS_APPLICATION": f"{APPLICATION}{name}",
        }
        self.workers[name] = self.target.worker(env, path)

    def revive(self) -> None:
        """A worker that exited (it SIGKILLed itself) is replaced; the other carries on
        meanwhile, so a kill costs the run no start-up time."""
        for name, worker in list(self.workers.items()):
            if worker.proc.poll() is not None:
                worker.kill()  # the rest of its process group
                self.start_worker(name)

    def serve_restarts(self) -> None:
        """One restart for every hook waiting at its point (each blocks until done)."""
        waiting = [
            r
            for r in sorted((self.folder / "restart").glob("*.request"))
            if not r.with_suffix(".done").exists()
        ]
        if not waiting:
            return
        time.sleep(0.3)  # let a hook reaching its point right now join this restart
        waiting = [
            r
            for r in sorted((self.folder / "restart").glob("*.request"))
            if not r.with_suffix(".done").exists()
        ]
        seconds = self.restart()
        self.restarts += 1
        self.log(f"    PostgreSQL restarted in {seconds:.1f}s for {[r.stem for r in waiting]}")
        for request in waiting:
            request.with_suffix(".done").write_text(f"{seconds}\n")

    # -- messages -------------------------------------------------------------------------

    def publish(self, message: Message, delta: int) -> None:
        if message.message_id is not None:
            send = message.send
            self.producer.send(Send(send.intent, "first", delta))
            return
        args = (message.account, delta)
        if self.setup.adapter == "dramatiq":
            _persist(lambda: self.producer.actor.send_with_options(args=args), "a message")
        else:
            body = {"account": message.account, "delta": delta}
            _persist(
                lambda: self.producer.loop.run_until_complete(
                    self.target.publish(self.producer.broker, body, {})  # type: ignore[attr-defined]
                ),
                "a message",
            )

    def follow_ups(self, state: State) -> None:
        """Send each duplicate and conflicting copy once its first delivery is settled."""
        for m in self.messages:
            if m.row.message not in ("duplicate", "conflict") or m.follow_up_sent:
                continue
            if m.message_id in state.journal or m.message_id in state.poison:
                delta = m.conflicting_delta if m.row.message == "conflict" else m.delta
                assert delta is not None
                self.publish(m, delta)
                m.follow_up_sent = True

    def pump(self, done: Any, timeout: float) -> bool:
        """Keep the run going (replacement workers, restarts, follow-ups) until
        ``done(state)`` or ``timeout``; whether it was done."""
        deadline = time.monotonic() + timeout
        while True:
            self.serve_restarts()
            self.revive()
            state = State.read(self.admin)
            self.follow_ups(state)
            if done(state):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


@dataclass
class State:
    journal: dict[str, list[tuple[int, int]]]
    poison: dict[str, str]
    quarantine: dict[str, tuple[str, str]]

    @classmethod
    def read(cls, admin: Admin) -> State:
        journal: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for message_id, account, delta in admin.query(
            "SELECT message_id, account_id, delta FROM chaos_journal"
        ):
            journal[message_id].append((account, delta))
        poison = dict(admin.query("SELECT message_id, reason_code FROM inbox_poison"))
        quarantine = {
            m: (decision, reason)
            for m, decision, reason in admin.query(
                "SELECT message_id, decision, reason_code FROM inbox_quarantine"
            )
        }
        return cls(dict(journal), poison, quarantine)

    def settled(self, messages: list[Message]) -> bool:
        """Every message with an identity has its effect or its record in the database."""
        for m in messages:
            if m.message_id is None:
                continue
            if m.row.message in ("duplicate", "conflict") and not m.follow_up_sent:
                return False
            if m.refused and m.message_id not in self.poison:
                return False
            if m.message_id not in self.journal and m.message_id not in self.poison:
                return False
            if m.row.message == "conflict" and m.message_id not in self.quarantine:
                return False
        return True


def run_group(
    setup: Setup,
    fault: str,
    database_url: str,
    folder: Path,
    log: Any = print,
    *,
    restart: Callable[[], float],
    only: set[str] | None = None,
    env: dict[str, str] | None = None,
) -> list[Cell]:
    """Run every row of ``setup`` x ``fault`` in one worker run against the database at
    ``database_url``, whose server ``restart`` restarts; a cell per row (``only``: these
    rows; ``env``: more variables for the worker)."""
    started = time.monotonic()
    rng = random.Random(f"{setup.name}-{fault}")
    cells: list[Cell] = []
    rows: list[Row] = []
    for row in ROWS:
        if only is not None and row.name not in only:
            continue
        reason = not_applicable(setup, row, fault)
        if reason is None:
            rows.append(row)
        else:
            status = "n.a." if reason.startswith("n.a.") else "skip"
            cells.append(Cell(setup, row, fault, status, reason))
    if not rows:
        return cells

    url = make_url(database_url)
    admin_url = url.set(drivername="postgresql").render_as_string(hide_password=False)
    asynchronous = setup.adapter == "faststream" or setup.asyncio
    driver = "postgresql+asyncpg" if asynchronous else "postgresql+psycopg"
    worker_url = url.set(drivername=driver).render_as_string(hide_password=False)
    target = make_target(setup.adapter, setup.broker, folder)
    target.app = APPS[setup.adapter]  # type: ignore[attr-defined]
    (folder / "stats").mkdir(parents=True, exist_ok=True)
    (folder / "restart").mkdir(exist_ok=True)
    admin = Admin(admin_url)
    run = Run(setup, fault, folder, target, admin, {}, log, restart)

    # A message per row, and the row's fault (plus a handler failure for "retry").
    tag = uuid.uuid4().hex[:6]
    faults: list[Fault] = []
    cell_faults: list[Fault] = []  # the row's own fault, one per message
    for n, row in enumerate(rows):
        message_id = None if row.message == "noid" else f"{tag}-{n:02d}-{row.point}"
        account = 1000 + n if row.message == "refused" else rng.randint(1, 100)
        delta = 10_000 * (n + 1) + rng.randint(1, 999)
        conflicting = delta + 1 if row.message == "conflict" else None
        run.messages.append(Message(row, message_id, account, delta, conflicting))
        fault_id = None if row.message == "check" else message_id
        cell_faults.append(Fault(row.point, fault_id, fault, row.occurrence))
        faults.append(cell_faults[-1])
        if row.message == "retry":
            faults.append(Fault("handler", message_id, "raise", 0, until=cell_faults[-1].key))
    plan = folder / "plan.json"
    write_plan(plan, faults)
    run.env = (
        target.worker_env()
        | FAST_REDELIVERY
        | {
            "CHAOS_DATABASE_URL": worker_url,
            "CHAOS_GUARD": "1" if setup.guard else "0",
            "CHAOS_CONCURRENCY": "8",
            "FAULTS_ASYNC": "1" if setup.asyncio else "0",
            "FAULTS_PLAN": str(plan),
            "FAULTS_DIR": str(folder),
            "FAULTS_ADMIN_URL": admin_url,
        }
        | (env or {})
    )
    leftover: dict[str, int] = {}
    try:
        _reset(admin)
        target.start()
        run.producer = target.producer()
        for name in WORKERS:
            run.start_worker(name)
        # The run's first message alone, so that the first-message check meets it.
        first, *rest = run.messages
        run.publish(first, first.delta)
        first.sent = True
        if first.row.message == "check":
            run.pump(lambda s: first.message_id in s.journal or read_fired(folder), 20)
        for m in rest:
            run.publish(m, m.delta)
            m.sent = True
        settled = run.pump(lambda s: s.settled(run.messages), SETTLE[fault])
        if settled:  # the broker must be empty too (no-identity messages, late acks)
            run.pump(lambda s: not any(target.leftover().values()), 15)
        for worker in run.workers.values():
            worker.kill()  # settled: nothing is in flight
        leftover = target.leftover()
        quarantined, dead = _destinations(target)
        state = State.read(admin)
    except BaseException:
        for name, worker in run.workers.items():
            log(f"--- {name} ---\n{_tail(worker)}")
        raise
    finally:
        for worker in run.workers.values():
            worker.kill()
        if run.producer is not None:
            run.producer.close()
        try:
            target.close()
        finally:
            admin.close()

    fired = read_fired(folder)
    reached = read_reached(folder)
    for m, f in zip(run.messages, cell_faults, strict=True):
        problems, notes = _verdict(m, state, quarantined, dead, leftover)
        if f.key not in fired:
            if not any(point == f.point for point, _ in reached):
                problems.insert(0, f"fault never fired (no call reaches {f.point!r})")
            else:
                problems.insert(0, "fault never fired (the point is reached, not by this message)")
        status = "FAIL" if problems else "pass"
        cells.append(Cell(setup, m.row, fault, status, "; ".join(problems + notes)))
    log(
        f"  {setup.name} x {fault}: {len(rows)} rows in {time.monotonic() - started:.0f}s, "
        f"{run.generations} worker process(es), {run.restarts} PostgreSQL restart(s), "
        f"{len(fired)} fault(s) fired, leftover {leftover}"
    )
    return sorted(cells, key=lambda c: [r.name for r in ROWS].index(c.row.name))


def _verdict(
    m: Message,
    state: State,
    quarantined: list[tuple[str | None, dict[str, Any]]],
    dead: list[tuple[str | None, dict[str, Any]]],
    leftover: dict[str, int],
) -> tuple[list[str], list[str]]:
    """(problems, notes) of one message at the end of the run."""
    problems: list[str] = []
    notes: list[str] = []
    left = sum(leftover.values())
    missing = (
        f"not settled: {left} message(s) still in the broker"
        if left
        else "dropped: acked with "
        "neither its effect nor a record (no journal, poison, quarantine row or copy)"
    )
    if m.message_id is None:
        payload = {"account": m.account, "delta": m.delta}
        if not any(i is None and p == payload for i, p in dead):
            problems.append(missing)
        return problems, notes
    rows = state.journal.get(m.message_id, [])
    dead_copy = any(i == m.message_id for i, _ in dead)
    if len(rows) > 1:
        problems.append(f"applied {len(rows)} times")
    if m.refused:
        if rows:
            problems.append("a refused intent was applied")
        elif m.message_id in state.poison:
            if not dead_copy:
                notes.append("poison row, but no copy at the dead-letter destination")
        elif dead_copy:
            notes.append("dead-lettered without a poison row")
        else:
            problems.append(missing)
        return problems, notes
    if rows:
        if rows[0] != (m.account, m.delta):
            problems.append(f"applied with another payload {rows[0]} than the first")
        if m.message_id in state.poison:
            problems.append(f"applied, and also poisoned ({state.poison[m.message_id]})")
    elif m.message_id in state.poison:
        notes.append(f"poisoned ({state.poison[m.message_id]}), not applied")
        if not dead_copy:
            notes.append("no copy at the dead-letter destination")
    else:
        problems.append(missing)
    if m.row.message == "conflict":
        copy = any(i == m.message_id for i, _ in quarantined)
        if m.message_id in state.quarantine:
            if not copy:
                notes.append("quarantine row, but no copy at the quarantine destination")
        elif copy:
            notes.append("quarantined message without a quarantine row")
        else:
            problems.append("conflicting copy lost: no quarantine row, no quarantined message")
    return problems, notes


def _destinations(target: Target) -> tuple[list[Any], list[Any]]:
    """What reached quarantine and dead letter; a RabbitMQ queue never declared is empty."""
    if target.broker != "rabbitmq":
        return target.destinations()
    import pika.exceptions

    from ..chaos import targets

    source = target.source
    if target.adapter == "dramatiq":
        names, read = [f"{source}.quarantine", f"{source}.XQ"], targets._rabbitmq_drain
        decode: Any = targets._dramatiq_found
    else:
        names = [f"{source}.quarantine", f"{source}.dead-letter"]
        read, decode = targets._rabbitmq_drain_with_headers, targets._faststream_found
    found: list[list[Any]] = []
    for name in names:
        try:
            found.append(decode(read(name)))
        except pika.exceptions.ChannelClosedByBroker:  # never declared: nothing went there
            found.append([])
    return found[0], found[1]


def _tail(worker: Worker, lines: int = 40) -> str:
    return "\n".join(worker.output().splitlines()[-lines:])
