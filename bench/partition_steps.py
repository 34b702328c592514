"""What each step of the compact purge costs the next claim of a worker's connection.

    python -m bench.partition_steps                 # 406 hourly partitions, 5 rounds
    python -m bench.partition_steps --hours 100 --rounds 9
    python -m bench.partition_steps --server postgresql://postgres@127.0.0.1:5470

The compact claims table (`claims="compact"`) has a partition an hour over the retention
window and the hours made ahead: about 400 for 14 days. A statement that changes which
partitions the table has (a partition attached or dropped) makes every connection that
knows the table rebuild what it caches of it (its partitions and their bounds) at its
next statement on it; one that changes a partition alone (a ``TRUNCATE``, a ``VACUUM`` of
it) does not. This benchmark measures that from outside: one connection claims (the
library's compact claim statement, its values written in, as a worker sends it) while a
second connection runs a step between two claims; the claim's time right after the step
is set against the claims before it, and the step's own time is told beside it (a
``DROP`` holds the whole table that long, every claim waiting behind it). Each step runs
``--rounds`` times, and the medians are reported, in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy import create_engine

from bench.common import PG
from inbox_middleware._storage import InboxSchema, migrate, partitions

DATABASE = "inbox_partition_steps"
STEPS = (
    "nothing",
    "TRUNCATE of an hour (with rows)",
    "VACUUM of an hour",
    "DROP of an emptied hour",
    "DROP of four emptied hours, one statement",
    "DROP of a day of emptied hours, one statement",
    "ATTACH of a new hour",
    "VACUUM of the whole table",
)
DROPPED = {
    "DROP of an emptied hour": 1,
    "DROP of four emptied hours, one statement": 4,
    "DROP of a day of emptied hours, one statement": 24,
}
"""The emptied hours each DROP step drops, oldest first."""


def _url(server: str, database: str) -> str:
    return f"{server.rstrip('/')}/{database}"


def _claim(conn: psycopg.Connection[Any]) -> float:
    """One claim of a new key in the current hour, as a worker writes it; its ms."""
    key = f"{int(time.time() * 1000):012x}{uuid.uuid4().hex[:20]}"
    began = time.perf_counter()
    with conn.transaction():
        conn.execute(
            "INSERT INTO inbox_claims (identity, payload_digest, processed_at, hash_scheme) "
            f"VALUES ('{key}', '{uuid.uuid4()}', now(), 1) ON CONFLICT DO NOTHING"
        )
    return (time.perf_counter() - began) * 1000


def _fill_hour(conn: psycopg.Connection[Any], hour: datetime, rows: int) -> None:
    """``rows`` claims in ``hour``'s partition (keys led by the hour's milliseconds)."""
    ms = int(hour.timestamp() * 1000)
    conn.execute(
        "INSERT INTO inbox_claims (identity, payload_digest, processed_at, hash_scheme) "
        "SELECT (lpad(to_hex(%(ms)s::bigint + n), 12, '0') "
        "|| left(md5(n::text), 20))::uuid, gen_random_uuid(), now(), 1 "
        "FROM generate_series(1, %(rows)s) n",
        {"ms": ms, "rows": rows},
    )


def _setup(server: str, hours: int) -> list[datetime]:
    """A new database with the library's tables and ``hours`` hourly partitions ending
    two hours ahead; the hours made, oldest first."""
    with psycopg.connect(_url(server, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{DATABASE}"')
    url = _url(server, DATABASE).replace("postgresql://", "postgresql+psycopg://")
    engine = create_engine(url)
    try:
        migrate(engine)
        last = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) + 2 * partitions.HOUR
        made = [last - k * partitions.HOUR for k in range(hours - 1, -1, -1)]
        for hour in made:
            partitions.add(engine, InboxSchema(), hour)
    finally:
        engine.dispose()
    return made


def run(server: str, hours: int, rounds: int) -> dict[str, Any]:
    made = _setup(server, hours)
    naming = InboxSchema()
    oldest = iter(made)  # the hours the steps empty, drop and vacuum, oldest first
    spare = datetime(2001, 1, 1, tzinfo=UTC)  # hours attached: far from the claims'
    times: dict[str, list[float]] = {step: [] for step in STEPS}
    took: dict[str, list[float]] = {step: [] for step in STEPS}
    steady: list[float] = []
    url = _url(server, DATABASE)

    def table(hour: datetime) -> str:
        return naming.hourly_partition(f"{hour:%Y%m%d%H}")

    with (
        psycopg.connect(url, prepare_threshold=None) as worker,
        psycopg.connect(url, autocommit=True) as purger,
    ):
        for _ in range(rounds):
            for step in STEPS:
                if step.startswith("TRUNCATE"):
                    hour = next(oldest)
                    _fill_hour(purger, hour, 1000)
                for _ in range(20):  # the worker's caches warm, its claims steady
                    steady.append(_claim(worker))
                began = time.perf_counter()
                if step.startswith("TRUNCATE"):
                    purger.execute(f"TRUNCATE {table(hour)}")
                elif step == "VACUUM of an hour":
                    purger.execute(f"VACUUM {table(made[-3])}")
                elif step in DROPPED:
                    names = [table(next(oldest)) for _ in range(DROPPED[step])]
                    purger.execute(f"DROP TABLE {', '.join(names)}")
                elif step.startswith("ATTACH"):
                    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
                    partitions.add(engine, naming, spare)
                    engine.dispose()
                    spare += timedelta(hours=1)
                elif step == "VACUUM of the whole table":
                    purger.execute("VACUUM inbox_claims")
                took[step].append((time.perf_counter() - began) * 1000)
                times[step].append(_claim(worker))
    return {
        "hours": hours,
        "rounds": rounds,
        "claim_ms_steady": round(statistics.median(steady), 3),
        "claim_ms_after": {step: round(statistics.median(ms), 3) for step, ms in times.items()},
        # A DROP holds the whole table in ACCESS EXCLUSIVE for this long: every claim
        # waits behind it
        "step_ms": {step: round(statistics.median(ms), 3) for step, ms in took.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.partition_steps", description=__doc__)
    parser.add_argument("--server", default=os.environ.get("BENCH_GROWTH_POSTGRES", PG))
    parser.add_argument("--hours", type=int, default=406, help="hourly partitions")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    report = run(args.server, args.hours, args.rounds)
    print(json.dumps(report, indent=2))
    print("| step in another connection | the step, ms | the next claim, ms |")
    print("|---|---|---|")
    print(f"| (claims in a row, median) | - | {report['claim_ms_steady']} |")
    for step, ms in report["claim_ms_after"].items():
        print(f"| {step} | {report['step_ms'][step]} | {ms} |")
    with psycopg.connect(_url(args.server, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')


if __name__ == "__main__":
    main()
