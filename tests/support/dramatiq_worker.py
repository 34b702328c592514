"""Running an in-process Dramatiq worker against a real broker."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import dramatiq


@contextlib.contextmanager
def running_worker(broker: dramatiq.Broker, threads: int = 4) -> Iterator[dramatiq.Worker]:
    worker = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=50)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


def drain(broker: dramatiq.Broker, queue: str, worker: dramatiq.Worker, timeout: int = 30) -> None:
    """Wait until the queue (and its delay queue) is empty and the worker idle."""
    broker.join(queue, timeout=timeout * 1000)
    worker.join()

