"""Messages per second through the FastStream example, with and without the inbox.

    python -m bench.faststream_example_throughput [--messages 5000] [--reps 3]

Both modes run the same handler body in the same kind of transaction on RabbitMQ, with
the same prefetch and connection pool; the only difference is the inbox (the claim INSERT
in the transaction, the ack after the commit). Messages are published persistent before
the worker starts; modes alternate within one run and each figure is the median of the
repetitions. The worker is one ``faststream run`` process; the clock starts at the first
applied credit, so worker start-up is excluded.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "faststream"
DATABASE = "inbox_bench_faststream"
BROKER = "amqp://guest:guest@127.0.0.1:5672/%2F"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    sys.path.insert(0, str(EXAMPLE))
    os.environ |= {
        "DATABASE_URL": f"postgresql+asyncpg://postgres@127.0.0.1:5432/{DATABASE}",
        "BROKER_URL": BROKER,
        "ACCOUNTS_QUEUE": f"bench-accounts-{uuid.uuid4().hex[:8]}",
        "PYTHONPATH": str(EXAMPLE),
    }
    asyncio.run(create_database())
    results: dict[str, list[float]] = {"unprotected": [], "service": []}
    for rep in range(args.reps):
        for module, rates in results.items():
            rate = asyncio.run(run_once(module, args.messages))
            rates.append(rate)
            print(f"rep {rep + 1} {module:12s} {rate:8.0f} msg/s", flush=True)
    bare = statistics.median(results["unprotected"])
    inbox = statistics.median(results["service"])
    print(f"\nmedian of {args.reps}, {args.messages} messages each, 1 process, prefetch 16:")
    print(f"  without the inbox {bare:8.0f} msg/s")
    print(f"  with the inbox    {inbox:8.0f} msg/s   ratio {inbox / bare:.2f}")


async def create_database() -> None:
    import asyncpg

    admin = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/postgres")
    try:
        if not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", DATABASE):
            await admin.execute(f'CREATE DATABASE "{DATABASE}"')
    finally:
        await admin.close()


async def run_once(module: str, messages: int) -> float:
    from accounts import QUEUE, engine_from_env, reset_database
    from faststream.rabbit import RabbitBroker, RabbitQueue
    from sqlalchemy import text

    from inbox_middleware.faststream import identity_headers

    engine = engine_from_env()
    await reset_database(engine, 100)
    broker = RabbitBroker(BROKER)
    async with broker:
        await broker.declare_queue(RabbitQueue(QUEUE, durable=True))
        for n in range(messages):
            order = {"account_id": n % 100 + 1, "amount": 1, "order_id": f"order-{n}"}
            headers = identity_headers(producer="bench", message_id=f"o-{n}")
            await broker.publish(order, QUEUE, headers=headers, persist=True)
    worker = subprocess.Popen(
        [sys.executable, "-m", "faststream", "run", f"{module}:app"],
        cwd=EXAMPLE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    async def count() -> int:
        async with engine.connect() as conn:
            return int(await conn.scalar(text("SELECT count(*) FROM credits")) or 0)

    try:
        while await count() == 0:
            await asyncio.sleep(0.005)
        started, first = time.monotonic(), await count()
        while await count() < messages:
            await asyncio.sleep(0.02)
        return (messages - first) / (time.monotonic() - started)
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        async with broker:
            channel = await broker._connection.channel()
            for name in (QUEUE, f"{QUEUE}.quarantine", f"{QUEUE}.dead-letter"):
                await channel.queue_delete(name)
        await engine.dispose()


if __name__ == "__main__":
    main()
