"""Fixtures over the real services: a PostgreSQL database per run, Redis and RabbitMQ
brokers with per-test queues, and SQLite for the embedded variant."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from dramatiq.middleware import AsyncIO, Retries
from sqlalchemy import Engine, create_engine, event

from inbox_middleware._storage import migrate

from .apps import domain
from .support import database, services
from .support.engines import async_engine, sync_engine
from .support.serial import is_own_servers, is_serial

pytest_plugins = [
    "pytester",  # the plugin's own tests run users' suites
    "tests.support.outage",  # the outage PostgreSQL fixture
    "tests.support.tenants",  # the three tenant databases
]


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: the modules that stop one server of their own share a process
    (tests/support/scheduling.py)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from .support.scheduling import ServerGroupScheduling

    return ServerGroupScheduling(config, log)


def pytest_report_header(config: pytest.Config) -> str | None:
    if os.environ.get("INBOX_TEST_SUBSET") != "1":
        return None
    offset = os.environ.get("INBOX_TEST_MATRIX_OFFSET", "0")
    return (
        f"fault matrix: the representative subset, offset {offset} (tests/faults/matrix.py"
        " in_subset); INBOX_TEST_FULL=1 runs every cell"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath))
    for item in items:
        relative = Path(str(item.path)).relative_to(root).as_posix()
        if is_serial(relative):
            item.add_marker(pytest.mark.serial)
        elif is_own_servers(relative):
            item.add_marker(pytest.mark.own_servers)
    if os.environ.get("INBOX_TEST_SUBSET") == "1":
        # scripts/test's representative subset of the fault matrices (tests/support/serial.py)
        kept: list[pytest.Item] = []
        beyond: list[pytest.Item] = []
        for item in items:
            (beyond if item.get_closest_marker("beyond_subset") else kept).append(item)
        if beyond:
            config.hook.pytest_deselected(items=beyond)
            items[:] = kept


@pytest.fixture(scope="session")
def database_name() -> Iterator[str]:
    services.require(services.POSTGRES, "PostgreSQL")
    name = database.create_run_database()
    yield name
    database.drop_database(name)


@pytest.fixture(scope="session")
def pg_url(database_name: str) -> str:
    return services.with_database(services.POSTGRES, database_name)


@pytest.fixture(scope="session")
def pg_async_url(database_name: str) -> str:
    return services.with_database(services.POSTGRES, database_name, driver="asyncpg")


@pytest.fixture(scope="session")
def pg_engine_session(pg_url: str) -> Iterator[Engine]:
    engine = sync_engine(pg_url, pool_size=20, max_overflow=10)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_engine(pg_engine_session: Engine, pg_url: str) -> Engine:
    """The run's PostgreSQL database, emptied before the test."""
    database.truncate(pg_url)
    return pg_engine_session


@pytest.fixture
async def pg_async_engine(pg_engine: Engine, pg_async_url: str) -> Any:
    engine = async_engine(pg_async_url, pool_size=20)
    yield engine
    await engine.dispose()


@pytest.fixture
def sqlite_engine(tmp_path: Path) -> Iterator[Engine]:
    engine = create_engine(f"sqlite:///{tmp_path / 'inbox.db'}")

    @event.listens_for(engine, "connect")
    def _busy_timeout(dbapi_connection: Any, _: Any) -> None:
        dbapi_connection.execute("PRAGMA busy_timeout = 5000")

    migrate(engine)
    with engine.begin() as conn:
        domain.create(conn)
    yield engine
    engine.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def engine(request: pytest.FixtureRequest) -> Engine:
    """Each sequential protocol case runs on both supported databases."""
    fixture = "pg_engine" if request.param == "postgresql" else "sqlite_engine"
    return request.getfixturevalue(fixture)


# -- brokers ------------------------------------------------------------------------------


@pytest.fixture
def queue() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def _ready(broker: dramatiq.Broker) -> None:
    """As the dramatiq command prepares a broker: AsyncIO, the process_boot signal (which
    starts the TimeLimit monitor), and retries fast enough for tests."""
    broker.add_middleware(AsyncIO())
    for middleware in broker.middleware:
        if isinstance(middleware, Retries):
            middleware.min_backoff, middleware.max_backoff = 50, 500
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)


@pytest.fixture
def redis_broker(queue: str) -> Iterator[dramatiq.Broker]:
    from dramatiq.brokers.redis import RedisBroker

    services.require(services.REDIS, "Redis")
    broker = RedisBroker(
        url=services.REDIS,
        namespace=f"inbox-test-{queue}",
        heartbeat_timeout=1000,
        maintenance_chance=1_000_000,
    )
    _ready(broker)
    yield broker
    for key in broker.client.scan_iter(f"inbox-test-{queue}*"):
        broker.client.delete(key)
    broker.close()


@pytest.fixture
def rabbitmq_broker(queue: str) -> Iterator[dramatiq.Broker]:
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    services.require(services.RABBITMQ, "RabbitMQ")
    broker = RabbitmqBroker(url=services.RABBITMQ, confirm_delivery=True)
    _ready(broker)
    yield broker
    with contextlib.suppress(Exception):
        channel = broker.channel
        for name in (queue, f"{queue}.DQ", f"{queue}.XQ", f"{queue}.quarantine"):
            channel.queue_delete(name)
    broker.close()


@pytest.fixture
def quorum_broker(queue: str) -> Iterator[dramatiq.Broker]:
    """Dramatiq on RabbitMQ quorum queues, a delivery limit of 5."""
    from inbox_middleware.dramatiq._quorum import QuorumRabbitmqBroker

    services.require(services.RABBITMQ, "RabbitMQ")
    broker = QuorumRabbitmqBroker(url=services.RABBITMQ, confirm_delivery=True, delivery_limit=5)
    _ready(broker)
    yield broker
    with contextlib.suppress(Exception):
        channel = broker.channel
        for name in (
            queue,
            f"{queue}.DQ",
            f"{queue}.XQ",
            f"{queue}.quarantine",
            f"{queue}.quarantine.XQ",
        ):
            channel.queue_delete(name)
    broker.close()


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request: pytest.FixtureRequest) -> dramatiq.Broker:
    """Each Dramatiq case runs on both real brokers."""
    return request.getfixturevalue(f"{request.param}_broker")


@pytest.fixture
def stub_broker() -> Iterator[dramatiq.Broker]:
    from dramatiq.brokers.stub import StubBroker

    broker = StubBroker()
    _ready(broker)
    yield broker
    broker.close()
