"""What tracing costs: the executor's hot path with tracing off, on, and before it existed.

    python -m bench.tracing_overhead                          # off vs on
    python -m bench.tracing_overhead --baseline-src OLD/src   # and the code before tracing

``hotpath``: one process claims and commits sequential first-seen messages through
`Inbox.process` (psycopg, an empty handler), as `bench.metrics_overhead` does; metrics are
off in every mode, so the figure is the claim's own cost. ``tracing on`` wraps each
delivery in its span (an SDK ``TracerProvider`` without exporter: the spans are made,
sampled and ended, not sent), so the claim also writes its trace id. ``baseline`` runs
another copy of ``src`` (without the ``trace_id`` column in the INSERT).

``calls``: the tracing work of one first-seen message alone, exactly (``timeit``): with
tracing off, the hooks the executor calls (the claim's, the handler's, the commit's and
the claim's trace id); with it on, the same and the delivery's span: four spans.

Modes alternate within each repetition; every figure is the median of ``--reps``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from bench.common import ROOT, prepare_database, sqlalchemy_url
from bench.metrics_overhead import _truncate_inbox

HOT_PATH = """
import contextlib, json, time, uuid
from sqlalchemy import create_engine
from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Delivery
from inbox_middleware._storage import Inbox

engine = create_engine({url!r}, pool_size=1)
inbox = Inbox(engine)
tag = uuid.uuid4().hex[:8]
digest = hash_json({{"n": 1}}, "bench.v1")
if {traced}:
    from opentelemetry.sdk.trace import TracerProvider
    from inbox_middleware._observe.tracing import Tracing

    tracing = Tracing(TracerProvider())
    traced = lambda: tracing.delivery("bench-hot", None)
else:
    traced = contextlib.nullcontext


def handler(session):
    return None


def one(n):
    identity = MessageIdentity("bench", f"{{tag}}-{{n}}")
    with traced():
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
import contextlib, json, sys, timeit
from inbox_middleware._observe import tracing
from inbox_middleware._core.protocol import Decision, Verdict

if sys.argv[1] == "on":
    from opentelemetry.sdk.trace import TracerProvider

    traced = tracing.Tracing(TracerProvider())
    delivery = lambda: traced.delivery("bench", None)
else:
    delivery = contextlib.nullcontext
verdict = Verdict(Decision.FIRST)


def claim_steps():
    yield "Claim"
    return verdict


def one():  # the hooks of one first-seen message: the delivery, claim, handler, commit
    with delivery():
        with tracing.claim(1) as claim:
            steps = claim.steps(claim_steps())
            next(steps)
            with contextlib.suppress(StopIteration):
                steps.send(True)
        tracing.trace_id()
        with tracing.phase("inbox.handler"):
            pass
        with tracing.phase("inbox.commit"):
            pass


one()
best = min(timeit.repeat(one, number=20000, repeat=7)) / 20000 * 1e6
print(json.dumps(best))
"""


def hot_path(src: str | None, traced: bool, messages: int) -> tuple[float, float]:
    chunks = 10
    env = os.environ | {"INBOX_PROMETHEUS_METRICS": "0", "INBOX_OTEL_METRICS": "0"}
    if src is not None:
        env["PYTHONPATH"] = src
    size = max(1, messages // chunks)
    code = HOT_PATH.format(url=sqlalchemy_url(), chunks=chunks, size=size, traced=traced)
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=ROOT, env=env, capture_output=True, text=True
    ).stdout
    wall, cpu = json.loads(out)
    return statistics.median(wall), statistics.median(cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tracing_overhead")
    parser.add_argument("--hot-messages", type=int, default=4000, help="per hot-path run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--baseline-src", default=None, help="another copy of src to compare")
    args = parser.parse_args(argv)
    prepare_database()
    results: dict[str, Any] = {}
    for mode in ("off", "on"):
        out = subprocess.run(
            [sys.executable, "-c", CALLS, mode],
            check=True,
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout
        results[f"hooks_{mode}_us"] = json.loads(out)
        print(f"tracing work per message, tracing {mode}: {json.loads(out):.2f} µs")
    modes: dict[str, tuple[str | None, bool]] = {"tracing off": (None, False)}
    modes["tracing on"] = (None, True)
    if args.baseline_src:
        modes = {"baseline": (args.baseline_src, False), **modes}
    wall: dict[str, list[float]] = {mode: [] for mode in modes}
    cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    _truncate_inbox()
    for _ in range(args.reps):
        for mode, (src, traced) in modes.items():
            took, used = hot_path(src, traced, args.hot_messages)
            wall[mode].append(took)
            cpu[mode].append(used)
            _truncate_inbox()
    for title, runs in (("client CPU", cpu), ("wall clock", wall)):
        print(f"claim hot path, {title} (µs per message, median of {args.reps})")
        for mode, values in runs.items():
            shown = " ".join(f"{v:.1f}" for v in values)
            print(f"  {mode:12s} {statistics.median(values):8.1f}   runs: {shown}")
    results |= {"hotpath_wall_us": wall, "hotpath_cpu_us": cpu}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
