"""The growth benchmark (`python -m bench.growth`) on a small table: its figures come from
what really happened (claims inserted, a tenth purged, the table's bytes)."""

from __future__ import annotations

import json
import statistics
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from bench import growth, partitioned
from bench.common import PG

pytestmark = pytest.mark.postgres

TWO_SIZES = {(0, "update"), (0, "claim"), (20000, "update"), (20000, "claim"), (20000, "duplicate")}
"""The loads of a run of ``--sizes 0,20000``: no duplicate on the empty table."""


@pytest.fixture
def database(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"inbox_growth_{uuid.uuid4().hex[:8]}"
    monkeypatch.setattr(growth, "DATABASE", name)
    monkeypatch.setattr(growth, "DURING", 1.5)
    monkeypatch.setattr(growth, "ROUNDS", 1)
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
        # Each purge takes a tenth: the old statement and the block-range walk alone, then
        # the old, the unpaced and the paced walk beside claims.
        purges = report["purge"][shape]
        assert set(purges["alone"]) == {"old", "new"}
        assert set(purges["under_load"]) == {"old", "new", "paced"}
        for result in [*purges["alone"].values(), *purges["under_load"].values()]:
            assert result["rows"] in (2000, 2001)
            # the VACUUM's own account: none left; all removed by it, or, under claims,
            # some pruned before it by the claims' own visits to those pages
            assert result["dead_tuples_after_vacuum"] == 0
            assert 0 < result["vacuum_removed_tuples"] <= result["rows"]
            assert result["vacuum_wal_bytes"] > 0
        for result in purges["alone"].values():
            assert result["vacuum_removed_tuples"] == result["rows"]
            assert result["vacuum_passes"] == 1
        assert purges["under_load"]["paced"]["ingest_rows_per_second"] > 0
    assert (tmp_path / "purge-rate.png").stat().st_size > 0
    assert (tmp_path / "purge-p99.png").stat().st_size > 0
    assert all(load["tps"] > 0 for load in report["loads"])
    # The claims themselves went in: every claim transaction inserted a row.
    with psycopg.connect(f"{PG}/{database}") as conn:
        row = conn.execute("SELECT count(*) FROM consumer_inbox").fetchone()
    assert row is not None
    assert row[0] > 20000 - 5 * 2001
    assert list(growth.table(report))[2].startswith("| random | 0 |")


@pytest.mark.parametrize(
    ("layout", "shape"), [("partitioned", "random"), ("compact", "random"), ("idtime", "uuid7")]
)
def test_growth__a_partitioned_layout_claims_in_its_partition_and_drops_the_oldest(
    database: str, tmp_path: Path, layout: str, shape: str
) -> None:
    growth.main(
        [
            "--sizes",
            "0,20000",
            "--seconds",
            "0.5",
            "--threads",
            "2",
            "--shapes",
            shape,
            "--layouts",
            layout,
            "--out",
            str(tmp_path),
        ]
    )
    report = json.loads((tmp_path / "growth.json").read_text())

    name = f"{shape}, {layout}"
    assert {load["layout"] for load in report["loads"]} == {layout}
    assert {(load["rows"], load["mode"]) for load in report["loads"]} == TWO_SIZES
    sizes = report["sizes"][f"{name}/20000"]
    assert sizes["rows"] > 20000
    assert 0 < sizes["primary_key_bytes"] < sizes["index_bytes"] + 1
    assert 60 < sizes["bytes_per_row"] < 2000
    # Each dropped partition (a day, or an hour for idtime) held the generated rows of its
    # part of the 14 days: alone the oldest, a part of one; under load the next DROPS.
    purges = report["purge"][name]
    assert set(purges["alone"]) == {"drop"}
    assert set(purges["under_load"]) == {"drops"}
    partitions = growth.WINDOW.days * 24 // partitioned.HOURS[layout]
    a_partition = 20000 / partitions + 1
    dropped = [purges["alone"]["drop"]["rows"], purges["under_load"]["drops"]["rows"]]
    assert 0 <= dropped[0] <= a_partition, dropped
    assert 0 < dropped[1] <= growth.DROPS * a_partition, dropped
    # The paced drops take DROP_PACE seconds each but the last.
    assert purges["under_load"]["drops"]["seconds"] >= (growth.DROPS - 1) * growth.DROP_PACE
    assert purges["under_load"]["drops"]["ingest_rows_per_second"] > 0
    assert list(growth.table(report))[2].startswith(f"| {name} | 0 |")
    with psycopg.connect(f"{PG}/{database}") as conn:
        row = conn.execute("SELECT count(*) FROM consumer_inbox").fetchone()
        leaves = conn.execute(
            "SELECT count(*) FROM pg_partition_tree('consumer_inbox') WHERE isleaf"
        ).fetchone()
    assert row is not None and leaves is not None
    # Every claim went in (the generated rows less the partitions dropped, and the claims).
    assert row[0] > 20000 - sum(dropped)
    assert (
        leaves[0] == (growth.WINDOW.days + 3) * 24 // partitioned.HOURS[layout] - 1 - growth.DROPS
    )


@pytest.mark.parametrize("shape", ["random", "uuid7"])
def test_growth__the_librarys_compact_claim_in_its_own_table(
    database: str, tmp_path: Path, shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(growth, "BURN_SECONDS", 0.3)
    growth.main(
        [
            *("--sizes", "0,20000", "--seconds", "0.5", "--threads", "2"),
            *("--shapes", shape, "--layouts", "library_compact", "--out", str(tmp_path)),
            *("--empty-share", "0.5"),  # the hours' pace: a few ms of pause an hour
            # two rounds, each in its own order, paired by round
            *(["--control", "--rounds", "2"] if shape == "uuid7" else []),
        ]
    )
    report = json.loads((tmp_path / "growth.json").read_text())

    name = f"{shape}, library_compact"
    # The duplicates found the generated rows: the fill wrote the key the library computes
    assert {(load["rows"], load["mode"]) for load in report["loads"]} >= {
        (20000, "claim"),
        (20000, "duplicate"),
    }
    sizes = report["sizes"][f"{name}/20000"]
    assert sizes["rows"] > 20000
    assert 80 < sizes["bytes_per_row"] < 2000  # the few rows share ~400 hourly partitions
    purges = report["purge"][name]
    assert set(purges["alone"]) == {"new"}
    control = {"burn"} if shape == "uuid7" else set()
    assert set(purges["under_load"]) == {"hour", "new", "paced", *control}
    rounds = 2 if control else 1
    loaded = purges["under_load"]
    orders = loaded["hour"]["orders"]
    assert len(orders) == rounds
    assert all(sorted(order) == sorted(["", "hour", "new", "paced", *control]) for order in orders)
    for x in loaded.values():
        assert len(x["claim_p99_ms_windows_during"]) == len(x["rows_each"]) == rounds
        assert len(x["claim_p99_rises_paired"]) == rounds
        paired = statistics.median(x["claim_p99_rises_paired"])
        assert x["claim_p99_rise_paired"] == pytest.approx(paired, abs=0.001)
        low, high = x["claim_p99_rise_pooled_interval"]
        assert low <= high and x["claim_p99_rise_pooled"] > -1
    if control:  # no purge: the claims beside a busy backend alone
        assert loaded["burn"]["rows_each"] == [0, 0]
        assert loaded["burn"]["seconds"] >= 0.3
    # random ids: walked, a tenth exactly; UUIDv7 ids: the hours wholly past the tenth's
    # end emptied (its last hour, partly younger, stays for the next purge). The steady
    # case (an hour past the last purge's end) takes the next hour: of the tenth the
    # next purge takes the rest of, or, last in its round, of the tenth after.
    hour = 20000 / (14 * 24)
    assert all(0 < rows < 3 * hour for rows in loaded["hour"]["rows_each"])
    tenths = 1 + 2 * rounds
    removed = purges["alone"]["new"]["rows"] + sum(
        sum(x["rows_each"]) for how, x in loaded.items() if how != "hour"
    )
    hours_last = sum(
        rows
        for rows, order in zip(loaded["hour"]["rows_each"], orders, strict=True)
        if order.index("hour") > max(order.index("new"), order.index("paced"))
    )
    removed += sum(loaded["hour"]["rows_each"]) - hours_last
    if shape == "random":
        assert tenths * 2000 <= removed <= tenths * 2001, removed
    else:
        assert abs(removed - tenths * 2000) < 2 * hour, removed
    for result in [*purges["alone"].values(), *loaded.values()]:
        assert result["dead_tuples_after_vacuum"] == 0
    with psycopg.connect(f"{PG}/{database}") as conn:
        compact = conn.execute("SELECT count(*) FROM inbox_claims").fetchone()
        library = conn.execute("SELECT count(*) FROM consumer_inbox").fetchone()
    assert compact is not None and library is not None
    assert (compact[0] > 20000 - 3 * 2001, library[0]) == (True, 0)


def test_pooled_rise__every_claim_of_the_rounds_and_an_interval_from_drawing_them_again() -> None:
    without = [[float(n) for n in range(1, 101)], [float(n) for n in range(101, 201)]]
    # every claim of a purge's windows half as slow again: +50% whichever rounds are drawn
    during = [[value * 1.5 for value in window] for window in without]
    assert growth.pooled_rise(without, during) == {
        "claim_p99_rise_pooled": 0.5,
        "claim_p99_rise_pooled_interval": [0.5, 0.5],
    }
    # the pooled p99 is that of every claim together: the 199th slowest of 200 (199 ms
    # without; the second round's five slowest 100 ms slower with: 299)
    slower = [without[0], [value + (100 if value > 195 else 0) for value in without[1]]]
    pooled = growth.pooled_rise(without, slower)
    assert pooled["claim_p99_rise_pooled"] == pytest.approx(299 / 199 - 1, abs=0.001)
    low, high = pooled["claim_p99_rise_pooled_interval"]
    assert 0 <= low < high <= 200 / 100 - 1  # rounds drawn again: one, the other, both
    # a purge that ran in the first round only is set beside that round's window alone
    assert growth.pooled_rise(without, [[value * 2 for value in without[0]]]) == {
        "claim_p99_rise_pooled": 1.0,
        "claim_p99_rise_pooled_interval": [1.0, 1.0],
    }


def test_vacuum_counts__the_tuples_a_verbose_vacuum_removed_and_left_over_its_tables() -> None:
    def finished(removed: int, left: int, tail: str = "") -> str:
        return (
            'finished vacuuming "db.public.t": index scans: 1\npages: 0 removed, 9 remain\n'
            f"tuples: {removed} removed, 70 remain, {left} are dead but not yet removable{tail}\n"
        )

    said = ['vacuuming "db.public.t"', finished(2000, 3), finished(5, 0, ", oldest xmin: 7")]
    assert growth.vacuum_counts(said) == (2005, 3)
    assert growth.vacuum_counts(['vacuuming "db.public.t"']) is None


def test_growth__without_the_purge_it_measures_the_claims_and_draws_their_charts(
    database: str, tmp_path: Path
) -> None:
    growth.main(
        [
            *("--sizes", "0,20000", "--seconds", "0.5", "--threads", "2", "--no-purge"),
            *("--shapes", "random", "--layouts", "library_compact", "--out", str(tmp_path)),
        ]
    )
    report = json.loads((tmp_path / "growth.json").read_text())

    assert report["purge"] == {}
    assert report["settings"]["purges"] is False
    assert {(load["rows"], load["mode"]) for load in report["loads"]} == TWO_SIZES
    charts = sorted(path.name for path in tmp_path.glob("*.png"))
    assert charts == ["growth-bytes.png", "growth-claim.png", "growth-wal.png"]
    with psycopg.connect(f"{PG}/{database}") as conn:
        row = conn.execute("SELECT count(*) FROM inbox_claims").fetchone()
    # nothing purged: the generated rows and every claim of the loads are there
    assert row is not None and row[0] > 20000
