"""The partitioned claims table of `bench.partitioned` (the library's columns, a partition
a day of arrival, the claim one statement calling the layout's function) keeps one claim
per identity across the partition boundary, under concurrency: the design's condition for
any partitioned layout, shown for the prototypes in `test_partition_boundary.py`, here
on the layout the growth benchmark measures, with the server's own clock deciding the
partition.

Each test puts a boundary about a second ahead of the server's clock, between two
partitions, and claims the same identity on both sides of it. The claims that are wrong
on purpose (the plain insert; the lock and the look-up in one statement) are run too, and
must let a second claim through: the tests can fail.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from bench import partitioned
from bench.common import PG

DAY = timedelta(days=1)

pytestmark = pytest.mark.postgres


@pytest.fixture
def database() -> Iterator[str]:
    name = f"inbox_partitions_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"{PG}/{name}"
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _began(conn: psycopg.Connection[Any]) -> datetime:
    """BEGIN on ``conn``; answers the transaction's start, the time its claim is
    partitioned by."""
    conn.execute("BEGIN")
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    began: datetime = row[0]
    return began


def _boundary(url: str, at: datetime, how: str = "function") -> datetime:
    """The claims table of a claim (``how``) as two partitions meeting at ``at``."""
    layout = how if how in partitioned.ROWS else "partitioned"  # the library's row
    table, function, _ = partitioned.ROWS[layout]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(table)
        for lower, upper in ((at - DAY, at), (at, at + DAY)):
            partitioned.add_partition(conn, lower, upper, layout=layout)
        if function is not None:
            conn.execute(function)
    return at


def _wait_past(conn: psycopg.Connection[Any], at: datetime) -> None:
    while True:
        now = conn.execute("SELECT clock_timestamp()").fetchone()
        assert now is not None
        if now[0] > at + timedelta(milliseconds=20):
            return
        time.sleep(0.01)


def _params(message_id: str) -> dict[str, Any]:
    return {
        "consumer_name": "ledger",
        "producer_name": "orders",
        "tenant": "",
        "message_id": message_id,
        "payload_sha256": "0" * 64,
        "hash_scheme": "v1",
        "handler_version": "",
        "trace_id": None,
        "produced_at": None,
        "received_at": datetime.now().astimezone(),
        "lock_timeout": "10s",
    }


_COMPACT = {
    "compact": (partitioned.COMPACT_CLAIM, partitioned.compact_params),
    "idtime": (partitioned.ID_TIME_CLAIM, partitioned.id_time_params),
}


def _claim(conn: psycopg.Connection[Any], how: str, message_id: str) -> bool:
    """One claim statement in the connection's open transaction: claimed or not. ``how``:
    one of `partitioned.CLAIMS`, ``compact`` (the function over the compact row) or
    ``idtime`` (the insert partitioned by the id's time)."""
    if how in _COMPACT:
        claim, shaped = _COMPACT[how]
        row = conn.execute(claim, shaped(_params(message_id))).fetchone()
    else:
        row = conn.execute(partitioned.CLAIMS[how], _params(message_id)).fetchone()
    return row is not None and row[0] is not None


def _stored(url: str, message_id: str, how: str) -> int:
    """The rows stored for one message id by a claim (``how``)."""
    if how not in _COMPACT:
        return sum(_rows(url, message_id).values())
    identity = _COMPACT[how][1](_params(message_id))["identity"]
    with psycopg.connect(url) as conn:
        row = conn.execute(
            f"SELECT count(*) FROM {partitioned.TABLE} WHERE identity = %s", (identity,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def _rows(url: str, message_id: str | None = None) -> dict[str, int]:
    """Rows per message id."""
    with psycopg.connect(url) as conn:
        where, args = ("WHERE message_id = %s", (message_id,)) if message_id else ("", ())
        rows = conn.execute(
            f"SELECT message_id, count(*) FROM {partitioned.TABLE} {where} GROUP BY 1", args
        ).fetchall()
    return {str(m): int(n) for m, n in rows}


def _waiting(url: str, pid: int) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
    return bool(row and row[0])


def _race(url: str, how: str, *, first_ends: str) -> tuple[bool, bool, int]:
    """A first delivery claims before the boundary and holds its transaction open past
    it; a redelivery begins after the boundary and claims while the first is still open
    (until it waits on a lock, or has inserted); then the first ends (``commit`` or
    ``rollback``). Answers whether each claimed, and the rows stored for the message."""
    with (
        psycopg.connect(url, autocommit=True) as first,
        psycopg.connect(url, autocommit=True) as second,
    ):
        boundary = _boundary(url, _began(first) + timedelta(seconds=0.5), how)
        message_id = _message_id(how, boundary)
        first_claimed = _claim(first, how, message_id)
        _wait_past(second, boundary)
        second.execute("BEGIN")
        with ThreadPoolExecutor(1) as pool:
            redelivery = pool.submit(_claim, second, how, message_id)
            deadline = time.monotonic() + 10
            while not redelivery.done() and not _waiting(url, second.info.backend_pid):
                assert time.monotonic() < deadline, "the redelivery neither waits nor ends"
                time.sleep(0.02)
            first.execute(first_ends.upper())
            second_claimed = redelivery.result(timeout=10)
        second.execute("COMMIT")
    return first_claimed, second_claimed, _stored(url, message_id, how)


def _message_id(how: str, boundary: datetime) -> str:
    """A random id; for ``idtime``, a UUIDv7 sent an hour before the boundary (so that,
    partitioned by its time, every copy goes to the older partition)."""
    if how != "idtime":
        return str(uuid.uuid4())
    sent = f"{int((boundary - timedelta(hours=1)).timestamp() * 1000):012x}"
    return f"{sent[:8]}-{sent[8:]}-7abc-8def-{uuid.uuid4().hex[:12]}"


@pytest.mark.parametrize("how", ["function", "compact", "idtime"])
def test_redelivery_racing_the_first_delivery_across_the_boundary__one_claim(
    database: str, how: str
) -> None:
    first, second, rows = _race(database, how, first_ends="commit")

    assert (first, second) == (True, False)
    assert rows == 1


@pytest.mark.parametrize("how", ["one_statement", "without_lock"])
def test_the_claims_wrong_on_purpose__let_the_racing_redelivery_through(
    database: str, how: str
) -> None:
    first, second, rows = _race(database, how, first_ends="commit")

    assert (first, second) == (True, True)
    assert rows == 2


@pytest.mark.parametrize("how", ["function", "compact"])
def test_first_delivery_rolled_back_across_the_boundary__the_redelivery_claims(
    database: str, how: str
) -> None:
    first, second, rows = _race(database, how, first_ends="rollback")

    assert (first, second) == (True, True)
    assert rows == 1


@pytest.mark.parametrize(("how", "claimed_again"), [("function", False), ("without_lock", True)])
def test_redelivery_on_the_next_day__seen_in_the_older_partition(
    database: str, how: str, claimed_again: bool
) -> None:
    message_id = str(uuid.uuid4())
    with psycopg.connect(database, autocommit=True) as conn:
        boundary = _boundary(database, _began(conn) + timedelta(seconds=0.3))
        assert _claim(conn, how, message_id)
        conn.execute("COMMIT")
        _wait_past(conn, boundary)
        conn.execute("BEGIN")
        assert _claim(conn, how, message_id) is claimed_again
        conn.execute("COMMIT")

    assert sum(_rows(database, message_id).values()) == (2 if claimed_again else 1)


def test_many_workers_claiming_the_same_identities_across_the_boundary__each_once(
    database: str,
) -> None:
    """Six connections claim the same 400 identities in the same order over about two
    seconds, the boundary in the middle, each holding its claim open for a random few
    milliseconds (some rolling back): every identity stored once, and claimed by exactly
    one transaction that committed."""
    with psycopg.connect(database, autocommit=True) as conn:
        now = conn.execute("SELECT now()").fetchone()
        assert now is not None
    boundary = _boundary(database, now[0] + timedelta(seconds=1.0))
    ids = [str(uuid.uuid4()) for _ in range(400)]
    committed: dict[str, int] = dict.fromkeys(ids, 0)
    lock = threading.Lock()
    began = time.monotonic()
    sides = {"before": 0, "after": 0}

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        with psycopg.connect(database, autocommit=True) as conn:
            for n, message_id in enumerate(ids):
                # Identity n is claimed about 5 ms * n after the start, by every worker.
                pause = began + n * 0.005 - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                conn.execute("BEGIN")
                row = conn.execute("SELECT now() < %s", (boundary,)).fetchone()
                assert row is not None
                claimed = _claim(conn, "function", message_id)
                time.sleep(rng.uniform(0, 0.02))
                # Half the workers roll a fifth of their claims back (the others never do,
                # so that every identity ends claimed).
                if claimed and seed % 2 and rng.random() < 0.2:
                    conn.execute("ROLLBACK")
                    continue
                conn.execute("COMMIT")
                with lock:
                    sides["before" if row[0] else "after"] += 1
                    committed[message_id] += claimed

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(worker, range(6)))

    rows = _rows(database)
    assert sides["before"] > 100 and sides["after"] > 100, sides
    assert sorted(rows.values()) == [1] * len(ids)
    assert all(count == 1 for count in committed.values()), {
        k: v for k, v in committed.items() if v != 1
    }


def test_drop_oldest__detaches_and_drops_a_whole_day_while_claims_go_on(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        today = conn.execute("SELECT current_date").fetchone()
        assert today is not None
        partitioned.create(conn, today[0] - timedelta(days=2), days=4)
        conn.execute(
            f"""INSERT INTO {partitioned.TABLE} (consumer_name, producer_name, message_id,
                    payload_sha256, hash_scheme, processed_at)
                SELECT 'ledger', 'orders', 'old-' || n, '', 'v1', now() - interval '2 days'
                FROM generate_series(1, 1000) n"""
        )
        before = partitioned.partitions(conn)

        name, rows = partitioned.drop_oldest(conn)

        assert (name, rows) == (before[0], 1000)
        assert partitioned.partitions(conn) == before[1:]
        conn.execute("BEGIN")
        assert _claim(conn, "function", "new")
        conn.execute("COMMIT")
    assert _rows(database) == {"new": 1}


def test_id_time_key__rises_with_the_time_in_the_id_and_matches_the_sql(database: str) -> None:
    """The id-time key begins with the id's milliseconds (a claim writes near the right
    edge of its partition's index), and the worker's key is the one the SQL computes."""
    sent = [datetime.now().astimezone() + timedelta(milliseconds=n) for n in range(0, 50, 7)]
    ids = [
        f"{ms[:8]}-{ms[8:]}-7abc-8def-{uuid.uuid4().hex[:12]}"
        for ms in (f"{int(at.timestamp() * 1000):012x}" for at in sent)
    ]
    keys = [partitioned.id_time_params(_params(message_id))["identity"] for message_id in ids]
    sql = partitioned.ID_TIME_DIGEST_SQL.format(c="%(c)s", p="%(p)s", t="%(t)s", m="%(m)s")
    with psycopg.connect(database) as conn:
        computed = [
            conn.execute(
                f"SELECT {sql}", {"c": "ledger", "p": "orders", "t": "", "m": message_id}
            ).fetchone()
            for message_id in ids
        ]

    assert keys == sorted(keys)
    assert [row[0] if row else None for row in computed] == keys
