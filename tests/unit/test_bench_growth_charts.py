"""The growth benchmark's charts of the claim are drawn from its reports, several runs
together, the docs' own included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench import growth_charts

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "assets" / "benchmark"


def _report(layout: str, rows: int, ratio: float, wal: float) -> dict[str, Any]:
    loads = [
        {"mode": mode, "shape": "random", "layout": layout, "rows": size, "tps": 100.0,
         "wal_bytes_per_tx": wal if size else 360.0, "blocks_read_per_tx": 0.0}
        for size in (0, rows)
        for mode in ("update", "claim")
    ]  # fmt: skip
    sized = {"bytes_per_row": 118.0, "table_bytes_per_row": 78.0, "primary_key_bytes_per_row": 40.0}
    return {
        "loads": loads,
        "ratios": [
            {"shape": "random", "layout": layout, "rows": 0, "claim_over_update": 0.6},
            {"shape": "random", "layout": layout, "rows": rows, "claim_over_update": ratio},
        ],
        "sizes": {f"{growth_charts.series('random', layout)}/{rows}": sized},
        "purge": {},
    }


def test_growth_charts__a_later_run_replaces_an_earlier_one_for_the_same_series_and_size():
    first = _report("library_compact", 10**7, 0.30, 5000.0)
    second = _report("library_compact", 10**7, 0.57, 400.0)
    other = _report("plain", 10**8, 0.52, 6500.0)

    merged = growth_charts.merge([first, other, second])

    ratios = {(x["layout"], x["rows"]): x["claim_over_update"] for x in merged["ratios"]}
    assert ratios == {
        ("library_compact", 0): 0.6,
        ("library_compact", 10**7): 0.57,
        ("plain", 0): 0.6,
        ("plain", 10**8): 0.52,
    }
    claims = [x for x in merged["loads"] if x["mode"] == "claim" and x["rows"] == 10**7]
    assert [x["wal_bytes_per_tx"] for x in claims] == [400.0]
    assert set(merged["sizes"]) == {"random, library_compact/10000000", "random/100000000"}


def test_growth_charts__a_run_without_purges_draws_the_claim_s_three(tmp_path: Path):
    written = growth_charts.charts(_report("library_compact", 10**8, 0.55, 380.0), tmp_path)

    assert [path.name for path in written] == [
        "growth-claim.png",
        "growth-wal.png",
        "growth-bytes.png",
    ]
    assert all(path.read_bytes().startswith(b"\x89PNG") for path in written)


def test_growth_charts__the_docs_charts_redraw_from_their_reports(tmp_path: Path):
    reports = sorted(DOCS.glob("growth-*.json"))
    assert reports, "the performance page's growth runs are kept beside their charts"

    growth_charts.main([*map(str, reports), "--out", str(tmp_path)])

    for name in ("growth-claim.png", "growth-wal.png", "growth-bytes.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
        assert (DOCS / name).is_file(), f"{name} is on the performance page"
    merged = growth_charts.merge([json.loads(path.read_text()) for path in reports])
    assert max(x["rows"] for x in merged["ratios"]) >= 10**8
