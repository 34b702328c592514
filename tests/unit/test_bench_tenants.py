"""The isolation benchmark's summary (`python -m bench.tenants`): a ratio a pair, and one
over the runs."""

from __future__ import annotations

import pytest
from bench.tenants import Run, summary


def _run(kind: str, per_s: float, p99: float) -> Run:
    return Run(kind, 100, 100, 0, 0, per_s, p99, 1.0, p99, p99, 0, [], [])


def test_summary__ratios_by_pair_and_over_the_runs() -> None:
    runs = [
        _run("baseline", 30, 8.0),
        _run("outage", 30, 8.8),
        _run("baseline", 30, 10.0),
        _run("outage", 27, 9.0),
    ]

    result = summary("faststream", runs, 45.0, 60.0, 2)

    assert result["p99_ratio"] == pytest.approx([1.1, 0.9])
    assert result["throughput_ratio"] == pytest.approx([1.0, 0.9])
    assert result["p99_ratio_over_runs"] == pytest.approx(17.8 / 18.0)
    assert result["throughput_ratio_over_runs"] == pytest.approx(57 / 60)
    assert result["baseline_p99_spread"] == pytest.approx(1.25)
    assert (result["lost"], result["twice"]) == (0, 0)
