"""Every cell of the fault-injection matrix: one worker run per broker set-up and fault,
walking every named point of a delivery with a message of its own.

For each row's message, after the run has settled: its effect committed exactly once, or
a durable record of why not (a poison or quarantine row, a dead-letter copy of a message
without identity); never acknowledged without either, never applied twice; and the row's
fault fired (a point the library does not call yet fails as "fault never fired").
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ..support.outage import OutagePostgres
from .harness import run_group
from .matrix import FAULTS, SETUPS, Cell, in_subset, render

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(600)]

OFFSET = int(os.environ.get("INBOX_TEST_MATRIX_OFFSET", "0"))
"""Turns the representative subset (`in_subset`); ``scripts/test`` sets the day's number."""
CELLS = [
    pytest.param(
        setup,
        fault,
        id=f"{setup.name}-{fault}",
        marks=[] if in_subset(setup, fault, OFFSET) else [pytest.mark.beyond_subset],
    )
    for setup in SETUPS
    for fault in FAULTS
]


@pytest.mark.parametrize(("setup", "fault"), CELLS)
def test_faults__every_point_settles_without_loss_or_double_effect(
    setup,
    fault: str,
    outage_postgres: OutagePostgres,
    tmp_path: Path,
    fault_cells: list[Cell],
    capsys,
) -> None:
    lines: list[str] = []
    try:
        cells = run_group(
            setup,
            fault,
            outage_postgres.url,
            tmp_path,
            lines.append,
            restart=outage_postgres.restart,
        )
    finally:
        with capsys.disabled():
            print("\n" + "\n".join(lines))
    fault_cells.extend(cells)
    with capsys.disabled():
        print(render(cells))
    failed = [f"{c.row.name}: {c.detail}" for c in cells if c.status == "FAIL"]
    assert not failed, f"{len(failed)} red cell(s) for {setup.name} x {fault}:\n" + "\n".join(
        failed
    )
