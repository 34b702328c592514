"""The commands' JSON over a database map is still JSON a program reads in one go: one
document keyed by database for ``status``, ``explain`` and ``show``, JSON lines naming
each row's database for the listings. On SQLite databases (the map's names and the
command line are the same over any database)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from sqlalchemy import create_engine

from inbox_middleware import DatabaseMap, MessageIdentity
from inbox_middleware._core.identity import hash_json
from inbox_middleware._core.protocol import Delivery
from inbox_middleware._storage import InboxSchema
from inbox_middleware._storage.failures import FailureRecorder
from inbox_middleware._storage.migrate import migrate
from inbox_middleware._storage.routed import RoutedInbox
from inbox_middleware.cli import main

TENANTS = {"t1": "eu-1", "t2": "eu-2", "t3": "eu-2"}


def fleet(tmp_path: Path) -> str:
    """Two databases, a claim for each tenant in its own and a poison row for t1 and
    t2; the map file's path."""
    urls = {name: f"sqlite:///{tmp_path / name}.db" for name in ("eu-1", "eu-2")}
    for url in urls.values():
        engine = create_engine(url)
        migrate(engine, InboxSchema())
        engine.dispose()
    inbox = RoutedInbox(DatabaseMap(urls, tenants=TENANTS))
    try:
        for tenant in TENANTS:
            identity = MessageIdentity("orders", f"o-{tenant}", tenant)
            delivery = Delivery("billing", identity, hash_json({"t": tenant}, "v1"), source="q")
            inbox.process(delivery, lambda session: None)
    finally:
        inbox.dispose()
    recorder = FailureRecorder(InboxSchema(), "sqlite")
    for tenant in ("t1", "t2"):
        engine = create_engine(urls[TENANTS[tenant]])
        with engine.begin() as conn:
            identity = MessageIdentity("orders", f"bad-{tenant}", tenant)
            delivery = Delivery("billing", identity, hash_json(1, "v1"), source="q")
            recorder.record_poison(conn, delivery, reason_code="closed", error="E", attempts=1)
        engine.dispose()
    path = tmp_path / "databases.json"
    path.write_text(json.dumps({"databases": urls, "tenants": TENANTS}))
    return str(path)


def run(*args: str) -> Any:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_cli_map_json__status_is_one_document_keyed_by_database(tmp_path: Path):
    path = fleet(tmp_path)
    # When status runs over the map with --json
    shown = run("status", "--map", path, "--json", "--exact")
    # Then its standard output is one JSON document, each database's status under its name
    document = json.loads(shown.stdout)
    assert document["format"] == "inbox-middleware.databases/1"
    assert set(document["databases"]) == {"eu-1", "eu-2"}
    assert document["failed"] == {}
    claims = {name: one["inbox"]["rows"] for name, one in document["databases"].items()}
    assert claims == {"eu-1": 1, "eu-2": 2}
    assert {one["format"] for one in document["databases"].values()} == {
        "inbox-middleware.status/1"
    }
    # And one database of the map is the same document with that database only
    one = json.loads(run("status", "--map", path, "--json", "--tenant", "t1").stdout)
    assert set(one["databases"]) == {"eu-1"}


def test_cli_map_json__a_database_that_fails_is_named_in_the_document(tmp_path: Path):
    path = fleet(tmp_path)
    data = json.loads(Path(path).read_text())
    data["databases"]["eu-3"] = f"sqlite:///{tmp_path / 'not-migrated.db'}"
    Path(path).write_text(json.dumps(data))
    result = CliRunner().invoke(main, ["status", "--map", path, "--json"])
    assert result.exit_code == 1
    document = json.loads(result.stdout)
    assert set(document["databases"]) == {"eu-1", "eu-2"}
    assert set(document["failed"]) == {"eu-3"}
    assert "inbox-middleware migrate" in document["failed"]["eu-3"]


def test_cli_map_json__explain_and_show_are_one_document_keyed_by_database(tmp_path: Path):
    path = fleet(tmp_path)
    explained = run(
        "explain", "billing", "orders", "o-t2", "--tenant", "t2", "--map", path, "--json"
    )
    document = json.loads(explained.stdout)
    assert list(document["databases"]) == ["eu-2"]
    assert document["databases"]["eu-2"]["claim"] is not None
    shown = run("poison", "show", "1", "--map", path, "--database", "eu-1")
    assert json.loads(shown.stdout)["databases"]["eu-1"]["message_id"] == "bad-t1"


def test_cli_map_json__listings_are_json_lines_each_naming_its_database(tmp_path: Path):
    path = fleet(tmp_path)
    listed = run("poison", "list", "--map", path, "--json")
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert sorted((row["database"], row["tenant"]) for row in rows) == [
        ("eu-1", "t1"),
        ("eu-2", "t2"),
    ]
    effects = run("outbox", "list", "--map", path, "--json")
    assert effects.stdout == ""  # no effect in either database: no line, still JSON lines


def test_cli_json__one_database_prints_as_before(tmp_path: Path):
    path = fleet(tmp_path)
    url = json.loads(Path(path).read_text())["databases"]["eu-2"]
    status = json.loads(run("status", "--database-url", url, "--json").stdout)
    assert status["format"] == "inbox-middleware.status/1"
    rows = [
        json.loads(line)
        for line in run("poison", "list", "--database-url", url, "--json").stdout.splitlines()
    ]
    assert [row["tenant"] for row in rows] == ["t2"] and "database" not in rows[0]
