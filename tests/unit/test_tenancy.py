"""The database map: which database serves an identity, as a pure function of it."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest

from inbox_middleware import (
    ConfigurationError,
    DatabaseMap,
    DatabaseUnavailable,
    MapFile,
    MessageIdentity,
    RouteUnavailable,
    TenantRange,
    UnknownTenant,
    load_map,
)
from inbox_middleware._storage.routed import AsyncRoutedInbox, RoutedInbox, database_url

DATABASES = {"a": "postgresql://h/a", "b": "postgresql://h/b", "c": "postgresql://h/c"}


def ident(tenant: str, message_id: str = "m-1") -> MessageIdentity:
    return MessageIdentity("orders", message_id, tenant)


def test_tenancy__exact_tenants_then_ranges_in_order():
    routes = DatabaseMap(
        DATABASES,
        tenants={"acme": "c"},
        ranges=(TenantRange("a", "m~", "a"), TenantRange("n", "z~", "b")),
    )
    assert routes.route(ident("acme")) == "c"  # the exact entry wins over the range
    assert routes.route(ident("globex")) == "a"
    assert routes.route(ident("umbrella")) == "b"


def test_tenancy__an_unknown_tenant_is_refused_never_defaulted():
    routes = DatabaseMap(DATABASES, tenants={"acme": "a"})
    with pytest.raises(UnknownTenant) as raised:
        routes.route(ident("initech"))
    assert raised.value.tenant == "initech"
    with pytest.raises(UnknownTenant):
        routes.route(ident(""))  # no tenant at all: no database either


def test_tenancy__the_resolver_is_asked_first_and_none_falls_through():
    def resolver(identity: MessageIdentity) -> str | None:
        return "b" if identity.tenant.startswith("eu-") else None

    routes = DatabaseMap(DATABASES, tenants={"eu-acme": "a", "acme": "c"}, resolver=resolver)
    assert routes.route(ident("eu-acme")) == "b"
    assert routes.route(ident("acme")) == "c"


def test_tenancy__a_resolver_that_raises_is_transient_one_naming_nothing_known_is_not():
    def broken(identity: MessageIdentity) -> str | None:
        raise LookupError("the tenant directory is down")

    with pytest.raises(RouteUnavailable):
        DatabaseMap(DATABASES, resolver=broken).route(ident("acme"))
    with pytest.raises(UnknownTenant):
        DatabaseMap(DATABASES, resolver=lambda identity: "zz").route(ident("acme"))


def test_tenancy__the_route_is_a_function_of_the_identity_alone():
    routes = DatabaseMap(DATABASES, ranges=(TenantRange("", "~", "a"),))
    assert {routes.route(ident("t-1", f"m-{n}")) for n in range(50)} == {"a"}


def test_tenancy__a_map_naming_unknown_databases_or_bad_names_is_refused():
    with pytest.raises(ConfigurationError):
        DatabaseMap(DATABASES, tenants={"acme": "zz"})
    with pytest.raises(ConfigurationError):
        DatabaseMap({"bad name": "postgresql://h/x"})
    with pytest.raises(ConfigurationError):
        DatabaseMap({})


def test_tenancy__the_commands_reach_every_database_or_one_tenants():
    routes = DatabaseMap(DATABASES, tenants={"acme": "b"})
    assert routes.databases_of(None) == ("a", "b", "c")
    assert routes.databases_of("acme") == ("b",)


def test_tenancy__map_files_in_json_and_toml(tmp_path: Path):
    data = {
        "databases": DATABASES,
        "tenants": {"acme": "a"},
        "ranges": [{"first": "b", "last": "b~", "database": "c"}],
    }
    (tmp_path / "map.json").write_text(json.dumps(data))
    (tmp_path / "map.toml").write_text(
        '[databases]\na = "postgresql://h/a"\nc = "postgresql://h/c"\n'
        '[tenants]\nacme = "a"\n[[ranges]]\nfirst = "b"\nlast = "b~"\ndatabase = "c"\n'
    )
    for name in ("map.json", "map.toml"):
        routes = load_map(tmp_path / name)
        assert routes.route(ident("acme")) == "a"
        assert routes.route(ident("bob")) == "c"


def test_tenancy__a_map_file_being_rewritten_hands_back_then_routes_by_the_new_map(
    tmp_path: Path,
):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"databases": DATABASES, "tenants": {"acme": "a"}}))
    routes = MapFile(path)
    assert routes.route(ident("acme")) == "a"
    path.write_text('{"databases": {"a": ')  # half written
    os.utime(path, ns=(1, 1))
    with pytest.raises(RouteUnavailable):
        routes.route(ident("acme"))
    path.write_text(json.dumps({"databases": DATABASES, "tenants": {"acme": "b"}}))
    os.utime(path, ns=(2, 2))
    assert routes.route(ident("acme")) == "b"


def test_tenancy__urls_get_the_inbox_driver():
    assert database_url("postgresql://u@h:5450/a", True).drivername == "postgresql+asyncpg"
    assert database_url("postgresql://u@h:5450/a", False).drivername == "postgresql+psycopg"


def test_tenancy__the_connection_budget_bounds_open_databases():
    inbox = RoutedInbox(DatabaseMap(DATABASES), pool_size=2, connection_budget=4)
    assert inbox.max_open == 2
    assert inbox._admit("a", lambda name: False) == []
    assert inbox._admit("b", lambda name: False) == []
    # a third database closes the least recently used idle one
    assert inbox._admit("c", lambda name: False) == ["a"]
    # every open database busy: the delivery waits, the budget holds
    with pytest.raises(RouteUnavailable):
        inbox._admit("a", lambda name: True)
    assert inbox._admit("b", lambda name: True) == []  # already open: no new connections
    with pytest.raises(ConfigurationError):
        RoutedInbox(DatabaseMap(DATABASES), pool_size=4, connection_budget=2)


def test_tenancy__a_paused_tenant_is_handed_back_the_others_route():
    routes = DatabaseMap.from_dict(
        {"databases": DATABASES, "tenants": {"acme": "a", "globex": "a"}, "paused": ["acme"]}
    )
    with pytest.raises(RouteUnavailable):
        routes.route(ident("acme"))
    assert routes.route(ident("globex")) == "a"


def test_tenancy__the_guides_set_ups_build_without_connecting():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "docs" / "snippets" / "many_databases.py"
    spec = importlib.util.spec_from_file_location("snippet_many_databases", path)
    assert spec is not None and spec.loader is not None
    snippet = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(snippet)
    databases = snippet.fleet_map()
    assert databases.route(ident("acme")) == "us-1"
    assert databases.route(ident("globex")) == "eu-1"
    assert databases.route(ident("umbrella")) == "eu-2"
    middleware = snippet.dramatiq_fleet(databases)
    assert middleware.inbox.engines == {}  # nothing opened before a delivery
    inbox = snippet.faststream_fleet(databases)
    assert inbox.storage.engines == {}
    middleware, inbox = snippet.patient_fleet(databases)
    for routed in (middleware.inbox, middleware.async_inbox, inbox.storage):
        assert (routed.connect_timeout, routed.down_pause, routed.down_pause_limit) == (2, 2, 30)
    assert snippet.resolved.route(ident("eu:acme")) in ("eu-1", "eu-2")
    assert snippet.resolved.route(ident("us:acme")) == "us-1"
    with pytest.raises(UnknownTenant):
        snippet.resolved.route(ident("acme"))


def test_tenancy__a_database_holds_at_most_its_pool_of_a_workers_deliveries():
    inbox = RoutedInbox(DatabaseMap(DATABASES), pool_size=2, connection_budget=4, busy_wait=0)
    with inbox._slot("a", "billing"), inbox._slot("a", "billing"):
        # a third delivery to the same database is handed back (no wait allowed here)
        with pytest.raises(RouteUnavailable) as refused, inbox._slot("a", "billing"):
            pass
        assert refused.value.retry_after == inbox.down_pause
        with inbox._slot("b", "billing"):  # the other databases are not held up
            pass
    with inbox._slot("a", "billing"):  # released
        pass


def test_tenancy__a_busy_database_is_waited_for_while_its_deliveries_are_young():
    """All of a database's places taken by deliveries that began less than busy_wait ago
    (a database that answers, busy for a moment): the next delivery waits for a place,
    it is not handed back for a pause."""
    inbox = RoutedInbox(DatabaseMap(DATABASES), pool_size=1, connection_budget=4, busy_wait=2)
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with inbox._slot("a", "billing"):
            taken.set()
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        taken.wait(5)
        threading.Timer(0.2, release.set).start()
        began = time.monotonic()
        with inbox._slot("a", "billing"):  # waits for the holder, about 0.2 s
            waited = time.monotonic() - began
        assert 0.1 < waited < 1.5, waited
    finally:
        release.set()
        holder.join(5)


def test_tenancy__a_database_whose_deliveries_hang_is_not_waited_for():
    """Its places held longer than busy_wait (a database that hangs): handed back at once;
    a delivery waiting meanwhile is handed back once the oldest has run busy_wait."""
    inbox = RoutedInbox(DatabaseMap(DATABASES), pool_size=1, connection_budget=4, busy_wait=0.3)
    with inbox._slot("a", "billing"):
        began = time.monotonic()
        with pytest.raises(RouteUnavailable), inbox._slot("a", "billing"):
            pass
        assert 0.2 < time.monotonic() - began < 1.0  # waited busy_wait, then handed back
        began = time.monotonic()
        with pytest.raises(RouteUnavailable), inbox._slot("a", "billing"):
            pass
        assert time.monotonic() - began < 0.1  # the holder is old: not waited for
        with inbox._slot("b", "billing"):
            pass


def test_tenancy__a_database_whose_deliveries_hang_is_paused_longer_while_they_hang():
    """Its places held past busy_wait (queries that never answer): its deliveries come back
    after a pause that grows while it hangs, as a database that does not answer, not after
    the first pause again and again (a backlog cycling through the workers)."""
    inbox = RoutedInbox(
        DatabaseMap(DATABASES),
        pool_size=1,
        connection_budget=4,
        busy_wait=0.1,
        down_pause=0.5,
        down_pause_limit=2.0,
    )

    def refused() -> float:
        with pytest.raises(RouteUnavailable) as caught, inbox._slot("a", "billing"):
            pass
        assert caught.value.retry_after is not None
        return caught.value.retry_after

    with inbox._slot("a", "billing"):
        time.sleep(0.15)
        assert refused() == pytest.approx(0.5, abs=0.01)  # the first pause
        assert 0.3 < refused() <= 0.5  # paused: what is left of it
        time.sleep(0.55)
        assert refused() == pytest.approx(1.0, abs=0.01)  # still hangs: twice as long
        with pytest.raises(RouteUnavailable) as caught, inbox._slot("a", "billing"):
            pass
        # what is left of the pause, and its whole length to spread the hand-backs over
        assert caught.value.retry_after is not None and caught.value.retry_after <= 1.0
        assert caught.value.retry_spread == pytest.approx(1.0)
        with inbox._slot("b", "billing"):  # the others are not held up
            pass


def test_tenancy__a_long_outages_hand_backs_are_spread_over_half_of_it():
    """A database down longer than twice its pause: its hand-backs are spread over half
    the time it has been down (its backlog, which grows with the outage, comes back at a
    bounded rate), not over one pause; once it answers, from its pause again."""
    inbox = RoutedInbox(
        DatabaseMap(DATABASES), pool_size=1, connection_budget=4, down_pause=0.2,
        down_pause_limit=0.2,
    )  # fmt: skip

    def refused() -> tuple[float, float]:
        with pytest.raises(DatabaseUnavailable) as caught:
            inbox._refuse_if_down("a", "billing")
        assert caught.value.retry_after is not None and caught.value.retry_spread is not None
        return caught.value.retry_after, caught.value.retry_spread

    inbox._went_down("a")
    assert refused()[1] == pytest.approx(0.2)  # down for less than two pauses: the pause
    time.sleep(0.3)
    inbox._went_down("a")  # still down at its next try
    time.sleep(0.1)
    after, spread = refused()
    assert after <= 0.2 and spread == pytest.approx(0.2, abs=0.03)  # 0.4 s down: 0.2
    time.sleep(0.4)
    inbox._went_down("a")
    _, spread = refused()
    assert spread == pytest.approx(0.4, abs=0.05)  # 0.8 s down: half of it
    inbox._answered("a")
    inbox._went_down("a")
    assert refused()[1] == pytest.approx(0.2)  # a new outage


def test_tenancy__an_async_busy_database_is_awaited_without_blocking_the_loop():
    inbox = AsyncRoutedInbox(DatabaseMap(DATABASES), pool_size=1, connection_budget=4, busy_wait=2)

    async def scenario() -> tuple[float, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())

        async def hold() -> None:
            async with inbox._aslot("a", "billing"):
                await asyncio.sleep(0.3)

        holder = asyncio.create_task(hold())
        await asyncio.sleep(0.05)
        began = time.monotonic()
        async with inbox._aslot("a", "billing"):  # waits for the holder
            waited = time.monotonic() - began
        await holder
        async with inbox._aslot("b", "billing"):
            pass
        ticker.cancel()
        return waited, ticks

    waited, ticks = asyncio.run(scenario())
    assert 0.1 < waited < 1.5, waited
    assert ticks >= 10  # the loop ran meanwhile


def test_tenancy__an_async_database_whose_deliveries_hang_is_not_awaited():
    inbox = AsyncRoutedInbox(
        DatabaseMap(DATABASES), pool_size=1, connection_budget=4, busy_wait=0.3
    )

    async def scenario() -> float:
        async with inbox._aslot("a", "billing"):
            began = time.monotonic()
            with pytest.raises(RouteUnavailable):
                async with inbox._aslot("a", "billing"):
                    pass
            return time.monotonic() - began

    assert 0.2 < asyncio.run(scenario()) < 1.0
