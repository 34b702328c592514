"""The driver-level limit: what the database and psycopg allow the worker's transaction.

No framework, no SQLAlchemy, no inbox: `threads` threads (the Dramatiq worker's 8), each
with its own psycopg connection, run the worker's transaction in a loop, with the claim
(BEGIN; INSERT claim; UPDATE account; COMMIT) or without it (BEGIN; UPDATE; COMMIT). The
ratio of the two is what the claim costs where nothing else is paid: the ratio the inbox
reaches in the worker (inbox / bare) is read against it.
"""

from __future__ import annotations

import threading
import time
import uuid

import psycopg

from bench.common import DATABASE, PG, reset_database

CLAIM = (
    "INSERT INTO consumer_inbox (consumer_name, producer_name, tenant, message_id, "
    "payload_sha256, hash_scheme, handler_version, received_at) "
    "VALUES ('limit', 'bench', '', %s, %s, 'bench', '', now()) "
    "ON CONFLICT DO NOTHING RETURNING 1"
)
UPDATE = "UPDATE bench_accounts SET balance = balance + 1 WHERE id = %s"
MODES = {"update only": False, "claim + update": True}


def throughput(claim: bool, threads: int = 8, seconds: float = 3.0) -> float:
    """Transactions a second, each with the claim or without it."""
    reset_database()
    run = uuid.uuid4().hex
    connections = [psycopg.connect(f"{PG}/{DATABASE}") for _ in range(threads)]
    counts = [0] * threads
    start = threading.Barrier(threads + 1)
    stop = time.monotonic() + seconds + 0.5

    def loop(index: int) -> None:
        conn, n = connections[index], 0
        start.wait()
        while time.monotonic() < stop:
            with conn.transaction():
                if claim:
                    conn.execute(CLAIM, (f"{run}-{index}-{n}", "0" * 64))
                conn.execute(UPDATE, (n % 100 + 1,))
            n += 1
        counts[index] = n

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    start.wait()
    began = time.monotonic()
    for worker in workers:
        worker.join()
    elapsed = time.monotonic() - began
    for conn in connections:
        conn.close()
    return sum(counts) / elapsed
