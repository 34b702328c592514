"""Which tests run where. ``scripts/test`` runs the suite in three parts:

- everything but the ``SERIAL`` list, in two processes (pytest-xdist, ``--dist
  loadgroup`` with the scheduler of ``tests/support/scheduling.py``; each process has its
  own database and queue names). A module is kept on one process, and so are all the
  modules that stop the same server of their own (``OWN_SERVERS``: the tenant servers,
  the outage server, the failover pair, the persistent Redis, the explorer's servers):
  ``group`` names the unit;
- then a part of the suite through PgBouncer (``scripts/test-pgbouncer``);
- then, alone, the tests that stop, restart or kill a server the others use (``SERIAL``:
  PostgreSQL on 5432, RabbitMQ on 5672), as the fault and chaos runs do.

The crash tests kill only worker processes of their own, and run with the rest.
``tests/conftest.py`` marks these lists ``serial`` and ``own_servers``;
``tests/unit/test_serial.py`` holds the lists to what the test modules call.

``scripts/test`` runs a representative subset of the fault matrix (``INBOX_TEST_SUBSET=1``,
the tests marked ``beyond_subset`` deselected; ``tests/faults/matrix.py`` says which);
``INBOX_TEST_FULL=1 scripts/test`` runs all of it."""

from __future__ import annotations

SERIAL = (
    "tests/chaos/",  # restarts PostgreSQL and RabbitMQ
    "tests/integration/test_broker_destinations.py",  # restarts RabbitMQ
)
"""Folders (ending in ``/``) and modules, relative to the project's root."""

OWN_SERVERS = {
    "tests/crash/test_many_databases.py": "tenants",  # stops a tenant server
    "tests/crash/test_outbox_many_databases.py": "tenants",  # stops a tenant server
    "tests/integration/test_cli_many_databases.py": "tenants",
    "tests/integration/test_move_tenant.py": "tenants",
    "tests/integration/test_outbox_many_databases.py": "tenants",
    "tests/integration/test_tenant_isolation.py": "tenants",
    "tests/acceptance/test_demo.py": "failover",  # the failover pair
    "tests/integration/test_replication.py": "failover",
    "tests/integration/test_outage_redeliveries.py": "outage",  # stops the outage server
    "tests/integration/test_startup_outage.py": "outage",
    "tests/faults/test_faults.py": "outage",  # restarts it at a delivery's points
    "tests/faults/test_paths.py": "outage",  # stops it during a worker's start-up
    "tests/integration/test_dramatiq_broker_outage.py": "redis-aof",  # kills it
    "tests/explore/": "explorer",  # the explorer's PostgreSQL, Redis, RabbitMQ, PgBouncer
}
"""Modules that stop only servers no test outside these lists uses, with the name of
those servers: the modules of one name run one after the other, in one process."""

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
    return _listed(relative, tuple(OWN_SERVERS))


def group(relative: str) -> str:
    """The pytest-xdist group of a test module: its servers' name for the modules of
    ``OWN_SERVERS``, else the module itself (a module is kept on one process)."""
    for entry, servers in OWN_SERVERS.items():
        if _listed(relative, (entry,)):
            return f"servers:{servers}"
    return relative
