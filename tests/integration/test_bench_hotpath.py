"""`python -m bench.hotpath --breakdown` measures both modes and tells the parts."""

from __future__ import annotations

import re

import pytest
from bench import hotpath

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
