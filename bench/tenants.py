"""Failure isolation over many databases: one database down, the others at their rate.

    python -m bench.tenants --connect     # the cold-connect cost, direct and through PgBouncer
    python -m bench.tenants --quick       # one pair of runs, 10 s outages, ~2 minutes
    python -m bench.tenants               # three alternating pairs, 60 s outages
    python -m bench.tenants --framework faststream   # the same on FastStream (RabbitMQ)
    python -m bench.tenants --framework both    # each pair on FastStream, then Dramatiq

Three databases, one on each tenant PostgreSQL server (``scripts/services tenant-postgres``:
5450, 5451, 5452), nine tenants spread over them, one shared queue, and a fleet of two
worker processes routed by a map file: Dramatiq on Redis (`bench.tenants_app`, eight
threads each) or FastStream on RabbitMQ (`bench.tenants_faststream_app`, a prefetch of 16
each). Both use ``pool_size=4`` per database and hand-backs from 0.2 s doubling to 1 s.
A producer sends at
a fixed rate below saturation. Runs alternate: a baseline (nothing breaks), then an
outage run: the third database is stopped for N seconds (``pg_ctlcluster stop -m fast``),
started, then black-holed for N seconds (its connections go through the test support's
proxy, which then takes bytes and answers nothing), then served again.

For the healthy tenants (the first two databases), over the outage window of each run:
throughput (their messages sent in the window and applied, a second) and p99 latency
(applied - sent), outage run against baseline run, as ratios a pair and over all the
pairs (the outage runs' mean over the baselines' mean, beside how far apart the baselines'
own p99 lie); and for every run, lost (sent, never applied) and twice (applied more than
once). The servers are stopped and
started: run it under the fault lock (``flock /tmp/inbox-fault.lock python -m
bench.tenants``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import create_engine

from bench.common import RABBITMQ, REDIS, ROOT, percentile
from inbox_middleware._storage import migrate

PORTS = (5450, 5451, 5452)
DOWN = 2  # the database that breaks
DATABASE = os.environ.get("BENCH_TENANTS_DATABASE", "bench_tenants")
TENANTS = [f"t{n}" for n in range(9)]  # t<n> lives in database n % 3
LEDGER = """CREATE TABLE IF NOT EXISTS bench_ledger (
    message_id text PRIMARY KEY,
    tenant text NOT NULL,
    sent_at double precision NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
)"""
INBOX_TABLES = "consumer_inbox, inbox_attempts, inbox_outputs, inbox_quarantine, inbox_poison"


def url(port: int) -> str:
    return f"postgresql://postgres@127.0.0.1:{port}/{DATABASE}"


def prepare() -> None:
    for port in PORTS:
        with psycopg.connect(
            f"postgresql://postgres@127.0.0.1:{port}/postgres", autocommit=True
        ) as conn:
            if not conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)
            ).fetchone():
                conn.execute(f'CREATE DATABASE "{DATABASE}"')
        engine = create_engine(url(port).replace("postgresql://", "postgresql+psycopg://"))
        try:
            migrate(engine)
        finally:
            engine.dispose()
        with psycopg.connect(url(port), autocommit=True) as conn:
            conn.execute(LEDGER)
            conn.execute(f"TRUNCATE bench_ledger, {INBOX_TABLES}")


def cluster(port: int, action: str) -> None:
    """Stop or start a tenant server; one already in that state is left as it is."""
    version = subprocess.run(
        ["pg_lsclusters", "--no-header"], check=True, capture_output=True, text=True
    ).stdout.split()[0]
    index = PORTS.index(port)
    if answering(port) == (action == "start"):
        return
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, f"inbox_tenant_{index}", action]
        + (["-m", "fast"] if action == "stop" else []),
        check=True,
        capture_output=True,
        timeout=120,
    )


def answering(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
        return True
    return False


def break_the_database(proxy: Any, at: float, outage: float) -> None:
    """At ``at`` (monotonic): the third database stopped for ``outage`` seconds, then
    started and black-holed through ``proxy`` for ``outage`` seconds."""
    time.sleep(max(0.0, at - time.monotonic()))
    cluster(PORTS[DOWN], "stop")
    restarted = keep_stopped(PORTS[DOWN], at + outage)
    if restarted:
        print(f"the stopped server was started by something else {restarted}x: stopped again")
    cluster(PORTS[DOWN], "start")
    proxy.blackhole()
    time.sleep(max(0.0, at + 2 * outage - time.monotonic()))
    proxy.unblackhole()


def keep_stopped(port: int, until: float) -> int:
    """Keep the server stopped until ``until`` (monotonic): something that starts it
    meanwhile (a test outside the fault lock) is undone. Answers how often it was."""
    restarted = 0
    while time.monotonic() < until:
        if answering(port):
            restarted += 1
            cluster(port, "stop")
        time.sleep(0.5)
    return restarted


@dataclass
class Run:
    kind: str
    sent: int
    applied: int
    lost: int
    twice: int
    healthy_per_s: float
    healthy_p99_ms: float
    healthy_p50_ms: float
    healthy_p99_stopped_ms: float
    """p99 over the first half of the window (the database stopped)."""
    healthy_p99_holed_ms: float
    """p99 over the second half (the database black-holed)."""
    down_applied_in_window: int
    healthy_p99_by_5s_ms: list[float]
    """p99 of the healthy tenants' messages sent in each 5 s of the window, in order."""
    healthy_slowest: list[tuple[float, float]]
    """The slowest 1% of the healthy tenants' messages of the window: (sent, seconds into
    the window; latency, ms), slowest first."""


def start_workers(
    proxy_port: int, queue: str, framework: str
) -> tuple[list[subprocess.Popen[bytes]], Any]:
    """The fleet: two worker processes, over a map whose third database is reached through
    the proxy."""
    folder = Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    databases = {f"db{i}": url(port) for i, port in enumerate(PORTS)}
    databases[f"db{DOWN}"] = f"postgresql://postgres@127.0.0.1:{proxy_port}/{DATABASE}"
    map_path = folder / "databases.json"
    tenants = {tenant: f"db{int(tenant[1:]) % 3}" for tenant in TENANTS}
    map_path.write_text(json.dumps({"databases": databases, "tenants": tenants}))
    env = {
        **os.environ,
        "BENCH_TENANTS_MAP": str(map_path),
        "BENCH_TENANTS_REDIS": REDIS,
        "BENCH_TENANTS_NAMESPACE": f"bench-{queue}",
        "BENCH_TENANTS_RABBITMQ": RABBITMQ,
        "BENCH_TENANTS_QUEUE": queue,
        "PYTHONUNBUFFERED": "1",
    }
    log = open(folder / "workers.log", "ab")  # noqa: SIM115 - closed below
    print(f"the workers' log: {log.name}", flush=True)
    if framework == "faststream":
        commands = [
            [sys.executable, "-m", "faststream", "run", "bench.tenants_faststream_app:app"]
        ] * 2
    else:
        commands = [
            [sys.executable, "-m", "dramatiq", "bench.tenants_app", "--processes", "2",
             "--threads", "8"]
        ]  # fmt: skip
    workers = [
        subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for command in commands
    ]
    return workers, log


class Sender:
    """Sends one message of the bench to the fleet's shared queue."""

    def __init__(self, queue: str, framework: str) -> None:
        self.queue = queue
        self.framework = framework
        if framework == "faststream":
            import pika

            self.connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ))
            self.channel = self.connection.channel()
            self.channel.queue_declare(queue, durable=True)
            self.channel.confirm_delivery()
            return
        import dramatiq
        from dramatiq.brokers.redis import RedisBroker

        self.broker = RedisBroker(url=REDIS, namespace=f"bench-{queue}")
        self.actor = dramatiq.actor(
            lambda message_id, tenant, sent_at: None, actor_name="apply", queue_name=queue,
            broker=self.broker,
        )  # fmt: skip

    def send(self, message_id: str, tenant: str, at: float) -> None:
        if self.framework == "faststream":
            import pika

            self.channel.basic_publish(
                "",
                self.queue,
                json.dumps({"message_id": message_id, "tenant": tenant, "sent_at": at}).encode(),
                pika.BasicProperties(
                    content_type="application/json",
                    delivery_mode=2,
                    headers={
                        "x-inbox-producer": "bench",
                        "x-inbox-message-id": message_id,
                        "x-inbox-tenant": tenant,
                    },
                ),
            )
            return
        from inbox_middleware.dramatiq import identity

        self.actor.send_with_options(
            args=(message_id, tenant, at),
            **identity(producer="bench", message_id=message_id, tenant=tenant),
        )

    def close(self) -> None:
        if self.framework == "faststream":
            # the wait queues (<queue>.inbox-wait.<ms>) go by themselves, unused
            for name in (self.queue, f"{self.queue}.dead-letter"):
                self.channel.queue_delete(name)
            self.connection.close()
            return
        for key in self.broker.client.scan_iter(f"bench-{self.queue}*"):
            self.broker.client.delete(key)


def one_run(
    kind: str, rate: float, warmup: float, outage: float, tail: float, framework: str
) -> Run:
    sys.path.insert(0, str(ROOT))
    from tests.support.proxy import Proxy

    prepare()
    proxy = Proxy(("127.0.0.1", PORTS[DOWN]))
    queue = f"bench{uuid.uuid4().hex[:8]}"
    sender = Sender(queue, framework)  # declares the queue before the workers consume it
    workers, log = start_workers(proxy.port, queue, framework)
    sent: dict[str, tuple[str, float]] = {}
    total = warmup + 2 * outage + tail
    window = (warmup, warmup + 2 * outage)

    def produce(start: float) -> None:
        n = 0
        while (now := time.monotonic() - start) < total:
            tenant = TENANTS[n % len(TENANTS)]
            message_id = f"{queue}-{n}"
            at = time.time()
            sender.send(message_id, tenant, at)
            sent[message_id] = (tenant, at)
            n += 1
            time.sleep(max(0.0, (n / rate) - (time.monotonic() - start)))
        del now

    booted = time.monotonic() + 60
    while framework == "faststream" and time.monotonic() < booted:
        if (
            log.name
            and Path(log.name).read_text(errors="replace").count("started successfully") >= 2
        ):
            break
        time.sleep(0.5)
    time.sleep(5)  # the workers boot (and FastStream's connect)
    started = time.monotonic()
    wall_start = time.time()
    producer = threading.Thread(target=produce, args=(started,))
    producer.start()
    if kind == "outage":
        break_the_database(proxy, started + warmup, outage)
    producer.join()
    rows = ledger_rows(len(sent), deadline=time.monotonic() + 120 + 2 * outage)
    for worker in workers:
        os.killpg(worker.pid, 15)
    for worker in workers:
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, 9)
    log.close()
    proxy.close()
    sender.close()
    return summarise(kind, sent, rows, wall_start + window[0], wall_start + window[1])


def summarise(
    kind: str,
    sent: dict[str, tuple[str, float]],
    rows: list[tuple[str, str, float, float]],
    low: float,
    high: float,
) -> Run:
    applied_ids = [r[0] for r in rows]

    def latencies(start: float, end: float) -> list[float]:
        return [
            (float(a) - float(s)) * 1000
            for _, tenant, s, a in rows
            if int(tenant[1:]) % 3 != DOWN and start <= s < end
        ]

    healthy = latencies(low, high)
    middle = (low + high) / 2
    stopped, holed = latencies(low, middle), latencies(middle, high)
    down = [1 for _, tenant, s, _ in rows if int(tenant[1:]) % 3 == DOWN and low <= s < high]
    timed = sorted(
        (
            (float(s) - low, (float(a) - float(s)) * 1000)
            for _, tenant, s, a in rows
            if int(tenant[1:]) % 3 != DOWN and low <= s < high
        ),
        key=lambda pair: -pair[1],
    )
    buckets = [latencies(start, min(start + 5.0, high)) for start in _steps(low, high, 5.0)]
    return Run(
        kind=kind,
        sent=len(sent),
        applied=len(set(applied_ids)),
        lost=len(set(sent) - set(applied_ids)),
        twice=len(applied_ids) - len(set(applied_ids)),
        healthy_per_s=len(healthy) / (high - low),
        healthy_p99_ms=percentile(healthy, 0.99) if healthy else float("nan"),
        healthy_p50_ms=statistics.median(healthy) if healthy else float("nan"),
        healthy_p99_stopped_ms=percentile(stopped, 0.99) if stopped else float("nan"),
        healthy_p99_holed_ms=percentile(holed, 0.99) if holed else float("nan"),
        down_applied_in_window=len(down),
        healthy_p99_by_5s_ms=[
            round(percentile(b, 0.99), 1) if b else float("nan") for b in buckets
        ],
        healthy_slowest=[
            (round(t, 2), round(ms, 1)) for t, ms in timed[: max(1, len(timed) // 100)]
        ],
    )


def _steps(low: float, high: float, step: float) -> list[float]:
    starts = []
    while low < high:
        starts.append(low)
        low += step
    return starts


def ledger_rows(expected: int, deadline: float) -> list[tuple[str, str, float, float]]:
    """Every database's ledger, once it holds ``expected`` messages (or at ``deadline``:
    what is missing then is lost)."""
    rows: list[tuple[str, str, float, float]] = []
    while time.monotonic() < deadline:
        rows = []
        for port in PORTS:
            with psycopg.connect(url(port)) as conn:
                rows += conn.execute(
                    "SELECT message_id, tenant, sent_at, extract(epoch FROM applied_at) "
                    "FROM bench_ledger"
                ).fetchall()
        if len({r[0] for r in rows}) >= expected:
            break
        time.sleep(1)
    return rows


def connect_cost(samples: int = 200) -> dict[str, Any]:
    """Median and p95 of a cold connection (connect and close), in milliseconds."""

    def measure(target: str) -> dict[str, float]:
        times = []
        for _ in range(samples):
            began = time.perf_counter()
            psycopg.connect(target).close()
            times.append((time.perf_counter() - began) * 1000)
        return {"p50_ms": statistics.median(times), "p95_ms": percentile(times, 0.95)}

    return {
        "direct (a PostgreSQL backend start)": measure(
            f"postgresql://postgres@127.0.0.1:{PORTS[0]}/postgres"
        ),
        "through PgBouncer (6432)": measure("postgresql://postgres@127.0.0.1:6432/postgres"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tenants", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one pair, 10 s outages")
    parser.add_argument("--connect", action="store_true", help="the cold-connect cost only")
    parser.add_argument("--pairs", type=int, default=None)
    parser.add_argument("--outage", type=float, default=None, help="seconds of each outage")
    parser.add_argument("--rate", type=float, default=45.0, help="messages a second, in all")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--framework",
        choices=("dramatiq", "faststream", "both"),
        default="dramatiq",
        help="both: each pair on FastStream, then on Dramatiq, pair after pair",
    )
    args = parser.parse_args(argv)
    if args.connect:
        print(json.dumps(connect_cost(), indent=2))
        return
    pairs = args.pairs or (1 if args.quick else 3)
    outage = args.outage or (10.0 if args.quick else 60.0)
    frameworks = ("faststream", "dramatiq") if args.framework == "both" else (args.framework,)
    runs: dict[str, list[Run]] = {framework: [] for framework in frameworks}
    for number in range(pairs):
        for framework in frameworks:
            for kind in ("baseline", "outage"):
                run = one_run(
                    kind, args.rate, warmup=5.0, outage=outage, tail=5.0, framework=framework
                )
                runs[framework].append(run)
                print(
                    f"{framework} pair {number + 1} {kind}: {json.dumps(asdict(run))}", flush=True
                )
    summaries = [
        summary(framework, ran, args.rate, outage, pairs) for framework, ran in runs.items()
    ]
    for one in summaries:
        print(json.dumps(one, indent=2))
    if args.json:
        results = [
            {"runs": [asdict(r) for r in ran], **one}
            for ran, one in zip(runs.values(), summaries, strict=True)
        ]
        args.json.write_text(json.dumps(results[0] if len(results) == 1 else results, indent=2))


def _mean_ratio(broken: list[Run], baseline: list[Run], name: str) -> float:
    return statistics.mean(getattr(r, name) for r in broken) / statistics.mean(
        getattr(r, name) for r in baseline
    )


def summary(
    framework: str, runs: list[Run], rate: float, outage: float, pairs: int
) -> dict[str, Any]:
    baseline = [r for r in runs if r.kind == "baseline"]
    broken = [r for r in runs if r.kind == "outage"]
    return {
        "framework": framework,
        "rate": rate,
        "outage_s": outage,
        "pairs": pairs,
        "throughput_ratio": [
            o.healthy_per_s / b.healthy_per_s for b, o in zip(baseline, broken, strict=True)
        ],
        "p99_ratio": [
            o.healthy_p99_ms / b.healthy_p99_ms for b, o in zip(baseline, broken, strict=True)
        ],
        # Over the runs: the mean of the outage runs' figure over the baselines'. A single
        # pair's ratio also carries the baseline's own run-to-run spread.
        "throughput_ratio_over_runs": _mean_ratio(broken, baseline, "healthy_per_s"),
        "p99_ratio_over_runs": _mean_ratio(broken, baseline, "healthy_p99_ms"),
        "baseline_p99_spread": max(r.healthy_p99_ms for r in baseline)
        / min(r.healthy_p99_ms for r in baseline),
        "lost": sum(r.lost for r in runs),
        "twice": sum(r.twice for r in runs),
    }


if __name__ == "__main__":
    main()
