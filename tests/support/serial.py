"""The tests that must run alone: they stop, restart or kill a server other tests use
(PostgreSQL on 5432, RabbitMQ, the persistent Redis, the failover pair, the outage and
tenant servers), as the fault and chaos runs do. The crash tests kill only worker
processes of their own, and run with the rest. ``tests/conftest.py`` marks these
``serial``; ``scripts/test`` runs everything else in two processes first (each with its
own database and queue names), then these in one. ``tests/unit/test_serial.py`` holds
this list to what the test modules call."""

from __future__ import annotations

SERIAL = (
    "tests/faults/",
    "tests/crash/test_many_databases.py",  # stops a tenant server
    "tests/crash/test_outbox_many_databases.py",  # stops a tenant server
    "tests/chaos/",
    "tests/explore/",
    "tests/acceptance/test_demo.py",  # the failover pair
    "tests/integration/test_broker_destinations.py",  # restarts RabbitMQ
    "tests/integration/test_cli_many_databases.py",  # the tenant servers
    "tests/integration/test_dramatiq_broker_outage.py",  # kills the persistent Redis
    "tests/integration/test_move_tenant.py",  # the tenant servers
    "tests/integration/test_outage_redeliveries.py",  # stops the outage server
    "tests/integration/test_outbox_many_databases.py",  # the tenant servers
    "tests/integration/test_replication.py",  # the failover pair
    "tests/integration/test_startup_outage.py",  # stops the outage server
    "tests/integration/test_tenant_isolation.py",  # the tenant servers
)
"""Folders (ending in ``/``) and modules, relative to the project's root."""

SERVER_FAULTS = (
    "restart_postgres",
    "restart_rabbitmq",
    "kill_persistent_redis",
    "failover_postgres",
    "failover_pair",
    "outage_postgres",
    "tenant_databases",
    "pg_ctl",
)
"""What a test module calls to stop, restart or kill a shared server."""


def is_serial(relative: str) -> bool:
    return any(relative == entry or relative.startswith(entry) for entry in SERIAL)
