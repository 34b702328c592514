"""The commands over a fleet's database map: ``--map`` runs on every database it names,
``--tenant`` on the one that serves that tenant; a database that fails is reported and
the others still run."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from inbox_middleware import DatabaseMap, MessageIdentity
from inbox_middleware._core.identity import hash_json
from inbox_middleware._core.protocol import Delivery
from inbox_middleware._operate.retention import RetentionPolicy, record_policy
from inbox_middleware._storage import InboxSchema
from inbox_middleware._storage.failures import FailureRecorder
from inbox_middleware._storage.routed import RoutedInbox

from ..support.tenants import TENANTS, TenantDatabases, account, tenant_database

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
    claims = {
        name: document["inbox"]["rows"]
        for name, document in json.loads(status.stdout)["databases"].items()
    }
    assert claims == {"db0": 6, "db1": 6, "db2": 6}  # one JSON document for the map
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
    assert rows[0]["database"] == tenant_database(rows[0]["tenant"])  # each row names its own
    document = json.loads(shown.stdout)  # one document, keyed by the database
    assert document["databases"][rows[0]["database"]]["message_id"] == rows[0]["message_id"]
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
    assert json.loads(shown.stdout)["databases"]["db2"]["status"] == "dispatched"
    retried = run("outbox", "retry", "--all-failed", "--map", path)
    assert retried.returncode == 0, retried.stderr
    assert retried.stdout.count("0 failed effects are pending again") == 3
    listening = run(*dispatch, "--map", path, "--listen")
    assert listening.returncode == 2 and "--listen is for one database" in listening.stderr


def test_cli_map__status_shows_each_databases_own_settlement_counts(
    tenant_databases: TenantDatabases,
):
    from inbox_middleware._operate.tally import RoutedCountFlusher, Tally

    # Given a worker over the map that counted settlements under each delivery's database
    counted = Tally()
    for _ in range(3):
        counted.count("billing", "duplicate", "db1")
    counted.count("billing", "duplicate", "db2")
    counted.count("billing", "processed", "db2")
    counted.count("billing", "dead_lettered", "")  # an unknown tenant: no database
    routes = DatabaseMap({f"db{i}": tenant_databases.url(i) for i in range(3)})
    inbox = RoutedInbox(routes)
    try:
        # When its flusher writes them
        RoutedCountFlusher.for_routed(inbox, 5.0, counted).flush()
    finally:
        inbox.dispose()
    # Then each database's status shows its own
    shown = run("status", "--map", str(tenant_databases.map_path), "--json")
    assert shown.returncode == 0, shown.stderr
    by_database = {}
    for name, document in json.loads(shown.stdout)["databases"].items():
        by_database[name] = {
            consumer["consumer"]: {k: v for k, v in consumer["counted"].items() if v}
            for consumer in document["consumers"]
        }
    assert by_database["db0"] == {}
    assert by_database["db1"] == {"billing": {"duplicate": 3}}
    assert by_database["db2"] == {"billing": {"duplicate": 1, "processed": 1}}


@pytest.mark.slow
def test_cli_map__a_faststream_worker_over_the_map_writes_each_databases_counts(
    tenant_databases: TenantDatabases, tmp_path: Path
):
    import pika

    from ..support import services
    from ..support.faststream_worker import FastStreamWorker
    from ..support.workers import wait_for

    services.require(services.RABBITMQ, "rabbitmq")
    queue = f"tenant-counts-{uuid.uuid4().hex[:8]}"
    env = {
        "INBOX_TEST_MAP": str(tenant_databases.map_path),
        "INBOX_TEST_BROKER_URL": services.RABBITMQ,
        "INBOX_TEST_SOURCE": queue,
    }
    connection = pika.BlockingConnection(pika.URLParameters(services.RABBITMQ))
    channel = connection.channel()
    channel.queue_declare(queue, durable=True)
    worker = FastStreamWorker("tests.apps.tenants_faststream:app", env, tmp_path / "w.log")
    try:
        wait_for(worker.ready, timeout=60, what="the FastStream worker")
        # Given t4's message twice (db1: a duplicate) and t5's once (db2)
        for tenant, message_id in [("t4", "m-1"), ("t4", "m-1"), ("t5", "m-2")]:
            channel.basic_publish(
                "",
                queue,
                json.dumps({"account": account(tenant, 1), "delta": 5}).encode(),
                pika.BasicProperties(
                    content_type="application/json",
                    headers={
                        "x-inbox-producer": "orders",
                        "x-inbox-message-id": message_id,
                        "x-inbox-tenant": tenant,
                    },
                ),
            )

        # Then, after the flush interval, each database's status shows its own counts
        def counts() -> dict[str, dict[str, int]] | None:
            shown = run("status", "--map", str(tenant_databases.map_path), "--json")
            found = {}
            for name, document in json.loads(shown.stdout)["databases"].items():
                found[name] = {
                    k: v
                    for consumer in document["consumers"]
                    for k, v in consumer["counted"].items()
                    if v
                }
            wanted = {"db0": {}, "db1": {"processed": 1, "duplicate": 1}, "db2": {"processed": 1}}
            return found if found == wanted else None

        wait_for(counts, timeout=30, interval=1, what="each database's counts")
    finally:
        worker.kill()
        with contextlib.suppress(Exception):
            channel.queue_delete(queue)
        connection.close()


@pytest.mark.slow
def test_cli_map__a_dramatiq_worker_over_the_map_writes_each_databases_counts(
    tenant_databases: TenantDatabases, tmp_path: Path
):
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker

    from inbox_middleware.dramatiq import identity

    from ..support import services
    from ..support.workers import WorkerProcess, wait_for

    services.require(services.REDIS, "redis")
    queue = f"t{uuid.uuid4().hex[:12]}"
    env = {
        "INBOX_TEST_MAP": str(tenant_databases.map_path),
        "INBOX_TEST_BROKER": "redis",
        "INBOX_TEST_BROKER_URL": services.REDIS,
        "INBOX_TEST_NAMESPACE": f"inbox-test-{queue}",
        "INBOX_TEST_QUEUE": queue,
    }
    broker = RedisBroker(url=services.REDIS, namespace=f"inbox-test-{queue}")
    actor = dramatiq.actor(
        lambda account_id, delta: None, actor_name="add_credit", queue_name=queue, broker=broker
    )
    worker = WorkerProcess("tests.apps.tenants_dramatiq", env, tmp_path / "w.log")
    try:
        # Given t4's message twice (db1: a duplicate) and t5's once (db2)
        for tenant, message_id in [("t4", "m-1"), ("t4", "m-1"), ("t5", "m-2")]:
            actor.send_with_options(
                args=(account(tenant, 1), 5),
                **identity(producer="orders", message_id=message_id, tenant=tenant),
            )
        wait_for(
            lambda: (
                len(tenant_databases.rows(1)["inbox"]) == 1
                and len(tenant_databases.rows(2)["inbox"]) == 1
            ),
            timeout=60,
            what="the claims",
        )
        time.sleep(1)  # the duplicate, queued after the first
    finally:
        worker.stop()  # its last flush
        broker.close()
    # Then each database's status shows its own counts
    shown = run("status", "--map", str(tenant_databases.map_path), "--json")
    found = {
        name: {k: v for c in document["consumers"] for k, v in c["counted"].items() if v}
        for name, document in json.loads(shown.stdout)["databases"].items()
    }
    assert found == {"db0": {}, "db1": {"processed": 1, "duplicate": 1}, "db2": {"processed": 1}}, (
        worker.output()
    )
