"""32 concurrent deliveries of one message: how long until every one is settled.

Each round, 32 threads (32 connections) deliver the same intent through the inbox at
once; one claims and applies it, 31 wait on its claim and then find a duplicate. The
figure is the time from the start barrier to the last delivery settled.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import create_engine, text

from bench.common import percentile, reset_database, sqlalchemy_url
from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Decision, Delivery
from inbox_middleware._storage import Inbox

UPDATE = text("UPDATE bench_accounts SET balance = balance + 1 WHERE id = 1")


def settle_times(deliveries: int = 32, rounds: int = 20) -> tuple[float, float]:
    """p50 and p99, in ms, of the time until all `deliveries` copies are settled."""
    reset_database()
    engine = create_engine(sqlalchemy_url(), pool_size=deliveries)
    inbox = Inbox(engine, lock_timeout=30)
    run = uuid.uuid4().hex
    results = []
    with ThreadPoolExecutor(deliveries) as pool:
        for round_ in range(rounds + 1):
            barrier = threading.Barrier(deliveries)
            delivery = Delivery(
                "contention", MessageIdentity("bench", f"{run}-{round_}"), hash_json({}, "b")
            )

            def deliver(_: int, delivery: Delivery = delivery, barrier=barrier) -> Decision:
                barrier.wait()
                return inbox.process(delivery, lambda s: s.execute(UPDATE)).decision

            started = time.monotonic()
            decisions = list(pool.map(deliver, range(deliveries)))
            elapsed = time.monotonic() - started
            assert decisions.count(Decision.FIRST) == 1, decisions
            if round_:  # the first round warms the pool up
                results.append(elapsed)
    engine.dispose()
    return percentile(results, 0.5) * 1000, percentile(results, 0.99) * 1000
