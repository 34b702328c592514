"""FastStream: bare versus inbox async handlers on RabbitMQ, the empty-handler ceiling,
and the batch claim against one claim per message on NATS JetStream.

Messages are published before the worker (one `faststream run` process) starts; the clock
runs from the first applied message to the last. The empty handler's rate is measured
from the queue draining instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from typing import Any

from bench.common import (
    NATS,
    RABBITMQ,
    ROOT,
    backend_cpu,
    backends,
    cpu_seconds,
    reset_database,
    wait_applied,
)

RABBIT_MODES = ["bare", "inbox", "floor", "floor_sync", "empty"]
RESULT_MODES = ["bare_result", "inbox_result"]
"""A handler whose result is published: the inbox stores it with the claim."""
BATCH_MODES = ["inbox, per message, same broker", "inbox, batch"]
WORKER_ARGUMENTS = ("-m", "faststream", "run", "bench.faststream_worker:app")
"""The benchmark's FastStream worker, as arguments to the Python interpreter."""
WORKER_APPLICATION = "bench-faststream-"
"""The worker's connections' application_name, before its mode (their server CPU)."""


def run(report: Any, messages: int, reps: int, measure: Any) -> None:
    measure(report, "faststream", RABBIT_MODES, reps, lambda mode: throughput(mode, messages))
    measure(report, "faststream", RESULT_MODES, reps, lambda mode: throughput(mode, messages))
    measure(
        report,
        "faststream",
        BATCH_MODES,
        reps,
        lambda mode: throughput(
            "nats_batch" if "batch" in mode and "per" not in mode else "nats_inbox", messages
        ),
    )


def throughput(mode: str, messages: int) -> float:
    queue = f"benchfs{mode.replace('_', '')}"
    reset_database()
    asyncio.run(_prepare(mode, queue, messages))
    env = os.environ | {"BENCH_MODE": mode, "BENCH_QUEUE": queue}
    worker = subprocess.Popen(
        [sys.executable, *WORKER_ARGUMENTS],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    cpu: list[tuple[float, dict[int, float] | None]] = []

    def sample() -> None:
        # The worker's process and the server's backends of its connections (a backend
        # the pool opens later counts from zero: it started within the window)
        cpu.append((cpu_seconds(worker.pid), backend_cpu(backends(WORKER_APPLICATION + mode))))

    try:
        if mode == "empty":
            first, done = asyncio.run(_drained(queue, messages))
        else:
            first, done = wait_applied(messages, timeout=600, on_first=sample)
            sample()
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        asyncio.run(_cleanup(mode, queue))
    # The first applied message is counted as the start, so one fewer is timed.
    rate = (messages - 1) / max(done - first, 1e-6)
    if len(cpu) < 2:
        return rate
    (worker_start, server_start), (worker_end, server_end) = cpu[0], cpu[-1]
    worker_us = (worker_end - worker_start) / (messages - 1) * 1e6
    if server_start is None or not server_end:
        return rate, worker_us
    server = sum(end - server_start.get(pid, 0.0) for pid, end in server_end.items())
    return rate, worker_us, server / (messages - 1) * 1e6


async def _prepare(mode: str, queue: str, messages: int) -> None:
    from inbox_middleware.faststream import identity_headers

    await _cleanup(mode, queue)
    tag = time.monotonic_ns()
    if mode.startswith("nats"):
        import nats

        client = await nats.connect(NATS)
        try:
            js = client.jetstream()
            await js.add_stream(name=queue.upper(), subjects=[queue])
            for n in range(messages):
                headers = identity_headers(producer="bench", message_id=f"{tag}-{n}")
                headers["content-type"] = "application/json"
                await js.publish(queue, f'{{"account": {n % 100 + 1}}}'.encode(), headers=headers)
        finally:
            await client.close()
        return
    from faststream.rabbit import RabbitBroker, RabbitQueue

    async with RabbitBroker(RABBITMQ) as broker:
        await broker.declare_queue(RabbitQueue(queue, durable=True))
        for n in range(messages):
            headers = identity_headers(producer="bench", message_id=f"{tag}-{n}")
            await broker.publish({"account": n % 100 + 1}, queue, headers=headers, persist=True)


async def _drained(queue: str, messages: int) -> tuple[float, float]:
    import aio_pika

    connection = await aio_pika.connect(RABBITMQ)
    first = None
    try:
        channel = await connection.channel()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            declared = await channel.declare_queue(queue, passive=True)
            ready = int(declared.declaration_result.message_count or 0)
            now = time.monotonic()
            if first is None and ready < messages:
                first = now
            if ready == 0:
                return first or now, now
            await asyncio.sleep(0.01)
    finally:
        await connection.close()
    raise RuntimeError("the queue did not drain")


async def _cleanup(mode: str, queue: str) -> None:
    if mode.startswith("nats"):
        import nats
        from nats.js.errors import NotFoundError

        client = await nats.connect(NATS)
        try:
            for stream in (queue.upper(), f"{queue.upper()}_INBOX"):
                with contextlib.suppress(NotFoundError):
                    await client.jetstream().delete_stream(stream)
        finally:
            await client.close()
        return
    import aio_pika

    connection = await aio_pika.connect(RABBITMQ)
    try:
        channel = await connection.channel()
        for name in (queue, f"{queue}.quarantine", f"{queue}.dead-letter", f"{queue}.out"):
            await channel.queue_delete(name)
    finally:
        await connection.close()
