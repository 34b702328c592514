"""Moving a tenant to another database, as the many-databases guide tells: pause it, copy
its business rows and its inbox rows in one transaction on the target, point the map at
the target, unpause, delete from the source. A message applied before the move is a
duplicate after it; nothing of the tenant stays behind."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, create_engine, text

from inbox_middleware import DatabaseMap, MessageIdentity, RouteUnavailable
from inbox_middleware._core.exceptions import ConfigurationError
from inbox_middleware._core.identity import hash_json
from inbox_middleware._core.protocol import Decision, Delivery
from inbox_middleware._storage import InboxSchema
from inbox_middleware._storage.layout import switch_claims
from inbox_middleware._storage.routed import RoutedInbox
from inbox_middleware._storage.tenants import copy_tenant

from ..apps.domain import apply_credit
from ..support.tenants import TENANTS, TenantDatabases, tenant_database


def delivery(message_id: str, delta: int) -> Delivery:
    return Delivery(
        "billing",
        MessageIdentity("orders", message_id, "t3"),
        hash_json({"account": 300, "delta": delta}, "v1"),
        source="q",
    )


def credit(inbox: RoutedInbox, message_id: str, delta: int) -> Decision:
    committed = inbox.process(
        delivery(message_id, delta), lambda session: apply_credit(session, "billing", 300, delta)
    )
    return committed.verdict.decision


def quarantined(url: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.scalar(text("SELECT count(*) FROM inbox_quarantine")) or 0)
    finally:
        engine.dispose()


def guide() -> Any:
    """The guide's snippet, as the page shows it."""
    path = Path(__file__).resolve().parents[2] / "docs" / "snippets" / "many_databases.py"
    spec = importlib.util.spec_from_file_location("snippet_many_databases", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def move_business_rows(source: Connection, target: Connection, tenant: str) -> None:
    """The user's part: the tenant's own rows (here: account 300 and its ledger)."""
    for table, key in (("accounts", "id"), ("ledger", "account_id")):
        rows = source.execute(text(f"SELECT * FROM {table} WHERE {key} = 300")).mappings().all()
        for found in rows:
            row = {k: v for k, v in found.items() if not (table == "ledger" and k == "id")}
            columns = ", ".join(row)
            values = ", ".join(f":{name}" for name in row)
            target.execute(text(f"INSERT INTO {table} ({columns}) VALUES ({values})"), dict(row))
        source.execute(text(f"DELETE FROM {table} WHERE {key} = 300"))


def test_move_tenant__its_claims_move_with_its_rows(tenant_databases: TenantDatabases):
    urls = {f"db{i}": tenant_databases.url(i) for i in range(2)}
    before = RoutedInbox(DatabaseMap(urls, tenants={"t3": "db0"}))
    # Given tenant t3 in db0, with one message applied and one conflict quarantined
    assert credit(before, "m-1", 10) is Decision.FIRST
    assert credit(before, "m-1", 99) is Decision.CONFLICT
    before.dispose()
    # When it is paused, its deliveries are handed back (nothing is claimed anywhere)
    paused = RoutedInbox(DatabaseMap(urls, tenants={"t3": "db0"}, paused=frozenset({"t3"})))
    with pytest.raises(RouteUnavailable):
        credit(paused, "m-2", 5)
    # ... and its rows move: the business rows and the inbox rows, in one transaction
    assert quarantined(urls["db0"]) == 1
    source_engine, target_engine = (create_engine(urls[name]) for name in ("db0", "db1"))
    try:
        guide().move_tenant(source_engine, target_engine, "t3", move_business_rows)
    finally:
        source_engine.dispose()
        target_engine.dispose()
    assert quarantined(urls["db1"]) == 1
    # Then, routed to db1, the message applied before the move is a duplicate there
    after = RoutedInbox(DatabaseMap(urls, tenants={"t3": "db1"}))
    try:
        assert credit(after, "m-1", 10) is Decision.DUPLICATE
        assert credit(after, "m-1", 99) is Decision.CONFLICT
        assert credit(after, "m-2", 5) is Decision.FIRST
    finally:
        after.dispose()
    assert tenant_databases.rows(0) == {"ledger": [], "inbox": []}
    moved = tenant_databases.rows(1)
    assert sorted(moved["ledger"]) == [(300, 5), (300, 10)]
    assert sorted(moved["inbox"]) == [("t3", "m-1"), ("t3", "m-2")]


def test_compact__a_routed_inbox_claims_in_each_tenants_database(tenant_databases):
    # Given a fleet over three databases claiming in the compact row, the switch recorded
    # in each (a new deployment)
    routes = DatabaseMap(
        {f"db{i}": tenant_databases.url(i) for i in range(3)},
        tenants={t: tenant_database(t) for t in TENANTS},
    )
    for index in range(3):
        engine = tenant_databases.engine(index)
        with engine.begin() as conn:
            switch_claims(conn, InboxSchema(), by="test")
        engine.dispose()
    inbox = RoutedInbox(routes, claims="compact")
    try:
        # When every tenant's message is delivered twice
        decided = [
            inbox.process(
                Delivery("billing", MessageIdentity("orders", f"o-{t}", t), hash_json({}, "v1")),
                lambda session: None,
            ).decision
            for t in TENANTS * 2
        ]
    finally:
        inbox.dispose()
    # Then each is first once, its claim in its tenant's database, none in the library's
    assert decided == [Decision.FIRST] * 9 + [Decision.DUPLICATE] * 9
    for index in range(3):
        engine = tenant_databases.engine(index)
        with engine.connect() as conn:
            compact = conn.scalar(text("SELECT count(*) FROM inbox_claims"))
            library = conn.scalar(text("SELECT count(*) FROM consumer_inbox"))
        engine.dispose()
        assert (compact, library) == (3, 0)
    # ... and a tenant's claims, which the compact row cannot tell apart, are not moved
    source, target = tenant_databases.engine(0), tenant_databases.engine(1)
    try:
        with (
            source.connect() as conn,
            target.begin() as into,
            pytest.raises(ConfigurationError, match="names no tenant"),
        ):
            copy_tenant(conn, into, "t0")
    finally:
        source.dispose()
        target.dispose()
