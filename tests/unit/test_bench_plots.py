"""The benchmark's charts are drawn from a results file, the docs' own included."""

from __future__ import annotations

from pathlib import Path

from bench import plots
from bench.common import Measurement, Report

ROOT = Path(__file__).resolve().parents[2]
DOCS_RESULTS = ROOT / "docs" / "assets" / "benchmark" / "results.json"


def test_plots__the_docs_charts_redraw_from_their_results_file(tmp_path: Path):
    report = plots.load(DOCS_RESULTS)

    written = plots.write(report, tmp_path)

    assert [path.name for path in written] == ["ratios.png", "peers.png", "cpu.png", "latency.png"]
    assert all(path.read_bytes().startswith(b"\x89PNG") for path in written)


def test_plots__a_run_without_latency_draws_the_ratios_alone(tmp_path: Path):
    # Given what `python -m bench --only dramatiq` writes, before the latency pass
    report = Report({"cpus": 2}, {"reps": 2})
    for mode, runs in (("bare", [1000.0, 900.0]), ("inbox", [700.0, 720.0])):
        report.measurements.append(Measurement("dramatiq", mode, "msg/s", runs))
    results = tmp_path / "latest.json"
    results.write_text(report.to_json())

    written = plots.write(plots.load(results), tmp_path)

    assert [path.name for path in written] == ["ratios.png"]
