"""What each way of deduplicating does when things go wrong, on the real PostgreSQL and
Redis: the correctness table beside the benchmark's speed table (docs/performance.md).

Each way is bench.peers' code, the same the benchmark's Dramatiq worker runs: a Redis
SET NX first, SELECT-then-INSERT, AWS Lambda Powertools' idempotency utility on Redis,
the justonce library on PostgreSQL, and the inbox. Four situations:

- a worker killed (SIGKILL, a real process) where the effect and the "done" mark are apart,
  then the message redelivered, at once and again after the way's expiry or lease;
- the same message id with another payload, and a plain redelivery of the same payload;
- 32 concurrent deliveries of one message;
- the database down when a message arrives, then back, the message redelivered.

A delivery's outcome is ``applied``, ``skipped`` (recognised as a duplicate) or the name
of what it raised (the broker redelivers the message then); ``effects`` counts how often
the effect (a credit of 1) happened. The expiries are short here so the test can
wait them out (2 s); Powertools' default is an hour, justonce's lease 15 minutes.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bench import peers
from bench.common import DDL
from sqlalchemy import Engine, create_engine, text

from ..support import services
from ..support.proxy import Proxy

ROOT = Path(__file__).resolve().parents[2]
WAYS = ["redis_setnx", "select_insert", "powertools", "justonce", "inbox"]
EXPIRES = 2  # seconds: Powertools' expires_after_seconds, justonce's claim lease

pytestmark = [
    pytest.mark.postgres,
    # Powertools outside AWS Lambda warns that it cannot read the remaining time, and
    # its Redis layer is deprecated under an old name that CachePersistenceLayer extends.
    pytest.mark.filterwarnings("ignore::UserWarning:aws_lambda_powertools"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


class World:
    """The run's database behind a proxy that can take it away, and Redis."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.proxy = Proxy(services.postgres_address())
        self.proxied = services.via_port(url, self.proxy.port)
        self.engine = create_engine(self.proxied, pool_size=40, pool_pre_ping=True)
        self.direct = create_engine(url)
        with self.direct.begin() as conn:
            for statement in DDL:
                conn.execute(text(statement))
            conn.execute(text("DELETE FROM bench_accounts"))
            conn.execute(text("DELETE FROM bench_seen"))
            conn.execute(text("INSERT INTO bench_accounts VALUES (1, 0), (2, 0)"))

    def way(self, name: str) -> peers.Way:
        dsn = self.proxied.replace("postgresql+psycopg://", "postgresql://")
        settings = {"powertools": {"expires": EXPIRES}, "justonce": {"ttl": EXPIRES}}
        return peers.make(
            name, self.engine, redis_url=services.REDIS, dsn=dsn, **settings.get(name, {})
        )

    def effects(self) -> int:
        with self.direct.connect() as conn:
            return int(conn.scalar(text("SELECT sum(balance) FROM bench_accounts")))

    def quarantined(self) -> int:
        with self.direct.connect() as conn:
            return int(conn.scalar(text("SELECT count(*) FROM inbox_quarantine")))

    def close(self) -> None:
        self.engine.dispose()
        self.direct.dispose()
        self.proxy.close()


@pytest.fixture
def world(pg_engine: Engine, pg_url: str) -> Iterator[World]:
    services.require(services.REDIS, "Redis")
    world = World(pg_url)
    yield world
    world.close()


def attempt(way: peers.Way, message_id: str, account: int = 1) -> str:
    try:
        return "applied" if way.deliver(message_id, account) else "skipped"
    except Exception as exc:
        return type(exc).__name__


def fresh() -> str:
    return f"peer-{uuid.uuid4().hex}"


# -- a crash between the effect and the "done" mark ---------------------------------------

CRASH: dict[str, tuple[str, str, int]] = {
    # way: (redelivered at once, redelivered after the expiry, effects)
    "redis_setnx": ("skipped", "skipped", 0),  # the mark was set, the effect never ran
    "select_insert": ("applied", "skipped", 1),  # one transaction: rolled back together
    "powertools": ("IdempotencyAlreadyInProgressError", "applied", 2),
    "justonce": ("OperationInFlightError", "applied", 2),
    "inbox": ("applied", "skipped", 1),
}


@pytest.mark.parametrize("name", WAYS)
def test_peers__a_worker_killed_between_effect_and_done_mark(world: World, name: str):
    message_id = fresh()
    arguments = [name, message_id, world.url, services.REDIS, str(EXPIRES)]
    crashed = subprocess.run(
        [sys.executable, "-m", "tests.support.peer_crash", *arguments],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert crashed.returncode == -9, crashed.stderr.decode()
    way = world.way(name)

    at_once = attempt(way, message_id)
    time.sleep(EXPIRES + 1.0)
    after_expiry = attempt(way, message_id)

    assert (at_once, after_expiry, world.effects()) == CRASH[name]


# -- the same id with another payload ------------------------------------------------------

OTHER_PAYLOAD: dict[str, tuple[str, str, int]] = {
    # way: (the same payload again, another payload, effects)
    "redis_setnx": ("skipped", "skipped", 1),  # the other payload is dropped unseen
    "select_insert": ("skipped", "skipped", 1),
    # Powertools' Redis layer drops the payload hash when it marks a record completed,
    # so with payload validation on, every later delivery fails validation, even the same.
    "powertools": ("IdempotencyValidationError", "IdempotencyValidationError", 1),
    "justonce": ("skipped", "KeyReuseError", 1),
    "inbox": ("skipped", "skipped", 1),  # and the conflict is quarantined (below)
}


@pytest.mark.parametrize("name", WAYS)
def test_peers__the_same_id_again_and_with_another_payload(world: World, name: str):
    way, message_id = world.way(name), fresh()
    assert attempt(way, message_id, account=1) == "applied"

    same = attempt(way, message_id, account=1)
    other = attempt(way, message_id, account=2)

    assert (same, other, world.effects()) == OTHER_PAYLOAD[name]
    assert world.quarantined() == (1 if name == "inbox" else 0)


# -- 32 concurrent duplicates --------------------------------------------------------------

# What the 31 losers got, besides "skipped": each is redelivered by the broker later.
CONCURRENT_LOSERS: dict[str, set[str]] = {
    "redis_setnx": {"skipped"},
    "select_insert": {"skipped", "IntegrityError"},
    "powertools": {"IdempotencyAlreadyInProgressError", "IdempotencyValidationError"},
    "justonce": {"skipped", "OperationInFlightError"},
    "inbox": {"skipped"},  # each waits for the first claim's commit, then is a duplicate
}


@pytest.mark.parametrize("name", WAYS)
def test_peers__thirty_two_concurrent_duplicates(world: World, name: str):
    way, message_id = world.way(name), fresh()
    start = threading.Barrier(32)
    outcomes: list[str] = []

    def deliver() -> None:
        start.wait()
        outcomes.append(attempt(way, message_id))

    threads = [threading.Thread(target=deliver) for _ in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert len(outcomes) == 32
    assert outcomes.count("applied") == 1, outcomes
    assert world.effects() == 1
    losers = [outcome for outcome in outcomes if outcome != "applied"]
    assert set(losers) <= CONCURRENT_LOSERS[name], losers


# -- a database outage ---------------------------------------------------------------------

OUTAGE: dict[str, tuple[str, int]] = {
    # way: (the redelivery once the database is back, effects)
    "redis_setnx": ("skipped", 0),  # the mark was set in Redis; the effect is lost
    "select_insert": ("applied", 1),
    "powertools": ("applied", 1),  # the failed call deleted its "in progress" record
    "justonce": ("applied", 1),  # the claim itself failed: nothing was recorded
    "inbox": ("applied", 1),
}


def redeliver(way: peers.Way, message_id: str) -> str:
    """The broker redelivers until the delivery is settled (applied or skipped): a pooled
    connection the outage cut may fail the first try."""
    outcome = ""
    for _ in range(5):
        outcome = attempt(way, message_id)
        if outcome in ("applied", "skipped"):
            break
        time.sleep(0.2)
    return outcome


@pytest.mark.parametrize("name", WAYS)
def test_peers__the_database_down_when_a_message_arrives(world: World, name: str):
    way = world.way(name)
    assert attempt(way, fresh()) == "applied"  # connected and warm
    message_id = fresh()
    world.proxy.down()
    try:
        during: Any = attempt(way, message_id)
    finally:
        world.proxy.up()

    assert during not in ("applied", "skipped")
    assert (redeliver(way, message_id), world.effects() - 1) == OUTAGE[name]
