"""Where the real services are, and a check that they answer.

A missing service fails the run: these tests exist to exercise the real thing, and a
skipped test proves nothing. `scripts/services` starts whatever is down.

``INBOX_TEST_POSTGRES`` is what the tests' engines, workers and commands connect to: the
server itself, or a transaction pooler in front of it (PgBouncer on 6432, as
``scripts/test`` runs its second configuration). ``INBOX_TEST_POSTGRES_SERVER`` is the
server itself, for what a pooler cannot carry: creating and dropping the run's database
(under a session-level advisory lock), restarting the server, watching its sessions.
When the two differ the run is through a pooler: the tests' engines are then configured
as docs/how-to/pgbouncer.md tells users to (`engine_options`).

The production topologies (``scripts/services`` starts them too): ``INBOX_TEST_REDIS_PERSISTENT``,
a Redis with an append-only file fsynced on every write; ``INBOX_TEST_POSTGRES_PAIR``, the
``host:port`` of a PostgreSQL primary and of its synchronous streaming standby, comma
separated (two local clusters, restarted and promoted by the failover tests, see
`tests.support.servers`); ``INBOX_TEST_POSTGRES_OUTAGE``, a PostgreSQL the outage tests
stop and start (`tests.support.outage`); ``INBOX_TEST_POSTGRES_TENANTS``, three
PostgreSQL servers of the many-databases tests (comma-separated URLs), which they stop and
start (`tests.support.tenants`).
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

import pytest

POSTGRES = os.environ.get("INBOX_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
POSTGRES_SERVER = os.environ.get("INBOX_TEST_POSTGRES_SERVER", POSTGRES)
THROUGH_POOLER = urlsplit(POSTGRES)[1:3] != urlsplit(POSTGRES_SERVER)[1:3]
REDIS = os.environ.get("INBOX_TEST_REDIS", "redis://127.0.0.1:6379/15")
REDIS_PERSISTENT = os.environ.get("INBOX_TEST_REDIS_PERSISTENT", "redis://127.0.0.1:6380/0")
POSTGRES_PAIR = os.environ.get("INBOX_TEST_POSTGRES_PAIR", "127.0.0.1:5433,127.0.0.1:5434")
# A PostgreSQL of the outage tests alone, which they stop and start (never the shared one).
POSTGRES_OUTAGE = os.environ.get(
    "INBOX_TEST_POSTGRES_OUTAGE", "postgresql://postgres@127.0.0.1:5446/postgres"
)
# Three PostgreSQL servers of the many-databases tests (a fleet over a database per shard).
POSTGRES_TENANTS = os.environ.get(
    "INBOX_TEST_POSTGRES_TENANTS",
    ",".join(f"postgresql://postgres@127.0.0.1:{port}/postgres" for port in (5450, 5451, 5452)),
).split(",")
RABBITMQ = os.environ.get("INBOX_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672/%2F")
NATS = os.environ.get("INBOX_TEST_NATS", "nats://127.0.0.1:4222")
KAFKA = os.environ.get("INBOX_TEST_KAFKA", "127.0.0.1:9092")  # bootstrap servers

_DEFAULT_PORTS = {"postgresql": 5432, "redis": 6379, "amqp": 5672, "nats": 4222, "kafka": 9092}


def require(url: str, name: str) -> None:
    """Fail the test (never skip) when ``url``'s server does not accept connections."""
    parts = urlsplit(url if "://" in url else f"kafka://{url}")
    host = parts.hostname or "127.0.0.1"
    port = parts.port or _DEFAULT_PORTS[parts.scheme]
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as exc:
        pytest.fail(
            f"{name} is not reachable at {host}:{port} ({exc}); start it with scripts/services",
            pytrace=False,
        )


def with_database(url: str, database: str, driver: str = "psycopg") -> str:
    """``url`` pointed at another database, with a SQLAlchemy driver name."""
    parts = urlsplit(url)
    return parts._replace(scheme=f"postgresql+{driver}", path=f"/{database}").geturl()


def postgres_address() -> tuple[str, int]:
    """Host and port of ``INBOX_TEST_POSTGRES`` (the server, or the pooler in front)."""
    parts = urlsplit(POSTGRES)
    return parts.hostname or "127.0.0.1", parts.port or 5432


def pair_addresses() -> list[tuple[str, int]]:
    """(host, port) of the failover pair's primary, then of its standby, as created."""
    hosts = []
    for entry in POSTGRES_PAIR.split(","):
        host, _, port = entry.strip().rpartition(":")
        hosts.append((host, int(port)))
    return hosts


def pair_url(database: str, driver: str | None = None) -> str:
    """A URL of ``database`` on the failover pair naming both servers, with
    ``target_session_attrs=read-write``: a connection goes to whichever is the primary.
    With ``driver``, a SQLAlchemy URL (``postgresql+<driver>``); without, a libpq one."""
    hosts = pair_addresses()
    if driver is None:
        netloc = ",".join(f"{host}:{port}" for host, port in hosts)
        return f"postgresql://postgres@{netloc}/{database}?target_session_attrs=read-write"
    query = "&".join(f"host={host}:{port}" for host, port in hosts)
    return f"postgresql+{driver}://postgres@/{database}?{query}&target_session_attrs=read-write"


def via_port(url: str, port: int) -> str:
    """``url`` pointed at 127.0.0.1:``port`` (a test's proxy in front of the database)."""
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    return parts._replace(
        netloc=f"{auth}@127.0.0.1:{port}" if auth else f"127.0.0.1:{port}"
    ).geturl()
