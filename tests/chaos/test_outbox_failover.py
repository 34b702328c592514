"""Outbox dispatchers through a PostgreSQL failover: two ``inbox-middleware outbox run``
processes on the failover pair's multi-host URL (``target_session_attrs=read-write``)
deliver effects to a real HTTP server while the primary crashes and its synchronous
standby is promoted. Every effect is delivered, each applied once by the remote (the
effect id is its idempotency key), and every one ends ``dispatched``.

``INBOX_TEST_TOPOLOGY_MESSAGES`` sets the number of effects (300 here by default).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session

from inbox_middleware import outbox
from inbox_middleware._storage import InboxSchema

from ..support import servers
from ..support.dispatchers import DispatcherProcess
from ..support.http_remote import Remote
from ..support.workers import wait_for
from .topologies import run_database

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.timeout(600)]
OUTBOX = InboxSchema().tables.outbox
EFFECTS = int(os.environ.get("INBOX_TEST_TOPOLOGY_MESSAGES", "300"))


def test_outbox_failover__every_effect_delivered_once_through_a_promotion(tmp_path: Path, capsys):
    remote = Remote()
    dispatchers: list[DispatcherProcess] = []
    try:
        with run_database("failover", "dramatiq") as (url, _):
            engine = create_engine(url, pool_pre_ping=True)
            try:
                with Session(engine) as session, session.begin():
                    for n in range(EFFECTS):
                        outbox.add(
                            session, destination="remote", payload={"n": n}, effect_id=f"fx-{n}"
                        )
                markers = tmp_path / "markers"
                markers.mkdir()
                env = {"INBOX_TEST_REMOTE_URL": remote.url, "INBOX_TEST_MARKERS": str(markers)}
                options = ["--lease", "5", "--delivery-timeout", "2", "--poll-interval", "0.1"]
                options += ["--batch-size", "10"]
                options += ["--backoff-base", "0.1", "--backoff-cap", "1"]
                for n in range(2):
                    log = tmp_path / f"dispatcher-{n}.log"
                    dispatchers.append(DispatcherProcess(url, env, log, *options))
                # When a third of the effects are delivered, the primary crashes and its
                # standby is promoted; the dispatchers reconnect to it
                wait_for(lambda: len(remote.applied) >= EFFECTS // 3, timeout=60, what="a third")
                took = servers.failover_postgres()
                wait_for(lambda: _dispatched(engine) == EFFECTS, timeout=180, what="all effects")
                dispatched = _dispatched(engine)
                alive = [p.proc.poll() is None for p in dispatchers]
            finally:
                engine.dispose()
                for process in dispatchers:
                    process.kill()
                servers.restore_failover_pair()
    finally:
        remote.close()
    replays = sum(remote.requests_for(f"fx-{n}") for n in range(EFFECTS)) - len(remote.applied)
    with capsys.disabled():
        print(
            f"\noutbox failover: {EFFECTS} effects, 2 dispatchers, 1 failover ({took:.1f}s), "
            f"dispatched {dispatched}, applied by the remote {len(remote.applied)}, "
            f"requests repeated {replays}, lost {EFFECTS - len(remote.applied)}"
        )
    # Then every effect was applied once, none is left pending or failed, and both
    # dispatchers lived through the failover (they reconnected to the new primary)
    assert sorted(remote.applied) == sorted(f"fx-{n}" for n in range(EFFECTS))
    assert dispatched == EFFECTS
    assert alive == [True, True]


def _dispatched(engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.scalar(
                select(func.count()).select_from(OUTBOX).where(OUTBOX.c.status == "dispatched")
            )
            or 0
        )
