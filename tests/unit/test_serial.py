"""Every test module that stops, restarts or kills a shared server is run alone."""

from __future__ import annotations

from pathlib import Path

from tests.support.serial import SERIAL, SERVER_FAULTS, is_serial

ROOT = Path(__file__).resolve().parents[2]


def test_serial__every_module_that_stops_a_shared_server_runs_alone() -> None:
    parallel = []
    for module in sorted((ROOT / "tests").rglob("test_*.py")):
        relative = module.relative_to(ROOT).as_posix()
        called = [name for name in SERVER_FAULTS if name in module.read_text()]
        if called and not is_serial(relative):
            parallel.append(f"{relative}: {', '.join(called)}")
    assert parallel == [], "add these to tests/support/serial.py's SERIAL"


def test_serial__every_entry_names_a_test_folder_or_module() -> None:
    missing = [entry for entry in SERIAL if not (ROOT / entry).exists()]
    assert missing == []
