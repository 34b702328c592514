"""Which tests run where. ``scripts/test`` runs the suite in three parts:

- everything that shares no server state, in two processes (pytest-xdist; each process
  has its own database and queue names, a module kept on one process);
- then the tests that stop, restart or kill a server only they use (``OWN_SERVERS``: the
  tenant servers, the outage server, the failover pair, the persistent Redis, the
  explorer's servers), one after the other; none of them disturbs the first part, so a
  machine with more cores can run the two at once (``scripts/test-beside``);
- then, alone, the tests that stop, restart or kill a server the others use (``SERIAL``:
  PostgreSQL on 5432, RabbitMQ on 5672), as the fault and chaos runs do.

The crash tests kill only worker processes of their own, and run with the rest.
``tests/conftest.py`` marks these lists ``serial`` and ``own_servers``;
``tests/unit/test_serial.py`` holds them to what the test modules call."""

from __future__ import annotations

SERIAL = (
    "tests/faults/test_faults.py",  # restarts and stops PostgreSQL
    "tests/faults/test_paths.py",  # restarts PostgreSQL during a worker's start-up
    "tests/chaos/",  # restarts PostgreSQL and RabbitMQ
    "tests/integration/test_broker_destinations.py",  # restarts RabbitMQ
)
"""Folders (ending in ``/``) and modules, relative to the project's root."""

OWN_SERVERS = (
    "tests/crash/test_many_databases.py",  # stops a tenant server
    "tests/crash/test_outbox_many_databases.py",  # stops a tenant server
    "tests/acceptance/test_demo.py",  # the failover pair
    "tests/explore/",  # the explorer's PostgreSQL, Redis, RabbitMQ and PgBouncer
    "tests/integration/test_cli_many_databases.py",  # the tenant servers
    "tests/integration/test_dramatiq_broker_outage.py",  # kills the persistent Redis
    "tests/integration/test_move_tenant.py",  # the tenant servers
    "tests/integration/test_outage_redeliveries.py",  # stops the outage server
    "tests/integration/test_outbox_many_databases.py",  # the tenant servers
    "tests/integration/test_replication.py",  # the failover pair
    "tests/integration/test_startup_outage.py",  # stops the outage server
    "tests/integration/test_tenant_isolation.py",  # the tenant servers
)
"""Modules that stop only servers no test outside these lists uses."""

SHARED_FAULTS = ("restart_postgres", "restart_rabbitmq", "pg_ctl")
"""What a test module calls to stop or restart a server every test uses."""

OWN_FAULTS = (
    "kill_persistent_redis",
    "failover_postgres",
    "failover_pair",
    "outage_postgres",
    "tenant_databases",
)
"""What a test module calls to stop, restart or kill (or use) a server of its own."""


def _listed(relative: str, entries: tuple[str, ...]) -> bool:
    return any(relative == entry or relative.startswith(entry) for entry in entries)


def is_serial(relative: str) -> bool:
    return _listed(relative, SERIAL)


def is_own_servers(relative: str) -> bool:
    return _listed(relative, OWN_SERVERS)
