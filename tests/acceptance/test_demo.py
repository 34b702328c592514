"""The README's demo, run as a user runs it: real worker processes, and the fallback."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ..support import services

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "dramatiq"
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


# What scripts/services does for each service it is asked for: the functions it calls.
SERVICE_STEPS = {
    "ensure PostgreSQL": "PostgreSQL",
    "ensure Redis": "Redis",
    "ensure 'persistent Redis'": "persistent Redis",
    "ensure_failover_pair_unlocked": "PostgreSQL failover pair",
    "ensure RabbitMQ": "RabbitMQ",
    "ensure NATS": "NATS",
    "install_pgbouncer": "PgBouncer",
    "ensure PgBouncer": "PgBouncer",
    "ensure_kafka": "Kafka",
}


def services_started(arguments: list[str]) -> set[str]:
    """The services ``scripts/services arguments`` looks after, read from bash's trace of
    the steps it runs (each starts its service when it is down)."""
    traced = subprocess.run(
        ["bash", "-x", str(ROOT / "scripts" / "services"), *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    steps = [line.lstrip("+ ") for line in traced.stderr.splitlines() if line.startswith("+")]
    return {
        service
        for step in steps
        for prefix, service in SERVICE_STEPS.items()
        if step == prefix or step.startswith(prefix + " ")
    }


@pytest.mark.parametrize(
    ("variant", "uses"),
    [("dramatiq", {"PostgreSQL", "Redis"}), ("faststream", {"PostgreSQL", "RabbitMQ"})],
)
def test_demo__starts_only_the_services_it_uses(variant: str, uses: set[str]):
    # Given the scripts/services call of each branch of scripts/demo
    demo = (ROOT / "scripts" / "demo").read_text()
    faststream, dramatiq = demo.split("exec ../../.venv/bin/python demo.py\nfi\n")
    branch = faststream if variant == "faststream" else dramatiq
    (call,) = re.findall(r"^\s*scripts/services (.*?)(?: \|\| true)?$", branch, re.MULTILINE)

    # When it runs, Then it looks after the demo's database and broker, and nothing else
    # (no PgBouncer installed, no failover pair built, no Kafka reported missing)
    assert services_started(shlex.split(call)) == uses
