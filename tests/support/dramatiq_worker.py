"""Running an in-process Dramatiq worker against a real broker."""

from __future__ import annotations

import contextlib
import time
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
    """Wait until nothing is queued, delayed, unacked or in progress, twice in a row.

    A failed attempt's retry goes through the delay queue after the attempt finished,
    so one join is not enough; settle only when a whole round finds nothing to do. That
    round is the wait: RabbitMQ's join is asked for two empty counts 50 ms apart, not its
    default ten 100 ms apart (a second a join, two or more a drain, in most tests).
    """
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < 2:
        if time.monotonic() > deadline:
            raise AssertionError(f"queue {queue} did not drain in {timeout}s")
        if hasattr(broker, "dead_letters"):  # the stub broker re-raises failures unless told
            broker.join(queue, timeout=timeout * 1000, fail_fast=False)
        elif hasattr(broker, "get_queue_message_counts"):  # RabbitMQ
            broker.join(queue, min_successes=2, idle_time=50, timeout=timeout * 1000)
        else:
            broker.join(queue, timeout=timeout * 1000)
        worker.join()
        time.sleep(0.1)
        quiet = quiet + 1 if _pending(broker, queue, worker) == 0 else 0


def _pending(broker: dramatiq.Broker, queue: str, worker: dramatiq.Worker) -> int:
    in_worker = worker.work_queue.unfinished_tasks + sum(
        consumer.delay_queue.unfinished_tasks for consumer in worker.consumers.values()
    )
    if hasattr(broker, "do_qsize"):  # Redis: queued, delayed and unacked messages
        return in_worker + int(broker.do_qsize(queue))
    if hasattr(broker, "get_queue_message_counts"):  # RabbitMQ: queued and delayed
        return in_worker + sum(broker.get_queue_message_counts(queue)[:-1])
    return in_worker + broker.queues[queue].qsize() + broker.queues[f"{queue}.DQ"].qsize()
