"""The configurations the explorer draws from, and a pairwise covering array over them.

Every axis is a setting the docs offer a user; a row of the array is one configuration.
The array is built once, greedily (the AETG construction: each new row is the best of a
few dozen random candidates completed one axis at a time, best meaning the one that
covers the most pairs of axis values still uncovered), from a fixed seed, so that a
seed always names the same row: ``ROWS[seed % len(ROWS)]``. Consecutive seeds therefore
cover every valid pair of axis values once ``len(ROWS)`` of them have run.

Pairs that cannot occur together (a Dramatiq worker has no FastStream guard or ack
policy; one process cannot be forked from a command) are excluded by `valid`. No
library is used: the generator is about sixty lines, and no well-kept one is installed.
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["AXES", "ROWS", "Config", "config_for", "uncovered_pairs", "valid"]

TARGETS = (
    "faststream-rabbitmq",
    "dramatiq-rabbitmq",
    "dramatiq-redis",
    "faststream-redis",
    "faststream-nats",
    "faststream-kafka",
)
AXES: dict[str, tuple[Any, ...]] = {
    "target": TARGETS,
    "guard": ("on", "off", "n/a"),
    "ack_policy": ("default", "nack_on_error", "n/a"),
    "processes": (1, 2, 3),
    "layout": ("commands", "forked"),
    "concurrency": (1, 4, 8),
    "missing_identity": ("reject", "process"),
    "max_attempts": (None, 2, 10),
    "redelivery_limit": (None, 1, 5),
    "focus": ("worker_kill", "worker_term", "pg_fast", "pg_immediate", "pg_terminate", "startup"),
    # -- the infrastructure around the workers (see `valid_infra`) --
    "queues": ("classic", "quorum", "n/a"),
    "pooler": ("direct", "pgbouncer"),
    "clock": ("none", "synced", "skewed"),
    "infra_fault": ("none", "net_cut", "net_delay", "net_blackhole", "pooler_restart"),
}
"""``focus`` is the fault the schedule is sure to contain (others are drawn beside it);
``layout``: "commands" runs one supervised command per process, "forked" one command
that forks them (``dramatiq --processes N``, ``faststream run --workers N``).

``queues``: RabbitMQ's queue type (Dramatiq's ``QuorumRabbitmqBroker``, FastStream's
``QueueType.QUORUM``), "n/a" on the other brokers; ``pooler``: the workers reach
PostgreSQL directly or through the explorer's PgBouncer in transaction mode; ``clock``:
the producer stamps no ``produced_at`` ("none"), its true time ("synced"), or a clock
off by minutes or hours per intent ("skewed"), the workers then having a
``retention_window`` of an hour; ``infra_fault``: a fault the schedule is sure to
contain besides its ``focus``: the workers' connections cut, delayed or black-holed by a
proxy between them and PostgreSQL (or PgBouncer), or PgBouncer restarted."""


@dataclass(frozen=True)
class Config:
    target: str
    guard: str
    ack_policy: str
    processes: int
    layout: str
    concurrency: int
    missing_identity: str
    max_attempts: int | None
    redelivery_limit: int | None
    focus: str
    queues: str = "classic"
    pooler: str = "direct"
    clock: str = "none"
    infra_fault: str = "none"
    # the workload and operations block (issue 29): defaults are the earlier space
    batch: str = "off"
    outputs: str = "none"
    outbox: str = "off"
    operator: str = "none"
    handlers: str = "basic"
    claims: str = "library"
    actor: str = "sync"
    databases: str = "one"

    @property
    def framework(self) -> str:
        return self.target.split("-")[0]

    @property
    def broker(self) -> str:
        return self.target.split("-")[1]

    def describe(self) -> str:
        parts = [self.target]
        if self.framework == "faststream":
            parts += [f"guard {self.guard}", f"ack policy {self.ack_policy}"]
        parts += [
            f"{self.processes} process(es) as {self.layout}",
            f"concurrency {self.concurrency}",
            f"missing_identity={self.missing_identity}",
            f"max_attempts={self.max_attempts}",
            f"redelivery_limit={self.redelivery_limit}",
            f"focus {self.focus}",
        ]
        if self.queues == "quorum":
            parts.insert(1, "quorum queues")
        if self.pooler != "direct":
            parts.append(f"through {self.pooler}")
        if self.clock != "none":
            parts.append(f"producer clock {self.clock}")
        if self.infra_fault != "none":
            parts.append(f"and {self.infra_fault}")
        parts += [
            f"{axis} {getattr(self, axis)}"
            for axis, values in WORKLOAD_AXES.items()
            if getattr(self, axis) != values[0]
        ]
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def valid(values: dict[str, Any]) -> bool:
    """Whether a (partial) assignment of axis values can occur."""
    target = values.get("target")
    if target is not None:
        dramatiq = target.startswith("dramatiq")
        for axis in ("guard", "ack_policy"):
            if axis in values and (values[axis] == "n/a") != dramatiq:
                return False
        if target.endswith("redis") and dramatiq is False and values.get("concurrency") == 1:
            return False  # streams read and reclaim on two subscribers sharing it
    if (
        "ack_policy" in values
        and "guard" in values
        and (values["ack_policy"] == "n/a") != (values["guard"] == "n/a")
    ):
        return False
    if values.get("processes") == 1 and values.get("layout") == "forked":
        return False
    return _workload_valid(values) and valid_infra(values)


def valid_infra(values: dict[str, Any]) -> bool:
    """The infrastructure axes: quorum queues only on RabbitMQ ("n/a" exactly elsewhere);
    Kafka only with ``AckPolicy.ACK`` (the docs require it: "default" is that policy
    there, ``NACK_ON_ERROR`` is left out); PgBouncer restarted only where there is one."""
    target = values.get("target")
    if (
        target is not None
        and "queues" in values
        and (values["queues"] == "n/a") != (not target.endswith("rabbitmq"))
    ):
        return False
    if target == "faststream-kafka" and values.get("ack_policy") == "nack_on_error":
        return False
    return not (values.get("infra_fault") == "pooler_restart" and values.get("pooler") == "direct")


def _pairs(row: dict[str, Any]) -> set[tuple[tuple[str, Any], tuple[str, Any]]]:
    items = sorted(row.items(), key=lambda kv: list(AXES).index(kv[0]))
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def _all_pairs() -> set[tuple[tuple[str, Any], tuple[str, Any]]]:
    names = list(AXES)
    pairs = set()
    for a, b in itertools.combinations(names, 2):
        for va in AXES[a]:
            for vb in AXES[b]:
                if valid({a: va, b: vb}):
                    pairs.add(((a, va), (b, vb)))
    return pairs


def _completable(row: dict[str, Any]) -> bool:
    """Whether the partial ``row`` can be completed into a valid row."""
    return _completable_items(tuple(sorted(row.items(), key=lambda kv: kv[0])))


@functools.cache
def _completable_items(items: tuple[tuple[str, Any], ...]) -> bool:
    row = dict(items)
    rest = [n for n in AXES if n not in row]
    if not rest:
        return valid(row)
    name = rest[0]
    return any(valid(row | {name: v}) and _completable(row | {name: v}) for v in AXES[name])


def _build(seed: int = 0, candidates: int = 40) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    todo = _all_pairs()
    rows: list[dict[str, Any]] = [ISSUE_27]
    todo -= _pairs(ISSUE_27)
    while todo:
        best: dict[str, Any] | None = None
        best_gain = -1
        for _ in range(candidates):
            # Start from one uncovered pair, then add the axes in a random order, each
            # with the value covering most uncovered pairs with what is already chosen.
            (a, va), (b, vb) = rng.choice(sorted(todo, key=repr))
            row = {a: va, b: vb}
            names = [n for n in AXES if n not in row]
            rng.shuffle(names)
            for name in names:
                scored = []
                for value in AXES[name]:
                    trial = row | {name: value}
                    if not valid(trial) or not _completable(trial):
                        continue
                    gain = len(_pairs(trial) & todo) - len(_pairs(row) & todo)
                    scored.append((gain, rng.random(), value))
                row[name] = max(scored)[2]
            gain = len(_pairs(row) & todo)
            if gain > best_gain:
                best, best_gain = row, gain
        assert best is not None and valid(best)
        rows.append(best)
        todo -= _pairs(best)
    return rows


ISSUE_27: dict[str, Any] = {
    # The outside report of issue 27 (item 1): FastStream on RabbitMQ without the guard,
    # `faststream run --workers 2`, the default ack policy; its schedule is pinned too
    # (see `schedule.draw`).
    "target": "faststream-rabbitmq",
    "guard": "off",
    "ack_policy": "default",
    "processes": 2,
    "layout": "forked",
    "concurrency": 8,
    "missing_identity": "reject",
    "max_attempts": 10,
    "redelivery_limit": 10,
    "focus": "pg_fast",
    "queues": "classic",
    "pooler": "direct",
    "clock": "none",
    "infra_fault": "none",
}
# -- the workload and operations (issue 29) --------------------------------------------------
# What the handlers do and what runs beside them; the runtime is in `workload`.
WORKLOAD_AXES: dict[str, tuple[Any, ...]] = {
    "batch": ("off", "on"),
    "outputs": ("none", "result"),
    "outbox": ("off", "on"),
    "operator": ("none", "repair", "purge", "move"),
    "handlers": ("basic", "extended"),
    "claims": ("library", "both", "compact"),
    "actor": ("sync", "async"),
    "databases": ("one", "map"),
}
"""``batch``: a FastStream batch subscriber (Redis streams, NATS, Kafka);
``outputs``: a FastStream publisher on the handler, or a Dramatiq ``on_success`` callback,
each consumed by an inbox consumer downstream; ``outbox``: the handler records an outbox
effect, ``outbox run`` dispatchers (SIGKILLed and SIGTERMed) deliver it; ``operator``:
``poison``/``quarantine`` redrive, discard and accept through the CLI while the workers
run, ``purge`` running in a loop, or over a map ``move``: tenant t1 moved from its
database to the other one while the workers run, as docs/how-to/many-databases.md says
(paused, its rows copied and deleted, pointed at the other database; the library's table
only: the compact rows name no tenant); ``handlers``: "extended" adds failures at commit
time (a deferred constraint), Dramatiq's time limit, FastStream validation errors and a
handler that settles its message itself; ``claims``: the workers claim in the library's
table, in both tables (``claims="compact"`` before the switch is recorded), or in the
compact table alone (the switch recorded before they start; the operator's purge is then
one of every consumer, which the compact rows need); ``actor``: Dramatiq's actors are
``def`` ("sync", on an Engine with psycopg) or ``async def`` ("async": Dramatiq's
``AsyncIO`` middleware, an AsyncEngine with asyncpg, ``current_async_session()``, as
docs/how-to/add-to-dramatiq.md offers); a FastStream handler is async whatever it says;
``databases``: the inbox on the run's database ("one"), or on a map over two ("map":
``router=MapFile(...)``, the map's file as docs/how-to/many-databases.md gives it),
each intent sent for one of two tenants, one a database, so that its claim, effect and
records land in its tenant's database; the outbox's dispatchers, the purge and the
repairs then run over the map (``--map``; a repair names its row's database,
``--database``)."""
BATCH_TARGETS = ("faststream-redis", "faststream-nats", "faststream-kafka")
AXES.update(WORKLOAD_AXES)
ISSUE_27.update({axis: values[0] for axis, values in WORKLOAD_AXES.items()})


def _workload_valid(values: dict[str, Any]) -> bool:
    target = values.get("target")
    if values.get("operator") == "move":
        if values.get("databases") not in (None, "map"):
            return False  # a tenant moves from one database of a map to another
        if values.get("claims") not in (None, "library"):
            return False  # the compact rows name no tenant: copy_tenant refuses them
        # what a move implies, so that a partial row that cannot take it fails now
        values = values | {"databases": "map", "claims": "library"}
    if values.get("databases") == "map":
        if values.get("missing_identity") == "process":
            return False  # no identity, no tenant, no database: the guide keeps "reject"
        if values.get("batch") == "on":
            return False  # a batch claims in one database: its tenants interleave here
    if values.get("actor") == "async":
        if target is not None and not target.startswith("dramatiq"):
            return False  # the axis is Dramatiq's: a FastStream row keeps "sync"
        if values.get("guard", "n/a") != "n/a" or values.get("ack_policy", "n/a") != "n/a":
            return False  # a FastStream worker
        if values.get("batch") == "on":
            return False
    if values.get("batch") == "on":
        if target is not None and target not in BATCH_TARGETS:
            return False
        if "n/a" in (values.get("guard"), values.get("ack_policy")):
            return False  # a Dramatiq worker
        if values.get("missing_identity") == "process":
            return False  # refused at start-up: a batch is claimed as a whole
        if values.get("queues") in ("classic", "quorum"):
            return False  # RabbitMQ's queues: no batch subscriber
        # A batch subscriber with a publisher is refused at start-up (docs/how-to/outputs.md)
        if values.get("outputs") == "result":
            return False
    # The explorer wires neither a publisher nor a batch subscriber on Kafka (`app_faststream`)
    return not (
        values.get("target") == "faststream-kafka"
        and (values.get("outputs", "none") != "none" or values.get("batch", "off") == "on")
    )


ROWS: list[dict[str, Any]] = _build()


def config_for(seed: int) -> Config:
    return Config(**ROWS[seed % len(ROWS)])


def uncovered_pairs(rows: list[dict[str, Any]]) -> set[Any]:
    """The valid pairs that no row of ``rows`` covers (empty for `ROWS`)."""
    covered: set[Any] = set()
    for row in rows:
        covered |= _pairs(row)
    return _all_pairs() - covered
