"""Every test module that stops, restarts or kills a server runs where no other test
depends on that server at the same time (tests/support/serial.py)."""

from __future__ import annotations

from pathlib import Path

from tests.support.serial import (
    OWN_FAULTS,
    OWN_SERVERS,
    SERIAL,
    SHARED_FAULTS,
    group,
    is_own_servers,
    is_serial,
)

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> list[tuple[str, str]]:
    return [
        (module.relative_to(ROOT).as_posix(), module.read_text())
        for module in sorted((ROOT / "tests").rglob("test_*.py"))
    ]


def test_serial__every_module_that_stops_a_shared_server_runs_alone() -> None:
    elsewhere = [
        f"{relative}: {', '.join(name for name in SHARED_FAULTS if name in text)}"
        for relative, text in _modules()
        if any(name in text for name in SHARED_FAULTS) and not is_serial(relative)
    ]
    assert elsewhere == [], "add these to tests/support/serial.py's SERIAL"


def test_serial__every_module_that_stops_a_server_of_its_own_runs_apart_from_the_rest() -> None:
    elsewhere = [
        f"{relative}: {', '.join(name for name in OWN_FAULTS if name in text)}"
        for relative, text in _modules()
        if any(name in text for name in OWN_FAULTS)
        and not (is_serial(relative) or is_own_servers(relative))
    ]
    assert elsewhere == [], "add these to tests/support/serial.py's OWN_SERVERS (or SERIAL)"


def test_serial__the_two_lists_do_not_overlap() -> None:
    both = [
        relative for relative, _ in _modules() if is_serial(relative) and is_own_servers(relative)
    ]
    assert both == []


def test_serial__every_entry_names_a_test_folder_or_module() -> None:
    missing = [entry for entry in SERIAL + tuple(OWN_SERVERS) if not (ROOT / entry).exists()]
    assert missing == []


def test_subset__half_the_fault_matrix_each_day_and_all_of_it_in_two_days() -> None:
    from tests.faults.matrix import FAULTS, SETUPS, in_subset

    for offset in range(4):
        cells = {(s, f) for s in SETUPS for f in FAULTS if in_subset(s, f, offset)}
        assert all(sum((s, f) in cells for f in FAULTS) == 2 for s in SETUPS)
        assert all(sum((s, f) in cells for s in SETUPS) >= 4 for f in FAULTS)
    walked = {(s, f) for o in range(2) for s in SETUPS for f in FAULTS if in_subset(s, f, o)}
    assert len(walked) == len(SETUPS) * len(FAULTS)


def test_groups__the_modules_of_one_server_share_a_process_the_others_have_their_own() -> None:
    assert group("tests/faults/test_faults.py") == group("tests/integration/test_startup_outage.py")
    assert group("tests/explore/test_checker.py") == group("tests/explore/test_explore.py")
    assert group("tests/unit/test_serial.py") == "tests/unit/test_serial.py"


def test_groups__the_first_parts_scheduler_keeps_a_group_on_one_process() -> None:
    from tests.support.scheduling import ServerGroupScheduling

    split = ServerGroupScheduling._split_scope
    faults = "tests/faults/test_faults.py::test_faults__every_point[dq-redis-kill]"
    outage = "tests/integration/test_startup_outage.py::test_startup__x"
    assert split(None, faults) == split(None, outage) == "servers:outage"  # type: ignore[arg-type]
    assert split(None, "tests/unit/test_serial.py::test_x") == "tests/unit/test_serial.py"  # type: ignore[arg-type]
