"""The production topologies under load, each at a small size in CI: the chaos run
(worker processes SIGKILLed every second or two) with one thing of the topology broken
while intents flow (`tests.chaos.topologies`), then the ledger must match what was sent,
exactly: every intent applied once, nothing lost, nothing twice.

- a persistent Redis (append-only file, fsync on every write; ``scripts/services``,
  6380) SIGKILLed and started again, under FastStream's Redis streams;
- RabbitMQ restarted under Dramatiq on quorum queues (`QuorumRabbitmqBroker`, a
  delivery limit of 20);
- a PostgreSQL failover: the standby (5434) held a second behind, then the pair's
  primary (5433) crashed and its synchronous standby promoted, the workers connecting
  with a URL that names both (``target_session_attrs=read-write``), Dramatiq and
  FastStream on RabbitMQ; afterwards the pair is restored as ``scripts/services``
  created it.

The size is ``INBOX_TEST_TOPOLOGY_MESSAGES`` (default 1000). Any topology runs alone at
any size, on either adapter, an asynchronous standby included (which loses effects, by
design): ``python -m tests.chaos --topology failover --adapter dramatiq --messages
20000``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from . import topologies
from .run import Report, run

MESSAGES = int(os.environ.get("INBOX_TEST_TOPOLOGY_MESSAGES", "1000"))
pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.timeout(600)]


def _run(topology: str, adapter: str, folder: Path, capsys: pytest.CaptureFixture[str]) -> Report:
    lines: list[str] = []
    config = topologies.config(topology, adapter, MESSAGES)
    with topologies.run_database(topology, adapter) as (url, admin_url):
        report = run(config, url, folder, lines.append, admin_url=admin_url)
    with capsys.disabled():
        print("\n" + "\n".join(lines) + "\n" + report.summary())
    assert report.problems == []
    assert report.ledger.applied == len(report.plan.applied)
    assert (report.ledger.lost, report.ledger.applied_twice) == (0, 0)
    assert report.events.kills >= 1
    return report


def test_topology__persistent_redis_killed_under_load_loses_and_doubles_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _run("persistent-redis", "faststream", tmp_path, capsys)
    assert len(report.events.broker_restarts) == 1


def test_topology__rabbitmq_restarted_under_load_on_quorum_queues_loses_and_doubles_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _run("quorum", "dramatiq", tmp_path, capsys)
    assert len(report.events.broker_restarts) == 1


@pytest.mark.parametrize("adapter", ["dramatiq", "faststream"])
def test_topology__postgres_failover_to_a_synchronous_standby_loses_and_doubles_nothing(
    adapter: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _run("failover", adapter, tmp_path, capsys)
    assert len(report.events.failovers) == 1
