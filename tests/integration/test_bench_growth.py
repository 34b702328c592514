"""The growth benchmark (`python -m bench.growth`) on a small table: its figures come from
what really happened (claims inserted, a tenth purged, the table's bytes)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from bench import growth
from bench.common import PG

pytestmark = pytest.mark.postgres


@pytest.fixture
def database(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"inbox_growth_{uuid.uuid4().hex[:8]}"
    monkeypatch.setattr(growth, "DATABASE", name)
    yield name
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_growth__measures_claims_duplicates_and_the_purge_on_a_filled_table(
    database: str, tmp_path: Path
) -> None:
    growth.main(
        ["--sizes", "0,20000", "--seconds", "0.5", "--threads", "2", "--out", str(tmp_path)]
    )
    report = json.loads((tmp_path / "growth.json").read_text())

    modes = {(load["shape"], load["rows"], load["mode"]) for load in report["loads"]}
    for shape in ("random", "ordered"):
        assert {(shape, 0, "update"), (shape, 0, "claim")} <= modes
        assert {(shape, 20000, mode) for mode in ("update", "claim", "duplicate")} <= modes
        # The generated rows, and the claims made on the empty table before them.
        assert report["sizes"][f"{shape}/20000"]["rows"] > 20000
        assert 60 < report["sizes"][f"{shape}/20000"]["bytes_per_row"] < 2000
        # Row n was processed at (oldest + n steps): the oldest tenth is 2,000 rows, and
        # the clock moves by less than a step (a minute) during the run.
        alone = report["purge"][shape]["alone"]
        assert alone["rows"] in (2000, 2001)
        assert report["purge"][shape]["under_load"]["rows"] in (2000, 2001)
    assert all(load["tps"] > 0 for load in report["loads"])
    # The claims themselves went in: every claim transaction inserted a row.
    with psycopg.connect(f"{PG}/{database}") as conn:
        row = conn.execute("SELECT count(*) FROM consumer_inbox").fetchone()
    assert row is not None
    assert row[0] > 20000 - 2 * 2001
    assert list(growth.table(report))[2].startswith("| random | 0 |")
