"""The explorer in CI: a budget of fresh seeds (printed, so that any of them can be
replayed with ``python -m tests.explore --seed S --repeat K``), each run on real worker
processes and servers and its history checked. A finding fails the test; so does the
harness's own trouble, reported as such (never silently dropped).

Long runs: ``python -m tests.explore --seeds 100`` or ``--hours 2``.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from .__main__ import report
from .explorer import explore, select

BUDGET = float(os.environ.get("INBOX_TEST_EXPLORE_SECONDS", "75"))
"""Seconds the run keeps within, for the suite's time budget: the first schedule always
runs (one takes 15 to 45 s, longer on a loaded machine, so it may end past them), and
another starts only if one as long as the longest so far would end inside them;
`python -m tests.explore --seeds N` for long runs."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_explore__fresh_seeds_find_no_loss_no_double_and_no_wrong_record(capsys) -> None:
    first = random.SystemRandom().randrange(10**6)
    lines: list[str] = []
    verdicts = []
    started = time.monotonic()
    seed, longest = first, 0.0
    while not verdicts or time.monotonic() - started + longest <= BUDGET:
        began = time.monotonic()
        verdict = explore(select(seed))
        longest = max(longest, time.monotonic() - began)
        report(verdict, lines.append)
        verdicts.append(verdict)
        seed += 1
    with capsys.disabled():
        print(f"\nexplored seeds {first}..{seed - 1}\n" + "\n".join(lines))
    findings = [v for v in verdicts if v.outcome == "finding"]
    assert not findings, "\n".join(v.line() for v in findings)
    trouble = [v for v in verdicts if v.outcome == "harness"]
    assert not trouble, "the explorer's harness was in trouble:\n" + "\n".join(
        v.line() for v in trouble
    )
    # Schedules did run: something was sent and applied in each that was not refused.
    ran = [v for v in verdicts if v.outcome == "ok"]
    assert ran and all(v.history is not None and v.history.effects for v in ran)
