"""`python -m bench.hotpath --breakdown` measures both modes and tells the parts; the quick
mode's checks count its calls."""

from __future__ import annotations

import re

import pytest
from bench import hotpath
from bench.__main__ import CALLS_CEILING, QUICK_FLOOR, quick_checks
from bench.common import Report

pytestmark = pytest.mark.postgres


def test_hotpath__the_breakdown_tells_the_parts_the_calls_and_the_arrival_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert hotpath.main(["--messages", "40", "--reps", "1", "--breakdown"]) == 0

    out = capsys.readouterr().out
    assert re.search(r"^added\s+-?\d+\.\d µs CPU/msg", out, re.MULTILINE)
    assert "claim (BEGIN + INSERT, verdict)" in out
    calls = re.search(r"calls a message: inbox (\d+), bare (\d+); .*: (\d+\.\d) µs", out)
    assert calls is not None, out
    inbox, bare, arrival = int(calls[1]), int(calls[2]), float(calls[3])
    assert inbox > bare > 100  # the inbox's own steps come on top of the bare transaction
    assert arrival > 0


def test_hotpath__the_calls_a_message_are_the_same_in_every_run() -> None:
    first, second = hotpath.calls_per_message(300), hotpath.calls_per_message(300)
    # A counted figure: the same whatever the machine's load (a gauge written once a second
    # may add a few calls over a run)
    assert first.keys() == second.keys() == {"bare", "inbox"}
    assert all(abs(first[mode] - second[mode]) < 0.5 for mode in first)
    assert first["bare"] > 100


@pytest.mark.parametrize(("ratio", "failed"), [(0.6, 0), (QUICK_FLOOR - 0.01, 1)])
def test_hotpath__the_quick_checks_judge_the_calls_and_the_worker_ratio(
    ratio: float, failed: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given the worker's ratio a quick run measured
    report = Report(machine={}, settings={}, ratios={"dramatiq inbox / bare": {"median": ratio}})
    # When the quick checks run, then they count the hot path's calls against their ceiling
    # (today's code is under it) and fail only on the ratio below its floor
    assert quick_checks(report) == failed
    out = capsys.readouterr()
    calls = re.search(r"calls a message: inbox (\d+), bare (\d+), added (\d+)", out.out)
    assert calls is not None, out.out
    assert int(calls[3]) == int(calls[1]) - int(calls[2]) <= CALLS_CEILING
    assert ("is below" in out.err) == bool(failed)


def test_hotpath__the_asyncpg_breakdown_counts_the_calls_of_both_modes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        hotpath.main(["--driver", "asyncpg", "--messages", "40", "--reps", "1", "--breakdown"]) == 0
    )

    out = capsys.readouterr().out
    calls = re.search(r"calls a message: inbox (\d+), bare (\d+)$", out, re.MULTILINE)
    assert calls is not None, out
    assert int(calls[1]) > int(calls[2]) > 100
