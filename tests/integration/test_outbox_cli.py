"""``inbox-middleware outbox`` run, list, show and retry, as an operator uses them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import make_url, select
from sqlalchemy.orm import Session

from inbox_middleware import outbox
from inbox_middleware._storage import InboxSchema
from inbox_middleware.cli._outbox import dispatcher_engine
from inbox_middleware.outbox import Dispatcher, Effect, PermanentDeliveryError

from ..support.http_remote import Remote

ROOT = Path(__file__).resolve().parents[2]
OUTBOX = InboxSchema().tables.outbox


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from inbox_middleware.cli import run; run()", "outbox", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


class Refuses:
    async def deliver(self, effect: Effect, timeout: float) -> Any:
        raise PermanentDeliveryError("the mailbox does not exist", result={"code": 550})


def status(engine, effect_id: str) -> tuple[str, int]:
    with engine.connect() as conn:
        row = conn.execute(
            select(OUTBOX.c.status, OUTBOX.c.attempts).where(OUTBOX.c.effect_id == effect_id)
        ).one()
    return row.status, row.attempts


def test_cli_outbox__list_show_and_retry_failed_effects(pg_url, pg_engine):
    with Session(pg_engine) as session, session.begin():
        for effect_id in ("mail-1", "mail-2"):
            outbox.add(session, destination="email", payload={"to": effect_id}, effect_id=effect_id)
    asyncio.run(Dispatcher(pg_engine, {"email": Refuses()}).run(burst=True))

    listed = cli("list", "--database-url", pg_url, "--status", "failed")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0] == "pending 0, dispatched 0, failed 2"
    assert any(
        line.split()[1:4] == ["mail-1", "│", "email"]
        and "PermanentDeliveryError: the mailbox does not exist" in line
        for line in lines
    )
    # A failed effect has no next attempt (until it is retried): the table says "-"
    header = next(line for line in lines if "next attempt" in line)
    column = [cell.strip() for cell in re.split("[│┃]", header)].index("next attempt")
    failed = [line for line in lines if "mail-" in line]
    assert [[c.strip() for c in re.split("[│┃]", x)][column] for x in failed] == ["-", "-"]
    as_json = cli("list", "--database-url", pg_url, "--status", "failed", "--json")
    rows = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert {(r["effect_id"], r["status"], r["attempts"]) for r in rows} == {
        ("mail-1", "failed", 1),
        ("mail-2", "failed", 1),
    }
    assert all(datetime.fromisoformat(r["next_attempt_at"]).tzinfo for r in rows)

    shown = cli("show", "--database-url", pg_url, "mail-1")
    assert shown.returncode == 0, shown.stderr
    detail = json.loads(shown.stdout)
    assert (detail["status"], detail["remote_result"], detail["payload"]) == (
        "failed",
        {"code": 550},
        {"to": "mail-1"},
    )

    retried = cli("retry", "--database-url", pg_url, "mail-1")
    assert (retried.returncode, retried.stdout) == (0, "pending again: mail-1\n")
    assert status(pg_engine, "mail-1") == ("pending", 0)

    refused = cli("retry", "--database-url", pg_url, "mail-1", "missing")
    assert refused.returncode == 1
    assert "not retried: mail-1: it is pending, not failed" in refused.stderr
    assert "not retried: missing: no such effect" in refused.stderr

    everything = cli("retry", "--database-url", pg_url, "--all-failed", "--destination", "email")
    assert everything.returncode == 0, everything.stderr
    assert "1 failed effects are pending again" in everything.stdout
    assert status(pg_engine, "mail-2") == ("pending", 0)

    missing = cli("show", "--database-url", pg_url, "nope")
    assert (missing.returncode, missing.stderr) == (1, "error: no effect 'nope'\n")


def test_cli_outbox_run__burst_delivers_what_is_due_and_exits(pg_url, pg_engine, tmp_path):
    remote = Remote()
    try:
        with Session(pg_engine) as session, session.begin():
            for n in range(3):
                outbox.add(session, destination="remote", payload={"n": n}, effect_id=f"e-{n}")
        env = {"INBOX_TEST_REMOTE_URL": remote.url, "INBOX_TEST_MARKERS": str(tmp_path)}
        ran = cli(
            "run",
            "--database-url",
            pg_url,
            "--destinations",
            "tests.apps.outbox_app:destinations",
            "--burst",
            env=env,
        )
    finally:
        remote.close()
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip().startswith("dispatched 3, retried 0, failed 0")
    assert sorted(remote.applied) == ["e-0", "e-1", "e-2"]
    # The log, configured by the command: a start-up line saying what it dispatches, from
    # where, how often it polls; every line with a timestamp, its level and logger
    print(ran.stderr)
    started = re.search(
        r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}     INFO - inbox_middleware.outbox: "
        r"outbox dispatcher started: dispatching to (.+) from (\S+), polling every 1.0s, "
        r"batch 100, lease 60.0s$",
        ran.stderr,
        re.MULTILINE,
    )
    assert started, ran.stderr
    assert started[2] == make_url(pg_url).render_as_string(hide_password=True)
    assert "remote" in started[1]
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} +[A-Z]+ - ", x) for x in lines)


def test_cli_outbox_run__refuses_sqlite_and_a_bad_target_with_one_line(sqlite_engine, pg_url):
    url = str(sqlite_engine.url)
    sqlite = cli(
        "run", "--database-url", url, "--destinations", "tests.apps.outbox_app:destinations"
    )
    assert sqlite.returncode == 1
    assert sqlite.stderr.startswith("error: the outbox dispatcher needs PostgreSQL")
    assert "Traceback" not in sqlite.stderr

    bad = cli("run", "--database-url", pg_url, "--destinations", "tests.apps.outbox_app")
    assert bad.returncode == 2
    assert "is not MODULE:ATTRIBUTE" in bad.stderr


def test_outbox_run__its_connections_give_up_on_a_server_that_stopped_answering(pg_url):
    # Given the engine `outbox run` leases through
    engine = dispatcher_engine(pg_url)
    try:
        with engine.connect() as conn:
            raw: Any = conn.connection.dbapi_connection
            sock = socket.socket(fileno=os.dup(raw.fileno()))
            try:
                # Then its TCP connection probes a silent peer after 30 s idle and drops it
                # about 30 s later, or after 60 s of unacknowledged data: a half-open
                # connection ends in a minute or so, not the system's two hours and more
                options = {
                    name: sock.getsockopt(level, option)
                    for name, level, option in (
                        ("keepalive", socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                        ("idle", socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                        ("interval", socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                        ("count", socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                        ("user_timeout_ms", socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
                    )
                }
            finally:
                sock.close()
        assert options == {
            "keepalive": 1,
            "idle": 30,
            "interval": 10,
            "count": 3,
            "user_timeout_ms": 60000,
        }
    finally:
        engine.dispose()
