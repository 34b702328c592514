"""The commands over a fleet's database map: ``--map`` runs on every database it names,
``--tenant`` on the one that serves that tenant; a database that fails is reported and
the others still run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from inbox_middleware import DatabaseMap, MessageIdentity
from inbox_middleware._core.identity import hash_json
from inbox_middleware._core.protocol import Delivery
from inbox_middleware._storage.routed import RoutedInbox

from ..support.tenants import TenantDatabases


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from inbox_middleware.cli import run; run()", *args],
        capture_output=True,
        text=True,
        timeout=120,
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
