"""Time-bounded partitions for the claims, and uniqueness at a partition's boundary.

A design test, written before any layout ships (issue: the inbox at a hundred million
rows, item 3): the purge could drop whole partitions instead of deleting rows, but a
unique key on a partitioned table must contain the partition key, so the claim is unique
only within one partition. Each layout below is a prototype in a schema of its own; the
race is a first delivery and its redelivery claimed at once, on both sides of a boundary.

- By arrival time: the copies land in two partitions and both claim (the hazard).
- By a time that is part of the identity (the producer's ``produced_at``, a UUIDv7's
  timestamp): every copy lands in the same partition, and its key decides.
- Other ids: claim in the arrival partition, after checking the older ones, under a
  transaction-scoped advisory lock on the identity's hash: the copies take turns.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from ..support import services

pytestmark = pytest.mark.postgres

ROUNDS = 40
DAY_1, DAY_2 = "2026-01-01 23:59:59.999+00", "2026-01-02 00:00:00+00"


def _url() -> str:
    return services.POSTGRES_SERVER.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture
def schema() -> Iterator[str]:
    name = f"partitions_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_url(), autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
        conn.execute(
            f"""CREATE TABLE {name}.claims (
                    message_id text NOT NULL, at timestamptz NOT NULL,
                    PRIMARY KEY (message_id, at)
                ) PARTITION BY RANGE (at)"""
        )
        for day, low, high in (
            ("d1", "2026-01-01", "2026-01-02"),
            ("d2", "2026-01-02", "2026-01-03"),
        ):
            conn.execute(
                f"CREATE TABLE {name}.claims_{day} PARTITION OF {name}.claims "
                f"FOR VALUES FROM ('{low}') TO ('{high}')"
            )
    yield name
    with psycopg.connect(_url(), autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {name} CASCADE")


Claim = Callable[[psycopg.Connection[Any], str, str, str], bool]
"""(connection, schema, message id, the time it is partitioned by) -> claimed."""


def _race(schema: str, claim: Claim, first_at: str, second_at: str) -> list[int]:
    """ROUNDS identities, each claimed at once by two connections (a first delivery at
    ``first_at``, its redelivery at ``second_at``); answer how many claims won, each."""
    wins: list[int] = []
    with psycopg.connect(_url()) as a, psycopg.connect(_url()) as b:
        for n in range(ROUNDS):
            message = f"m{n}"
            barrier = threading.Barrier(2)
            won = [False, False]

            def copy(
                index: int,
                conn: psycopg.Connection[Any],
                at: str,
                message: str = message,
                barrier: threading.Barrier = barrier,
                won: list[bool] = won,
            ) -> None:
                barrier.wait()
                with conn.transaction():
                    won[index] = claim(conn, schema, message, at)

            threads = [
                threading.Thread(target=copy, args=(0, a, first_at)),
                threading.Thread(target=copy, args=(1, b, second_at)),
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wins.append(sum(won))
    return wins


def _insert(conn: psycopg.Connection[Any], schema: str, message: str, at: str) -> bool:
    inserted = conn.execute(
        f"INSERT INTO {schema}.claims VALUES (%s, %s) ON CONFLICT DO NOTHING RETURNING 1",
        (message, at),
    ).fetchone()
    return inserted is not None


def test_partitions__by_arrival_time_a_redelivery_across_the_boundary_claims_again(
    schema: str,
) -> None:
    # The first copy arrives just before midnight, its redelivery just after.
    wins = _race(schema, _insert, DAY_1, DAY_2)
    assert wins == [2] * ROUNDS  # every message applied twice: the hazard


def test_partitions__by_a_time_in_the_identity_every_copy_meets_the_same_key(
    schema: str,
) -> None:
    # The producer's produced_at is part of the identity: both copies carry the same one,
    # whenever they arrive.
    wins = _race(schema, _insert, DAY_1, DAY_1)
    assert wins == [1] * ROUNDS


def _locked_claim(conn: psycopg.Connection[Any], schema: str, message: str, at: str) -> bool:
    """Claim in the arrival partition once no partition holds the identity, the check and
    the insert serialized per identity by a transaction-scoped advisory lock."""
    conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (message,))
    if conn.execute(f"SELECT 1 FROM {schema}.claims WHERE message_id = %s", (message,)).fetchone():
        return False
    return _insert(conn, schema, message, at)


def test_partitions__other_ids_claim_under_an_advisory_lock_across_the_boundary(
    schema: str,
) -> None:
    wins = _race(schema, _locked_claim, DAY_1, DAY_2)
    assert wins == [1] * ROUNDS
    with psycopg.connect(_url()) as conn:
        rows = conn.execute(f"SELECT count(*) FROM {schema}.claims").fetchone()
    assert rows == (ROUNDS,)
