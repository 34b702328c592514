"""What must hold behind a transaction pooler (PgBouncer, ``pool_mode = transaction``) as on
a direct connection. ``scripts/test`` runs this file in both configurations: on a direct
connection each test holds as well, through PgBouncer it is the case the pooler breaks.

Through a transaction pooler each transaction may run on another server session, and
another client's next transaction may run on this one. So nothing the library does may
outlive its transaction in a server session: no named prepared statement (psycopg names
one after five executions), no session-level setting.
"""

from __future__ import annotations

import time
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from inbox_middleware import outbox
from inbox_middleware.storage import InboxSchema

from ..support.dispatchers import DispatcherProcess
from ..support.http_remote import Remote
from ..support.workers import wait_for

OUTBOX = InboxSchema().tables.outbox


def dispatched(engine) -> int:
    with engine.connect() as conn:
        return conn.scalar(
            select(func.count()).select_from(OUTBOX).where(OUTBOX.c.status == "dispatched")
        )


def test_outbox_run__two_dispatcher_processes_deliver_every_effect(
    pg_url, pg_engine, tmp_path: Path
):
    # Given 40 effects and two `inbox-middleware outbox run` processes leasing two at a
    # time and polling every 50 ms: each runs its lease statement far more than 5 times
    effect_ids = [f"fx-{n}" for n in range(40)]
    with Session(pg_engine) as session, session.begin():
        for effect_id in effect_ids:
            outbox.add(
                session, destination="remote", payload={"id": effect_id}, effect_id=effect_id
            )
    remote = Remote()
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {"INBOX_TEST_REMOTE_URL": remote.url, "INBOX_TEST_MARKERS": str(markers)}
    options = ("--batch-size", "2", "--poll-interval", "0.05")
    processes = [
        DispatcherProcess(pg_url, env, tmp_path / f"dispatcher-{n}.log", *options) for n in range(2)
    ]

    def exited() -> bool:
        return any(process.proc.poll() is not None for process in processes)

    try:
        # When they run until every effect is dispatched (and a little longer, idle)
        wait_for(lambda: exited() or dispatched(pg_engine) == 40, timeout=60, what="40 dispatched")
        time.sleep(1)
        alive = [process.proc.poll() is None for process in processes]
        codes = [process.terminate() for process in processes]
    finally:
        for process in processes:
            process.kill()
        remote.close()
    # Then both were still running and stopped cleanly, and each effect was applied once
    outputs = "\n".join(process.output() for process in processes)
    assert (alive, codes) == ([True, True], [0, 0]), outputs
    assert "prepared statement" not in outputs
    assert sorted(remote.applied) == sorted(effect_ids)
