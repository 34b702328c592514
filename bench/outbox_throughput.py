"""Effects per second through the outbox dispatcher, with one and with two dispatchers.

    python -m bench.outbox_throughput [--effects 5000] [--reps 3] [--latency-ms 0]

Each run records the effects, makes them all due at one instant a few seconds ahead,
starts one or two ``inbox-middleware outbox run`` processes (already polling when the
effects fall due), and measures from that instant to the last recorded outcome. The
destination does no I/O (or sleeps ``--latency-ms``), so the figure is the dispatcher's
own cost: lease, deliver, settle. The two modes alternate within one run; each figure is
the median of the repetitions.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from inbox_middleware import outbox
from inbox_middleware._storage import migrate
from inbox_middleware.outbox import Destinations, Effect

ROOT = Path(__file__).resolve().parents[1]
DATABASE = "inbox_bench_outbox"
SERVER = "postgresql://postgres@127.0.0.1:5432"


class Sink:
    """A destination that accepts everything, after an optional simulated latency."""

    def __init__(self, latency: float) -> None:
        self.latency = latency

    async def deliver(self, effect: Effect, timeout: float) -> Any:
        if self.latency:
            await asyncio.sleep(self.latency)
        return None


def destinations() -> Destinations:
    return Destinations({"sink": Sink(float(os.environ.get("BENCH_LATENCY_MS", "0")) / 1000)})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--effects", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    args = parser.parse_args()

    with psycopg.connect(f"{SERVER}/postgres", autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DATABASE}")
        admin.execute(f"CREATE DATABASE {DATABASE}")
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{DATABASE}"
    engine = create_engine(url)
    migrate(engine)
    rates: dict[int, list[float]] = {1: [], 2: []}
    try:
        for rep in range(args.reps):
            for dispatchers, found in rates.items():
                rate = run_once(engine, url, dispatchers, args)
                found.append(rate)
                print(
                    f"rep {rep + 1}  {dispatchers} dispatcher(s)  {rate:8.0f} effects/s", flush=True
                )
    finally:
        engine.dispose()
    one, two = (statistics.median(rates[n]) for n in (1, 2))
    print(
        f"\nmedian of {args.reps}, {args.effects} effects each, batch {args.batch_size}, "
        f"destination latency {args.latency_ms:g} ms:"
    )
    print(f"  one dispatcher   {one:8.0f} effects/s")
    print(f"  two dispatchers  {two:8.0f} effects/s   ratio {two / one:.2f}")


def run_once(engine: Any, url: str, dispatchers: int, args: argparse.Namespace) -> float:
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE message_outbox"))
    with Session(engine) as session, session.begin():
        for n in range(args.effects):
            outbox.add(session, destination="sink", payload={"n": n}, effect_id=f"bench-{n}")
    with engine.begin() as conn:
        due = conn.scalar(
            text(
                "UPDATE message_outbox SET next_attempt_at = now() + interval '4 seconds' "
                "RETURNING next_attempt_at"
            )
        )
    command = [
        sys.executable,
        "-c",
        "from inbox_middleware.cli import run; run()",
        "outbox",
        "run",
        "--database-url",
        url,
        "--destinations",
        "bench.outbox_throughput:destinations",
        "--batch-size",
        str(args.batch_size),
        "--poll-interval",
        "0.02",
    ]
    env = os.environ | {"BENCH_LATENCY_MS": str(args.latency_ms)}
    processes = [
        subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        for _ in range(dispatchers)
    ]
    try:
        deadline = time.monotonic() + 300
        while pending(engine) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=60)
    with engine.connect() as conn:
        done, last = conn.execute(
            text(
                "SELECT count(*), max(dispatched_at) FROM message_outbox "
                "WHERE status = 'dispatched'"
            )
        ).one()
    if done != args.effects:
        raise SystemExit(f"only {done} of {args.effects} effects were dispatched")
    return float(done / (last - due).total_seconds())


def pending(engine: Any) -> int:
    with engine.connect() as conn:
        return int(
            conn.scalar(text("SELECT count(*) FROM message_outbox WHERE status <> 'dispatched'"))
        )


if __name__ == "__main__":
    main()
