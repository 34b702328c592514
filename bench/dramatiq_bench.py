"""Dramatiq on RabbitMQ: throughput and latency of each dedup mode, side by side.

Throughput: N messages are enqueued first, then one worker process (8 threads) drains
them; the clock runs from the first applied message to the last, so start-up is excluded.
Latency: a second pass sends messages at a fixed pace to a warm worker and records, for
each one, the time from send to commit.
"""

from __future__ import annotations

import bisect
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import ROOT, applied, cpu_seconds, percentile, reset_database, wait_applied

SEND = """
import sys, time
sys.argv = ["bench"]
from bench.dramatiq_bench import intents
from bench.dramatiq_worker import credit, broker
from inbox_middleware.dramatiq import identity
total, unique, pace = {total}, {unique}, {pace}
start = time.monotonic()
for n, intent in enumerate(intents(total, unique)):
    if pace:
        delay = start + n / pace - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    credit.send_with_options(
        args=(intent % 100 + 1, 0.0 if not pace else time.time()),
        **identity(producer="bench", message_id=f"{{tag}}-{{intent}}"),
    )
broker.close()
"""


def intents(total: int, unique: int, gap: int = 64) -> list[int]:
    """The intent of each of ``total`` messages, ``unique`` of them first seen.

    The first-seen messages are spread evenly, the last of them near the end, so the clock
    (which stops when every intent is applied) runs over the duplicates too; a duplicate
    repeats an intent first sent at least ``gap`` messages earlier (once there is one), so
    that it meets a committed claim rather than one still in flight."""
    firsts = {(i * total) // unique: i for i in range(unique)}
    sequence: list[int] = []
    first_at: list[int] = []
    pick = random.Random(total * 31 + unique)
    for n in range(total):
        if n in firsts:
            sequence.append(firsts[n])
            first_at.append(n)
            continue
        old = bisect.bisect_right(first_at, n - gap)
        sequence.append(pick.randrange(old) if old else sequence[first_at[-1]])
    return sequence


def worker_arguments(processes: int = 1, threads: int = 8) -> list[str]:
    """The benchmark's Dramatiq worker, as arguments to the Python interpreter."""
    counts = ["--processes", str(processes), "--threads", str(threads)]
    return ["-m", "dramatiq", "bench.dramatiq_worker", *counts]


class Worker:
    def __init__(self, mode: str, queue: str, processes: int = 1, threads: int = 8) -> None:
        self.latency_dir = Path(tempfile.mkdtemp(prefix="bench-latency-"))
        env = os.environ | {
            "BENCH_MODE": mode,
            "BENCH_QUEUE": queue,
            "BENCH_LATENCY_DIR": str(self.latency_dir),
            "BENCH_POOL": str(threads + 2),
        }
        self.proc = subprocess.Popen(
            [sys.executable, *worker_arguments(processes, threads)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def stop(self) -> list[float]:
        # SIGTERM to the main process only: it forwards one to each worker process, and a
        # second one would make a worker exit at once, skipping its shutdown hooks.
        self.proc.terminate()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        return [float(v) for f in self.latency_dir.glob("*.txt") for v in f.read_text().split()]


def send(mode: str, queue: str, total: int, unique: int, pace: float = 0.0) -> None:
    tag = f"{queue}-{time.monotonic_ns()}"
    code = SEND.format(total=total, unique=unique, pace=pace).replace("{tag}", tag)
    env = os.environ | {"BENCH_MODE": mode, "BENCH_QUEUE": queue}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)


def throughput(
    mode: str, messages: int, *, duplicates: float = 0.0, processes: int = 1, threads: int = 8
) -> tuple[float, float]:
    """Messages per second draining `messages` deliveries, `duplicates` of them copies, and
    the worker's CPU time per message in µs (its process tree, user and system, over the
    same interval: from the first applied message to the last)."""
    queue = f"bench_{mode}"
    unique = max(1, round(messages * (1 - duplicates)))
    reset_database()
    _purge(queue)
    send(mode, queue, messages, unique)
    expected = messages if mode == "bare" else unique
    worker = Worker(mode, queue, processes, threads)
    cpu: list[float] = []
    try:

        def sample() -> None:
            cpu.append(cpu_seconds(worker.proc.pid))

        if mode == "empty":
            first, done = _drained(queue, messages, sample)
        else:
            first, done = wait_applied(expected, timeout=600, on_first=sample)
        sample()
    finally:
        worker.stop()
    # The first applied message is counted as the start, so one fewer is timed.
    handled = messages if duplicates else expected
    return (handled - 1) / max(done - first, 1e-6), (cpu[1] - cpu[0]) / (handled - 1) * 1e6


def latency(mode: str, messages: int, pace: float) -> tuple[float, float]:
    """p50 and p99 send-to-commit latency, in ms, at `pace` messages per second."""
    queue = f"bench_{mode}_latency"
    reset_database()
    _purge(queue)
    worker = Worker(mode, queue)
    try:
        send(mode, queue, 1, 1, pace=1)  # warm up: the worker is connected and ready
        wait_applied(1, timeout=60) if mode != "empty" else time.sleep(3)
        base = applied()
        send(mode, queue, messages, messages, pace=pace)
        if mode != "empty":
            wait_applied(base + messages, timeout=600)
        else:
            time.sleep(2)
    finally:
        values = worker.stop()
    values = values[1:] if len(values) > 1 else values
    return percentile(values, 0.5) * 1000, percentile(values, 0.99) * 1000


def _purge(queue: str) -> None:
    import pika

    from bench.common import RABBITMQ

    connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ))
    channel = connection.channel()
    for name in (queue, f"{queue}.DQ", f"{queue}.XQ", f"{queue}.quarantine"):
        channel.queue_delete(name)
    connection.close()


def _drained(queue: str, messages: int, on_first: Callable[[], None]) -> tuple[float, float]:
    import pika

    from bench.common import RABBITMQ

    connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ))
    channel = connection.channel()
    first = None
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            ready = channel.queue_declare(queue, passive=True).method.message_count
            now = time.monotonic()
            if first is None and ready < messages:
                first = now
                on_first()
            if ready == 0:
                return first or now, now
            time.sleep(0.01)
    finally:
        connection.close()
    raise RuntimeError("the queue did not drain")
