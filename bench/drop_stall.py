"""What dropping a table costs the commits beside it, by the table's size.

    python -m bench.drop_stall                     # 700 MB against 700/24 MB, 3 rounds
    python -m bench.drop_stall --megabytes 850 --pieces 24 --rounds 5 --rate 2000
    python -m bench.drop_stall --server postgresql://postgres@127.0.0.1:5470

A purge that drops partitions removes their files at once: PostgreSQL unlinks a dropped
table's files when the DROP commits, and the file system frees their blocks. This
benchmark tells that cost apart from anything a partitioned claims table does: its table
is a plain one, unrelated to the load. Eight connections run small transactions (an
INSERT of a new UUID key and an UPDATE of one of 100 rows, committed: a claim's shape) at
a fixed rate; in 6-second windows, a second after each starts, either nothing happens,
or a table of ``--megabytes`` is dropped, or a table of ``--megabytes / --pieces`` (the
same rows split as a partition an hour would split a day's) is dropped. Each window
reports the transactions' p50, p99, the longest, and how many took over 20 ms.

The tables are made and checkpointed before the window, so the window holds the DROP
alone. On a file system that discards freed blocks as it frees them (ext4 mounted with
``discard``), the large file's discard holds the WAL's flush, and with it every commit,
for tens of milliseconds; a small one's goes unnoticed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import uuid
from typing import Any

import psycopg

from bench.common import PG, percentile

DATABASE = "inbox_drop_stall"
WINDOW = 6.0
SLOW_MS = 20.0
ROW_BYTES = 240
"""About what a row of the dropped tables takes on disk (200 characters and a number)."""


def _url(server: str, database: str) -> str:
    return f"{server}/{database}"


def _prepare(server: str) -> None:
    with psycopg.connect(_url(server, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{DATABASE}"')
    with psycopg.connect(_url(server, DATABASE), autocommit=True) as conn:
        conn.execute("CREATE TABLE claims (id uuid PRIMARY KEY, at timestamptz DEFAULT now())")
        conn.execute("CREATE TABLE accounts (id integer PRIMARY KEY, balance bigint)")
        conn.execute("INSERT INTO accounts SELECT n, 0 FROM generate_series(1, 100) n")


def _make(server: str, name: str, megabytes: float) -> None:
    rows = int(megabytes * 1024 * 1024 / ROW_BYTES)
    with psycopg.connect(_url(server, DATABASE), autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {name}")
        conn.execute(
            f"CREATE TABLE {name} AS SELECT n, repeat('x', 200) AS v"
            f" FROM generate_series(1, {rows}) n"
        )
        conn.execute("CHECKPOINT")


def window(server: str, rate: float, threads: int, drop: str | None) -> dict[str, Any]:
    """One window of transactions at ``rate``; ``drop``: the table dropped in it."""
    stop = threading.Event()
    latencies: list[float] = []
    lock = threading.Lock()
    interval = threads / rate

    def worker(n: int) -> None:
        mine: list[float] = []
        with psycopg.connect(_url(server, DATABASE)) as conn:
            due = time.monotonic()
            while not stop.is_set():
                due += interval
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                began = time.perf_counter()
                with conn.transaction():
                    conn.execute("INSERT INTO claims (id) VALUES (%s)", (uuid.uuid4(),))
                    conn.execute(
                        "UPDATE accounts SET balance = balance + 1 WHERE id = %s", (n % 100 + 1,)
                    )
                mine.append((time.perf_counter() - began) * 1000)
        with lock:
            latencies.extend(mine)

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    began = time.monotonic()
    for thread in pool:
        thread.start()
    time.sleep(1.0)
    took = 0.0
    if drop is not None:
        with psycopg.connect(_url(server, DATABASE), autocommit=True) as conn:
            start = time.perf_counter()
            conn.execute(f"DROP TABLE {drop}")
            took = time.perf_counter() - start
    time.sleep(max(0.0, began + WINDOW - time.monotonic()))
    stop.set()
    for thread in pool:
        thread.join()
    return {
        "transactions": len(latencies),
        "drop_seconds": round(took, 3),
        "p50_ms": round(percentile(latencies, 0.5), 2),
        "p99_ms": round(percentile(latencies, 0.99), 2),
        "max_ms": round(max(latencies), 1),
        "over_20_ms": sum(1 for value in latencies if value > SLOW_MS),
    }


def run(server: str, megabytes: float, pieces: int, rounds: int, rate: float) -> dict[str, Any]:
    _prepare(server)
    results: dict[str, list[dict[str, Any]]] = {"nothing": [], "large": [], "small": []}
    with psycopg.connect(_url(server, "postgres")) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    for _ in range(rounds):
        for kind in ("nothing", "large", "nothing", "small"):
            table = None
            if kind != "nothing":
                table = f"dropped_{kind}"
                _make(server, table, megabytes if kind == "large" else megabytes / pieces)
            result = window(server, rate, 8, table)
            results[kind].append(result)
            print(json.dumps({"window": kind} | result), flush=True)
    p99 = {
        kind: statistics.median(x["p99_ms"] for x in windows) for kind, windows in results.items()
    }
    summary = {
        kind: {
            "p99_ms_median": p99[kind],
            "p99_over_nothing": round(p99[kind] / p99["nothing"], 2),
            "max_ms": max(x["max_ms"] for x in windows),
            "over_20_ms": [x["over_20_ms"] for x in windows],
        }
        for kind, windows in results.items()
    }
    return {
        "server": (row[0] if row else "?"),
        "megabytes": megabytes,
        "pieces": pieces,
        "rate": rate,
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.drop_stall")
    parser.add_argument("--server", default=os.environ.get("BENCH_GROWTH_POSTGRES", PG))
    parser.add_argument("--megabytes", type=float, default=700.0)
    parser.add_argument("--pieces", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=1000.0, help="transactions a second")
    args = parser.parse_args(argv)
    report = run(args.server, args.megabytes, args.pieces, args.rounds, args.rate)
    print(json.dumps(report, indent=2))
    with psycopg.connect(_url(args.server, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')


if __name__ == "__main__":
    main()
