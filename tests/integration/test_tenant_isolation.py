"""Failure isolation over many databases: one tenant database black-holed (its packets
dropped, through the test proxy: a connect or a query that never answers), the other
tenants' messages on the same shared queue still complete, on a real FastStream worker
over RabbitMQ with a bounded prefetch.

Nothing here stops a server (the proxy black-holes one database's connections), so no
fault lock is needed.
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
