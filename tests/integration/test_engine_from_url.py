"""`engine_from_url`: the command line's ``DATABASE_URL`` gives a worker's engines, on the
real PostgreSQL; a worker whose engine cannot be built says why in one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from sqlalchemy import text

from inbox_middleware import engine_from_url

from ..support import services

APP = """
import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker

from inbox_middleware import engine_from_url
from inbox_middleware.dramatiq import InboxMiddleware

broker = RedisBroker(url=os.environ["REDIS_URL"], namespace=os.environ["NAMESPACE"])
dramatiq.set_broker(broker)
engine = engine_from_url(os.environ["DATABASE_URL"])
broker.add_middleware(InboxMiddleware(engine))
"""


async def test_engine_from_url__a_postgres_url_as_the_cli_takes_it_serves_both_kinds(pg_url):
    # Given the URL an operator gives the command line: postgres://, no driver
    parts = urlsplit(pg_url)
    given = parts._replace(scheme="postgres").geturl()
    # Then a synchronous and an asynchronous engine both reach the database
    engine = engine_from_url(given)
    with engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM consumer_inbox")) is not None
    engine.dispose()
    async_engine = engine_from_url(given, asynchronous=True)
    async with async_engine.connect() as conn:
        assert await conn.scalar(text("SELECT 1")) == 1
    await async_engine.dispose()


def test_engine_from_url__a_dramatiq_worker_whose_engine_cannot_be_built_exits_in_one_line(
    tmp_path: Path,
):
    services.require(services.REDIS, "Redis")
    (tmp_path / "service.py").write_text(APP)
    env = {
        "REDIS_URL": services.REDIS,
        "NAMESPACE": f"inbox-test-{uuid.uuid4().hex[:8]}",
        "DATABASE_URL": "mysql://app@127.0.0.1/shop",
        "PYTHONUNBUFFERED": "1",
    }
    ran = subprocess.run(
        [sys.executable, "-m", "dramatiq", "service", "--processes", "1", "--threads", "1"],
        cwd=tmp_path,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = ran.stdout + ran.stderr
    print(output)
    # Then the worker never starts, says why in one line, and the command exits with 3,
    # as it does when the database cannot be reached
    assert ran.returncode == 3
    assert "Traceback" not in output
    reasons = [line for line in output.splitlines() if "cannot build its database" in line]
    assert len(reasons) == 1, output
    assert re.search(
        r"\[CRITICAL\] the inbox cannot build its database engine, so the worker does not "
        r"start: inbox-middleware supports PostgreSQL and SQLite, not 'mysql'; give a URL "
        r"like postgresql://",
        reasons[0],
    )
