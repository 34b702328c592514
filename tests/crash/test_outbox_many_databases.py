"""Dispatchers over three databases (`tests.support.tenants`): real
``inbox-middleware outbox run --map`` processes delivering to a real HTTP server that
applies each idempotency key once.

The run: effects recorded in every database; two dispatchers share them; one is
SIGKILLed mid-run (its leases end and the other takes them over); then one database is
stopped while more effects are recorded in the others, which keep being dispatched; the
database is started again and its effects are dispatched too. At the end every effect is
applied once downstream (delivered at least once, deduplicated by its effect id) and
marked dispatched in its own database.

The second stops a server: run it under the fault lock, as every test that stops one.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from inbox_middleware import outbox

from ..support.dispatchers import DispatcherProcess
from ..support.http_remote import Behaviour, Remote
from ..support.tenants import TENANTS, TenantDatabases, tenant_database
from ..support.workers import wait_for

pytestmark = pytest.mark.slow

DOWN = 1  # the database stopped mid-run (db1: tenants t1, t4, t7)
PER_TENANT = 12


def index_of(tenant: str) -> int:
    return int(tenant_database(tenant)[2:])


def record(tenant_databases: TenantDatabases, wave: str, indexes: set[int]) -> list[str]:
    """``PER_TENANT`` effects for each tenant of the databases ``indexes``, each committed
    in its tenant's database; their ids."""
    recorded: list[str] = []
    for index in sorted(indexes):
        engine = tenant_databases.engine(index)
        try:
            with Session(engine) as session, session.begin():
                for tenant in TENANTS:
                    if index_of(tenant) != index:
                        continue
                    for k in range(PER_TENANT):
                        effect_id = f"fx-{wave}-{tenant}-{k}"
                        outbox.add(
                            session,
                            destination="remote",
                            payload={"tenant": tenant, "k": k},
                            effect_id=effect_id,
                        )
                        recorded.append(effect_id)
        finally:
            engine.dispose()
    return recorded


def statuses(tenant_databases: TenantDatabases, index: int) -> dict[str, str]:
    engine = tenant_databases.engine(index)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT effect_id, status FROM message_outbox")).all()
        return {row.effect_id: row.status for row in rows}
    finally:
        engine.dispose()


OPTIONS = [
    "--lease", "2", "--delivery-timeout", "1", "--poll-interval", "0.1",
    "--backoff-base", "0.1", "--backoff-cap", "0.5", "--batch-size", "5",
    "--sweep", "1", "--parallel", "2",
]  # fmt: skip


def test_outbox_map__a_dispatcher_killed_holding_leases_loses_nothing(
    tenant_databases: TenantDatabases, tmp_path: Path
):
    """(Stops no server: runs without the fault lock too.)"""
    remote = Remote(Behaviour(slow=0.02))
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {"INBOX_TEST_REMOTE_URL": remote.url, "INBOX_TEST_MARKERS": str(markers)}
    everything = record(tenant_databases, "k", {0, 1, 2})
    logs = [tmp_path / "doomed.log", tmp_path / "survivor.log"]
    doomed = DispatcherProcess(tenant_databases.map_path, env, logs[0], *OPTIONS)
    survivor = DispatcherProcess(tenant_databases.map_path, env, logs[1], *OPTIONS)
    try:
        # Given two dispatchers over the map, one SIGKILLed while it holds leases
        wait_for((markers / f"leased.{doomed.proc.pid}").exists, timeout=60, what="lease")
        wait_for(lambda: len(remote.applied) >= 20, timeout=60, what="a share delivered")
        doomed.kill()
        killed_at = len(remote.applied)
        assert killed_at < len(everything), "the run ended before the kill"
        # Then the survivor takes its leases over once they end, and finishes every database
        wait_for(lambda: set(everything) <= set(remote.applied), timeout=90, what="every effect")
        wait_for(
            lambda: all(
                set(statuses(tenant_databases, i).values()) == {"dispatched"} for i in range(3)
            ),
            timeout=30,
            what="every effect recorded as dispatched",
        )
    finally:
        doomed.kill()
        survivor.kill()
        remote.close()
    assert sorted(remote.applied) == sorted(everything)
    assert (markers / f"leased.{survivor.proc.pid}").exists()
    print(
        f"\n{len(everything)} effects over 3 databases, {len(remote.received)} deliveries; "
        f"one of two dispatchers killed after {killed_at} applied"
    )


def test_outbox_map__a_killed_dispatcher_and_a_stopped_database_lose_nothing(
    tenant_databases: TenantDatabases, tmp_path: Path
):
    remote = Remote(Behaviour(slow=0.02))  # each delivery takes a moment: a run, not a blink
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {"INBOX_TEST_REMOTE_URL": remote.url, "INBOX_TEST_MARKERS": str(markers)}
    started: list[DispatcherProcess] = []

    def start() -> DispatcherProcess:
        log = tmp_path / f"dispatcher-{len(started)}.log"
        started.append(DispatcherProcess(tenant_databases.map_path, env, log, *OPTIONS))
        return started[-1]

    everything = record(tenant_databases, "w1", {0, 1, 2})
    try:
        # Given two dispatchers over the map, one SIGKILLed once it holds leases
        doomed, survivor = start(), start()
        wait_for((markers / f"leased.{doomed.proc.pid}").exists, timeout=60, what="lease")
        wait_for(lambda: len(remote.applied) >= 20, timeout=60, what="a share delivered")
        doomed.kill()
        killed_at = len(remote.applied)
        assert killed_at < len(everything), "the run ended before the kill"

        # When one database stops while more effects are recorded in the others
        tenant_databases.stop(DOWN)
        stopped_at = time.monotonic()
        during = record(tenant_databases, "w2", {0, 2})
        everything += during
        # Then the others' effects are all dispatched while it is down
        healthy = [e for e in everything if not any(f"-t{n}-" in e for n in (1, 4, 7))]
        wait_for(
            lambda: set(healthy) <= set(remote.applied),
            timeout=60,
            what="the healthy databases' effects",
        )
        down_for = time.monotonic() - stopped_at
        tenant_databases.start(DOWN)

        # And once it is back, its effects are dispatched too, and later ones everywhere
        everything += record(tenant_databases, "w3", {0, 1, 2})
        wait_for(lambda: set(everything) <= set(remote.applied), timeout=90, what="every effect")
        wait_for(
            lambda: all(
                set(statuses(tenant_databases, i).values()) == {"dispatched"} for i in range(3)
            ),
            timeout=30,
            what="every effect recorded as dispatched",
        )
    finally:
        for process in started:
            process.kill()
        remote.close()

    # Every effect applied once downstream, delivered at least once, and in its own database
    assert sorted(remote.applied) == sorted(everything)
    deliveries = len(remote.received)
    assert deliveries >= len(everything)
    for index in range(3):
        own = {e for e in everything if index_of(e.split("-")[2]) == index}
        assert set(statuses(tenant_databases, index)) == own
    # The stopped database failed on the survivor's side only, and the rotation went on
    assert "database db1 failed" in survivor.output()
    assert down_for < 60
    print(
        f"\n{len(everything)} effects over 3 databases, {deliveries} deliveries "
        f"({deliveries - len(everything)} repeated, answered by the remote's dedup); "
        f"killed after {killed_at} applied; the healthy databases' {len(healthy)} effects "
        f"dispatched {down_for:.1f}s into db1's outage"
    )
