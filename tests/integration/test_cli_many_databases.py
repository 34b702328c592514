"""The commands over a fleet's database map: ``--map`` runs on every database it names,
``--tenant`` on the one that serves that tenant; a database that fails is reported and
the others still run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.orm import Session

from inbox_middleware import DatabaseMap, MessageIdentity
from inbox_middleware._core.identity import hash_json
from inbox_middleware._core.protocol import Delivery
from inbox_middleware._operate.retention import RetentionPolicy, record_policy
from inbox_middleware._storage import InboxSchema
from inbox_middleware._storage.failures import FailureRecorder
from inbox_middleware._storage.routed import RoutedInbox

from ..support.tenants import TENANTS, TenantDatabases, tenant_database

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from inbox_middleware.cli import run; run()", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )


def test_cli_map__check_and_migrate_every_database_or_one_tenants(
    tenant_databases: TenantDatabases,
):
    path = str(tenant_databases.map_path)
    checked = run("check", "--map", path)
    assert checked.returncode == 0, checked.stderr
    assert checked.stderr.splitlines() == ["== database db0", "== database db1", "== database db2"]
    assert checked.stdout.count("the inbox schema is at version") == 3
    one = run("migrate", "--map", path, "--tenant", "t4")  # t4 lives in db1
    assert one.returncode == 0, one.stderr
    assert one.stderr.splitlines() == ["== database db1"]
    assert "up to date" in one.stdout
    unknown = run("check", "--map", path, "--tenant", "nobody")
    assert unknown.returncode == 1
    assert "no database serves tenant 'nobody'" in unknown.stderr
    refused = run("check", "--tenant", "t4", "--database-url", tenant_databases.url(0))
    assert refused.returncode == 2


def test_cli_map__a_database_that_fails_is_reported_and_the_others_still_run(
    tenant_databases: TenantDatabases, tmp_path: Path
):
    data = json.loads(tenant_databases.map_path.read_text())
    data["databases"]["gone"] = "postgresql://postgres@127.0.0.1:5469/nothing_listens"
    path = tmp_path / "with-a-gone-database.json"
    path.write_text(json.dumps(data))
    checked = run("check", "--map", str(path))
    assert checked.returncode == 1
    assert checked.stdout.count("the inbox schema is at version") == 3
    assert "error: database gone:" in checked.stderr
    assert checked.stderr.splitlines()[-1] == "error: 1 of 4 databases failed: gone"


def test_cli_map__status_shows_each_databases_own_claims(tenant_databases: TenantDatabases):
    # Given a claim made through the routed inbox for a tenant of db2
    routes = DatabaseMap(
        {f"db{i}": tenant_databases.url(i) for i in range(3)}, tenants={"t5": "db2"}
    )
    inbox = RoutedInbox(routes)
    identity = MessageIdentity("orders", "o-1", "t5")
    delivery = Delivery("billing", identity, hash_json({"a": 1}, "v1"), source="q")
    try:
        inbox.process(delivery, lambda session: None)
    finally:
        inbox.dispose()
    # Then only db2's status shows it
    shown = run("status", "--map", str(tenant_databases.map_path), "--tenant", "t5")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("inbox: 1 claim"), shown.stdout
    for index in (0, 1):
        assert tenant_databases.rows(index)["inbox"] == []
    assert tenant_databases.rows(2)["inbox"] == [("t5", "o-1")]


# -- every operator command over the map ---------------------------------------------------


def claims_and_poison(tenant_databases: TenantDatabases) -> None:
    """Two claims for each tenant through the routed inbox, aged 40 days, and a poison
    row for t1 (db1) and t2 (db2), each in its tenant's database."""
    routes = DatabaseMap(
        {f"db{i}": tenant_databases.url(i) for i in range(3)},
        tenants={t: tenant_database(t) for t in TENANTS},
    )
    inbox = RoutedInbox(routes)
    try:
        for tenant in TENANTS:
            for k in range(2):
                identity = MessageIdentity("orders", f"o-{tenant}-{k}", tenant)
                delivery = Delivery("billing", identity, hash_json({"k": k}, "v1"), source="q")
                inbox.process(delivery, lambda session: None)
    finally:
        inbox.dispose()
    recorder = FailureRecorder(InboxSchema(), "postgresql")
    for index in range(3):
        engine = tenant_databases.engine(index)
        try:
            with engine.begin() as conn:
                conn.execute(
                    text("UPDATE consumer_inbox SET processed_at = now() - interval '40 days'")
                )
                for tenant in ("t1", "t2"):
                    if tenant_database(tenant) == f"db{index}":
                        identity = MessageIdentity("orders", f"bad-{tenant}", tenant)
                        delivery = Delivery("billing", identity, hash_json(1, "v1"), source="q")
                        recorder.record_poison(
                            conn, delivery, reason_code="closed", error="E", attempts=1
                        )
        finally:
            engine.dispose()


def test_cli_map__status_explain_purge_and_poison_on_every_database_or_one(
    tenant_databases: TenantDatabases,
):
    claims_and_poison(tenant_databases)
    path = str(tenant_databases.map_path)
    # status: each database's own counts (three tenants, two claims each)
    status = run("status", "--map", path, "--json", "--exact")
    assert status.returncode == 0, status.stderr
    assert status.stderr.splitlines() == ["== database db0", "== database db1", "== database db2"]
    # explain: the identity's tenant picks the database
    explained = run("explain", "billing", "orders", "o-t4-1", "--tenant", "t4", "--map", path)
    assert explained.returncode == 0, explained.stderr
    assert explained.stderr.splitlines() == ["== database db1"]
    assert "o-t4-1" in explained.stdout and "not claimed" not in explained.stdout
    missing = run("explain", "billing", "orders", "o-t4-1", "--tenant", "t5", "--map", path)
    assert missing.stderr.splitlines()[0] == "== database db2"
    # poison list: every database's rows, or one database's
    listed = run("poison", "list", "--map", path, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert sorted(row["tenant"] for row in rows) == ["t1", "t2"]
    one = run("poison", "list", "--map", path, "--database", "db2", "--json")
    assert [json.loads(line)["tenant"] for line in one.stdout.splitlines()] == ["t2"]
    # row ids belong to one database: refused over the whole map, taken with --tenant
    row_id = str(rows[0]["id"])
    refused = run("poison", "show", row_id, "--map", path)
    assert refused.returncode == 2
    assert "give --tenant or --database" in refused.stderr
    shown = run("poison", "show", row_id, "--map", path, "--tenant", rows[0]["tenant"])
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["message_id"] == rows[0]["message_id"]
    discarded = run("poison", "discard", "--map", path, "--consumer", "billing", "--reason", "gone")
    assert discarded.returncode == 0, discarded.stderr
    # (row #1 of db1 and row #1 of db2: the same id in two databases, hence the refusal)
    assert discarded.stdout == "poison #1 discarded\n" * 2, discarded.stdout
    # purge: each database purges its own claims (one tenant's database only, first)
    first = run("purge", "--map", path, "--tenant", "t0", "--older-than", "30d", "--force")
    assert first.returncode == 0, first.stderr
    assert tenant_databases.rows(0)["inbox"] == []
    assert len(tenant_databases.rows(1)["inbox"]) == 6
    rest = run("purge", "--map", path, "--older-than", "30d", "--force", "--unpaced")
    assert rest.returncode == 0, rest.stderr
    assert rest.stdout.count("deleted 6 claims") == 2, rest.stdout
    assert all(tenant_databases.rows(i)["inbox"] == [] for i in range(3))


def test_cli_map__a_purge_refused_on_one_database_still_runs_on_the_others(
    tenant_databases: TenantDatabases,
):
    claims_and_poison(tenant_databases)
    for index in range(3):  # db1's policy keeps claims 45 days, the others' 14
        engine = tenant_databases.engine(index)
        try:
            with engine.begin() as conn:
                record_policy(
                    conn,
                    InboxSchema(),
                    RetentionPolicy(broker_retention=timedelta(days=45 if index == 1 else 14)),
                    consumer="*",
                    by="t",
                )
        finally:
            engine.dispose()
    purged = run("purge", "--map", str(tenant_databases.map_path), "--older-than", "30d")
    assert purged.returncode == 1
    assert "error: 1 of 3 databases failed: db1" in purged.stderr
    assert tenant_databases.rows(0)["inbox"] == tenant_databases.rows(2)["inbox"] == []
    assert len(tenant_databases.rows(1)["inbox"]) == 6


def test_cli_map__outbox_run_list_and_retry_over_the_map(
    tenant_databases: TenantDatabases, tmp_path: Path
):
    from inbox_middleware import outbox

    from ..support.http_remote import Remote

    # Given two effects in each database
    for index in range(3):
        engine = tenant_databases.engine(index)
        try:
            with Session(engine) as session, session.begin():
                for k in range(2):
                    outbox.add(session, destination="remote", payload={}, effect_id=f"e{index}{k}")
        finally:
            engine.dispose()
    path = str(tenant_databases.map_path)
    dispatch = ["outbox", "run", "--destinations", "tests.apps.outbox_app:destinations"]
    dispatch.append("--burst")
    listed = run("outbox", "list", "--map", path)
    assert listed.stdout.count("pending 2,") == 3, listed.stdout
    refused = run("outbox", "show", "e00", "--map", path)
    assert refused.returncode == 2
    remote = Remote()
    try:
        # When one dispatcher runs over db1 only, then one over the whole map
        env = {
            **os.environ,
            "INBOX_TEST_REMOTE_URL": remote.url,
            "INBOX_TEST_MARKERS": str(tmp_path),
        }
        dispatch = [
            "outbox",
            "run",
            "--destinations",
            "tests.apps.outbox_app:destinations",
            "--burst",
        ]
        one = run(*dispatch, "--map", path, "--database", "db1", env=env)
        assert one.returncode == 0, one.stderr
        assert sorted(remote.applied) == ["e10", "e11"]
        assert "database db1: dispatched 2" in one.stdout
        every = run(*dispatch, "--map", path, "--sweep", "1", env=env)
        assert every.returncode == 0, every.stderr
        assert sorted(remote.applied) == ["e00", "e01", "e10", "e11", "e20", "e21"]
        assert every.stdout.splitlines()[-1].startswith("dispatched 4,"), every.stdout
        assert len(remote.received) == 6
    finally:
        remote.close()
    listed = run("outbox", "list", "--map", path)
    assert listed.stdout.count("dispatched 2,") == 3, listed.stdout
    shown = run("outbox", "show", "e21", "--map", path, "--database", "db2")
    assert json.loads(shown.stdout)["status"] == "dispatched"
    retried = run("outbox", "retry", "--all-failed", "--map", path)
    assert retried.returncode == 0, retried.stderr
    assert retried.stdout.count("0 failed effects are pending again") == 3
    listening = run(*dispatch, "--map", path, "--listen")
    assert listening.returncode == 2 and "--listen is for one database" in listening.stderr
