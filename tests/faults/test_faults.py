"""Every cell of the fault-injection matrix: one worker run per broker set-up and fault,
walking every named point of a delivery with a message of its own.

For each row's message, after the run has settled: its effect committed exactly once, or
a durable record of why not (a poison or quarantine row, a dead-letter copy of a message
without identity); never acknowledged without either, never applied twice; and the row's
fault fired (a point the library does not call yet fails as "fault never fired").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import run_group
from .matrix import FAULTS, SETUPS, Cell, render

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.name)
def test_faults__every_point_settles_without_loss_or_double_effect(
    setup,
    fault: str,
    pg_url: str,
    pg_engine_session,
    tmp_path: Path,
    fault_cells: list[Cell],
    capsys,
) -> None:
    lines: list[str] = []
    try:
        cells = run_group(setup, fault, pg_url, tmp_path, lines.append)
    finally:
        pg_engine_session.dispose()  # a restart ends the pooled sessions of the suite
        with capsys.disabled():
            print("\n" + "\n".join(lines))
    fault_cells.extend(cells)
    with capsys.disabled():
        print(render(cells))
    failed = [f"{c.row.name}: {c.detail}" for c in cells if c.status == "FAIL"]
    assert not failed, f"{len(failed)} red cell(s) for {setup.name} x {fault}:\n" + "\n".join(
        failed
    )
