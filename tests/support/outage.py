"""The outage PostgreSQL: a cluster of the outage tests and the fault matrix alone
(``scripts/services postgres-outage``, port 5446), which they stop and start (to start a
worker while its database is down) or restart at a point of a delivery. The shared
PostgreSQL is never stopped. The modules that use it run one after the other
(``tests/support/serial.py``)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from . import database, services
from .servers import _wait, answering, checkpoint

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = "inbox_outage"


def _port() -> int:
    return urlsplit(services.POSTGRES_OUTAGE).port or 5446


def _version() -> str:
    listing = subprocess.run(
        ["pg_lsclusters", "--no-header"], check=True, capture_output=True, text=True
    ).stdout
    for line in listing.splitlines():
        version, name, port, *_ = line.split()
        if name == CLUSTER and int(port) == _port():
            return version
    pytest.fail(
        f"no PostgreSQL cluster {CLUSTER!r} on port {_port()}: start it with "
        "scripts/services postgres-outage",
        pytrace=False,
    )


def _ctl(action: str, *options: str) -> None:
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", _version(), CLUSTER, action, *options],
        check=True,
        capture_output=True,
        timeout=120,
    )


def _answers() -> bool:
    import psycopg

    url = services.POSTGRES_OUTAGE.replace("postgresql+psycopg", "postgresql")
    try:
        with psycopg.connect(url, connect_timeout=2) as conn:
            return conn.execute("SELECT 1").fetchone() == (1,)
    except psycopg.OperationalError:
        return False


@dataclass
class OutagePostgres:
    """A database of its own on the outage cluster, migrated, with the test domain."""

    name: str

    @property
    def url(self) -> str:
        return services.with_database(services.POSTGRES_OUTAGE, self.name)

    @property
    def async_url(self) -> str:
        return services.with_database(services.POSTGRES_OUTAGE, self.name, driver="asyncpg")

    def stop(self, mode: str = "fast") -> None:
        """A shutdown (fast: connections cut, nothing lost; immediate: as a crash, WAL
        replayed at the next start), and wait until it is down."""
        if not answering(_port()):
            return
        _ctl("stop", "-m", mode)
        _wait(lambda: not answering(_port()), 30, "the outage PostgreSQL to stop")

    def start(self) -> None:
        if not answering(_port()):
            _ctl("start")
        _wait(_answers, 60, "the outage PostgreSQL")

    def restart(self) -> float:
        """A fast restart (every session ended), after a checkpoint as an operator would
        make before a planned one; the seconds it took."""
        checkpoint(services.POSTGRES_OUTAGE)
        started = time.monotonic()
        try:
            _ctl("restart", "-m", "fast")
        finally:
            self.start()
        return time.monotonic() - started


@pytest.fixture
def outage_postgres() -> Iterator[OutagePostgres]:
    services.require(services.POSTGRES_OUTAGE, "the outage PostgreSQL")
    if not _answers():
        pytest.fail("the outage PostgreSQL does not answer", pytrace=False)
    name = database.create_run_database(services.POSTGRES_OUTAGE)
    server = OutagePostgres(name)
    try:
        yield server
    finally:
        server.start()  # whatever the test did
        with contextlib.suppress(Exception):
            database.drop_database(name, services.POSTGRES_OUTAGE)
