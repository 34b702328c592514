"""Where the real services are, and a check that they answer.

A missing service fails the run: these tests exist to exercise the real thing, and a
skipped test proves nothing. `scripts/services` starts whatever is down.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

import pytest

POSTGRES = os.environ.get("INBOX_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
REDIS = os.environ.get("INBOX_TEST_REDIS", "redis://127.0.0.1:6379/15")
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
