"""The workload and operations axes at run time (`space.WORKLOAD_AXES`): the extended
handler kinds drawn into a schedule, and what runs beside the workers.

    Extras (one per run)
    ├── dispatchers     ``outbox run`` commands, supervised like the workers, two of them
    │                   (``outbox on``), SIGKILLed or SIGTERMed at drawn times
    └── operator thread ``operator repair``: every second or so, the pending poison and
                        quarantine rows are listed with the CLI and each decided once, by
                        a coin of the seed and its row id (poison: redrive or discard;
                        quarantine: accept, discard or redrive), through the CLI, while
                        the workers run; ``operator purge``: ``purge --older-than 10s
                        --force`` in a loop, from the start to the end of the settling;
                        ``operator move`` (over a map): tenant `MOVED` moved from ``d1``
                        to ``d0`` once, at a drawn time, as the many-databases guide says

Every feature is detected in the library the workers import (`features`), so that the
explorer runs on older commits: a missing one is reported "not available" with the
verdict, and its axis is left out of the run rather than crashing it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..chaos.run import Admin
from .schedule import FAULT_WINDOW, Intent
from .space import Config
from .tenants import TENANTS

__all__ = ["MOVED", "PURGE_WINDOW", "Extras", "extend", "features", "worker_env"]

PURGE_WINDOW = 10.0
"""Seconds: ``purge --older-than 10s``: claims older than this may go (the documented
window of memory), younger ones must stay."""
MOVED = TENANTS[1]
"""``operator move``: the tenant moved, from its database ``d1`` to ``d0``."""
AT_WORK = 0.3
"""``operator move``: seconds each handler stays at work once its effect is written
(`domain.AT_WORK`), so that the move finds deliveries of its tenant in flight."""
ROOT = Path(__file__).resolve().parents[2]
OPERATOR = "explore-operator"
"""``--by`` of every decision the operator thread makes."""
CLI = str(Path(sys.executable).with_name("inbox-middleware"))
EXTENDED = {
    # behaviour: (share of the "ok" intents turned into it, frameworks)
    "deferred": (0.08, ("dramatiq", "faststream")),
    "timelimit": (0.05, ("dramatiq",)),
    "invalid": (0.06, ("faststream",)),
    "msg_ack": (0.05, ("faststream",)),
}
MISUSES = {"commit", "rollback", "msg_ack"}
"""Handlers that end the transaction or settle the message themselves: never applied,
kept as poison at once (``handler_transaction``)."""


def extend(seed: int, config: Config, intents: list[Intent]) -> list[Intent]:
    """The workload's intents for ``config``: some "ok" ones turned into the extended
    kinds, and in a batch only what a batch can hold apart (with its own generator, so
    that the earlier draws of a seed stay as they were)."""
    rng = random.Random(f"workload-{seed}")
    batch = config.batch == "on"
    kinds = [
        (kind, share)
        for kind, (share, frameworks) in EXTENDED.items()
        if config.framework in frameworks and not (batch and kind != "deferred")
    ]
    out = []
    for intent in intents:
        behaviour = intent.behaviour
        if config.handlers == "extended" and behaviour == "ok":
            roll = rng.random()
            for kind, share in kinds:
                if roll < share:
                    behaviour = kind
                    break
                roll -= share
        if batch and behaviour == "sometimes":
            # A coin per attempt and message: a batch of several would rarely succeed.
            behaviour = "transient"
        out.append(
            replace(intent, behaviour=behaviour) if behaviour != intent.behaviour else intent
        )
    return out


_FEATURES: dict[str, set[str]] = {}


def features(env: dict[str, str]) -> set[str]:
    """What the library the workers import offers, of what the workload axes use."""
    library = env.get("EXPLORE_LIBRARY", "")
    if library not in _FEATURES:
        _FEATURES[library] = _probe(env)
    return _FEATURES[library]


def _probe(env: dict[str, str]) -> set[str]:
    probes = {
        "batch": "from inbox_middleware.faststream import InboxBatch",
        "outbox": "from inbox_middleware import outbox; outbox.add",
        "outputs": "import inbox_middleware.dramatiq, inbox_middleware.faststream",
        "repair": "import inbox_middleware.cli",
        "claims": "from inbox_middleware._core.claims import claim_key",
        "databases": "from inbox_middleware import MapFile",
        "move": "from inbox_middleware import copy_tenant, delete_tenant",
    }
    found = set()
    for name, probe in probes.items():
        done = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, timeout=60
        )
        if done.returncode == 0:
            found.add(name)
    return found


def worker_env(config: Config, available: set[str]) -> dict[str, str]:
    return {
        "EXPLORE_BATCH": config.batch if "batch" in available else "off",
        "EXPLORE_OUTPUTS": config.outputs if "outputs" in available else "none",
        "EXPLORE_OUTBOX": config.outbox if "outbox" in available else "off",
        "EXPLORE_HANDLERS": config.handlers,
        "EXPLORE_CLAIMS": claims(config, available),
        "EXPLORE_ACTOR": config.actor,
        "EXPLORE_DATABASES": config.databases if "databases" in available else "one",
        # a move pauses its tenant while some of its deliveries are still at work
        "EXPLORE_AT_WORK": str(AT_WORK) if config.operator == "move" else "0",
    }


def claims(config: Config, available: set[str]) -> str:
    """Where the workers claim (`space.WORKLOAD_AXES`), if the library offers it."""
    return config.claims if "claims" in available else "library"


def _coin(seed: int, row: Any, sides: int) -> int:
    return hashlib.sha256(f"{seed}/{row}".encode()).digest()[0] % sides


class Extras:
    """What runs beside the workers for the workload axes, and what it saw."""

    def __init__(
        self,
        schedule: Any,
        admin_url: str,
        env: dict[str, str],
        folder: Path,
        available: set[str],
        slot: Any,
    ) -> None:
        self.schedule, self.config = schedule, schedule.config
        self.admin_url, self.env, self.folder = admin_url, env, folder
        self.available = available
        self.not_available = [
            axis
            for axis, feature in (
                ("batch", "batch"),
                ("outputs", "outputs"),
                ("outbox", "outbox"),
                ("operator", "repair" if self.config.operator != "move" else "move"),
                ("databases", "databases"),
            )
            if getattr(self.config, axis) not in ("off", "none", "one") and feature not in available
        ]
        self.outbox = self.config.outbox == "on" and "outbox" in available
        feature = "move" if self.config.operator == "move" else "repair"
        self.operator = self.config.operator if feature in available else "none"
        rng = random.Random(f"extras-{schedule.seed}")
        self.dispatcher_faults = sorted(
            (rng.uniform(1, FAULT_WINDOW), rng.choice(["kill", "term"]), rng.randrange(2))
            for _ in range(rng.randint(1, 3))
        )
        # The run's database, or over a map the map's file (the commands' --map).
        mapped = env.get("EXPLORE_MAP_FILE")
        self.where = ["--map", mapped] if mapped else ["--database-url", admin_url]
        self.dispatchers = []
        if self.outbox:
            command = [
                CLI,
                "outbox",
                "run",
                *self.where,
                "--destinations",
                "tests.explore.outbox_app:destinations",
                "--poll-interval",
                "0.2",
                "--lease",
                "5",
                "--delivery-timeout",
                "2",
                "--backoff-base",
                "0.2",
                "--backoff-cap",
                "1",
                "--max-attempts",
                "1000",
                "--shutdown-grace",
                "2",
            ]
            self.dispatchers = [
                slot(f"d{k}", command, env, folder, "outbox dispatcher started") for k in range(2)
            ]
        self.events: list[str] = []
        self.waiting: list[str] = []
        self.decisions: list[tuple[str, int | str, str, str, int]] = []
        """(kind, row id, action, message id, CLI exit status) of the operator's decisions;
        over a map, a row's id is ``<database>:<id>`` (`_row_id`)."""
        self.mover: subprocess.Popen[str] | None = None
        if self.operator == "move":  # ready before the workers start: `_move`
            self.mover = subprocess.Popen(
                [
                    *(sys.executable, "-m", "tests.explore.mover"),
                    *(env["EXPLORE_WORKERS_MAP"], env["EXPLORE_MAP_FILE"], MOVED),
                ],
                env=env,
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        self.moved: bool | None = None
        """``operator move``: whether tenant `MOVED` lives in ``d0`` now (None: no move)."""
        self.purges: list[tuple[float, int]] = []
        """(the database's clock once a purge ended, epoch seconds; its exit status)."""
        self.stopping = threading.Event()
        self.closed = threading.Event()
        self.threads: list[threading.Thread] = []
        self.deciding: threading.Thread | None = None
        """The operator's thread (repair), joined at the end of the faults."""
        self.started = 0.0

    # -- running ------------------------------------------------------------------------------

    def _event(self, what: str) -> None:
        self.events.append(f"{time.monotonic() - self.started:6.1f}s {what}")

    def start(self, started: float) -> None:
        self.started = started
        for slot in self.dispatchers:
            slot.start()
        targets = []
        if self.dispatchers:
            targets += [self._supervise, self._fault_dispatchers]
        if self.operator == "repair":
            targets.append(self._repair)
        if self.operator == "purge":
            targets.append(self._purge)
        if self.operator == "move":
            targets.append(self._move)
        for target in targets:
            thread = threading.Thread(target=self._guarded(target), daemon=True)
            thread.start()
            self.threads.append(thread)
            if target in (self._repair, self._move):
                self.deciding = thread

    def _guarded(self, target: Any) -> Any:
        def run() -> None:
            try:
                target()
            except Exception as exc:  # the explorer's own trouble: in its events
                self._event(f"{target.__name__} failed: {exc!r}")

        return run

    def _supervise(self) -> None:
        while not self.closed.is_set():
            for slot in self.dispatchers:
                if slot.exited() is not None and not slot.held and not self.closed.is_set():
                    self._event(f"dispatcher {slot.name} exited ({slot.exited()}): started again")
                    time.sleep(0.5)
                    slot.start()
            time.sleep(0.2)

    def _fault_dispatchers(self) -> None:
        for at, kind, which in self.dispatcher_faults:
            delay = self.started + at - time.monotonic()
            if delay > 0 and self.stopping.wait(delay):
                return
            slot = self.dispatchers[which]
            if kind == "kill":
                slot.kill()
                self._event(f"dispatcher {slot.name} SIGKILLed")
            else:
                slot.held = True
                began = time.monotonic()
                slot.terminate(timeout=10)
                slot.held = False
                self._event(
                    f"dispatcher {slot.name} SIGTERMed, exited in {time.monotonic() - began:.1f}s"
                )

    def _cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [CLI, *args, *self.where],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def _publish_options(self) -> list[str]:
        options = ["--broker-url", self.env["EXPLORE_BROKER_URL"], "--by", OPERATOR]
        if self.config.target == "dramatiq-redis":
            options += ["--redis-namespace", self.env["EXPLORE_QUEUE"]]
        return options

    def _pending(self, kind: str) -> list[dict[str, Any]]:
        done = self._cli(kind, "list", "--json", "--limit", "1000")
        if done.returncode != 0:
            return []  # the database restarting: the next look
        return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]

    def _repair(self) -> None:
        seed = self.schedule.seed
        decided: set[tuple[str, int | str]] = set()
        actions = {"poison": ["redrive", "discard"], "quarantine": ["accept", "discard", "redrive"]}
        while not self.stopping.wait(1.0):
            for kind in ("poison", "quarantine"):
                for row in self._pending(kind):
                    if self.stopping.is_set():
                        return  # the run settles: no decision after the faults
                    # Over a map, a row's id is its database's: the command names both.
                    database = row.get("database")
                    row_id = _row_id(database, row["id"])
                    if (kind, row_id) in decided or row.get("consumer_name") != "explore":
                        continue
                    action = actions[kind][_coin(seed, row_id, len(actions[kind]))]
                    args = [kind, action, str(row["id"])]
                    if database:
                        args += ["--database", database]
                    if action == "discard":
                        args += ["--reason", "explorer", "--by", OPERATOR]
                    else:
                        args += self._publish_options()
                    done = self._cli(*args)
                    if "could not be reached" not in done.stderr:
                        decided.add((kind, row_id))  # else: again at the next look
                    self.decisions.append(
                        (kind, row_id, action, str(row["message_id"]), done.returncode)
                    )
                    self._event(
                        f"{kind} {action} {row_id} ({row['message_id']}): exit "
                        f"{done.returncode} {done.stderr.strip()[-200:]}"
                    )

    def _move(self) -> None:
        """Tenant `MOVED` from ``d1`` to ``d0`` at a drawn time, by `tests.explore.mover`
        (the many-databases guide's steps, the library under test's ``copy_tenant`` and
        ``delete_tenant``), started with the extras so that its imports are done by then."""
        assert self.mover is not None
        at = random.Random(f"move-{self.schedule.seed}").uniform(1.0, FAULT_WINDOW - 2.0)
        when = time.time() + self.started + at - time.monotonic()
        out, err = self.mover.communicate(f"{when:.3f}\n", timeout=180)
        self.moved = self.mover.returncode == 0
        if not self.moved:
            raise RuntimeError(f"the move failed: {err.strip()[-2000:]}")
        self._event(
            f"move: {MOVED} paused at {at:.1f}s, copied to d0, deleted from d1, pointed at "
            f"d0 ({out.strip()}; {err.count('again')} tries again)"
        )

    def _purge(self) -> None:
        admin = Admin(self.admin_url)
        try:
            while not self.closed.wait(2.0):
                done = self._cli(
                    "purge",
                    "--older-than",
                    f"{PURGE_WINDOW:.0f}s",
                    "--force",
                    "--batch-size",
                    "20",
                    "--unpaced",
                    # the compact rows name no consumer: a purge of every consumer
                    *(
                        ()
                        if self.env.get("EXPLORE_CLAIMS") == "compact"
                        else ("--consumer", "explore")
                    ),
                )
                # Taken once the command has ended: its own clock, which decides what is
                # older than the window, ran after its start-up (seconds on a loaded
                # machine), so a clock taken before the command would be too early.
                (now,) = admin.query("SELECT extract(epoch FROM clock_timestamp())")[0]
                self.purges.append((float(now), done.returncode))
                if done.returncode != 0:
                    self._event(f"purge: exit {done.returncode} {done.stderr.strip()[-200:]}")
        finally:
            admin.close()

    def end_of_faults(self) -> None:
        """The sends and faults are done: no more dispatcher faults nor decisions (a
        purge goes on while the run settles). A decision under way (a CLI command takes
        seconds to start on a loaded machine) ends first: the settling then sees what it
        did, and the workers still run to apply what it sent (seed 800045: an accept that
        ended after the workers had stopped, its message applied by nobody)."""
        self.stopping.set()
        if self.deciding is not None:
            self.deciding.join(timeout=90)
            if self.deciding.is_alive():
                raise RuntimeError("the operator's decision did not end within 90s")

    def unsettled(self, admin: Admin) -> int:
        """Outbox effects not dispatched yet, outputs not applied downstream yet (what
        they are is kept, for the events of a run that does not settle)."""
        waiting: list[str] = []
        if self.outbox:
            waiting += [
                f"effect {e[:16]} {status} attempts {attempts} next {nxt} lease {leased}"
                for e, status, attempts, nxt, leased in admin.query(
                    "SELECT effect_id, status, attempts, "
                    "round(extract(epoch FROM next_attempt_at - now())::numeric, 1), "
                    "round(extract(epoch FROM leased_until - now())::numeric, 1) "
                    "FROM message_outbox WHERE status NOT IN ('dispatched', 'failed')"
                )
            ]
        if self.config.outputs == "result" and "outputs" in self.available:
            # Not the outputs of messages without identity: processed unprotected, as
            # without the inbox (add-to-dramatiq.md, "Roll out with missing_identity"),
            # their callbacks may run out of Dramatiq's retries in an outage.
            unidentified = [i.key for i in self.schedule.intents if not i.identified]
            waiting += [
                f"output of {k} not downstream"
                for (k,) in admin.query(
                    "SELECT DISTINCT e.key FROM explore_effects e WHERE NOT EXISTS "
                    "(SELECT 1 FROM explore_downstream d WHERE d.key = e.key) "
                    "AND NOT e.key = ANY(%s)",
                    (unidentified,),
                )
            ]
        if waiting and waiting != self.waiting:
            self._event("waiting for: " + "; ".join(waiting[:6]))
        self.waiting = waiting
        return len(waiting)

    def stop(self) -> None:
        self.stopping.set()
        self.closed.set()
        for thread in self.threads:
            thread.join(timeout=90)
        for slot in self.dispatchers:
            slot.held = True
            slot.terminate(timeout=10)

    def kill(self) -> None:
        self.stopping.set()
        self.closed.set()
        if self.mover is not None and self.mover.poll() is None:
            self.mover.kill()
        for slot in self.dispatchers:
            slot.held = True
            with contextlib.suppress(Exception):
                slot.kill()

    def cleanup(self) -> None:
        """The queues of the run's own the outputs used (RabbitMQ is shared; Redis keys
        and NATS streams go with the broker's own cleanup)."""
        if self.config.target == "faststream-rabbitmq" and self.config.outputs == "result":
            from .brokers import _rabbit_delete

            out = f"{self.env['EXPLORE_QUEUE']}.out"
            _rabbit_delete([out, f"{out}.quarantine", f"{out}.dead-letter"])

    # -- what it saw ---------------------------------------------------------------------------

    def collect(self, admin: Admin) -> dict[str, Any]:
        def columns(table: str) -> set[str]:
            return {
                c
                for (c,) in admin.query(
                    "SELECT column_name FROM information_schema.columns WHERE table_name = %s",
                    (table,),
                )
            }

        seen: dict[str, Any] = {
            "not_available": self.not_available,
            "moved": self.moved,
            "decisions": self.decisions,
            "purges": self.purges,
            "events": self.events,
            # When the claim was written as the purge sees it (``processed_at``, its
            # transaction's start): seconds before the effect where the link is slow.
            "first_effect": {
                k: float(at)
                for k, at in admin.query(
                    "SELECT key, extract(epoch FROM min(began)) FROM explore_effects GROUP BY key"
                )
            },
            "effect_times": [
                (k, int(n), float(at))
                for k, n, at in admin.query(
                    "SELECT key, n, extract(epoch FROM at) FROM explore_effects"
                )
            ],
            "downstream": [
                (k, int(n), via)
                for k, n, via in admin.query("SELECT key, n, via FROM explore_downstream")
            ],
            "received": [
                (e, k, int(n), int(d))
                for e, k, n, d in admin.query(
                    "SELECT effect_id, key, n, deliveries FROM explore_outbox_received"
                )
            ],
        }
        if self.outbox:
            seen["outbox"] = [
                (e, payload.get("key") if isinstance(payload, dict) else None, status)
                for e, payload, status in admin.query(
                    "SELECT effect_id, payload, status FROM message_outbox"
                )
            ]
        for table in ("inbox_poison", "inbox_quarantine"):
            have = columns(table)
            wanted = [
                c
                for c in (
                    "id",
                    "message_id",
                    "decision",
                    "decided_by",
                    "published_at",
                    "accepted_message_id",
                    "reason_code",
                )
                if c in have
            ]
            query = f"SELECT {', '.join(wanted)} FROM {table}"
            each = getattr(admin, "each", None)
            if self.where[0] != "--map" or each is None:
                rows = admin.query(query)
                seen[table] = [dict(zip(wanted, row, strict=True)) for row in rows]
                continue
            seen[table] = []
            for index, rows in enumerate(each(query)):  # the map's databases, d0, d1, ...
                for row in rows:
                    found = dict(zip(wanted, row, strict=True))
                    if "id" in found:
                        found["id"] = _row_id(f"d{index}", found["id"])
                    seen[table].append(found)
        return seen


def _row_id(database: str | None, row_id: Any) -> int | str:
    """A repair row's id as the decisions and the checks name it: over a map,
    ``<database>:<id>``, ids being each database's own."""
    return f"{database}:{row_id}" if database else int(row_id)
