"""The chaos run: worker processes consume the plan's stream while the controller breaks
everything it can, then the ledger is checked exactly.

    controller (this process)
    ├── producer thread     publishes the stream, paced to a bounded backlog; sends each
    │                       conflict once its first payload has committed
    ├── database proxy      every worker connection passes through it; the controller
    │                       cuts those PostgreSQL reports as mid-transaction
    └── chaos loop          SIGKILLs a worker's process tree every few seconds and starts
                            it again; restarts PostgreSQL once and the broker once
                            (unless it keeps nothing on disk: Kafka's tansu)

A production topology's run (`Config.postgres_fault`, `broker_restart`, `cuts`) breaks one
thing of it instead: the failover pair's primary stopped and its standby promoted, the
workers connecting through a URL that names both; or the broker restarted (a persistent
Redis SIGKILLed, RabbitMQ with quorum queues restarted); the SIGKILLs of workers go on.

One worker (the first) is never killed: its pool and memory are watched over the whole
run. The run ends when every intent is settled and the broker holds nothing for the run;
then the pools must be idle, the workers stop, and the ledger must match the plan.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

from ..apps import chaos_domain
from ..support import servers, services
from ..support.cutting_proxy import CuttingProxy
from .ledger import Ledger, check
from .plan import Plan, make_plan
from .targets import Target, Worker, make_target

__all__ = ["Config", "Report", "run"]

APPLICATION = "chaos-"  # prefix of the workers' database session names


@dataclass
class Config:
    adapter: str
    broker: str
    messages: int
    workers: int = 3
    seed: int = 0
    kill_every: tuple[float, float] = (2.0, 4.0)
    kill_at: tuple[float, ...] = (0.15, 0.45)
    """Shares of the intents settled at which a running worker is killed whatever the
    clock says, so that a short or fast run still has its kills mid-stream."""
    cut_every: tuple[float, float] = (1.0, 3.0)
    backlog: int = 1500
    """Intents sent ahead of those settled, at most."""
    postgres_restart_at: float = 0.3
    broker_restart_at: float = 0.6
    postgres_fault: str = "restart"
    """What happens to PostgreSQL at ``postgres_restart_at``: "restart" (the server's fast
    restart), "failover" (the failover pair's primary stopped in immediate mode and its
    standby promoted: the run's database must be on the pair) or "none"."""
    broker_restart: bool = True
    losses_expected: bool = False
    """A topology that can lose acknowledged effects (asynchronous replication): the run
    ends once nothing settles any more and the broker holds nothing, and the ledger says
    what was lost, instead of waiting for every intent."""
    cuts: bool = True
    """Whether the workers connect through the proxy that cuts their transactions (a URL
    that names the failover pair's two servers connects directly)."""
    chaos_until: float = 0.9
    """Share of the intents settled after which the chaos stops and the run settles."""

    @property
    def timeout(self) -> float:
        return 240 + self.messages * 0.04


@dataclass
class Events:
    kills: int = 0
    revived: int = 0
    cut_rounds: int = 0
    cut_links: int = 0
    postgres_restarts: list[float] = field(default_factory=list)
    failovers: list[float] = field(default_factory=list)
    broker_restarts: list[float] = field(default_factory=list)
    worker_restarts: int = 0
    """Workers stopped gracefully and started again after the broker's restart, when the
    target needs it (`Target.restart_workers_after_broker_restart`)."""


@dataclass
class Report:
    config: Config
    plan: Plan
    ledger: Ledger
    events: Events
    seconds: float
    publish_retries: int
    outcomes: Counter[str]
    pools: dict[str, dict[str, int]]
    sessions: int
    rss: tuple[int, int] | None
    """The never-killed worker's RSS (KiB) when half the intents were settled, and at
    the end."""
    leftover: dict[str, int]
    problems: list[str]

    @property
    def rss_growth(self) -> float | None:
        if self.rss is None:
            return None
        middle, end = self.rss
        return (end - middle) / middle

    def summary(self) -> str:
        plan, ledger, events = self.plan, self.ledger, self.events
        counts = plan.counts
        idle = sum(p["idle"] for p in self.pools.values())
        size = sum(p["size"] for p in self.pools.values())
        out = sum(p["checkedout"] for p in self.pools.values())
        rss = "n/a"
        if self.rss is not None and self.rss_growth is not None:
            rss = (
                f"{self.rss[0] / 1024:.1f}->{self.rss[1] / 1024:.1f} MiB "
                f"({self.rss_growth:+.1%} over the second half)"
            )
        failures = ", ".join(
            f"{name} {count}"
            for name, count in self.outcomes.most_common()
            if name not in ("processed", "skipped")
        )
        return (
            f"chaos {self.config.adapter}/{self.config.broker}: {plan.messages} messages "
            f"({counts['first']} intents, {counts['redelivered']} redelivered, "
            f"{counts['concurrent']} concurrent duplicates, {counts['conflict']} conflicts, "
            f"{counts['refused']} refused) in {self.seconds:.0f}s | "
            f"{events.kills} SIGKILLs, {events.revived} revived, "
            f"{len(events.postgres_restarts)} PostgreSQL restart, "
            f"{len(events.failovers)} failover, "
            f"{len(events.broker_restarts)} broker restart, "
            f"{events.worker_restarts} workers restarted after it, "
            f"{events.cut_links} connections cut mid-transaction, "
            f"{self.publish_retries} publish retries | "
            f"applied {ledger.applied}, twice {ledger.applied_twice}, lost {ledger.lost}, "
            f"wrong balances {ledger.wrong_balances}, inbox rows {ledger.inbox_rows}, "
            f"quarantined {ledger.quarantine_rows} ({ledger.quarantined_messages} messages), "
            f"poison {ledger.poison_rows} ({ledger.dead_letters} dead letters), "
            f"left in the broker {sum(self.leftover.values())} | "
            f"worker outcomes: {failures or 'no failures'} | "
            f"pools: {out} checked out, {idle} idle of {size}, {self.sessions} sessions | "
            f"RSS {rss} | {'OK' if not self.problems else 'FAILED'}"
        )


class Admin:
    """A direct connection (not through the proxy) that outlives a PostgreSQL restart."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn: psycopg.Connection[Any] | None = None

    def query(self, sql: str, params: Any = None, patience: float = 120) -> list[Any]:
        deadline = time.monotonic() + patience
        while True:
            try:
                if self.conn is None:
                    self.conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
                return self.conn.execute(sql, params).fetchall()
            except psycopg.OperationalError:
                self.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def connection(self) -> psycopg.Connection[Any]:
        self.query("SELECT 1")
        assert self.conn is not None
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class Fleet:
    """The worker processes, by name; each restart is a new generation."""

    def __init__(self, target: Target, env: dict[str, str], folder: Path, count: int) -> None:
        self.target, self.env, self.folder = target, env, folder
        self.names = [f"w{n}" for n in range(count)]
        self.workers: dict[str, Worker] = {}
        self.generations: Counter[str] = Counter()

    @property
    def survivor(self) -> str:
        return self.names[0]

    def stats_folder(self, name: str) -> Path:
        return self.folder / "stats" / f"{name}-{self.generations[name]}"

    def start(self, name: str) -> None:
        self.generations[name] += 1
        stats = self.stats_folder(name)
        stats.mkdir(parents=True)
        log = self.folder / f"{name}-{self.generations[name]}.log"
        env = self.env | {"CHAOS_WORKER": name, "CHAOS_STATS": str(stats)}
        self.workers[name] = self.target.worker(env, log)

    def start_all(self) -> None:
        for name in self.names:
            self.start(name)

    def kill(self, name: str) -> None:
        self.workers[name].kill()
        self.start(name)

    def restart(self, name: str) -> None:
        """A graceful stop, and a start."""
        self.workers[name].stop()
        self.start(name)

    def revive(self) -> list[str]:
        """Start again every worker that exited by itself; their names."""
        gone = [n for n, w in self.workers.items() if w.proc.poll() is not None]
        for name in gone:
            self.start(name)
        return gone

    def stats(self, name: str) -> dict[str, Any] | None:
        """The latest statistics of the current generation of ``name``."""
        files = sorted(self.stats_folder(name).glob("*.json"), key=lambda p: p.stat().st_mtime)
        for path in reversed(files):
            try:
                return dict(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return None

    def outcomes(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for path in (self.folder / "stats").glob("*/*.json"):
            try:
                total.update(json.loads(path.read_text())["outcomes"])
            except (OSError, ValueError):
                continue
        return total

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.stop()

    def kill_all(self) -> None:
        for worker in self.workers.values():
            worker.kill()

    def tails(self, lines: int = 15) -> str:
        parts = []
        for name, worker in self.workers.items():
            tail = "\n".join(worker.output().splitlines()[-lines:])
            parts.append(f"--- {name} (generation {self.generations[name]}) ---\n{tail}")
        return "\n".join(parts)


class Producing(threading.Thread):
    """Publishes the plan: the stream, paced to the backlog; each conflict once its
    intent's first payload has committed."""

    def __init__(self, target: Target, plan: Plan, admin_url: str, backlog: int) -> None:
        super().__init__(name="chaos-producer", daemon=True)
        self.target, self.plan, self.backlog = target, plan, backlog
        self.admin = Admin(admin_url)
        self.settled = 0  # written by the chaos loop
        self.sent = 0
        self.retries = 0
        self.done = threading.Event()
        self.abort = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            producer = self.target.producer()
            try:
                self._produce(producer)
            finally:
                producer.close()
        except BaseException as exc:
            self.error = exc
        finally:
            self.admin.close()
            self.done.set()

    def _produce(self, producer: Any) -> None:
        pending = {send.message_id: send for send in self.plan.conflicts}
        waiting: set[str] = set()  # conflicts whose intent's first delivery was sent
        checked = time.monotonic()
        firsts = 0
        for send in self.plan.stream:
            if send.kind == "first":
                while firsts - self.settled > self.backlog and not self.abort.is_set():
                    time.sleep(0.05)
                firsts += 1
                if send.message_id in pending:
                    waiting.add(send.message_id)
            if self.abort.is_set():
                return
            self.retries += producer.send(send)
            self.sent += 1
            if time.monotonic() - checked > 0.5:
                self._conflicts(producer, pending, waiting)
                checked = time.monotonic()
        deadline = time.monotonic() + 600
        while pending and not self.abort.is_set():
            self._conflicts(producer, pending, waiting)
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(pending)} conflicts never found their first payload")
            time.sleep(0.2)

    def _conflicts(self, producer: Any, pending: dict[str, Any], waiting: set[str]) -> None:
        if not waiting:
            return
        rows = self.admin.query(
            "SELECT message_id FROM consumer_inbox WHERE consumer_name = 'ledger' "
            "AND message_id = ANY(%s)",
            (sorted(waiting),),
        )
        for (message_id,) in rows:
            waiting.discard(message_id)
            self.retries += producer.send(pending.pop(message_id))
            self.sent += 1


def run(
    config: Config,
    database_url: str,
    folder: Path,
    log: Any = print,
    admin_url: str | None = None,
) -> Report:
    """Run the chaos against the migrated database at ``database_url`` (SQLAlchemy URL);
    the harness's own connection at ``admin_url`` (libpq URL; by default the same
    database on ``services.POSTGRES_SERVER``, past any pooler)."""
    started = time.monotonic()
    plan = make_plan(config.messages, config.seed)
    rng = random.Random(config.seed)
    target = make_target(config.adapter, config.broker, folder)
    if target.kill_every is not None:
        config.kill_every = target.kill_every
    url = make_url(database_url)
    if admin_url is None:
        # The harness's own connection goes to the server itself, past any pooler.
        server = make_url(services.POSTGRES_SERVER)
        admin_url = url.set(drivername="postgresql", host=server.host, port=server.port)
        admin_url = admin_url.render_as_string(hide_password=False)
    admin = Admin(admin_url)
    _reset(admin)
    driver = "postgresql+asyncpg" if config.adapter == "faststream" else "postgresql+psycopg"
    proxy = None
    if config.cuts:
        proxy = CuttingProxy((url.host or "127.0.0.1", url.port or 5432))
        worker_url = url.set(drivername=driver, host="127.0.0.1", port=proxy.port)
    else:
        worker_url = url.set(drivername=driver)
    env = target.worker_env() | {
        "CHAOS_DATABASE_URL": worker_url.render_as_string(hide_password=False)
    }
    fleet = Fleet(target, env, folder, config.workers)
    producing = Producing(target, plan, admin_url, config.backlog)
    events = Events()
    try:
        target.start()
        fleet.start_all()
        producing.start()
        rss_middle = _chaos(config, plan, rng, admin, proxy, fleet, producing, events, log)
        log(f"  settled after {time.monotonic() - started:.0f}s; waiting for the broker")
        leftover = _quiet(target, config.timeout / 4)
        pools, sessions, pool_problems = _pools(admin, fleet)
        end = fleet.stats(fleet.survivor)
        fleet.stop()
        leftover = target.leftover()  # consumers gone: unacknowledged would be ready again
        quarantined, dead = target.destinations()
        ledger = check(admin.query, plan, quarantined, dead)
        problems = ledger.problems + pool_problems
        if any(leftover.values()):
            problems.append(f"messages left in the broker: {leftover}")
        rss = None
        if rss_middle is not None and end is not None and fleet.generations[fleet.survivor] == 1:
            rss = (rss_middle, int(end["rss_kb"]))
        return Report(
            config=config,
            plan=plan,
            ledger=ledger,
            events=events,
            seconds=time.monotonic() - started,
            publish_retries=producing.retries,
            outcomes=fleet.outcomes(),
            pools=pools,
            sessions=sessions,
            rss=rss,
            leftover=leftover,
            problems=problems,
        )
    except BaseException:
        log(fleet.tails())
        raise
    finally:
        producing.abort.set()
        producing.join(timeout=30)
        fleet.kill_all()
        if proxy is not None:
            proxy.close()
        try:
            target.close()
        finally:
            admin.close()
            if config.postgres_fault == "failover":
                servers.restore_failover_pair()
            servers.ensure_postgres()
            if config.broker.startswith("rabbitmq"):
                servers.ensure_rabbitmq()


def _sessions(admin: Admin) -> dict[str, int]:
    """Database connections per worker: the server's sessions, or through a transaction
    pooler (which shares its server sessions among clients) the pooler's clients."""
    if not services.THROUGH_POOLER:
        rows = admin.query(
            "SELECT application_name, count(*) FROM pg_stat_activity "
            "WHERE application_name LIKE %s GROUP BY 1",
            (f"{APPLICATION}%",),
        )
        return dict(rows)
    host, port = services.postgres_address()
    with psycopg.connect(f"postgresql://postgres@{host}:{port}/pgbouncer", autocommit=True) as c:
        clients = c.execute("SHOW CLIENTS").fetchall()
    return dict(Counter(row[17] for row in clients if str(row[17]).startswith(APPLICATION)))


def _reset(admin: Admin) -> None:
    conn = admin.connection()
    with conn.transaction():
        for statement in chaos_domain.DDL:
            conn.execute(statement)
        conn.execute(
            "TRUNCATE chaos_accounts, chaos_journal, consumer_inbox, inbox_quarantine, "
            "inbox_poison, inbox_attempts"
        )
        conn.execute(
            "INSERT INTO chaos_accounts (id, balance) SELECT g, 0 FROM generate_series(1, %s) AS g",
            (chaos_domain.ACCOUNTS,),
        )


def _chaos(
    config: Config,
    plan: Plan,
    rng: random.Random,
    admin: Admin,
    proxy: CuttingProxy | None,
    fleet: Fleet,
    producing: Producing,
    events: Events,
    log: Any,
) -> int | None:
    """Break things until the chaos share is settled, then wait until every intent is;
    the survivor's RSS when half of them were."""
    intents, refused, conflicts = len(plan.intents), len(plan.refused), len(plan.conflicts)
    deadline = time.monotonic() + config.timeout
    next_kill = time.monotonic() + rng.uniform(*config.kill_every)
    next_cut = time.monotonic() + rng.uniform(*config.cut_every)
    next_log = time.monotonic() + 10
    kill_points = sorted(config.kill_at)
    rss_middle: int | None = None
    victims = fleet.names[1:]
    restarts = Restarts(config, fleet.target, events, log)
    last, still = None, time.monotonic()
    try:
        while True:
            journal, poison, quarantine = admin.query(
                "SELECT (SELECT count(*) FROM chaos_journal),"
                " (SELECT count(*) FROM inbox_poison), (SELECT count(*) FROM inbox_quarantine)"
            )[0]
            producing.settled = journal + poison
            progress = (journal + poison) / intents
            if producing.error is not None:
                raise AssertionError("the producer failed") from producing.error
            restarts.check()
            if rss_middle is None and progress >= 0.5:
                stats = fleet.stats(fleet.survivor)
                rss_middle = int(stats["rss_kb"]) if stats else None
            settled = journal + poison >= intents and quarantine >= conflicts
            if producing.done.is_set() and settled and restarts.done and not kill_points:
                if journal > intents - refused or poison > refused or quarantine > conflicts:
                    raise AssertionError(
                        f"more settled than sent: journal {journal}, poison {poison}, "
                        f"quarantine {quarantine}"
                    )
                return rss_middle
            now = time.monotonic()
            if (journal, poison, quarantine) != last:
                last, still = (journal, poison, quarantine), now
            elif (
                config.losses_expected
                and restarts.done
                and now - still > 10
                and not any(fleet.target.leftover().values())
            ):
                log(f"  nothing settled for {now - still:.0f}s and the broker is empty: done")
                producing.abort.set()  # conflicts whose first payload was lost stay unsent
                return rss_middle
            if now > deadline:
                raise AssertionError(
                    f"not settled after {config.timeout:.0f}s: journal {journal} of "
                    f"{intents - refused}, poison {poison} of {refused}, quarantine "
                    f"{quarantine} of {conflicts}, {producing.sent} of {plan.messages} sent"
                )
            if now > next_log:
                log(
                    f"  {now - deadline + config.timeout:4.0f}s: {progress:.0%} settled, "
                    f"{producing.sent} sent, {events.kills} kills, {events.cut_links} cuts"
                )
                next_log = now + 10
            revived = fleet.revive()
            if revived:
                events.revived += len(revived)
                log(f"  worker(s) {', '.join(revived)} exited by themselves; started again")
            chaos = progress < config.chaos_until or not producing.done.is_set()
            # A worker still starting has nothing in flight: only running ones are killed.
            running = [name for name in victims if fleet.stats(name) is not None]
            point_due = bool(kill_points) and progress >= kill_points[0]
            if (point_due or (chaos and now >= next_kill)) and running:
                fleet.kill(rng.choice(running))
                events.kills += 1
                next_kill = now + rng.uniform(*config.kill_every)
                if point_due:
                    kill_points.pop(0)
            if chaos and proxy is not None and now >= next_cut:
                # Running workers only: a starting one would fail its start-up check.
                names = [APPLICATION + n for n in fleet.names if fleet.stats(n) is not None]
                events.cut_rounds += 1
                events.cut_links += proxy.cut_mid_transaction(
                    admin.connection(), names, fleet.target.cut_search
                )
                next_cut = now + rng.uniform(*config.cut_every)
            if progress >= config.postgres_restart_at or (settled and producing.done.is_set()):
                restarts.postgres()
            if progress >= config.broker_restart_at or (settled and producing.done.is_set()):
                restarts.broker()
            if (
                fleet.target.restart_workers_after_broker_restart
                and events.broker_restarts
                and not events.worker_restarts
            ):
                for name in fleet.names:
                    fleet.restart(name)
                events.worker_restarts = len(fleet.names)
                log(f"  {len(fleet.names)} workers stopped and started again")
            time.sleep(0.25)
    finally:
        restarts.join()


class Restarts:
    """PostgreSQL and the broker, each restarted once, on a thread of its own: the kills
    and the cuts go on meanwhile."""

    def __init__(self, config: Config, target: Target, events: Events, log: Any) -> None:
        self.config, self.target, self.events, self.log = config, target, events, log
        self.threads: dict[str, threading.Thread] = {}
        self.errors: list[BaseException] = []

    def _start(self, what: str, restart: Any, record: list[float]) -> None:
        if what in self.threads or any(t.is_alive() for t in self.threads.values()):
            return  # one at a time

        def job() -> None:
            try:
                record.append(restart())
                self.log(f"  {what} in {record[-1]:.1f}s")
            except BaseException as exc:
                self.errors.append(exc)

        self.threads[what] = threading.Thread(target=job, name=f"restart-{what}", daemon=True)
        self.threads[what].start()

    def postgres(self) -> None:
        fault = self.config.postgres_fault
        if fault == "restart":
            restarts = self.events.postgres_restarts
            self._start("PostgreSQL restarted", servers.restart_postgres, restarts)
        elif fault == "failover":
            failovers = self.events.failovers
            self._start("PostgreSQL failed over", servers.failover_postgres, failovers)

    @property
    def restarts_broker(self) -> bool:
        return self.config.broker_restart and self.target.restartable

    def broker(self) -> None:
        if self.restarts_broker:
            restarts = self.events.broker_restarts
            self._start(f"{self.config.broker} restarted", self.target.restart_broker, restarts)

    @property
    def done(self) -> bool:
        broker = bool(self.events.broker_restarts) or not self.restarts_broker
        postgres = {
            "restart": bool(self.events.postgres_restarts),
            "failover": bool(self.events.failovers),
        }.get(self.config.postgres_fault, True)
        return postgres and broker

    def check(self) -> None:
        if self.errors:
            raise AssertionError("a restart failed") from self.errors[0]

    def join(self) -> None:
        for thread in self.threads.values():
            thread.join(timeout=300)


def _quiet(target: Target, timeout: float) -> dict[str, int]:
    """Wait until the broker holds nothing for the run's queues (ready, delayed or
    unacknowledged), twice in a row a second apart."""
    deadline = time.monotonic() + timeout
    quiet = 0
    while True:
        leftover = target.leftover()
        quiet = quiet + 1 if not any(leftover.values()) else 0
        if quiet >= 2:
            return leftover
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the broker still holds messages after {timeout:.0f}s: {leftover}"
            )
        time.sleep(1)


def _pools(admin: Admin, fleet: Fleet) -> tuple[dict[str, dict[str, int]], int, list[str]]:
    """Every live worker's pool must be back to idle, and PostgreSQL must hold no more
    sessions than those pools keep (none left behind by a cut, a restart or a killed
    worker)."""
    deadline = time.monotonic() + 15
    while True:
        # A worker that exited by itself at the end (its start-up check found no database
        # during a failover) is started again, and its new pool checked.
        fleet.revive()
        time.sleep(1)  # statistics are written every half second
        pools = {}
        for name in fleet.names:
            stats = fleet.stats(name)
            pools[name] = dict(stats["pool"]) if stats else {"size": 0, "checkedout": -1, "idle": 0}
        sessions = _sessions(admin)
        problems = [
            f"worker {name}: pool {pool} with {sessions.get(APPLICATION + name, 0)} sessions"
            for name, pool in pools.items()
            if pool["checkedout"] != 0
            or pool["idle"] > pool["size"]
            # More sessions than idle connections: something left behind on the server.
            # Fewer: pooled connections whose session a cut or a restart ended, which the
            # pool replaces when they are checked out (pre-ping); nothing is left behind.
            or sessions.get(APPLICATION + name, 0) > pool["idle"]
        ]
        if not problems or time.monotonic() > deadline:
            return pools, sum(sessions.values()), problems
