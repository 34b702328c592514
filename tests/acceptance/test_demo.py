"""The README's demo, run as a user runs it: real worker processes, and the fallback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ..support import services

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dramatiq"
pytestmark = pytest.mark.slow


def run_demo(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=EXAMPLE, capture_output=True, text=True, timeout=300
    )


def test_demo__real_workers_apply_each_effect_once():
    services.require(services.POSTGRES, "PostgreSQL")
    services.require(services.REDIS, "Redis")
    result = run_demo("import demo; raise SystemExit(demo.main())")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "two `dramatiq` worker processes" in result.stdout
    assert "60 credits applied, one per order (20 duplicates skipped)" in result.stdout
    assert "6 conflicting messages quarantined" in result.stdout
    assert "86 credits applied for 60 orders" in result.stdout  # without the inbox
    assert "each effect happened exactly once with the inbox" in result.stdout


def test_demo__falls_back_to_sqlite_and_the_stub_broker_and_says_so():
    result = run_demo(
        "import demo; demo.reachable = lambda port: False; raise SystemExit(demo.main())"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "embedded SQLite and Dramatiq's stub broker" in result.stdout
    assert "60 credits applied, one per order" in result.stdout
