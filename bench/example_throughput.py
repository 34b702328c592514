"""Messages per second through the example's Dramatiq worker, with and without the inbox.

    python -m bench.example_throughput [--messages 5000] [--broker amqp://...] [--reps 3]

Both modes run the same actor body in the same kind of transaction; the only difference
is the inbox (claim INSERT in the transaction). Modes alternate within one run and each
figure is the median of the repetitions. The worker is one `dramatiq` process with eight
threads; the clock starts at the first applied credit, so worker start-up is excluded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "dramatiq"
DATABASE = "inbox_bench"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--broker", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    args = parser.parse_args()

    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
        if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone():
            c.execute(f"CREATE DATABASE {DATABASE}")
    env = os.environ | {
        "DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:5432/{DATABASE}",
        "BROKER_URL": args.broker,
        "ACCOUNTS_QUEUE": "bench_accounts",
        "PYTHONPATH": str(EXAMPLE),
    }
    results: dict[str, list[float]] = {"unprotected": [], "service": []}
    for rep in range(args.reps):
        for module, rates in results.items():
            rate = run_once(module, args.messages, env)
            rates.append(rate)
            print(f"rep {rep + 1} {module:12s} {rate:8.0f} msg/s", flush=True)
    bare = statistics.median(results["unprotected"])
    inbox = statistics.median(results["service"])
    print(f"\nmedian of {args.reps}, {args.messages} messages each, 1 process x 8 threads:")
    print(f"  without the inbox {bare:8.0f} msg/s")
    print(f"  with the inbox    {inbox:8.0f} msg/s   ratio {inbox / bare:.2f}")


def run_once(module: str, messages: int, env: dict[str, str]) -> float:
    code = f"""
import sys
sys.path.insert(0, {str(EXAMPLE)!r})
from accounts import engine_from_env, reset_database
from inbox_middleware.dramatiq import identity
reset_database(engine_from_env(), 100)
import {module} as app
for n in range({messages}):
    app.add_credit.send_with_options(
        args=(n % 100 + 1, 1, f"order-{{n}}"), **identity(producer="bench", message_id=f"o-{{n}}")
    )
app.broker.close()
"""
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=EXAMPLE)
    worker = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", module, "--processes", "1", "--threads", "8"],
        env=env,
        cwd=EXAMPLE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{DATABASE}") as conn:
            conn.autocommit = True
            while count(conn) == 0:
                time.sleep(0.005)
            started, first = time.monotonic(), count(conn)
            while count(conn) < messages:
                time.sleep(0.02)
            return (messages - first) / (time.monotonic() - started)
    finally:
        worker.terminate()
        worker.wait(timeout=60)


def count(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM credits").fetchone()
    return int(row[0]) if row else 0


if __name__ == "__main__":
    main()
