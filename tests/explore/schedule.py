"""A schedule, drawn from a seed: its configuration (`space.config_for`), a workload and
a fault schedule.

The workload is a list of sends at given times: first deliveries of intents whose
handlers behave in one of `BEHAVIOURS`, sequential duplicates (the same intent and payload
again, later), concurrent duplicates (copies right behind the first), conflicts (the
intent's id with another payload, sent once the first payload committed) and messages
without identity. The faults are at given times from the workers' start, the start-up
included, and always include the configuration's ``focus``.

A seed fixes the schedule, not the timing: real processes and servers run it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

from .space import Config, config_for

__all__ = ["BEHAVIOURS", "Fault", "Intent", "Schedule", "Send", "draw"]

BEHAVIOURS = {
    "ok": 0.58,
    "transient": 0.1,  # fails its first two attempts, then applies
    "sometimes": 0.08,  # fails or applies, by a coin drawn per attempt
    "permanent": 0.08,  # raises PermanentError("explore_refused")
    "commit": 0.04,  # writes its effect, then calls session.commit()
    "rollback": 0.04,  # calls session.rollback(), then writes its effect
    "no-identity": 0.08,  # sent without identity (policy: the configuration's)
}
SEND_WINDOW = 8.0  # seconds over which the sends are spread
FAULT_WINDOW = 12.0  # seconds over which the faults happen
RETENTION = 3600.0
"""The workers' ``retention_window`` (seconds) where the producer stamps ``produced_at``."""
SKEWS = (0.0, -600.0, 600.0, -3 * 3600.0, 3 * 3600.0)
"""A skewed producer clock, per intent: right, ten minutes behind or ahead (within the
window), three hours behind (beyond it: a first-seen copy is expired) or ahead."""


@dataclass(frozen=True)
class Intent:
    key: str
    behaviour: str
    n: int

    @property
    def identified(self) -> bool:
        return self.behaviour != "no-identity"

    def payload(self, n: int | None = None) -> dict[str, Any]:
        return {"key": self.key, "do": self.behaviour, "n": self.n if n is None else n}


@dataclass(frozen=True)
class Send:
    at: float
    intent: Intent
    kind: str  # first, duplicate, concurrent, conflict
    n: int


@dataclass(frozen=True)
class Fault:
    at: float
    kind: str
    """worker_kill, worker_term, pg_fast, pg_immediate, pg_terminate, pg_after_start,
    broker_restart; and the infrastructure's: net_cut, net_delay, net_blackhole (through
    the proxy between the workers and PostgreSQL), pooler_restart (PgBouncer); over a map,
    pg_one_fast and pg_one_immediate (one database's server stopped, the other's
    answering)"""
    worker: int = 0
    seconds: float = 0.0
    latency: float = 0.0
    """net_delay: seconds each chunk of bytes waits in the proxy, either way."""
    phase: str = "ready"
    """pg_after_start: PostgreSQL stops once the replacement has started ("ready") or
    as soon as its process exists ("spawned", in the middle of its start-up)."""
    database: int = 0
    """pg_one_*: the database of the map whose server stops (0: ``d0``, 1: ``d1``)."""

    def describe(self) -> str:
        what = self.kind
        if self.kind.startswith("worker"):
            what += f" w{self.worker}"
        if self.kind == "pg_after_start":
            what += f" w{self.worker} ({self.phase})"
        if self.kind.startswith("pg_one"):
            what += f" d{self.database}"
        if self.latency:
            what += f" by {self.latency * 1000:.0f}ms"
        if self.seconds:
            what += f" {self.seconds:.1f}s"
        return f"{what} at {self.at:.1f}s"


@dataclass
class Schedule:
    seed: int
    config: Config
    intents: list[Intent]
    sends: list[Send]
    conflicts: list[Send]
    """Sent once their intent's first payload committed."""
    faults: list[Fault]
    notes: list[str] = field(default_factory=list)
    prefetch: int | None = None
    """FastStream on RabbitMQ: the channel's prefetch, when not the configuration's
    concurrency (0: none, FastStream's default)."""
    skews: dict[str, float] | None = None
    """Seconds each intent's ``produced_at`` is off the true time (the producer's clock);
    None: no ``produced_at`` (the configuration's ``clock`` is "none")."""

    @property
    def proxied(self) -> bool:
        """Whether the workers reach PostgreSQL through the explorer's proxy."""
        return any(f.kind.startswith("net_") for f in self.faults)

    def expired(self) -> set[str]:
        """Intents stamped older than the retention window: kept as poison
        (``expired_redelivery``), never applied (docs/how-to/retention.md)."""
        return {k for k, skew in (self.skews or {}).items() if skew < -RETENTION}

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for send in self.sends + self.conflicts:
            kinds[send.kind] = kinds.get(send.kind, 0) + 1
        behaviours: dict[str, int] = {}
        for intent in self.intents:
            behaviours[intent.behaviour] = behaviours.get(intent.behaviour, 0) + 1
        return (
            f"seed {self.seed}: {self.config.describe()} | {len(self.intents)} intents "
            f"{behaviours}, sends {kinds}"
            + (f" ({'; '.join(self.notes)})" if self.notes else "")
            + " | faults: "
            + (", ".join(f.describe() for f in self.faults) or "none")
        )

    def without(self, faults: list[Fault] | None = None, keys: set[str] | None = None) -> Schedule:
        """The same schedule with fewer faults, or only the intents in ``keys``."""
        keep = keys if keys is not None else {i.key for i in self.intents}
        return replace(
            self,
            intents=[i for i in self.intents if i.key in keep],
            sends=[s for s in self.sends if s.intent.key in keep],
            conflicts=[s for s in self.conflicts if s.intent.key in keep],
            faults=list(self.faults if faults is None else faults),
        )


def _behaviour(rng: random.Random) -> str:
    return rng.choices(list(BEHAVIOURS), weights=list(BEHAVIOURS.values()))[0]


def draw(seed: int, intents: int | None = None) -> Schedule:
    config = config_for(seed)
    rng = random.Random(seed)
    pinned = config.focus == "pg_fast" and seed % len_rows() == 0
    count = intents or (405 if pinned else rng.randint(20, 60))
    chosen = [
        Intent(f"s{seed}-{k:04d}", _behaviour(rng), rng.randint(1, 10**6)) for k in range(count)
    ]
    if config.framework == "faststream" and config.max_attempts is None:
        # No limit of the inbox's own: a handler that fails every time (the misuses) is
        # retried for ever, as documented; it has a coin instead, so the run can settle.
        chosen = [
            replace(i, behaviour="sometimes") if i.behaviour in ("commit", "rollback") else i
            for i in chosen
        ]
    from .workload import extend  # the workload axes' kinds (their own generator)

    chosen = extend(seed, config, chosen)
    sends: list[Send] = []
    conflicts: list[Send] = []
    for intent in chosen:
        # The outside report's backlog is waiting for the workers as they start.
        at = rng.uniform(0, 0.3) if pinned else rng.uniform(0, SEND_WINDOW)
        sends.append(Send(at, intent, "first", intent.n))
        if not intent.identified:
            continue
        roll = rng.random()
        if roll < 0.25:
            sends.append(Send(at + rng.uniform(0.5, 4), intent, "duplicate", intent.n))
        elif roll < 0.35:
            for _ in range(rng.randint(1, 2)):
                sends.append(Send(at + 0.001, intent, "concurrent", intent.n))
        elif roll < 0.42 and intent.behaviour == "ok":
            conflicts.append(Send(at, intent, "conflict", intent.n + rng.randint(1, 99)))
    sends.sort(key=lambda s: s.at)
    faults = _faults(rng, config, pinned)
    # The infrastructure's draws come from a generator of their own, so that they leave
    # the workload's and the other faults' draws as they were.
    infra = random.Random(f"{seed}/infra")
    if not pinned:  # the outside report's schedule stays as it was
        faults = sorted(faults + _infra_faults(infra, config), key=lambda f: f.at)
    if config.databases == "map":  # and so do the draws of the runs with one database
        more = random.Random(f"{seed}/databases")
        faults = sorted(faults + _database_faults(more), key=lambda f: f.at)
    schedule = Schedule(seed, config, chosen, sends, conflicts, faults)
    if config.clock != "none":
        schedule.skews = {
            i.key: infra.choice(SKEWS) if config.clock == "skewed" else 0.0
            for i in chosen
            if i.identified
        }
    if pinned:
        schedule.prefetch = 0
        schedule.notes.append("issue 27, item 1: a backlog at start-up, no prefetch limit")
    return schedule


def _infra_faults(rng: random.Random, config: Config) -> list[Fault]:
    """The configuration's ``infra_fault``, and one more of its kind half the time; on
    RabbitMQ (durable queues, persistent messages), the broker restarted a third of the
    time."""
    faults = []
    if config.broker == "rabbitmq" and rng.random() < 1 / 3:
        faults.append(Fault(rng.uniform(0, FAULT_WINDOW), "broker_restart"))
    if config.infra_fault == "none":
        return faults
    kinds = ["net_cut", "net_delay", "net_blackhole"]
    if config.pooler == "pgbouncer":
        kinds.append("pooler_restart")
    chosen = [config.infra_fault]
    if rng.random() < 0.5:
        chosen.append(rng.choice(kinds))
    for kind in chosen:
        at = rng.uniform(0, FAULT_WINDOW)
        if kind == "net_delay":
            faults.append(
                Fault(at, kind, seconds=rng.choice([2.0, 5.0]), latency=rng.choice([0.05, 0.3]))
            )
        elif kind == "net_blackhole":
            faults.append(Fault(at, kind, seconds=rng.choice([1.0, 3.0, 8.0])))
        else:
            faults.append(Fault(at, kind))
    return faults


def _database_faults(rng: random.Random) -> list[Fault]:
    """Over a map, one or two faults of one database's server: stopped (fast or
    immediate) for a while, the other database's answering all along."""
    return [
        Fault(
            rng.uniform(0, FAULT_WINDOW),
            rng.choice(["pg_one_fast", "pg_one_immediate"]),
            seconds=rng.choice([1.5, 3.0, 8.0]),
            database=rng.randrange(2),
        )
        for _ in range(rng.randint(1, 2))
    ]


def len_rows() -> int:
    from .space import ROWS

    return len(ROWS)


def _fault(rng: random.Random, kind: str, config: Config, at: float | None = None) -> Fault:
    if at is None:
        at = rng.uniform(0, FAULT_WINDOW)
    workers = config.processes  # a command each, or processes of one command
    if kind in ("worker_kill", "worker_term"):
        return Fault(at, kind, worker=rng.randrange(workers))
    if kind in ("pg_fast", "pg_immediate"):
        return Fault(at, kind, seconds=rng.choice([0.5, 1.5, 3.0]))
    if kind == "pg_after_start":
        return Fault(at, kind, worker=rng.randrange(workers), seconds=3.0, phase=_phase(at))
    return Fault(at, kind)


def _phase(at: float) -> str:
    # From the fault's time, not from the schedule's generator: adding the phase left
    # every seed's other draws as they were.
    return "spawned" if random.Random(at).random() < 0.5 else "ready"


def _faults(rng: random.Random, config: Config, pinned: bool) -> list[Fault]:
    if pinned:
        # Issue 27, item 1: PostgreSQL stopped in fast mode for 3 s as the workers start
        # with the backlog waiting; later a worker SIGKILLed and restarted (its supervisor
        # does it), and PostgreSQL stopped again for 3 s right after it started.
        at = rng.uniform(4, 8)
        return [
            Fault(rng.uniform(0, 0.5), "pg_fast", seconds=3.0),
            Fault(at, "pg_after_start", worker=rng.randrange(2), seconds=3.0, phase=_phase(at)),
        ]
    kinds = [
        "worker_kill",
        "worker_term",
        "pg_fast",
        "pg_immediate",
        "pg_terminate",
        "pg_after_start",
    ]
    if config.broker == "nats":
        kinds.append("broker_restart")  # its JetStream keeps its streams on disk
    focus = config.focus
    if focus == "startup":
        # During the workers' start-up: PostgreSQL down, or sessions ended, as they boot.
        chosen = [
            _fault(
                rng,
                rng.choice(["pg_fast", "pg_immediate", "pg_terminate"]),
                config,
                rng.uniform(0, 1.5),
            )
        ]
    else:
        chosen = [_fault(rng, focus, config)]
    for _ in range(rng.randint(1, 3)):
        chosen.append(_fault(rng, rng.choice(kinds), config))
    return sorted(chosen, key=lambda f: f.at)
