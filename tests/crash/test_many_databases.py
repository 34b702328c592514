"""One fleet over three databases: a ledger whose tenants are spread over three PostgreSQL
servers (`tests.support.tenants`), all on one shared queue, with real worker processes
on both frameworks (Dramatiq on Redis and RabbitMQ, FastStream on RabbitMQ).

The run: every intent sent twice, a conflicting copy of some, messages for a tenant no
database serves; a worker SIGKILLed mid-run; one database stopped while a second wave
is sent, and started again. Then every intent is applied once in its own database,
nothing is lost, no ledger or inbox row is in another tenant's database, the unknown
tenant's messages are dead-lettered with their reason, and while the database was down
the other databases' deliveries went on (only its own were handed back).

These stop a server: run them under the fault lock (``flock /tmp/inbox-fault.lock``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from ..support import services
from ..support.faststream_worker import FastStreamWorker
from ..support.servers import answering
from ..support.tenants import (
    TENANTS,
    TenantDatabases,
    account,
    tenant_database,
    tenant_of,
)
from ..support.workers import WorkerProcess, wait_for

pytestmark = pytest.mark.slow

PER_TENANT = 6  # intents per tenant and wave
DOWN = 1  # the database stopped mid-run (db1: tenants t1, t4, t7)
UNKNOWN = ["nobody-1", "nobody-2", "nobody-3"]


@dataclass
class Intent:
    tenant: str
    message_id: str
    account_id: int
    delta: int


def quarantined(databases: TenantDatabases, index: int) -> list[str]:
    """The tenants of the quarantine rows in database ``index``."""
    engine = databases.engine(index)
    try:
        with engine.connect() as conn:
            return sorted(t for (t,) in conn.execute(text("SELECT tenant FROM inbox_quarantine")))
    finally:
        engine.dispose()


def wave(number: int) -> list[Intent]:
    return [
        Intent(tenant, f"w{number}-{tenant}-{k}", account(tenant, k), 10 * number + k)
        for tenant in TENANTS
        for k in range(PER_TENANT)
    ]


@dataclass
class Fleet:
    """A framework's side of the run: start a worker group, send one intent."""

    start: Callable[[], Any]
    send: Callable[[Intent, int], None]
    dead_letters: Callable[[], list[tuple[str, str | None]]]
    """Dead letters taken from the broker: (tenant, the reason they carry, if any)."""
    logs: Callable[[], str]


# -- Dramatiq ---------------------------------------------------------------------------------


@pytest.fixture
def dramatiq_fleet(request, tenant_databases: TenantDatabases, tmp_path: Path) -> Iterator[Fleet]:
    import dramatiq

    from inbox_middleware.dramatiq import identity

    kind = request.param
    queue = f"t{uuid.uuid4().hex[:12]}"
    url = services.RABBITMQ if kind == "rabbitmq" else services.REDIS
    services.require(url, kind)
    env = {
        "INBOX_TEST_MAP": str(tenant_databases.map_path),
        "INBOX_TEST_BROKER": kind,
        "INBOX_TEST_BROKER_URL": url,
        "INBOX_TEST_NAMESPACE": f"inbox-test-{queue}",
        "INBOX_TEST_QUEUE": queue,
    }
    if kind == "rabbitmq":
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        broker: Any = RabbitmqBroker(url=url, confirm_delivery=True)
    else:
        from dramatiq.brokers.redis import RedisBroker

        broker = RedisBroker(url=url, namespace=f"inbox-test-{queue}")
    actor = dramatiq.actor(
        lambda account_id, delta: None, actor_name="add_credit", queue_name=queue, broker=broker
    )
    started: list[WorkerProcess] = []

    def start() -> WorkerProcess:
        worker = WorkerProcess(
            "tests.apps.tenants_dramatiq",
            env,
            tmp_path / f"worker-{len(started)}.log",
            processes=2,
            threads=4,
        )
        started.append(worker)
        return worker

    def send(intent: Intent, delta: int) -> None:
        actor.send_with_options(
            args=(intent.account_id, delta),
            **identity(producer="orders", message_id=intent.message_id, tenant=intent.tenant),
        )

    def dead_letters() -> list[tuple[str, str | None]]:
        # Dramatiq's dead-letter path is the broker's own: the reason is in the log.
        found = []
        if kind == "rabbitmq":
            while True:
                method, _, body = broker.channel.basic_get(f"{queue}.XQ", auto_ack=True)
                if method is None:
                    break
                found.append(json.loads(body))
        else:
            key = f"inbox-test-{queue}:{queue}.XQ.msgs"
            found = [json.loads(raw) for raw in broker.client.hvals(key)]
            broker.client.delete(key)
        return [(message["options"]["inbox_tenant"], None) for message in found]

    def logs() -> str:
        return "".join(worker.output() for worker in started)

    try:
        yield Fleet(start, send, dead_letters, logs)
    finally:
        for worker in started:
            worker.kill()
        if kind == "rabbitmq":
            for name in (queue, f"{queue}.DQ", f"{queue}.XQ", f"{queue}.quarantine"):
                broker.channel.queue_delete(name)
        else:
            for key in broker.client.scan_iter(f"inbox-test-{queue}*"):
                broker.client.delete(key)
        broker.close()


# -- FastStream ---------------------------------------------------------------------------------


@pytest.fixture
def faststream_fleet(tenant_databases: TenantDatabases, tmp_path: Path) -> Iterator[Fleet]:
    import pika

    services.require(services.RABBITMQ, "RabbitMQ")
    queue = f"t{uuid.uuid4().hex[:12]}"
    env = {
        "INBOX_TEST_MAP": str(tenant_databases.map_path),
        "INBOX_TEST_BROKER_URL": services.RABBITMQ,
        "INBOX_TEST_SOURCE": queue,
    }
    connection = pika.BlockingConnection(pika.URLParameters(services.RABBITMQ))
    channel = connection.channel()
    channel.queue_declare(queue, durable=True)
    channel.confirm_delivery()
    started: list[FastStreamWorker] = []

    def start() -> FastStreamWorker:
        workers = [
            FastStreamWorker(
                "tests.apps.tenants_faststream:app",
                env,
                tmp_path / f"worker-{len(started)}-{n}.log",
            )
            for n in range(2)
        ]
        started.extend(workers)
        for worker in workers:
            wait_for(worker.ready, timeout=60, what="the FastStream worker")
        return _Group(workers)

    def send(intent: Intent, delta: int) -> None:
        channel.basic_publish(
            "",
            queue,
            json.dumps({"account": intent.account_id, "delta": delta}).encode(),
            pika.BasicProperties(
                content_type="application/json",
                delivery_mode=2,
                headers={
                    "x-inbox-producer": "orders",
                    "x-inbox-message-id": intent.message_id,
                    "x-inbox-tenant": intent.tenant,
                },
            ),
        )

    def dead_letters() -> list[tuple[str, str | None]]:
        found = []
        while True:
            method, properties, _ = channel.basic_get(f"{queue}.dead-letter", auto_ack=True)
            if method is None:
                return found
            details = json.loads(properties.headers["x-inbox-rejected"])
            found.append((details["tenant"], details["reason"]))

    def logs() -> str:
        return "".join(worker.output() for worker in started)

    try:
        yield Fleet(start, send, dead_letters, logs)
    finally:
        for worker in started:
            worker.kill()
        for name in (queue, f"{queue}.dead-letter", f"{queue}.quarantine"):
            channel.queue_delete(name)
        connection.close()


class _Group:
    def __init__(self, workers: list[FastStreamWorker]) -> None:
        self.workers = workers

    def kill(self) -> None:
        for worker in self.workers:
            worker.kill()

    def output(self) -> str:
        return "".join(worker.output() for worker in self.workers)


# -- the run ------------------------------------------------------------------------------------


def applied(databases: TenantDatabases, index: int) -> int:
    return len(databases.rows(index)["ledger"])


def expected(intents: list[Intent], index: int) -> int:
    return sum(1 for intent in intents if tenant_database(intent.tenant) == f"db{index}")


def run_ledger(fleet: Fleet, databases: TenantDatabases) -> None:
    first = wave(1)
    # Given a fleet of two worker processes over three databases, and the first wave:
    # every intent twice, a conflicting copy of one intent per tenant, unknown tenants
    workers = fleet.start()
    for intent in first:
        fleet.send(intent, intent.delta)
    for intent in first[::PER_TENANT]:
        fleet.send(intent, intent.delta + 1000)  # same identity, another payload
    for intent in first:
        fleet.send(intent, intent.delta)  # the duplicate
    for n, tenant in enumerate(UNKNOWN):
        fleet.send(Intent(tenant, f"u-{n}", 5000 + n, 1), 1)
    # When a worker is SIGKILLed mid-run and another one takes over
    wait_for(lambda: applied(databases, 0) >= 3, timeout=60, what="the first effects")
    workers.kill()
    fleet.start()
    # ... and one database is stopped while a second wave is sent
    databases.stop(DOWN)
    second = wave(2)
    for intent in second:
        fleet.send(intent, intent.delta)
    # Then the other databases' deliveries all go through while it is down
    everything = first + second
    healthy = [i for i in range(3) if i != DOWN]
    for index in healthy:
        wait_for(
            lambda index=index: applied(databases, index) == expected(everything, index),
            timeout=120,
            what=f"database {index}'s intents while database {DOWN} is down",
        )
    assert not answering(5450 + DOWN), "the stopped database came back by itself"
    # And once it is back, its own deliveries are applied too
    databases.start(DOWN)
    wait_for(
        lambda: applied(databases, DOWN) == expected(everything, DOWN),
        timeout=180,
        what=f"database {DOWN}'s intents after its restart",
    )
    time.sleep(3)  # a late duplicate applied twice would show up here
    for index in range(3):
        rows = databases.rows(index)
        # every intent applied once, in its own database: nothing lost, nothing twice (a
        # conflicting copy that won the race to the claim stands for its intent: +1000)
        mine = sorted(
            (i.account_id, i.delta) for i in everything if tenant_database(i.tenant) == f"db{index}"
        )
        assert sorted((a, d % 1000) for a, d in rows["ledger"]) == mine, index  # type: ignore[operator]
        # no record of another tenant's in this database
        assert {tenant_database(tenant_of(int(a))) for a, _ in rows["ledger"]} <= {f"db{index}"}  # type: ignore[call-overload]
        assert {tenant_database(str(t)) for t, _ in rows["inbox"]} == {f"db{index}"}
        assert len(rows["inbox"]) == len(mine)
    for index in range(3):
        # the conflicting copies are quarantined in their tenant's database (a copy handed
        # back while its database was down may come back after that database's intents:
        # waited for, not lost)
        tenants = sorted(t for t in TENANTS if tenant_database(t) == f"db{index}")
        wait_for(
            lambda index=index, tenants=tenants: quarantined(databases, index) == tenants,
            timeout=60,
            what=f"database {index}'s conflicts quarantined",
        )
    # The unknown tenants' messages are dead-lettered with the reason (a worker killed
    # between the dead letter's publish and the ack dead-letters its redelivery again)
    dead: list[tuple[str, str | None]] = []

    def all_dead() -> bool:
        dead.extend(fleet.dead_letters())
        return len(dead) >= len(UNKNOWN)

    wait_for(all_dead, timeout=30, what="the unknown tenants' dead letters")
    assert sorted({tenant for tenant, _ in dead}) == UNKNOWN
    assert {reason for _, reason in dead} <= {None, "UnknownTenant"}
    for tenant in UNKNOWN:
        assert f"no database serves tenant '{tenant}'" in fleet.logs()


@pytest.mark.parametrize("dramatiq_fleet", ["redis", "rabbitmq"], indirect=True)
def test_many_databases__dramatiq_ledger_over_three_databases(
    dramatiq_fleet: Fleet, tenant_databases: TenantDatabases
) -> None:
    run_ledger(dramatiq_fleet, tenant_databases)


def test_many_databases__faststream_ledger_over_three_databases(
    faststream_fleet: Fleet, tenant_databases: TenantDatabases
) -> None:
    run_ledger(faststream_fleet, tenant_databases)
