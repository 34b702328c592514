"""What every benchmark shares: the database, timing, statistics and results."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parents[1]
DATABASE = os.environ.get("BENCH_DATABASE", "inbox_bench")
PG = os.environ.get("BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432")
RABBITMQ = os.environ.get("BENCH_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672/%2F")
REDIS = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/14")
NATS = os.environ.get("BENCH_NATS", "nats://127.0.0.1:4222")
ACCOUNTS = 100

DDL = [
    "CREATE TABLE IF NOT EXISTS bench_accounts (id integer PRIMARY KEY, balance bigint NOT NULL)",
    # For the SELECT-then-INSERT mode: the dedup table most teams write by hand.
    "CREATE TABLE IF NOT EXISTS bench_seen (message_id text PRIMARY KEY)",
]


def sqlalchemy_url(driver: str = "psycopg") -> str:
    return f"{PG.replace('postgresql://', f'postgresql+{driver}://')}/{DATABASE}"


def admin() -> psycopg.Connection[Any]:
    return psycopg.connect(f"{PG}/{DATABASE}", autocommit=True)


def prepare_database() -> None:
    """Create the benchmark database, the inbox tables and the domain table."""
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone():
            conn.execute(f'CREATE DATABASE "{DATABASE}"')
    from sqlalchemy import create_engine

    from inbox_middleware._storage import migrate

    engine = create_engine(sqlalchemy_url())
    migrate(engine)
    engine.dispose()
    with admin() as conn:
        for statement in DDL:
            conn.execute(statement)


def reset_database() -> None:
    with admin() as conn:
        conn.execute(
            "TRUNCATE consumer_inbox, inbox_quarantine, inbox_claims, inbox_layout, bench_seen"
        )
        # The justonce peer's table, created by its store when that mode first runs.
        conn.execute(
            "DO $$ BEGIN IF to_regclass('justonce_keys') IS NOT NULL THEN "
            "TRUNCATE justonce_keys; END IF; END $$"
        )
        conn.execute("DELETE FROM bench_accounts")
        conn.execute(
            "INSERT INTO bench_accounts SELECT n, 0 FROM generate_series(1, %s) n", (ACCOUNTS,)
        )
        conn.execute("VACUUM ANALYZE bench_accounts")
        conn.execute("CHECKPOINT")


def applied() -> int:
    """Every handled first-seen message adds 1 to some balance."""
    with admin() as conn:
        row = conn.execute("SELECT coalesce(sum(balance), 0) FROM bench_accounts").fetchone()
    return int(row[0]) if row else 0


def wait_applied(
    expected: int, timeout: float, on_first: Callable[[], None] | None = None
) -> tuple[float, float]:
    """Poll until `expected` messages are applied; return (first seen, done) times.
    ``on_first`` is called as soon as the first one is seen."""
    deadline = time.monotonic() + timeout
    first = None
    with admin() as conn:
        while time.monotonic() < deadline:
            row = conn.execute("SELECT coalesce(sum(balance), 0) FROM bench_accounts").fetchone()
            count = int(row[0]) if row else 0
            now = time.monotonic()
            if count and first is None:
                first = now
                if on_first is not None:
                    on_first()
            if count >= expected:
                return first or now, now
            time.sleep(0.01)
    raise RuntimeError(f"only {applied()} of {expected} messages applied in {timeout}s")


def run_python(code: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` and every process below it, so far."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def backends(application: str) -> list[int]:
    """The server processes (backends) of the connections named ``application``."""
    with admin() as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (application,)
        ).fetchall()
    return [row[0] for row in rows]


def backend_cpu(pids: list[int]) -> dict[int, float] | None:
    """Each process's CPU seconds (user and system) so far, from ``/proc``; None where
    ``/proc`` does not show one (a server on another host)."""
    seconds = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        seconds[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def server_cpu(pids: list[int]) -> float | None:
    """The CPU seconds the processes ``pids`` have used together (None: not on this host,
    or no process)."""
    seconds = backend_cpu(pids)
    return sum(seconds.values()) if seconds else None


def spread(values: list[float]) -> dict[str, float]:
    """The median of ``values`` with its range: what a figure of this benchmark reports."""
    if not values:
        return {"median": float("nan"), "low": float("nan"), "high": float("nan")}
    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


@dataclass
class Measurement:
    """One benchmark figure: the median of its repetitions, with every repetition kept."""

    group: str
    mode: str
    unit: str
    runs: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    """CPU time of the worker's process tree per message, in µs, in each repetition."""
    server_cpu_us: list[float] = field(default_factory=list)
    """CPU time of the PostgreSQL server per message, in µs, in each repetition (where the
    run measured it: the server on this host)."""
    p50_ms: float | None = None
    p99_ms: float | None = None
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.runs) if self.runs else float("nan")


@dataclass
class Report:
    machine: dict[str, Any]
    settings: dict[str, Any]
    measurements: list[Measurement] = field(default_factory=list)
    ratios: dict[str, dict[str, Any]] = field(default_factory=dict)
    """name -> median, low and high of the ratio within each repetition, and the runs."""
    cpu: dict[str, dict[str, Any]] = field(default_factory=dict)
    """name -> median, low and high of a CPU figure (µs per message), and the runs."""

    def find(self, group: str, mode: str) -> Measurement:
        for measurement in self.measurements:
            if (measurement.group, measurement.mode) == (group, mode):
                return measurement
        raise KeyError((group, mode))

    def to_json(self) -> str:
        data = asdict(self)
        for item, measurement in zip(data["measurements"], self.measurements, strict=True):
            item["median"] = measurement.median
        return json.dumps(data, indent=2)


def machine() -> dict[str, Any]:
    import platform

    with admin() as conn:
        server = conn.execute("SHOW server_version").fetchone()
        sync = conn.execute("SHOW synchronous_commit").fetchone()
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "postgresql": server[0] if server else "?",
        "synchronous_commit": sync[0] if sync else "?",
        "platform": platform.platform(),
    }
