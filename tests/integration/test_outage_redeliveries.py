"""An outage poisons no valid message: several workers hand the same messages back while
the database is down, each remembering only its own hand-backs, and JetStream's delivery
count climbs far past the ``redelivery_limit`` meanwhile. No worker died: when the
database returns, every message is applied once and none is kept as poison. The same
for messages held back while the start-up check, run at the first message (no
``guard``), fails.

Three real ``faststream run`` workers on NATS JetStream, a small hand-back backoff and a
low limit, and a PostgreSQL of these tests alone that they stop and start
(``scripts/services postgres-outage``); a ten-minute outage with the defaults is the same
path, run in a long run instead.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from inbox_middleware.faststream import identity_headers

from ..apps.domain import balance, effects
from ..support import services
from ..support.faststream_brokers import Harness, eventually
from ..support.faststream_worker import FastStreamWorker
from ..support.outage import OutagePostgres

pytestmark = pytest.mark.slow

INTENTS = 8
LIMIT = 2


def _arrivals(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize(
    ("workers", "guarded"), [(3, True), (1, False)], ids=["three-workers", "held-unguarded"]
)
async def test_outage__nats_workers_handing_back_through_an_outage_poison_nothing(
    workers: int, guarded: bool, outage_postgres: OutagePostgres, tmp_path: Path
) -> None:
    services.require(services.NATS, "NATS")
    producer = Harness("nats", [])
    await producer.prepare_source()
    arrivals = tmp_path / "arrivals.log"
    env = {
        "INBOX_TEST_DATABASE_URL": outage_postgres.async_url,
        "INBOX_TEST_BROKER": "nats",
        "INBOX_TEST_BROKER_URL": services.NATS,
        "INBOX_TEST_SOURCE": producer.name,
        "INBOX_TEST_ARRIVALS": str(arrivals),
        "INBOX_TEST_REDELIVERY_LIMIT": str(LIMIT),
        "INBOX_TEST_RETRY_BACKOFF": "0.05,0.2",
        "INBOX_TEST_UNGUARDED": "0" if guarded else "1",
    }
    if not guarded:  # the start-up check fails at the first message, and holds it back
        outage_postgres.stop()
    started = [
        FastStreamWorker("tests.apps.faststream_app:app", env, tmp_path / f"w{n}.log")
        for n in range(workers)
    ]
    engine = create_engine(outage_postgres.url)
    try:
        for worker in started:
            await eventually(worker.ready, timeout=60, what="the workers to start")
        # Given the workers, and the database going down
        outage_postgres.stop()
        async with producer.broker:
            for number in range(INTENTS):
                headers = identity_headers(producer="orders", message_id=f"o-{number}")
                await producer.publish({"account": 7, "delta": 1}, headers)
        # When each message is handed back, by one worker then another, far more often
        # than the redelivery limit
        await eventually(
            lambda: _arrivals(arrivals) > INTENTS * (LIMIT + 1) * 4,
            timeout=60,
            what="many hand-backs",
        )
        # And the database returns
        outage_postgres.start()
        await eventually(
            lambda: _settled(engine) >= INTENTS, timeout=60, what="every intent settled"
        )
        await asyncio.sleep(1.5)  # a poisoned or twice-applied message would show here
    finally:
        for worker in started:
            worker.stop()
        for number, worker in enumerate(started):
            print(f"-- worker {number}\n{worker.output()}")
    # Then every message is applied once, none is poisoned or dead-lettered
    with engine.connect() as conn:
        poison = conn.execute(text("SELECT reason_code, attempts FROM inbox_poison")).all()
        claims = conn.scalar(text("SELECT count(*) FROM consumer_inbox"))
        assert (effects(conn, 7), balance(conn, 7), claims) == (INTENTS, INTENTS, INTENTS)
    engine.dispose()
    assert poison == []
    assert await producer.leftover() == 0
    await producer.cleanup()


def _settled(engine) -> int:
    """Intents applied, plus messages kept as poison."""
    with engine.connect() as conn:
        poison = conn.scalar(text("SELECT count(*) FROM inbox_poison")) or 0
        return effects(conn, 7) + int(poison)
