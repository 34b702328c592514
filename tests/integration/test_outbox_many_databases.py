"""The outbox over three databases (`tests.support.tenants`): effects recorded by a routed
handler land in its tenant's database with the claim; `RoutedDispatcher` delivers every
database's effects, shares them with another dispatcher (SKIP LOCKED per database), and
looks at an idle database within its stated latency bound."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from inbox_middleware import DatabaseMap, MessageIdentity, outbox
from inbox_middleware._core.identity import hash_json
from inbox_middleware._core.protocol import Delivery
from inbox_middleware._storage.routed import RoutedInbox
from inbox_middleware.outbox.destinations.http import HttpDestination

from ..support.http_remote import Remote
from ..support.tenants import TENANTS, TenantDatabases, tenant_database
from ..support.workers import wait_for

PER_TENANT = 4


def routes(tenant_databases: TenantDatabases, **extra: Any) -> DatabaseMap:
    return DatabaseMap(
        {f"db{i}": tenant_databases.url(i) for i in range(3)},
        tenants={tenant: tenant_database(tenant) for tenant in TENANTS},
        **extra,
    )


def record(tenant_databases: TenantDatabases, wave: str = "a") -> list[str]:
    """Each tenant's messages, processed through the routed inbox; each handler records
    one effect. The effect ids, in order."""
    inbox = RoutedInbox(routes(tenant_databases))
    recorded: list[str] = []

    def handler(session: Any) -> None:
        recorded.append(outbox.add(session, destination="remote", payload={"n": len(recorded)}))

    try:
        for tenant in TENANTS:
            for k in range(PER_TENANT):
                identity = MessageIdentity("orders", f"{wave}-{tenant}-{k}", tenant)
                delivery = Delivery("billing", identity, hash_json({"k": k}, "v1"), source="q")
                inbox.process(delivery, handler)
    finally:
        inbox.dispose()
    return recorded


def outbox_rows(tenant_databases: TenantDatabases, index: int) -> dict[str, str]:
    engine = tenant_databases.engine(index)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT effect_id, status FROM message_outbox")).all()
        return {row.effect_id: row.status for row in rows}
    finally:
        engine.dispose()


def dispatcher(tenant_databases: TenantDatabases, remote: Remote, **options: Any) -> Any:
    settings: dict[str, Any] = {"poll_interval": 0.1, "lease": 5, "delivery_timeout": 2}
    return outbox.RoutedDispatcher(
        routes(tenant_databases),
        outbox.Destinations({"remote": HttpDestination(remote.url)}),
        **(settings | options),
    )


@pytest.fixture
def remote():
    found = Remote()
    yield found
    found.close()


def test_outbox_map__effects_are_recorded_in_the_tenants_database_with_its_claim(
    tenant_databases: TenantDatabases,
):
    # When each tenant's handler records an effect through the routed inbox
    recorded = record(tenant_databases)
    # Then each effect is in its tenant's database only, beside the claim
    assert len(set(recorded)) == len(TENANTS) * PER_TENANT
    for index in range(3):
        rows = outbox_rows(tenant_databases, index)
        tenants = {tenant for tenant, _ in tenant_databases.rows(index)["inbox"]}
        assert tenants == {t for t in TENANTS if tenant_database(t) == f"db{index}"}
        assert len(rows) == len(tenants) * PER_TENANT
        assert set(rows.values()) == {"pending"}
    assert sum(len(outbox_rows(tenant_databases, i)) for i in range(3)) == len(recorded)


def test_outbox_map__two_dispatchers_deliver_every_databases_effects_once(
    tenant_databases: TenantDatabases, remote: Remote
):
    recorded = record(tenant_databases)
    before = {name: delivered(name) for name in ("db0", "db1", "db2")}
    # When two dispatchers over the map run together until nothing is due
    first = dispatcher(tenant_databases, remote, batch_size=3, parallel=2)
    second = dispatcher(tenant_databases, remote, batch_size=3, parallel=2)

    async def both() -> None:
        await asyncio.gather(first.run(burst=True), second.run(burst=True))

    asyncio.run(both())
    # Then every effect was delivered once (their leases skip each other's rows) and is
    # dispatched in its own database
    assert sorted(remote.applied) == sorted(recorded)
    assert len(remote.received) == len(recorded)
    for index in range(3):
        assert set(outbox_rows(tenant_databases, index).values()) == {"dispatched"}
    assert first.stats.dispatched + second.stats.dispatched == len(recorded)
    assert first.stats.dispatched > 0 and second.stats.dispatched > 0
    assert set(first.stats_by_database()) | set(second.stats_by_database()) == {
        "db0",
        "db1",
        "db2",
    }
    # And each attempt is counted under its database's name in the map (not its tenant)
    counted = {name: delivered(name) - before[name] for name in ("db0", "db1", "db2")}
    assert counted == {
        name: len(outbox_rows(tenant_databases, index)) for index, name in enumerate(counted)
    }


def delivered(database: str) -> float:
    """``inbox_outbox_attempts_total`` of the remote's delivered effects from ``database``."""
    from prometheus_client import REGISTRY

    labels = {"destination": "remote", "outcome": "delivered", "database": database}
    return REGISTRY.get_sample_value("inbox_outbox_attempts_total", labels) or 0.0


def test_outbox_map__an_idle_database_is_looked_at_within_the_latency_bound(
    tenant_databases: TenantDatabases, remote: Remote
):
    # Given a dispatcher looking at one database per 0.3 s: a bound of 0.9 s over three
    running = dispatcher(tenant_databases, remote, sweep=1, poll_interval=0.3)
    assert running.latency_bound == pytest.approx(0.9)
    thread = running.start()
    try:
        time.sleep(1.0)  # every database looked at once, idle
        waits = []
        for n, tenant in enumerate(["t2", "t0", "t1"]):  # db2, db0, db1
            # When an effect is recorded in one database
            effect_id = f"fx-latency-{n}"
            engine = tenant_databases.engine(int(tenant_database(tenant)[2:]))
            try:
                with Session(engine) as session, session.begin():
                    outbox.add(session, destination="remote", payload={}, effect_id=effect_id)
                started = time.monotonic()  # committed
            finally:
                engine.dispose()
            # Then it is delivered within the bound (and a delivery's time)
            wait_for(lambda e=effect_id: e in remote.applied, timeout=10, what=effect_id)
            waits.append(time.monotonic() - started)
        assert max(waits) < running.latency_bound + 0.5, waits
    finally:
        running.stop()
        thread.join(timeout=30)


def test_outbox_map__one_tenants_database_only(tenant_databases: TenantDatabases, remote: Remote):
    recorded = record(tenant_databases)
    only = dispatcher(tenant_databases, remote, databases=["db1"])
    asyncio.run(only.run(burst=True))
    assert set(remote.applied) == set(outbox_rows(tenant_databases, 1))
    assert set(outbox_rows(tenant_databases, 0).values()) == {"pending"}
    assert len(remote.applied) == len(recorded) // 3


def test_outbox_map__a_black_holed_database_holds_one_slot_the_others_keep_flowing(
    tenant_databases: TenantDatabases, remote: Remote
):
    from urllib.parse import urlsplit

    from ..support.proxy import Proxy

    # Given db1 reached through a proxy, and a dispatcher that has looked at it already
    upstream = urlsplit(tenant_databases.url(1))
    proxy = Proxy(("127.0.0.1", upstream.port or 5451))
    urls = {f"db{i}": tenant_databases.url(i) for i in range(3)}
    urls["db1"] = urls["db1"].replace(f":{upstream.port}/", f":{proxy.port}/")
    routed = outbox.RoutedDispatcher(
        DatabaseMap(urls),
        outbox.Destinations({"remote": HttpDestination(remote.url)}),
        poll_interval=0.1,
        lease=5,
        delivery_timeout=2,
        parallel=2,
        connect_timeout=1,
    )
    thread = routed.start()
    try:
        time.sleep(1.0)
        # When db1's packets are dropped (its open connection hangs, new ones are never
        # served) while effects are recorded in every database
        proxy.blackhole()
        added = {index: [f"fx-hole-{index}-{k}" for k in range(3)] for index in (1, 0, 2)}
        for index, ids in added.items():
            engine = tenant_databases.engine(index)
            try:
                with Session(engine) as session, session.begin():
                    for effect_id in ids:
                        outbox.add(session, destination="remote", payload={}, effect_id=effect_id)
            finally:
                engine.dispose()
        started = time.monotonic()
        # Then the other databases' effects are delivered at once, db1's wait
        healthy = added[0] + added[2]
        wait_for(lambda: set(healthy) <= set(remote.applied), timeout=10, what="db0 and db2")
        healthy_in = time.monotonic() - started
        assert not set(added[1]) & set(remote.applied)
        # And once db1 answers again, its effects are delivered too
        proxy.unblackhole()
        wait_for(lambda: set(added[1]) <= set(remote.applied), timeout=30, what="db1")
    finally:
        routed.stop()
        proxy.close()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert healthy_in < 3.0, healthy_in
    assert len(remote.received) == 9


def test_outbox_map__a_database_not_migrated_is_reported_the_others_dispatched(
    tenant_databases: TenantDatabases, remote: Remote, caplog: pytest.LogCaptureFixture
):
    recorded = record(tenant_databases)
    # Given a map naming a fourth database without the inbox tables
    urls = {f"db{i}": tenant_databases.url(i) for i in range(3)}
    urls["bare"] = tenant_databases.url(0).rsplit("/", 1)[0] + "/postgres"
    routed = outbox.RoutedDispatcher(
        DatabaseMap(urls),
        outbox.Destinations({"remote": HttpDestination(remote.url)}),
        poll_interval=0.1,
        lease=5,
        delivery_timeout=2,
    )
    # When it runs until nothing is due
    with caplog.at_level("WARNING", logger="inbox_middleware.outbox"):
        asyncio.run(routed.run(burst=True))
    # Then the three databases' effects are delivered, and the bare one is named
    assert sorted(remote.applied) == sorted(recorded)
    assert "database bare failed" in caplog.text
    assert "migrate" in caplog.text
    assert (
        "bare" not in routed.stats_by_database()
        or routed.stats_by_database()["bare"] == outbox.DispatcherStats()
    )
