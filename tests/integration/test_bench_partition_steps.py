"""`python -m bench.partition_steps` runs each step of the compact purge between a
worker's claims, on the test server."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from bench import partition_steps
from bench.common import PG
from sqlalchemy import create_engine

from inbox_middleware._storage import InboxSchema, partitions

pytestmark = pytest.mark.postgres


@pytest.fixture
def database(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = "inbox_partition_steps_test"
    monkeypatch.setattr(partition_steps, "DATABASE", name)
    yield name
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_partition_steps__each_step_runs_between_two_claims(database: str) -> None:
    report = partition_steps.run(PG, hours=70, rounds=2)

    assert list(report["claim_ms_after"]) == list(partition_steps.STEPS)
    assert list(report["step_ms"]) == list(partition_steps.STEPS)
    assert all(ms > 0 for ms in report["claim_ms_after"].values())
    assert all(ms > 0 for ms in report["step_ms"].values())
    assert report["claim_ms_steady"] > 0
    # Each round: an hour filled then truncated, 1 + 4 + 24 dropped, one attached
    engine = create_engine(f"{PG}/{database}".replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as conn:
            hours = partitions.hourly(conn, InboxSchema())
            assert len(hours) == 70 - 2 * 29 + 2
            truncated = [hour.name for hour in hours[2:4]]  # after the two attached in 2001
            counts = [
                conn.exec_driver_sql(f"SELECT count(*) FROM {name}").scalar() for name in truncated
            ]
    finally:
        engine.dispose()
    assert counts == [0, 0]
