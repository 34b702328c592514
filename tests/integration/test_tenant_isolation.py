"""Failure isolation over many databases: one tenant database black-holed (its packets
dropped, through the test proxy: a connect or a query that never answers), the other
tenants' messages on the same shared queue still complete, on a real FastStream worker
over RabbitMQ with a bounded prefetch.

Nothing here stops a server (the proxy black-holes one database's connections); but the
tenant databases' fixture starts any tenant server it finds stopped when it ends, which
would cut short another run's outage: run these under the fault lock while such a run
(``tests/crash/test_many_databases.py``, ``python -m bench.tenants``) may be going on.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from sqlalchemy import text

from ..support import services
from ..support.faststream_worker import FastStreamWorker
from ..support.proxy import Proxy
from ..support.tenants import TENANTS, TenantDatabases, account, tenant_database, write_map
from ..support.workers import wait_for

pytest_plugins = ["tests.support.tenants"]
pytestmark = pytest.mark.slow

HOLED = 2  # db2: tenants t2, t5, t8
PER_TENANT = 8


def applied(databases: TenantDatabases, index: int) -> int:
    engine = databases.engine(index)
    try:
        with engine.connect() as conn:
            return int(conn.scalar(text("SELECT count(*) FROM ledger")) or 0)
    finally:
        engine.dispose()


@pytest.fixture
def rabbit() -> Iterator[tuple[object, str]]:
    import pika

    services.require(services.RABBITMQ, "RabbitMQ")
    queue = f"iso{uuid.uuid4().hex[:12]}"
    connection = pika.BlockingConnection(pika.URLParameters(services.RABBITMQ))
    channel = connection.channel()
    channel.queue_declare(queue, durable=True)
    channel.confirm_delivery()
    try:
        yield channel, queue
    finally:
        waits = [f"{queue}.inbox-wait.{ms}" for ms in (2000, 4000, 8000, 10000)]
        for name in (queue, f"{queue}.dead-letter", f"{queue}.quarantine", *waits):
            channel.queue_delete(name)
        connection.close()


def test_tenant_isolation__faststream_black_holed_database_does_not_stall_the_others(
    tenant_databases: TenantDatabases, rabbit: tuple[object, str], tmp_path: Path
) -> None:
    """The black-holed database's messages are sent first, so that they fill the
    subscriber's prefetch window; its hand-backs must leave the window (not wait in it)
    for the other tenants' messages, sent after them, to be applied."""
    import pika

    channel, queue = rabbit
    port = urlsplit(services.POSTGRES_TENANTS[HOLED]).port
    proxy = Proxy(("127.0.0.1", port or 5452))
    urls = [tenant_databases.url(i) for i in range(3)]
    urls[HOLED] = urls[HOLED].replace(f":{port}/", f":{proxy.port}/")
    map_path = tmp_path / "holed.json"
    write_map(map_path, urls)
    proxy.blackhole()
    worker = FastStreamWorker(
        "tests.apps.tenants_faststream:app",
        {
            "INBOX_TEST_MAP": str(map_path),
            "INBOX_TEST_BROKER_URL": services.RABBITMQ,
            "INBOX_TEST_SOURCE": queue,
            "INBOX_TEST_PREFETCH": "4",
            "INBOX_TEST_BACKOFF": "2,10",
        },
        tmp_path / "worker.log",
    )
    try:
        wait_for(worker.ready, timeout=60, what="the FastStream worker")

        def send(tenant: str, k: int) -> None:
            channel.basic_publish(  # type: ignore[attr-defined]
                "",
                queue,
                json.dumps({"account": account(tenant, k), "delta": 1}).encode(),
                pika.BasicProperties(
                    content_type="application/json",
                    delivery_mode=2,
                    headers={
                        "x-inbox-producer": "orders",
                        "x-inbox-message-id": f"{tenant}-{k}",
                        "x-inbox-tenant": tenant,
                    },
                ),
            )

        holed = [t for t in TENANTS if tenant_database(t) == f"db{HOLED}"]
        healthy = [t for t in TENANTS if t not in holed]
        for k in range(PER_TENANT):
            for tenant in holed:
                send(tenant, k)
        time.sleep(1)  # the black-holed database's messages reach the window first
        began = time.monotonic()
        for k in range(PER_TENANT):
            for tenant in healthy:
                send(tenant, k)
        per_database = PER_TENANT * 3
        wait_for(
            lambda: all(
                applied(tenant_databases, i) == per_database for i in range(3) if i != HOLED
            ),
            timeout=20,
            interval=0.5,
            what="the healthy databases' messages while one database is black-holed",
        )
        took = time.monotonic() - began
        assert took < 20, took
        proxy.unblackhole()
        wait_for(
            lambda: applied(tenant_databases, HOLED) == per_database,
            timeout=90,
            interval=0.5,
            what="the black-holed database's messages once it answers again",
        )
        time.sleep(2)
        assert [applied(tenant_databases, i) for i in range(3)] == [per_database] * 3
    finally:
        worker.kill()
        proxy.close()


def test_tenant_isolation__faststream_a_busy_healthy_database_is_waited_for_not_paused(
    tenant_databases: TenantDatabases, rabbit: tuple[object, str], tmp_path: Path
) -> None:
    """One database black-holed, and a burst for the two healthy ones, twice their pool
    each (the handler holds its place 0.2 s): the deliveries that find a healthy database's
    places taken wait for one (its deliveries are young: it answers), so the whole burst is
    applied in about two handler times; handed back, they would come back after a pause
    (a second or more), the latency the healthy tenants paid while another database was
    down. The black-holed database's messages are handed back and applied once after."""
    import pika

    channel, queue = rabbit
    port = urlsplit(services.POSTGRES_TENANTS[HOLED]).port
    proxy = Proxy(("127.0.0.1", port or 5452))
    urls = [tenant_databases.url(i) for i in range(3)]
    urls[HOLED] = urls[HOLED].replace(f":{port}/", f":{proxy.port}/")
    map_path = tmp_path / "busy.json"
    write_map(map_path, urls)
    proxy.blackhole()
    worker = FastStreamWorker(
        "tests.apps.tenants_faststream:app",
        {
            "INBOX_TEST_MAP": str(map_path),
            "INBOX_TEST_BROKER_URL": services.RABBITMQ,
            "INBOX_TEST_SOURCE": queue,
            "INBOX_TEST_PREFETCH": "64",
            "INBOX_TEST_SLEEP": "0.2",
            "INBOX_TEST_BACKOFF": "0.2,1.0",
        },
        tmp_path / "worker.log",
    )
    engines = [tenant_databases.engine(i) for i in range(3)]

    def count(index: int) -> int:
        with engines[index].connect() as conn:
            return int(conn.scalar(text("SELECT count(*) FROM ledger")) or 0)

    def send(tenant: str, k: int) -> None:
        channel.basic_publish(  # type: ignore[attr-defined]
            "",
            queue,
            json.dumps({"account": account(tenant, k), "delta": 1}).encode(),
            pika.BasicProperties(
                content_type="application/json",
                delivery_mode=2,
                headers={
                    "x-inbox-producer": "orders",
                    "x-inbox-message-id": f"{tenant}-{k}",
                    "x-inbox-tenant": tenant,
                },
            ),
        )

    try:
        wait_for(worker.ready, timeout=60, what="the FastStream worker")
        holed = [t for t in TENANTS if tenant_database(t) == f"db{HOLED}"]
        healthy = {0: [t for t in TENANTS if tenant_database(t) == "db0"], 1: []}
        healthy[1] = [t for t in TENANTS if tenant_database(t) == "db1"]
        for k in range(4):
            for tenant in holed:
                send(tenant, k)  # 12: the black-holed database's places, and more
        time.sleep(1)
        # a warm-up message for each healthy database (their pools connected)
        send(healthy[0][0], 99)
        send(healthy[1][0], 99)
        wait_for(lambda: count(0) == 1 and count(1) == 1, timeout=30, what="the warm-up")
        pool = 4  # the app's pool_size: FastStreamInbox's default
        burst = [(tenant, k) for k in range(2 * pool) for tenant in (healthy[0][0], healthy[1][0])]
        began = time.monotonic()
        for tenant, k in burst:
            send(tenant, k)
        wait_for(
            lambda: count(0) == count(1) == 1 + 2 * pool,
            timeout=30,
            interval=0.02,
            what="the healthy databases' burst",
        )
        took = time.monotonic() - began
        # two rounds of the handler's 0.2 s, and the broker's and the claims' time; a
        # delivery handed back for a pause (1 s or more) would take 1.2 s at least
        assert took < 1.0, took
        proxy.unblackhole()
        wait_for(
            lambda: count(HOLED) == 4 * len(holed),
            timeout=90,
            interval=0.5,
            what="the black-holed database's messages once it answers again",
        )
        time.sleep(2)
        assert [count(i) for i in range(3)] == [1 + 2 * pool, 1 + 2 * pool, 4 * len(holed)]
    finally:
        worker.kill()
        proxy.close()
        for engine in engines:
            engine.dispose()


def test_tenant_isolation__a_database_down_is_paused_longer_while_it_stays_down(
    tenant_databases: TenantDatabases,
) -> None:
    """A routed inbox tries a database that does not answer once per pause (the pause
    doubling while it stays down), hands its deliveries back meanwhile with the pause as
    their least delay, and serves the other databases as before; once it answers, its
    pauses start again from the first."""
    from inbox_middleware import DatabaseMap, MessageIdentity
    from inbox_middleware._core.exceptions import DatabaseUnavailable
    from inbox_middleware._core.identity import hash_json
    from inbox_middleware._core.protocol import Decision, Delivery
    from inbox_middleware._storage.routed import RoutedInbox

    from ..apps.domain import apply_credit

    port = urlsplit(services.POSTGRES_TENANTS[1]).port
    proxy = Proxy(("127.0.0.1", port or 5451))
    urls = {"db0": tenant_databases.url(0), "db1": tenant_databases.url(1)}
    urls["db1"] = urls["db1"].replace(f":{port}/", f":{proxy.port}/")
    inbox = RoutedInbox(
        DatabaseMap(urls, tenants={"t0": "db0", "t1": "db1"}),
        down_pause=0.5,
        down_pause_limit=2.0,
        connect_timeout=1.0,
    )
    counter = iter(range(1000))

    def credit(tenant: str) -> Decision:
        n = next(counter)
        delivery = Delivery(
            "billing",
            MessageIdentity("orders", f"m-{n}", tenant),
            hash_json({"n": n}, "v1"),
            source="q",
        )
        account_id = 0 if tenant == "t0" else 100
        result = inbox.process(delivery, lambda s: apply_credit(s, "billing", account_id, 1))
        return result.verdict.decision

    def refused(tenant: str) -> float:
        with pytest.raises(DatabaseUnavailable) as caught:
            credit(tenant)
        assert caught.value.retry_after is not None
        return caught.value.retry_after

    try:
        proxy.down()
        # the first try fails: paused 0.5 s, then 1 s, then 2 s (the limit), then 2 s
        pauses = []
        for _ in range(4):
            pauses.append(refused("t1"))
            # meanwhile its deliveries are refused at once, the other database serves
            began = time.monotonic()
            assert 0 < refused("t1") <= pauses[-1]
            assert credit("t0") is Decision.FIRST
            assert time.monotonic() - began < 0.5
            time.sleep(pauses[-1] + 0.05)
        assert pauses == pytest.approx([0.5, 1.0, 2.0, 2.0], abs=0.01)
        proxy.up()
        assert credit("t1") is Decision.FIRST  # the try after the pause answers
        proxy.down()
        assert refused("t1") == pytest.approx(0.5, abs=0.01)  # from the first pause again
    finally:
        inbox.dispose()
        proxy.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_tenant_isolation__a_try_that_fails_in_its_handler_ends_the_pause(
    tenant_databases: TenantDatabases, asynchronous: bool
) -> None:
    """The delivery that tries a paused database may fail for a reason of its own (its
    handler's error): the database answered all the same, so its pause ends, and the next
    delivery there (the failed one's own bookkeeping, its poison row, among them) is not
    refused. Seed 929423 of the explorer: a Kafka partition whose first message was a
    handler's misuse tried its paused database again and again, each failure leaving the
    database paused, so its poison row was refused, and every delivery of the database
    with it, for good."""
    import asyncio

    from inbox_middleware import DatabaseMap, MessageIdentity
    from inbox_middleware._core.exceptions import DatabaseUnavailable
    from inbox_middleware._core.identity import hash_json
    from inbox_middleware._core.protocol import Decision, Delivery
    from inbox_middleware._storage.routed import AsyncRoutedInbox, RoutedInbox

    port = urlsplit(services.POSTGRES_TENANTS[1]).port
    proxy = Proxy(("127.0.0.1", port or 5451))
    urls = {"db1": tenant_databases.url(1).replace(f":{port}/", f":{proxy.port}/")}
    options = {"down_pause": 0.3, "down_pause_limit": 0.3, "connect_timeout": 2.0}
    routes = DatabaseMap(urls, tenants={"t1": "db1"})
    inbox = AsyncRoutedInbox(routes, **options) if asynchronous else RoutedInbox(routes, **options)
    counter = iter(range(1000))

    class Refused(Exception):
        """The handler's own failure."""

    async def process(fails: bool) -> Decision:
        n = next(counter)
        delivery = Delivery(
            "billing", MessageIdentity("orders", f"m-{n}", "t1"), hash_json({"n": n}, "v1")
        )

        def handler(session: object) -> None:
            if fails:
                raise Refused(f"m-{n}")

        async def async_handler(session: object) -> None:
            handler(session)

        if isinstance(inbox, AsyncRoutedInbox):
            result = await inbox.process(delivery, async_handler)
        else:
            result = inbox.process(delivery, handler)
        return result.verdict.decision  # type: ignore[no-any-return]

    async def scenario() -> None:
        try:
            proxy.down()
            with pytest.raises(DatabaseUnavailable):
                await process(fails=False)  # the database does not answer: paused
            proxy.up()
            await asyncio.sleep(0.4)  # the pause is over: the next delivery tries it
            with pytest.raises(Refused):
                await process(fails=True)  # it answered: claimed, then the handler failed
            assert await process(fails=False) is Decision.FIRST  # not refused: answered
        finally:
            if isinstance(inbox, AsyncRoutedInbox):
                await inbox.dispose()
            else:
                inbox.dispose()
            proxy.close()

    asyncio.run(scenario())
