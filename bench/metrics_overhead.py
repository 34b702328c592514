"""What the metrics cost: the executor's hot path, and Dramatiq throughput, with and without.

    python -m bench.metrics_overhead                       # both parts, metrics off vs on
    python -m bench.metrics_overhead --only hotpath --baseline-src OLD/src

``hotpath``: one process claims and commits sequential first-seen messages through
`Inbox.process` (psycopg, an empty handler), so the figure is the executor's own cost per
message plus one round trip and one commit. ``--baseline-src`` adds a column for another
copy of the library's ``src`` folder (the code before a change), run the same way.

``calls``: the work the executor adds per message, alone and exactly (``timeit``): three
clock reads and the claim, commit and decision records, with metrics off, on, and on in
multiprocess mode; the hot path's noise (a commit waits for the disk) hides a cost this
small, so this is the figure to compare with its CPU time per message.

``throughput``: the `bench.dramatiq_bench` throughput run (one RabbitMQ worker process,
8 threads) with metrics off, on in-process, and on in Prometheus multiprocess mode (the
deployed configuration: every worker writes its samples to ``PROMETHEUS_MULTIPROC_DIR``).

Modes alternate within each repetition so that a noisy machine affects them alike; every
figure is the median of ``--reps``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from bench.common import ROOT, prepare_database, sqlalchemy_url

HOT_PATH = """
import json, sys, time, uuid
from sqlalchemy import create_engine
from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Delivery
from inbox_middleware._storage import Inbox

engine = create_engine({url!r}, pool_size=1)
inbox = Inbox(engine)
tag = uuid.uuid4().hex[:8]
digest = hash_json({{"n": 1}}, "bench.v1")


def handler(session):
    return None


def one(n):
    identity = MessageIdentity("bench", f"{{tag}}-{{n}}")
    inbox.process(Delivery("bench-hot", identity, digest), handler)


for n in range(200):  # warm up: connection, compiled statements
    one(-n - 1)
wall, cpu = [], []
for chunk in range({chunks}):
    start, start_cpu = time.perf_counter(), time.process_time()
    for n in range(chunk * {size}, (chunk + 1) * {size}):
        one(n)
    wall.append((time.perf_counter() - start) / {size} * 1e6)
    cpu.append((time.process_time() - start_cpu) / {size} * 1e6)
engine.dispose()
print(json.dumps([wall, cpu]))
"""


CALLS = """
import json, timeit
from time import perf_counter
from inbox_middleware._operate.metrics import metrics


def one():  # what Inbox._run and _Single.committed add to one first-seen message
    clock = perf_counter()
    metrics.claim_seconds("bench-calls", perf_counter() - clock)
    clock = perf_counter()
    metrics.commit_seconds("bench-calls", perf_counter() - clock)
    metrics.decision("bench-calls", "bench", "first", False)


one()
best = min(timeit.repeat(one, number=20000, repeat=7)) / 20000 * 1e6
print(json.dumps(best))
"""


def calls() -> dict[str, float]:
    """Microseconds the executor's metrics work adds per message, by mode."""
    found = {}
    for mode, env in {
        "metrics off": {"INBOX_PROMETHEUS_METRICS": "0"},
        "metrics on": {"INBOX_PROMETHEUS_METRICS": "1"},
        "multiprocess": {"INBOX_PROMETHEUS_METRICS": "1", _DIR: tempfile.mkdtemp()},
    }.items():
        base = {k: v for k, v in os.environ.items() if k != _DIR}
        out = subprocess.run(
            [sys.executable, "-c", CALLS],
            check=True,
            cwd=ROOT,
            env=base | env,
            capture_output=True,
            text=True,
        ).stdout
        found[mode] = json.loads(out)
        if _DIR in env:
            shutil.rmtree(env[_DIR], ignore_errors=True)
    return found


def hot_path(src: str | None, metrics: bool, messages: int) -> tuple[float, float]:
    """Median wall-clock and CPU microseconds per message over chunks of one run, in a
    fresh process. CPU time is the client's own cost; wall-clock adds the database's."""
    chunks = 10
    env = os.environ | {"INBOX_PROMETHEUS_METRICS": "1" if metrics else "0"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if src is not None:
        env["PYTHONPATH"] = src
    code = HOT_PATH.format(url=sqlalchemy_url(), chunks=chunks, size=max(1, messages // chunks))
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=ROOT, env=env, capture_output=True, text=True
    ).stdout
    wall, cpu = json.loads(out)
    return statistics.median(wall), statistics.median(cpu)


def run_hot_path(
    messages: int, reps: int, baseline: str | None
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    modes: dict[str, tuple[str | None, bool]] = {
        "metrics off": (None, False),
        "metrics on": (None, True),
    }
    if baseline:
        modes = {"baseline": (baseline, True), **modes}
    wall: dict[str, list[float]] = {mode: [] for mode in modes}
    cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    _truncate_inbox()
    for _ in range(reps):
        for mode, (src, on) in modes.items():
            took, used = hot_path(src, on, messages)
            wall[mode].append(took)
            cpu[mode].append(used)
            _truncate_inbox()
    return wall, cpu


def run_throughput(messages: int, reps: int) -> dict[str, list[float]]:
    from bench.dramatiq_bench import throughput

    runs: dict[str, list[float]] = {"metrics off": [], "metrics on": [], "multiprocess": []}
    saved = {name: os.environ.get(name) for name in ("INBOX_PROMETHEUS_METRICS", _DIR)}
    try:
        for _ in range(reps):
            for mode, values in runs.items():
                folder = tempfile.mkdtemp(prefix="bench-prometheus-")
                os.environ["INBOX_PROMETHEUS_METRICS"] = "0" if mode == "metrics off" else "1"
                os.environ.pop(_DIR, None)
                if mode == "multiprocess":
                    os.environ[_DIR] = folder
                try:
                    values.append(throughput("inbox", messages))
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return runs


_DIR = "PROMETHEUS_MULTIPROC_DIR"


def _truncate_inbox() -> None:
    from bench.common import admin

    with admin() as conn:
        conn.execute("TRUNCATE consumer_inbox")


def render(title: str, unit: str, runs: dict[str, list[float]], *, higher: bool) -> str:
    reference = statistics.median(runs["metrics off"])
    lines = [f"{title} ({unit}, median of {len(next(iter(runs.values())))})"]
    for mode, values in runs.items():
        median = statistics.median(values)
        change = (median / reference - 1) * 100
        shown = " ".join(f"{v:.1f}" for v in values)
        lines.append(f"  {mode:14s} {median:10.1f}  {change:+6.1f}% vs off   runs: {shown}")
    lines.append(f"  ({'higher' if higher else 'lower'} is better)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.metrics_overhead")
    parser.add_argument("--only", default="calls,hotpath,throughput")
    parser.add_argument("--messages", type=int, default=3000, help="per throughput run")
    parser.add_argument("--hot-messages", type=int, default=4000, help="per hot-path run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--baseline-src", default=None, help="another copy of src to compare")
    args = parser.parse_args(argv)
    parts = args.only.split(",")
    prepare_database()
    results: dict[str, Any] = {}
    if "calls" in parts:
        results["calls_us"] = calls()
        print("metrics work added per message (µs, best of 7 x 20000):")
        for mode, value in results["calls_us"].items():
            print(f"  {mode:14s} {value:8.2f}")
    if "hotpath" in parts:
        wall, cpu = run_hot_path(args.hot_messages, args.reps, args.baseline_src)
        results["hotpath_wall_us"], results["hotpath_cpu_us"] = wall, cpu
        print(render("executor hot path, client CPU", "µs per message", cpu, higher=False))
        print(render("executor hot path, wall clock", "µs per message", wall, higher=False))
    if "throughput" in parts:
        results["throughput"] = run_throughput(args.messages, args.reps)
        print(render("dramatiq throughput", "messages/s", results["throughput"], higher=True))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
