"""How the claim's cost grows with the inbox table, and what the purge costs.

    python -m bench.growth --quick                      # empty and 10^6 rows, ~2 minutes
    python -m bench.growth --sizes 0,1e6,1e7,5e7        # a full run (disk: ~290 B a row)
    python -m bench.growth --shapes random --seconds 20 --threads 8
    python -m bench.growth --layouts plain,partitioned,compact  # beside a partition a day
    python -m bench.growth --shapes uuid7 --layouts plain,compact,idtime  # ids with a time
    python -m bench.growth --shapes random,uuid7 --layouts plain,library_compact  # claims="compact"

For each key shape (``random``: UUIDv4-like message ids, every claim lands on a random
primary-key page; ``ordered``: time-ordered ids, every claim lands on the rightmost
page), the library's own tables are filled to each size with generated rows, and then,
side by side in one run, with the same threads on the same database:

- ``update``: BEGIN; UPDATE one account; COMMIT (the business change alone);
- ``claim``: BEGIN; the library's claim statement (a new identity); the same UPDATE; COMMIT;
- ``duplicate``: BEGIN; the claim of an identity already stored (no row), then the
  library's hash look-up; COMMIT.

Each reports transactions a second, p50 and p99 latency, WAL bytes and blocks read
(from disk or the OS cache) per transaction; ``claim / update`` is the ratio the inbox
costs. Then, at the largest size: bytes per remembered message (table, primary key,
other indexes), the library's `purge` of the oldest tenth alone (rows a second, WAL) and
the VACUUM it leaves, and a second tenth purged while claims run at half of their
measured rate (their p99 during the purge against the same rate without it; the window
lasts at least `DURING` seconds, ``--window``, the claims' connections warm a second
before the purge). The windows run in rounds (``--rounds``), each round's in an order
drawn from ``--seed``, and each purge's rise is also told paired with the window without
a purge of its own round, and pooled: the p99 of every claim of its windows against that
of every claim of the windows without a purge of the same rounds, with a 95% interval from
drawing the rounds again (`pooled_rise`).

With ``--layouts plain,partitioned,compact`` each shape runs again on `bench.partitioned`'s
claims table (a partition a day of arrival, the claim under an advisory lock on the
identity, looked for in every partition), whose purge drops the oldest day; ``compact``
is the same with its compact row (a 16-byte digest of the identity for a key); ``idtime``
the compact row partitioned by the time its id carries (``--shapes uuid7``: RFC 9562's
version 7, the time the message was sent first), a partition an hour, whose claim is the
plain insert, its key led by that time.

With ``--layouts library_compact``, the library's compact claim (``claims="compact"``, the
switch recorded): its own table, ``inbox_claims``, an hour of id time a partition over the
window and the prepared hours ahead (the ids without a time in a partition of their own),
purged by the library's `purge` of every consumer, which empties whole hours and walks the
rest (``docs/how-to/compact-claims.md``).

Each run draws one chart a question beside its report: the claim's growth (its cost over
the empty table's, the WAL and reads a claim, the bytes a row: `bench.growth_charts`,
which also draws them from several runs' reports) and the purge's two (does it outrun
ingest; what it does to the claims' p99). ``--no-purge`` measures the claims alone.

The statements are the library's (``ClaimStatements`` compiled for psycopg), sent by raw
psycopg connections: the figures are the database's, not the worker's Python. Server
settings are printed with the results; they are the server's own, not tuned here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import random
import re
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import create_engine
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect

from bench import growth_charts, partitioned
from bench.common import PG, ROOT, percentile
from bench.growth_charts import series
from inbox_middleware._core import claims
from inbox_middleware._operate.retention import DEFAULT_PURGE_RATE, purge
from inbox_middleware._storage import InboxSchema, migrate, partitions
from inbox_middleware._storage.statements import ClaimStatements, CompactClaimStatements
from inbox_middleware._storage.tables import CLAIMS_PARTITIONS

DATABASE = os.environ.get("BENCH_GROWTH_DATABASE", "inbox_growth")
SERVER = os.environ.get("BENCH_GROWTH_POSTGRES", PG)
"""The server: the shared test PostgreSQL by default (the quick mode, in CI); for the
figures of the performance page, the production-like one (``scripts/services
growth-postgres``, ``--server postgresql://postgres@127.0.0.1:5470``)."""
CONSUMER, PRODUCER, SCHEME = "growth", "orders", "v1"
WINDOW = timedelta(days=14)
"""The generated rows' processed_at spans this window, oldest first."""
ACCOUNTS = 100
FILL_CHUNK = 1_000_000
DURING = 5.0
"""The shortest window of claims measured during a purge, seconds."""
DROPS, DROP_PACE = 3, 2.0
"""Under load, the partitioned layouts' purge drops this many of the oldest partitions,
one every DROP_PACE seconds, as a purge catching up would: its rows a second count the
pauses between them."""
SETTINGS = (
    "server_version",
    "shared_buffers",
    "max_wal_size",
    "checkpoint_timeout",
    "full_page_writes",
    "synchronous_commit",
    "autovacuum",
    "maintenance_work_mem",
)


def _url(database: str) -> str:
    return f"{SERVER}/{database}"


def _compiled(statement: Any) -> str:
    return str(statement.compile(dialect=psycopg_dialect.dialect()))


CLAIMS = ClaimStatements(InboxSchema(), "postgresql", lock_timeout=5.0)
CLAIM_SQL, LOOK_UP_SQL = _compiled(CLAIMS.claim), _compiled(CLAIMS.look_up)
# The claim's own constants (the values its statement binds itself), under the names the
# compiled SQL gives them.
CLAIM_CONSTANTS = {
    name: value
    for name, value in CLAIMS.claim.compile(dialect=psycopg_dialect.dialect()).params.items()
    if value is not None
}
UPDATE_SQL = "UPDATE bench_accounts SET balance = balance + 1 WHERE id = %(account)s"

COMPACT = CompactClaimStatements(InboxSchema(), 5.0, claims.ClaimsPhase.COMPACT)
COMPACT_CLAIM_SQL, COMPACT_LOOK_UP_SQL = _compiled(COMPACT.claim), _compiled(COMPACT.look_up)
COMPACT_CONSTANTS = {
    name: getattr(value, "value", value)
    for name, value in COMPACT.claim.compile(dialect=psycopg_dialect.dialect()).params.items()
    if value is not None
}
TABLE = "consumer_inbox"
"""The claims table of the layout being measured (`_use`): the library's compact claim
has its own."""


def _use(layout: str) -> None:
    global TABLE  # noqa: PLW0603 (every statement of the layout's run names it)
    TABLE = "inbox_claims" if layout == "library_compact" else "consumer_inbox"


def _library_compact(params: dict[str, Any]) -> dict[str, Any]:
    """The library's compact claim's parameters (`CompactClaimStatements`)."""
    key = (params["consumer_name"], params["producer_name"], "", params["message_id"])
    return (
        params
        | COMPACT_CONSTANTS
        | {
            "identity": claims.claim_key(*key).hex(),
            "payload_digest": claims.payload_digest(params["payload_sha256"]),
            "scheme_code": str(claims.scheme_code(params["hash_scheme"])),
        }
    )


# -- the rows ---------------------------------------------------------------------------------


@dataclass
class Clock:
    """The generated rows' times, in whole milliseconds so that Python and SQL agree: row
    ``n`` of a run whose largest size is ``top`` was sent at ``epoch + n * step``."""

    epoch_ms: int = 0
    step_ms: int = 0
    top: int = 0

    def start(self, top: int) -> None:
        self.epoch_ms = int((datetime.now(UTC) - WINDOW).timestamp() * 1000)
        self.step_ms = int(WINDOW.total_seconds() * 1000) // max(top, 1)
        self.top = top

    def first(self) -> datetime:
        """The oldest row's time: the first partition holds it."""
        return datetime.fromtimestamp(self.epoch_ms / 1000, UTC)

    def sent_ms(self, n: int) -> int:
        """Row ``n``'s time; a message above the generated rows is sent now."""
        if n < self.top:
            return self.epoch_ms + n * self.step_ms
        return int(time.time() * 1000)


CLOCK = Clock()


def message_id(shape: str, n: int) -> str:
    """The message id of the ``n``-th message of a shape; the same in SQL (`_ID_SQL`)."""
    digest = hashlib.md5(f"{shape}{n}".encode()).hexdigest()
    if shape == "random":
        return str(uuid.UUID(digest))
    if shape == "uuid7":  # the time it was sent, then random bits (RFC 9562's version 7)
        ms = f"{CLOCK.sent_ms(n):012x}"
        return f"{ms[:8]}-{ms[8:]}-7{digest[:3]}-8{digest[3:6]}-{digest[6:18]}"
    return f"{n:016x}-{digest[:16]}"  # time-ordered: the sequence first


_ID_SQL = {
    "random": "md5('random' || n)::uuid::text",
    "ordered": "lpad(to_hex(n), 16, '0') || '-' || left(md5('ordered' || n), 16)",
    "uuid7": """(SELECT left(ms, 8) || '-' || right(ms, 4) || '-7' || left(h, 3) || '-8'
        || substr(h, 4, 3) || '-' || substr(h, 7, 12)
        FROM (SELECT lpad(to_hex(%(epoch_ms)s::bigint + n * %(step_ms)s::bigint), 12, '0'),
                     md5('uuid7' || n)) AS parts(ms, h))""",
}
_HASH = hashlib.sha256(b"payload").hexdigest()


_UUID7 = "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-7[0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}$"
"""A message id `claims.id_milliseconds` reads a time from (the UUIDv7 form)."""
_SENT_SQL = "to_timestamp((%(epoch_ms)s::bigint + n * %(step_ms)s::bigint) / 1000.0)"
"""Row ``n``'s time (`Clock.sent_ms`) in SQL."""


def _fill_sql(shape: str, layout: str) -> str:
    """The INSERT of rows ``low`` to ``high - 1`` of a shape into a layout's table."""
    rows = "FROM generate_series(%(low)s::bigint, %(high)s::bigint - 1) n"
    if layout == "library_compact":  # the key `claims.claim_key` computes
        parts = {"c": "%(consumer)s::text", "p": "%(producer)s::text", "t": "''", "m": "m"}
        digest = partitioned.IDENTITY_SHA256.format(**parts)
        # 6 bytes of time, the id's when it is in a UUIDv7's form (a random id has that
        # form one time in 64: the version digit 7 and the variant 8 to b), else zeros;
        # then 10 bytes of the identity's digest
        identity = f"""((CASE WHEN m ~ '{_UUID7}' THEN left(replace(m, '-', ''), 12)
            ELSE '000000000000' END) || encode(substr({digest}, 1, 10), 'hex'))::uuid"""
        return f"""INSERT INTO inbox_claims (identity, payload_digest, processed_at, hash_scheme)
            SELECT {identity}, left(%(hash)s, 32)::uuid, {_SENT_SQL}, %(code)s::smallint
            {rows}, LATERAL (SELECT {_ID_SQL[shape]}) AS ids(m)"""
    if layout in ("plain", "partitioned"):  # the library's row
        return f"""INSERT INTO consumer_inbox (consumer_name, producer_name, tenant, message_id,
                payload_sha256, hash_scheme, handler_version, produced_at, received_at,
                processed_at)
            SELECT %(consumer)s, %(producer)s, '', {_ID_SQL[shape]}, %(hash)s, %(scheme)s,
                '', t, t, t
            {rows}, LATERAL (SELECT {_SENT_SQL}) AS at(t)"""
    digest = partitioned.ID_TIME_DIGEST_SQL if layout == "idtime" else partitioned.DIGEST_SQL
    identity = digest.format(c="%(consumer)s::text", p="%(producer)s::text", t="''", m="m")
    sent = "id_time" if layout == "idtime" else "processed_at"
    return f"""INSERT INTO consumer_inbox ({sent}, identity, payload_digest, hash_scheme)
        SELECT {_SENT_SQL}, {identity}, left(%(hash)s, 32)::uuid, 1
        {rows}, LATERAL (SELECT {_ID_SQL[shape]}) AS ids(m)"""


def _fill(
    conn: psycopg.Connection[Any], shape: str, start: int, stop: int, layout: str = "plain"
) -> None:
    """Insert messages ``start`` to ``stop - 1``, each at its time (`CLOCK`): they rise
    with n over `WINDOW`, the run's largest size ending at the run's start."""
    sql = _fill_sql(shape, layout)
    for low in range(start, stop, FILL_CHUNK):
        params = {
            "consumer": CONSUMER,
            "producer": PRODUCER,
            "hash": _HASH,
            "scheme": SCHEME,
            "low": low,
            "high": min(stop, low + FILL_CHUNK),
            "epoch_ms": CLOCK.epoch_ms,
            "step_ms": CLOCK.step_ms,
            "code": claims.scheme_code(SCHEME),
        }
        conn.execute(sql, params)


def _claim_params(shape: str, n: int) -> dict[str, Any]:
    now = datetime.now(UTC)
    return CLAIM_CONSTANTS | {
        "consumer_name": CONSUMER,
        "producer_name": PRODUCER,
        "tenant": "",
        "message_id": message_id(shape, n),
        "payload_sha256": _HASH,
        "hash_scheme": SCHEME,
        "handler_version": "",
        "trace_id": None,
        "produced_at": None,
        "received_at": now,
        "set_config_2": "lock_timeout",
        "lock_timeout": "5000ms",
    }


# -- one load -----------------------------------------------------------------------------------


@dataclass
class Load:
    """One mode's run: what the threads did and what the server did for it."""

    mode: str
    shape: str
    rows: int
    seconds: float
    layout: str = "plain"
    transactions: int = 0
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    wal_bytes: int = 0
    blocks_read: int = 0

    @property
    def rate(self) -> float:
        return self.transactions / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, Any]:
        per = max(self.transactions, 1)
        return {
            "mode": self.mode,
            "shape": self.shape,
            "layout": self.layout,
            "rows": self.rows,
            "tps": round(self.rate, 1),
            "p50_ms": round(percentile(self.latencies_ms, 0.5), 3),
            "p99_ms": round(percentile(self.latencies_ms, 0.99), 3),
            "wal_bytes_per_tx": round(self.wal_bytes / per, 1),
            "blocks_read_per_tx": round(self.blocks_read / per, 3),
        }


class Counter:
    """Hands out message numbers above the rows already stored, across threads."""

    def __init__(self, start: int) -> None:
        self._next = start
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            self._next += 1
            return self._next


def _transaction(
    mode: str, shape: str, stored: int, fresh: Counter, layout: str = "plain"
) -> Callable[..., None]:
    claim_sql, look_up_sql, shaped = {
        "plain": (CLAIM_SQL, LOOK_UP_SQL, dict),
        "library_compact": (COMPACT_CLAIM_SQL, COMPACT_LOOK_UP_SQL, _library_compact),
        "partitioned": (partitioned.CLAIM, LOOK_UP_SQL, dict),
        "compact": (
            partitioned.COMPACT_CLAIM,
            partitioned.COMPACT_LOOK_UP,
            partitioned.compact_params,
        ),
        "idtime": (
            partitioned.ID_TIME_CLAIM,
            partitioned.ID_TIME_LOOK_UP,
            partitioned.id_time_params,
        ),
    }[layout]

    def claimed(conn: psycopg.Connection[Any], params: dict[str, Any]) -> bool:
        # The plain claim answers no row for a stored identity, the layout's function NULL.
        row = conn.execute(claim_sql, params).fetchone()
        return row is not None and row[0] is not None

    def update(conn: psycopg.Connection[Any]) -> None:
        with conn.transaction():
            conn.execute(UPDATE_SQL, {"account": random.randint(1, ACCOUNTS)})

    def claim(conn: psycopg.Connection[Any]) -> None:
        params = shaped(_claim_params(shape, fresh()))
        with conn.transaction():
            assert claimed(conn, params), "a new identity, not claimed"
            conn.execute(UPDATE_SQL, {"account": random.randint(1, ACCOUNTS)})

    def duplicate(conn: psycopg.Connection[Any]) -> None:
        params = shaped(_claim_params(shape, random.randrange(max(stored, 1))))
        with conn.transaction():
            assert not claimed(conn, params), "not a duplicate"
            assert conn.execute(look_up_sql, params).fetchone() is not None

    return {"update": update, "claim": claim, "duplicate": duplicate}[mode]


def _server_counters(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    conn.execute("SELECT pg_stat_force_next_flush()")
    wal = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    reads = conn.execute(
        "SELECT blks_read FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()
    assert wal is not None
    assert reads is not None
    return int(wal[0]), int(reads[0])


def run_load(
    mode: str,
    shape: str,
    stored: int,
    fresh: Counter,
    *,
    threads: int,
    seconds: float,
    rate: float | None = None,
    during: Callable[[], None] | None = None,
    layout: str = "plain",
) -> Load:
    """Run ``threads`` connections doing ``mode`` for ``seconds`` (at most ``rate``
    transactions a second in all, when given); with ``during``, until it returns."""
    load = Load(mode, shape, stored, seconds, layout)
    work = _transaction(mode, shape, stored, fresh, layout)
    stop = threading.Event()
    lock = threading.Lock()
    interval = threads / rate if rate else 0.0

    def worker() -> None:
        latencies: list[float] = []
        # Never prepared: a generic plan of a statement that reads a partitioned claims
        # table (the look-ups, the prototypes' claims) locks every partition at each run.
        # (The library's claim is prepared on the server: an INSERT's generic plan locks
        # the parent and the partition its row goes to.)
        with psycopg.connect(_url(DATABASE), prepare_threshold=None) as conn:
            due = time.monotonic()
            while not stop.is_set():
                if interval:
                    due += interval
                    pause = due - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                began = time.perf_counter()
                work(conn)
                latencies.append((time.perf_counter() - began) * 1000)
            conn.execute("SELECT pg_stat_force_next_flush()")
        with lock:
            load.transactions += len(latencies)
            load.latencies_ms.extend(latencies)

    with psycopg.connect(_url(DATABASE), autocommit=True) as admin:
        wal0, reads0 = _server_counters(admin)
        began = time.monotonic()
        pool = [threading.Thread(target=worker) for _ in range(threads)]
        for thread in pool:
            thread.start()
        if during is not None:
            during()
        else:
            time.sleep(seconds)
        stop.set()
        for thread in pool:
            thread.join()
        load.seconds = time.monotonic() - began
        time.sleep(0.2)
        wal1, reads1 = _server_counters(admin)
    load.wal_bytes, load.blocks_read = wal1 - wal0, reads1 - reads0
    return load


# -- the run ------------------------------------------------------------------------------------


def _reset(layout: str = "plain") -> None:
    """A new database with the library's tables; with ``layout`` partitioned or compact,
    the claims table replaced by `bench.partitioned`'s, partitioned over `WINDOW` and two
    days ahead."""
    with psycopg.connect(_url("postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{DATABASE}"')
    engine = create_engine(_url(DATABASE).replace("postgresql://", "postgresql+psycopg://"))
    migrate(engine)
    if layout == "library_compact":  # an hour a partition over the window, and ahead
        hour = CLOCK.first().replace(minute=0, second=0, microsecond=0)
        while hour <= datetime.now(UTC) + timedelta(hours=partitions.PREPARE_HOURS):
            partitions.add(engine, InboxSchema(), hour)
            hour += partitions.HOUR
    engine.dispose()
    with psycopg.connect(_url(DATABASE), autocommit=True) as conn:
        if layout not in ("plain", "library_compact"):
            partitioned.create(conn, CLOCK.first(), WINDOW.days + 3, layout=layout)
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_freespacemap")
        conn.execute("CREATE TABLE bench_accounts (id integer PRIMARY KEY, balance bigint)")
        conn.execute(
            "INSERT INTO bench_accounts SELECT n, 0 FROM generate_series(1, %s) n", (ACCOUNTS,)
        )


def _settle(conn: psycopg.Connection[Any]) -> None:
    conn.execute(f"VACUUM ANALYZE {TABLE}")
    conn.execute("CHECKPOINT")


def _leaves() -> str:
    """The claims table's relations that hold rows: its partitions, or the table itself."""
    return f"""(SELECT relid FROM pg_partition_tree('{TABLE}') WHERE isleaf
    UNION ALL SELECT '{TABLE}'::regclass
    WHERE (SELECT relkind FROM pg_class WHERE oid = '{TABLE}'::regclass) = 'r')"""


def sizes_of(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    # Over the partition tree: the table itself when it is not partitioned. The key is
    # its unique index (the primary key, or each partition's).
    row = conn.execute(
        f"""SELECT sum(pg_table_size(t.relid)),
                  (SELECT coalesce(sum(pg_relation_size(i.indexrelid)), 0) FROM pg_index i
                   WHERE i.indisunique AND i.indrelid IN {_leaves()}),
                  sum(pg_indexes_size(t.relid)),
                  (SELECT count(*) FROM {TABLE})
           FROM {_leaves()} AS t(relid)"""
    ).fetchone()
    assert row is not None
    table, key, indexes, count = (int(value) for value in row)
    per = max(count, 1)
    return {
        "rows": count,
        "table_bytes": table,
        "primary_key_bytes": key,
        "index_bytes": indexes,
        "bytes_per_row": round((table + indexes) / per, 1),
        "table_bytes_per_row": round(table / per, 1),
        "primary_key_bytes_per_row": round(key / per, 1),
    }


# The purge as it was before it walked the heap by block ranges (kept here only, to compare):
# each batch a sequential scan with LIMIT, resumed where the last one stopped only by
# synchronized scans.
OLD_PURGE_SQL = """DELETE FROM consumer_inbox WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM consumer_inbox
    WHERE processed_at < now() - make_interval(secs => %(seconds)s::float8)
    LIMIT %(limit)s FOR UPDATE SKIP LOCKED))"""
CONTROL = False
"""Whether the purges under load are measured beside the control (``--control``)."""
BURN_SHARE, BURN_SECONDS = 0.05, 3.0
"""The control (``--control``): in place of a purge, a connection of the purge's process
keeps its server backend busy this share of the time (a computation that reads and writes
nothing), for this long."""


SHORT = {
    "drop": "the oldest partition dropped",
    "drops": f"{DROPS} partitions dropped, {DROP_PACE:g} s apart",
    "old": "old: a seq scan per batch",
    "new": "block ranges, unpaced",
    "paced": f"block ranges, {DEFAULT_PURGE_RATE:,.0f}/s",
    "hour": "an hour, paced",
    "burn": "no purge: 5% of a core burnt",
}
PURGES = {
    "drop": "the partitioned layouts': the oldest partition detached concurrently and dropped",
    "drops": f"the same for the {DROPS} oldest partitions, {DROP_PACE:g} s apart",
    "old": "the old purge: a sequential scan per batch, unpaced",
    "new": "block ranges, unpaced",
    "paced": f"block ranges, paced at {DEFAULT_PURGE_RATE:,.0f} rows a second (the default)",
    "hour": "the steady case: the default purge, run every hour, one hour past the window",
    "burn": f"the control: no purge, a server backend kept busy {BURN_SHARE:.0%} of the time",
}


def _old_purge(older_than: timedelta, batch_size: int = 5000) -> int:
    total = 0
    with psycopg.connect(_url(DATABASE), autocommit=True) as conn:
        while True:
            params = {"seconds": older_than.total_seconds(), "limit": batch_size}
            deleted = conn.execute(OLD_PURGE_SQL, params).rowcount
            total += deleted
            if deleted < batch_size:
                return total


def _burn(seconds: float) -> float:
    with psycopg.connect(_url(DATABASE), autocommit=True) as conn:
        began = time.monotonic()
        while time.monotonic() - began < seconds:
            busy = time.monotonic()
            conn.execute("SELECT count(*) FROM generate_series(1, 100000)")
            time.sleep((time.monotonic() - busy) * (1 / BURN_SHARE - 1))
        return time.monotonic() - began


def _purge_tenth(tenth: int, how: str = "new", hours: int = 1) -> tuple[int, float]:
    """Purge the ``tenth``-th oldest tenth of the generated rows, ``how``: one of `PURGES`;
    answer (rows deleted, seconds). A drop's rows are counted before it starts (a count
    of a day's partition is a scan of it, which is no part of the purge). The steady
    purge (``hour``) takes the ``hours``-th hour of the tenth."""
    # Row n was processed at epoch + n * WINDOW / top (`CLOCK`): keep what is younger than the end
    # of this tenth.
    older_than = WINDOW * (1 - (tenth + 1) / 10)
    if how == "hour":  # the steady case: the hour past the last purge's end, no more
        older_than = WINDOW * (1 - tenth / 10) - timedelta(hours=hours)
    began = time.monotonic()
    if how in ("drop", "drops"):
        with psycopg.connect(_url(DATABASE), autocommit=True) as conn:
            oldest = partitioned.partitions(conn)[: DROPS if how == "drops" else 1]
            rows = sum(partitioned.rows_of(conn, name) for name in oldest)
            began = time.monotonic()
            for n, name in enumerate(oldest):
                time.sleep(max(0.0, began + n * DROP_PACE - time.monotonic()))
                partitioned.drop(conn, name)
        return rows, time.monotonic() - began
    if how == "burn":
        return 0, _burn(BURN_SECONDS)
    if how == "old":
        return _old_purge(older_than), time.monotonic() - began
    engine = create_engine(_url(DATABASE).replace("postgresql://", "postgresql+psycopg://"))
    try:
        rate = DEFAULT_PURGE_RATE if how in ("paced", "hour") else None
        deleted = purge(engine, InboxSchema(), older_than, rows_per_second=rate)
        return deleted, time.monotonic() - began
    finally:
        engine.dispose()


class Purger:
    """The purges, run in a process of their own, as ``inbox-middleware purge`` runs beside
    the workers: its Python (the engine's first connection, the statements' building) does
    not hold the GIL of the claims' threads, whose latency the benchmark measures. The
    process starts and connects before any load."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(
            1,
            mp_context=context,
            initializer=_purger_started,
            initargs=(SERVER, DATABASE, TABLE, CLOCK, partitions.EMPTY_SHARE),
        )
        self._pool.submit(_purger_warm).result()

    def run(self, tenth: int, how: str, hours: int = 1) -> tuple[int, float]:
        return self._pool.submit(_purge_tenth, tenth, how, hours).result()

    def close(self) -> None:
        self._pool.shutdown()


def _purger_started(
    server: str, database: str, table: str, clock: Clock, empty_share: float
) -> None:
    global SERVER, DATABASE, TABLE  # the parent run's, in the purge's process
    SERVER, DATABASE, TABLE = server, database, table
    os.environ["PGAPPNAME"] = PURGER_NAME  # every connection of the purges (libpq's)
    partitions.EMPTY_SHARE = empty_share
    CLOCK.epoch_ms, CLOCK.step_ms, CLOCK.top = clock.epoch_ms, clock.step_ms, clock.top


def _purger_warm() -> None:
    engine = create_engine(_url(DATABASE).replace("postgresql://", "postgresql+psycopg://"))
    with engine.connect() as conn:
        conn.exec_driver_sql("SELECT 1")
    engine.dispose()


def _dead_tuples(conn: psycopg.Connection[Any]) -> int:
    conn.execute("SELECT pg_stat_force_next_flush()")
    row = conn.execute(
        f"SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables WHERE relid IN {_leaves()}"
    ).fetchone()
    return int(row[0]) if row else 0


def _vacuum(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """The VACUUM the purge leaves (run now, unthrottled, as autovacuum would run it when
    its thresholds are met): of each table the purge deleted rows from, as autovacuum
    takes them one by one (it never vacuums a partitioned table whole, whose untouched
    partitions have nothing to vacuum; a dropped or truncated partition leaves nothing);
    its time and its WAL, and its own account (VERBOSE) of the tuples it removed and of
    those still dead but not yet removable. When a transaction older than the purge's
    end held some back all the same, it is run again (as autovacuum would come back),
    at most `VACUUM_PASSES` times, each a little later, and the passes are reported.
    A statement's snapshot, taken between the wait and the VACUUM, holds the horizon
    back only for as long as it runs (a CI run, with another test's transaction open in
    another database beside the claims, had 26 dead tuples left after three passes run
    back to back, each table's cutoff moving between the old transaction and now)."""
    dead = _dead_tuples(conn)
    dirty = {
        "consumer_inbox": ["consumer_inbox"],
        "inbox_claims": ["consumer_inbox", *CLAIMS_PARTITIONS],  # the walked ones
    }[TABLE]
    if TABLE == "consumer_inbox" and conn.execute(
        "SELECT relkind = 'p' FROM pg_class WHERE oid = 'consumer_inbox'::regclass"
    ).fetchone() == (True,):
        dirty = []  # the partitioned prototypes: their purge drops partitions
    said: list[str] = []
    conn.add_notice_handler(lambda notice: said.append(notice.message_primary or ""))
    seconds, wal, removed, passes = 0.0, 0, 0, 0
    kept: int | None = None
    while dirty and passes < VACUUM_PASSES:
        time.sleep(VACUUM_BACKOFF * passes)  # a statement's snapshot is over by then
        _older_transactions_ended(conn)
        said.clear()
        wal0, _ = _server_counters(conn)
        began = time.monotonic()
        conn.execute(f"VACUUM (VERBOSE) {', '.join(dirty)}")
        seconds += time.monotonic() - began
        wal1, _ = _server_counters(conn)
        wal, passes = wal + wal1 - wal0, passes + 1
        counted = vacuum_counts(said)
        if counted is None:  # a server whose VACUUM tells no counts: its statistics
            break
        removed, kept = removed + counted[0], counted[1]
        if kept:
            print(f"the VACUUM left {kept} dead tuples: {said}", file=sys.stderr)
        else:
            break
    return {
        "dead_tuples_before_vacuum": dead,
        "vacuum_seconds": seconds,
        "vacuum_wal_bytes": wal,
        "vacuum_removed_tuples": removed,
        "vacuum_passes": passes,
        # nothing vacuumed (dropped partitions), or no counts told: the statistics'
        "dead_tuples_after_vacuum": _dead_tuples(conn) if kept is None else kept,
    }


VACUUM_PASSES = 6
"""How many times `_vacuum` runs the VACUUM while it leaves dead tuples behind."""
VACUUM_BACKOFF = 0.05
"""Seconds `_vacuum` waits before its second pass, twice that before its third, and so
on (0.75 s over the six)."""

_VACUUM_TUPLES = re.compile(
    r"tuples: (\d+) removed, \d+ remain, (\d+) are dead but not yet removable"
)


def vacuum_counts(said: list[str]) -> tuple[int, int] | None:
    """From a VACUUM (VERBOSE)'s messages (PostgreSQL 14 and later), the tuples it
    removed and those dead but not yet removable, over its tables; None where it tells
    neither."""
    found = [_VACUUM_TUPLES.search(message) for message in said]
    counts = [(int(m[1]), int(m[2])) for m in found if m]
    if not counts:
        return None
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


PURGER_NAME = "inbox-growth-purge"
"""The application name of the purges' connections (`Purger`)."""


def _older_transactions_ended(conn: psycopg.Connection[Any], patience: float = 30.0) -> None:
    """Wait, at most ``patience`` seconds, until no other backend of the database holds a
    snapshot older than now, none of any database a transaction id older than now, and
    the purge's connections are gone. A
    claim's transaction whose snapshot is older than the purge's commit keeps the rows it
    deleted from this VACUUM (autovacuum, later, never meets one); so does a claim begun
    while such a one still ran, whose snapshot's horizon (``backend_xmin``) is that one's
    transaction, even after it ended: the horizon, not the transaction's start, is what is
    waited for. Between two statements a claim's transaction holds no snapshot (READ
    COMMITTED) but still its id (``backend_xid``, assigned by its INSERT), which holds the
    horizon back as well: both are waited for (the CI run of a purge beside claims found
    2,000 dead tuples left with the snapshot alone waited for). And a purge's backend
    reports its deletions to the statistics when it ends, after this VACUUM's report of
    the dead tuples left, unless waited for (a backend leaves pg_stat_activity after its
    statistics are written). A transaction of another database counts too: it is
    running in every snapshot a backend of this one takes meanwhile (a snapshot is the
    server's), so a claim's statement then holds the horizon back at its id."""
    row = conn.execute(  # the next xid, as the 32-bit xid backend_xmin is
        "SELECT (pg_snapshot_xmax(pg_current_snapshot())::text::bigint % 4294967296)::text"
    ).fetchone()
    assert row is not None
    deadline = time.monotonic() + patience
    holders: list[Any] = []
    while time.monotonic() < deadline:
        # age() of both against the same reference: an older xid has the larger age
        holders = conn.execute(
            "SELECT pid, datname, application_name, backend_type, state, left(query, 60)"
            " FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND ("
            " datname = current_database() AND (age(backend_xmin) > age(%(next)s::xid)"
            " OR application_name = %(purger)s)"
            # a transaction of any database: every snapshot taken here has it as horizon
            " OR age(backend_xid) > age(%(next)s::xid))",
            {"next": row[0], "purger": PURGER_NAME},
        ).fetchall()
        if not holders:
            return
        time.sleep(0.005)
    # The VACUUM runs anyway; what it could not remove is reported as dead tuples left.
    print(f"the VACUUM did not wait for {holders} after {patience:.0f} s", file=sys.stderr)


def _left_behind(purged: dict[str, Any]) -> dict[str, Any]:
    """A purge's figures (`_one_purge`) and the table after it and its vacuum: dead tuples
    (in the statistics), bytes, free space. Measured after the claims' window: the free
    space map's walk reads an entry for each of the table's blocks (about a million at
    10^8 rows), which is no part of the purge."""
    with psycopg.connect(_url(DATABASE), autocommit=True) as conn:
        sizes = sizes_of(conn)
        dead = _dead_tuples(conn)
        if dead != purged["dead_tuples_after_vacuum"]:
            told = f"the statistics hold {dead} dead tuples; the purge and its VACUUM: {purged}"
            print(told, file=sys.stderr)
        return purged | {
            "dead_tuples_in_statistics_after": dead,
            "bytes_per_live_row_after": sizes["bytes_per_row"],
            "table_bytes_per_live_row_after": sizes["table_bytes_per_row"],
            "index_bytes_per_live_row_after": round(
                sizes["index_bytes"] / max(sizes["rows"], 1), 1
            ),
            "free_heap_fraction_after": _free_fraction(conn),
        }


def _free_fraction(conn: psycopg.Connection[Any]) -> float | None:
    """The heap's free space over its size, from the free space map (bloat left behind)."""
    row = conn.execute(
        f"""SELECT (SELECT sum(f.avail) FROM {_leaves()} AS t(relid),
                       LATERAL pg_freespace(t.relid) f)::float8
                  / nullif((SELECT sum(pg_relation_size(t.relid))
                            FROM {_leaves()} AS t(relid)), 0)"""
    ).fetchone()
    return round(float(row[0]), 3) if row and row[0] is not None else None


def _one_purge(purger: Purger, tenth: int, how: str, hours: int = 1) -> dict[str, Any]:
    with psycopg.connect(_url(DATABASE), autocommit=True) as conn:
        wal0, _ = _server_counters(conn)
        deleted, seconds = purger.run(tenth, how, hours)
        wal1, _ = _server_counters(conn)
        result: dict[str, Any] = {
            "purge": how,
            "rows": deleted,
            "seconds": round(seconds, 2),
            "rows_per_second": round(deleted / seconds) if seconds else None,
            "wal_bytes_per_row": round((wal1 - wal0) / max(deleted, 1), 1),
        }
        vacuumed = _vacuum(conn)
        result |= vacuumed | {"vacuum_seconds": round(vacuumed["vacuum_seconds"], 2)}
    # From the unrounded times: a small partition's drop takes less than the 10 ms the
    # rounded figure shows.
    total = seconds + vacuumed["vacuum_seconds"]
    result["rows_per_second_with_vacuum"] = round(deleted / total) if total else None
    return result


def measure_purge(
    shape: str, top: int, claim_rate: float, threads: int, layout: str = "plain"
) -> dict[str, Any]:
    """Each purge (`PURGES`) removes one tenth of the rows, oldest first, alone; then each
    the next tenth while claims run at half their measured rate. The partitioned layouts'
    drop the oldest partition alone instead (a day, or an hour: `partitioned.HOURS`; the
    first one partly filled), then `DROPS` of them, paced, under the claims."""
    result: dict[str, Any] = {"alone": {}, "under_load": {}}
    tenth = 0
    alone, loaded = {
        "plain": PLAIN_PURGES,
        # the old purge is the library's table's: the compact claims have known none
        # "hour": the steady case, a purge that runs every hour (one hour past the window)
        "library_compact": (("new",), ("hour", "new", "paced")),
    }.get(layout, (("drop",), ("drops",)))
    if CONTROL:
        loaded = (*loaded, "burn")
    purger = Purger()
    try:
        for how in alone:
            result["alone"][how] = _left_behind(_one_purge(purger, tenth, how))
            tenth += 1
        _purge_under_load(result, purger, shape, top, claim_rate, threads, layout, tenth, loaded)
    finally:
        purger.close()
    return result


def _purge_under_load(
    result: dict[str, Any],
    purger: Purger,
    shape: str,
    top: int,
    claim_rate: float,
    threads: int,
    layout: str,
    tenth: int,
    loaded: tuple[str, ...],
) -> None:
    """Rounds of a window of claims alone and a window for each purge (`ROUNDS`; a purge
    that takes a tenth runs in as many rounds as the tenths left allow), in an order
    drawn anew each round (`SEED`): the p99 of a window moves by tens of percent from one
    to the next on this machine, and with the place a window has in its round. Each side
    is the median of its windows; the paired rise is the median over rounds of a purge's
    window against the window alone of the same round."""
    fresh = Counter(top * 2)
    half = claim_rate / 2
    drops = all(how in ("drop", "drops") for how in loaded)
    tenths = sum(how not in STEADY for how in loaded)  # a round's
    rounds = ROUNDS if drops or not tenths else max(1, min(ROUNDS, (10 - tenth) // tenths))
    windows: dict[str, list[Load]] = {"": [], **{how: [] for how in loaded}}
    purges: dict[str, list[dict[str, Any]]] = {how: [] for how in loaded}
    paired: dict[str, list[float]] = {how: [] for how in loaded}
    orders: list[list[str]] = []
    draw = random.Random(SEED)
    hours = 0  # the steady purges' since the last tenth

    def window(seconds: float, during: Callable[[], None] | None = None) -> Load:
        return run_load(
            "claim", shape, top, fresh, threads=threads, seconds=seconds, rate=half,
            during=during, layout=layout,
        )  # fmt: skip

    for number in range(ROUNDS):
        # past the rounds the tenths allow, the steady purges and the windows alone go on
        order = ["", *(how for how in loaded if number < rounds or how in STEADY)]
        if len(order) == 1:
            break
        draw.shuffle(order)
        orders.append(order)
        p99s: dict[str, float] = {}
        for how in order:
            if not how:
                windows[""].append(window(DURING))
                p99s[""] = percentile(windows[""][-1].latencies_ms, 0.99)
                continue
            purged: dict[str, Any] = {}
            hours += how == "hour"

            def purge_now(
                tenth: int = tenth,
                how: str = how,
                purged: dict[str, Any] = purged,
                hours: int = hours,
            ) -> None:
                # The claims' connections are warm before the purge starts, and the window
                # lasts at least DURING seconds: a purge shorter than a second (a dropped
                # day) would otherwise be measured on the claims' first transactions.
                began = time.monotonic()
                time.sleep(1.0)
                purged.update(_one_purge(purger, tenth, how, hours))
                time.sleep(max(0.0, began + DURING - time.monotonic()))

            windows[how].append(window(0, purge_now))
            if how not in STEADY:  # the next tenth: the steady purge takes its first hour
                tenth, hours = tenth + 1, 0
            purges[how].append(_left_behind(purged))
            p99s[how] = percentile(windows[how][-1].latencies_ms, 0.99)
        for how, p99 in p99s.items():
            if how and p99s[""]:
                paired[how].append(p99 / p99s[""] - 1)

    def median_of(loads: list[Load], share: float) -> float:
        return statistics.median(percentile(load.latencies_ms, share) for load in loads)

    base_p50, base_p99 = median_of(windows[""], 0.5), median_of(windows[""], 0.99)
    for how in loaded:
        first = purges[how][0]
        p50, p99 = median_of(windows[how], 0.5), median_of(windows[how], 0.99)
        ingest = statistics.median(load.rate for load in windows[how])
        with_vacuum = statistics.median(x["rows_per_second_with_vacuum"] or 0 for x in purges[how])
        result["under_load"][how] = first | {
            "rounds": len(windows[how]),
            "orders": orders,
            "rows_per_second": statistics.median(x["rows_per_second"] or 0 for x in purges[how]),
            "rows_each": [x["rows"] for x in purges[how]],
            "rows_per_second_with_vacuum": with_vacuum,
            "claim_rate": round(half, 1),
            "claim_p50_ms_without": round(base_p50, 3),
            "claim_p99_ms_without": round(base_p99, 3),
            "claim_p50_ms_during": round(p50, 3),
            "claim_p99_ms_during": round(p99, 3),
            "claim_p99_rise": round(p99 / base_p99 - 1, 3) if base_p99 else None,
            "claim_p99_rise_paired": round(statistics.median(paired[how]), 3),
            "claim_p99_rises_paired": [round(rise, 3) for rise in paired[how]],
            **pooled_rise(
                [load.latencies_ms for load in windows[""]],
                [load.latencies_ms for load in windows[how]],
            ),
            "claim_p99_ms_windows_without": [
                round(percentile(load.latencies_ms, 0.99), 2) for load in windows[""]
            ],
            "claim_p99_ms_windows_during": [
                round(percentile(load.latencies_ms, 0.99), 2) for load in windows[how]
            ],
            "ingest_rows_per_second": round(ingest, 1),
            "purge_and_vacuum_over_ingest": round(with_vacuum / ingest, 1) if ingest else None,
        }


def pooled_rise(
    without: list[list[float]], during: list[list[float]], draws: int = 1000
) -> dict[str, Any]:
    """The rise of the p99 of every claim of a purge's windows over the p99 of every claim
    of the windows without a purge of the same rounds (the ``n``-th of ``during`` ran in
    the round of the ``n``-th of ``without``), and its 95% interval: the rounds drawn again
    with replacement ``draws`` times, the same rounds on both sides (a percentile
    bootstrap, seeded with `SEED`). A window's p99 rests on its few dozen slowest claims;
    the pooled one on every round's."""
    import numpy  # the benchmark's extra (with matplotlib)

    rounds = len(during)
    alone = [numpy.asarray(latencies) for latencies in without[:rounds]]
    purged = [numpy.asarray(latencies) for latencies in during]

    def p99(windows: list[Any]) -> float:
        values = numpy.concatenate(windows)
        k = min(len(values) - 1, int(0.99 * len(values)))  # as `percentile` takes it
        return float(numpy.partition(values, k)[k])

    rise = p99(purged) / p99(alone) - 1
    draw = numpy.random.default_rng(SEED)
    rises = sorted(
        p99([purged[i] for i in picked]) / p99([alone[i] for i in picked]) - 1
        for picked in (draw.integers(0, rounds, rounds) for _ in range(draws))
    )
    low, high = rises[int(0.025 * draws)], rises[min(draws - 1, int(0.975 * draws))]
    return {
        "claim_p99_rise_pooled": round(rise, 3),
        "claim_p99_rise_pooled_interval": [round(low, 3), round(high, 3)],
    }


ROUNDS = 3
"""Rounds of windows of claims alone and under each purge (`_purge_under_load`)."""
SEED = 0
"""The seed of the windows' order in each round (`--seed`)."""
STEADY = ("hour", "burn")
"""Purges that take an hour of the next tenth, not a tenth: the next purge takes the rest."""
PLAIN_PURGES = (("old", "new"), ("old", "new", "paced"))
LAYOUTS = ("plain", "partitioned", "compact", "idtime", "library_compact")


def run(
    shapes: list[str],
    sizes: list[int],
    seconds: float,
    threads: int,
    layouts: tuple[str, ...] = ("plain",),
    purges: bool = True,
) -> dict[str, Any]:
    report: dict[str, Any] = {"loads": [], "sizes": {}, "purge": {}, "ratios": []}
    top = max(sizes)
    CLOCK.start(top)
    with psycopg.connect(_url("postgres"), autocommit=True) as conn:
        report["server"] = {name: _setting(conn, name) for name in SETTINGS}
        report["server"]["address"] = SERVER.rsplit("@", 1)[-1]
    for layout, shape in [(layout, shape) for layout in layouts for shape in shapes]:
        name = series(shape, layout)
        _use(layout)
        _reset(layout)
        stored = 0
        claim_rate = 0.0
        for size in sorted(sizes):
            with psycopg.connect(_url(DATABASE), autocommit=True) as conn:
                began = time.monotonic()
                _fill(conn, shape, stored, size, layout)
                stored = size
                _settle(conn)
                filled = time.monotonic() - began
                report["sizes"][f"{name}/{size}"] = sizes_of(conn) | {"fill_seconds": filled}
            fresh = Counter(top * 4 + size)  # above every stored and purge-time number
            loads = {}
            for mode in ("update", "claim", "duplicate"):
                if mode == "duplicate" and not size:
                    continue
                loads[mode] = run_load(
                    mode, shape, stored, fresh, threads=threads, seconds=seconds, layout=layout
                )
                report["loads"].append(loads[mode].summary())
                print(json.dumps(loads[mode].summary()), flush=True)
            claim_rate = loads["claim"].rate
            report["ratios"].append(
                {
                    "shape": shape,
                    "layout": layout,
                    "rows": size,
                    "claim_over_update": round(claim_rate / loads["update"].rate, 3),
                }
            )
            # The claims of this size are part of the table now.
            with psycopg.connect(_url(DATABASE), autocommit=True) as conn:
                _settle(conn)
        if top and purges:
            report["purge"][name] = measure_purge(shape, top, claim_rate, threads, layout)
            print(json.dumps({name: report["purge"][name]}), flush=True)
    return report


def _setting(conn: psycopg.Connection[Any], name: str) -> str:
    row = conn.execute(f"SHOW {name}").fetchone()
    return str(row[0]) if row else "?"


def _sizes(text: str) -> list[int]:
    return [int(float(part)) for part in text.split(",") if part.strip()]


def table(report: dict[str, Any]) -> Iterator[str]:
    """The report as Markdown tables, for the performance page."""
    yield (
        "| shape | rows | claim / update | update tps | claim tps | claim p99 ms "
        "| WAL bytes a claim tx | blocks read a claim tx | duplicate tps |"
    )
    yield "|---|---|---|---|---|---|---|---|---|"
    loads = {
        (series(x["shape"], x.get("layout", "plain")), x["rows"], x["mode"]): x
        for x in report["loads"]
    }
    for ratio in report["ratios"]:
        key = (series(ratio["shape"], ratio.get("layout", "plain")), ratio["rows"])
        update, claim = loads[(*key, "update")], loads[(*key, "claim")]
        duplicate = loads.get((*key, "duplicate"), {}).get("tps", "-")
        yield (
            f"| {key[0]} | {key[1]:,} | {ratio['claim_over_update']} | {update['tps']} "
            f"| {claim['tps']} | {claim['p99_ms']} | {claim['wal_bytes_per_tx']} "
            f"| {claim['blocks_read_per_tx']} | {duplicate} |"
        )


def _thousands(value: float | None) -> str:
    return "-" if value is None else f"{value:,}"


def purge_table(report: dict[str, Any]) -> Iterator[str]:
    """The purges, side by side, as Markdown tables: their speed, the claims beside them,
    what they leave behind."""
    brief = {
        "drop": "a partition dropped",
        "drops": f"{DROPS} dropped",
        "old": "old",
        "new": "ranges",
        "paced": f"ranges, {DEFAULT_PURGE_RATE:,.0f}/s",
        "hour": "an hour",
        "burn": "no purge, 5% of a core",
    }
    purges = report["purge"]
    yield "| ids, purge | rows/s | vacuum: s, WAL MB | with the vacuum, rows/s | ÷ claims/s |"
    yield "|---|---|---|---|---|"
    for shape in purges:
        for phase in ("alone", "under_load"):
            for how, x in purges[shape][phase].items():
                loaded = phase == "under_load"
                yield (
                    f"| {shape}, {brief[how]}{', claims' if loaded else ', alone'} "
                    f"| {_thousands(x['rows_per_second'])} "
                    f"| {x['vacuum_seconds']}, {x['vacuum_wal_bytes'] / 1e6:.0f} "
                    f"| {_thousands(x['rows_per_second_with_vacuum'])} "
                    f"| {x['purge_and_vacuum_over_ingest'] if loaded else '-'} |"
                )
    yield ""
    yield (
        "| ids, purge | claims/s | windows | p50 ms | p99 ms | p99 | p99, paired by round "
        "| p99 of every claim (95% interval) |"
    )
    yield "|---|---|---|---|---|---|---|---|"
    for shape in purges:
        for how, x in purges[shape]["under_load"].items():
            low, high = x["claim_p99_rise_pooled_interval"]
            yield (
                f"| {shape}, {brief[how]} | {x['claim_rate']:.0f} | {x['rounds']} "
                f"| {x['claim_p50_ms_without']:.1f} → {x['claim_p50_ms_during']:.1f} "
                f"| {x['claim_p99_ms_without']:.1f} → {x['claim_p99_ms_during']:.1f} "
                f"| {x['claim_p99_rise']:+.0%} | {x['claim_p99_rise_paired']:+.0%} "
                f"| {x['claim_p99_rise_pooled']:+.0%} ({low:+.0%} to {high:+.0%}) |"
            )
    yield ""
    yield "| ids, purge | dead tuples before the vacuum | bytes a live row after it |"
    yield "|---|---|---|"
    for shape in purges:
        for phase in ("alone", "under_load"):
            for how, x in purges[shape][phase].items():
                loaded = phase == "under_load"
                yield (
                    f"| {shape}, {brief[how]}{', claims' if loaded else ', alone'} "
                    f"| {x['dead_tuples_before_vacuum']:,} | {x['bytes_per_live_row_after']:.0f} |"
                )


def charts(report: dict[str, Any], out: Path) -> list[Path]:
    """One chart a question: the claim's growth (`growth_charts`); does the purge, its
    vacuum included, outrun ingest (purge-rate.png)? What does it do to the claims beside
    it (purge-p99.png)?"""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = growth_charts.charts(report, out)
    rows = [
        (f"{shape} ids, {SHORT[how]}", x)
        for shape, purges in report["purge"].items()
        for how, x in purges["under_load"].items()
    ]
    if not rows:
        return written
    labels = [label for label, _ in rows]
    fig, ax = plt.subplots(figsize=(8, 0.7 * len(rows) + 2.6))
    ratios = [x["purge_and_vacuum_over_ingest"] or 0 for _, x in rows]
    ax.barh(range(len(rows)), ratios, color="#2f6db3", height=0.6)
    for index, ratio in enumerate(ratios):
        ax.text(ratio, index, f" {ratio:,.1f}x", va="center", fontsize=9)
    ax.axvline(3, color="black", linestyle="--", linewidth=1)
    ax.text(3, len(rows) - 0.45, " target: 3x", fontsize=8)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("rows removed a second (the purge and the VACUUM after it)\n÷ claims a second")
    ax.set_title(
        "Does the purge outrun ingest?\n(claims held at half their saturation rate)", fontsize=11
    )
    ax.spines[["top", "right"]].set_visible(False)
    written.append(out / "purge-rate.png")
    fig.savefig(written[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 0.7 * len(rows) + 2.6))
    for index, (_, x) in enumerate(rows):
        before, during = x["claim_p99_ms_without"], x["claim_p99_ms_during"]
        ax.plot([before, during], [index, index], color="#9aa9b8", zorder=1)
        ax.plot([before], [index], "o", color="#9aa9b8", label="before" if not index else None)
        ax.plot([during], [index], "o", color="#2f6db3", label="during" if not index else None)
        ax.plot([before * 1.2], [index], "|", color="black", markersize=12)
        ax.text(during, index - 0.25, f" {x['claim_p99_rise']:+.0%}", fontsize=8)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("claim p99, ms (bar: the target, +20%)")
    ax.set_title(
        "What the purge does to the claims beside it:\ntheir p99 before and during", fontsize=11
    )
    ax.legend(fontsize=8, loc="lower right")
    ax.spines[["top", "right"]].set_visible(False)
    written.append(out / "purge-p99.png")
    fig.savefig(written[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
    return written


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.growth", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="empty and 10^6 rows, 3 s loads")
    parser.add_argument("--sizes", type=_sizes, default=None, help="e.g. 0,1e6,1e7")
    parser.add_argument("--shapes", default="random,ordered")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument(
        "--layouts",
        default="plain",
        help="plain (the library's claims table), partitioned (bench.partitioned: a "
        "partition a day, the purge a dropped day), compact (the same with the compact "
        "row), idtime (the compact row partitioned by its id's time, an hour a partition: "
        "--shapes uuid7), library_compact (the library's compact claim, inbox_claims), or "
        "several: plain,partitioned,compact",
    )
    parser.add_argument(
        "--server",
        default=None,
        help="PostgreSQL URL without a database (default: BENCH_GROWTH_POSTGRES, else "
        "BENCH_POSTGRES, else 127.0.0.1:5432)",
    )
    parser.add_argument(
        "--empty-share",
        type=float,
        default=partitions.EMPTY_SHARE,
        help="library_compact: the share of a paced purge's time spent emptying hours",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="beside the purges under load, windows with no purge and a server backend "
        "busy 5%% of the time (what any small work beside the claims does to their p99)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help="rounds of windows beside the purges under load, each in an order of its own "
        "(a purge taking a tenth runs in as many as the tenths left allow)",
    )
    parser.add_argument("--seed", type=int, default=SEED, help="of the windows' order")
    parser.add_argument(
        "--window",
        type=float,
        default=DURING,
        help="seconds of claims a window of the purges under load lasts at least",
    )
    parser.add_argument(
        "--no-purge",
        action="store_true",
        help="the claims at each size only (a purge of a tenth of 10^8 random ids, paced, "
        "takes most of an hour)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    return parser


def main(argv: list[str] | None = None) -> None:
    global CONTROL, DURING, ROUNDS, SEED  # noqa: PLW0603 (the run's purges under load)
    parser = _parser()
    args = parser.parse_args(argv)
    sizes = args.sizes or ([0, 1_000_000] if args.quick else [0, 1_000_000, 10_000_000])
    seconds = args.seconds or (3.0 if args.quick else 20.0)
    shapes = [shape for shape in args.shapes.split(",") if shape]
    for shape in shapes:
        if shape not in _ID_SQL:
            parser.error(f"unknown shape {shape!r}: one of {', '.join(_ID_SQL)}")
    layouts = tuple(layout for layout in args.layouts.split(",") if layout)
    for layout in layouts:
        if layout not in LAYOUTS:
            parser.error(f"unknown layout {layout!r}: one of {', '.join(LAYOUTS)}")
    if "idtime" in layouts and shapes != ["uuid7"]:
        parser.error("the idtime layout partitions by the id's time: --shapes uuid7")
    if not 0 < args.empty_share <= 1:
        parser.error("--empty-share is a share of the time: above 0, at most 1")
    partitions.EMPTY_SHARE = args.empty_share
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    if args.window <= 1:
        parser.error("--window: over a second (the claims warm a second before a purge)")
    DURING = args.window
    CONTROL, ROUNDS, SEED = args.control, args.rounds, args.seed
    if args.server:
        global SERVER  # noqa: PLW0603 (the URL every connection of the run takes)
        SERVER = args.server.rstrip("/")
    began = time.monotonic()
    report = run(shapes, sizes, seconds, args.threads, layouts, purges=not args.no_purge)
    report["settings"] = {
        "empty_share": args.empty_share,
        "rounds": args.rounds,
        "seed": args.seed,
        "window_seconds": args.window,
        "sizes": sizes,
        "seconds": seconds,
        "threads": args.threads,
        "layouts": layouts,
        "purges": not args.no_purge,
    }
    report["elapsed_seconds"] = round(time.monotonic() - began, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "growth.json").write_text(json.dumps(report, indent=2, default=str))
    print("\n".join(table(report)))
    if report["purge"]:
        print("\n".join(purge_table(report)))
    for chart in charts(report, args.out):
        print(f"chart: {chart}")
    print(json.dumps({"sizes": report["sizes"], "purge": report["purge"]}, indent=2))
    print(f"server: {report['server']}")
    print(f"elapsed: {report['elapsed_seconds']} s; written to {args.out / 'growth.json'}")


if __name__ == "__main__":
    main()
