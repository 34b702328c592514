"""The matrix of the run's cells, printed after the tests and written to a file."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .matrix import Cell, render

_CELLS: list[Cell] = []


@pytest.fixture(scope="session")
def fault_cells(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Cell]]:
    yield _CELLS
    if _CELLS:
        path = tmp_path_factory.getbasetemp() / "faults-matrix.txt"
        path.write_text(render(_CELLS) + "\n")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _CELLS:
        terminalreporter.section("fault-injection matrix")
        terminalreporter.write_line(render(_CELLS))
        path = terminalreporter.config._tmp_path_factory.getbasetemp() / "faults-matrix.txt"  # type: ignore[attr-defined]
        path.write_text(render(_CELLS) + "\n")
        terminalreporter.write_line(f"\nwritten to {path}")
