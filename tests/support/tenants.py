"""Three tenant databases, one on each tenant PostgreSQL server (``scripts/services
tenant-postgres``: 5450, 5451, 5452), each a run database cloned from the template (the
migrated inbox schema and the test domain), and a map file naming them.

Tenants ``t0`` .. ``t8`` are spread over the three: ``t<n>`` lives in database ``db<n % 3>``,
its accounts are ``100 * n + k``, so a ledger row or an inbox row in the wrong database
shows at once. The tests stop and start one server: run them under the fault lock
(``flock /tmp/inbox-fault.lock``); whatever a test did, the servers are started again.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from sqlalchemy import Engine, create_engine, text

from . import database, services
from .servers import _wait, answering

TENANTS = [f"t{n}" for n in range(9)]


def tenant_database(tenant: str) -> str:
    return f"db{int(tenant[1:]) % 3}"


def account(tenant: str, k: int) -> int:
    return 100 * int(tenant[1:]) + k


def tenant_of(account_id: int) -> str:
    return f"t{account_id // 100}"


def _port(index: int) -> int:
    return urlsplit(services.POSTGRES_TENANTS[index]).port or 5450 + index


def _version(index: int) -> str:
    listing = subprocess.run(
        ["pg_lsclusters", "--no-header"], check=True, capture_output=True, text=True
    ).stdout
    for line in listing.splitlines():
        version, name, port, *_ = line.split()
        if name == f"inbox_tenant_{index}" and int(port) == _port(index):
            return version
    pytest.fail(
        f"no PostgreSQL cluster inbox_tenant_{index} on port {_port(index)}: start it with "
        "scripts/services tenant-postgres",
        pytrace=False,
    )


def _answers(index: int) -> bool:
    import psycopg

    url = services.POSTGRES_TENANTS[index].replace("postgresql+psycopg", "postgresql")
    try:
        with psycopg.connect(url, connect_timeout=2) as conn:
            return conn.execute("SELECT 1").fetchone() == (1,)
    except psycopg.OperationalError:
        return False


@dataclass
class TenantDatabases:
    names: list[str]
    map_path: Path

    def url(self, index: int) -> str:
        return services.with_database(services.POSTGRES_TENANTS[index], self.names[index])

    def engine(self, index: int) -> Engine:
        return create_engine(self.url(index), pool_size=2)

    def stop(self, index: int) -> None:
        """A fast shutdown of server ``index`` (connections cut, nothing lost)."""
        if not answering(_port(index)):
            return
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", _version(index),
             f"inbox_tenant_{index}", "stop", "-m", "fast"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        _wait(lambda: not answering(_port(index)), 30, f"tenant PostgreSQL {index} to stop")

    def start(self, index: int) -> None:
        if not answering(_port(index)):
            subprocess.run(
                ["pg_ctlcluster", "--skip-systemctl-redirect", _version(index),
                 f"inbox_tenant_{index}", "start"],
                check=True, capture_output=True, timeout=120,
            )  # fmt: skip
        _wait(lambda: _answers(index), 60, f"tenant PostgreSQL {index}")

    def rows(self, index: int) -> dict[str, list[tuple[object, ...]]]:
        """The ledger's (account, delta) and the inbox's (tenant, message id) rows."""
        engine = self.engine(index)
        try:
            with engine.connect() as conn:
                ledger = conn.execute(text("SELECT account_id, delta FROM ledger")).all()
                inbox = conn.execute(text("SELECT tenant, message_id FROM consumer_inbox")).all()
            return {"ledger": [tuple(r) for r in ledger], "inbox": [tuple(r) for r in inbox]}
        finally:
            engine.dispose()


def write_map(path: Path, urls: list[str], **extra: object) -> None:
    data = {
        "databases": {f"db{i}": url for i, url in enumerate(urls)},
        "tenants": {tenant: tenant_database(tenant) for tenant in TENANTS},
        **extra,
    }
    path.write_text(json.dumps(data))


@pytest.fixture
def tenant_databases(tmp_path: Path) -> Iterator[TenantDatabases]:
    for index, url in enumerate(services.POSTGRES_TENANTS):
        services.require(url, f"tenant PostgreSQL {index}")
        if not _answers(index):
            pytest.fail(f"tenant PostgreSQL {index} does not answer", pytrace=False)
    names = [database.create_run_database(url) for url in services.POSTGRES_TENANTS]
    found = TenantDatabases(names, tmp_path / "databases.json")
    write_map(found.map_path, [found.url(i) for i in range(3)])
    try:
        yield found
    finally:
        for index, name in enumerate(names):
            found.start(index)  # whatever the test did
            with contextlib.suppress(Exception):
                database.drop_database(name, services.POSTGRES_TENANTS[index])
