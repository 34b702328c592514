"""Real ``faststream run`` worker processes, killed with SIGKILL at named points.

Each test starts a worker on `tests.apps.faststream_app`, lets the first message reach a
point where that worker stops (it writes ``<point>.paused`` and waits), kills its whole
process group, starts a fresh worker, and checks that the message came back and was
applied exactly once:

    in_body        after the claim and the writes,   the server rolls the transaction back
                   before the commit
    after_commit   after the commit, before the ack  the redelivery must be a duplicate

RabbitMQ redelivers once the dead worker's connection drops; Redis once the message has
been pending for the reclaiming subscriber's idle time; NATS once JetStream's ack wait
has passed.

The last tests stop a RabbitMQ worker gracefully (SIGTERM) instead, and show what a stop
leaves without an outcome (see the section "a graceful stop" below).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from inbox_middleware._storage import InboxSchema
from inbox_middleware._storage.layout import switch_claims
from inbox_middleware.faststream import identity_headers

from ..apps.domain import balance, effects
from ..support import services
from ..support.faststream_brokers import KINDS, Harness, eventually
from ..support.faststream_worker import FastStreamWorker

APP = "tests.apps.faststream_app:app"
pytestmark = pytest.mark.slow

URLS = {
    "rabbit": services.RABBITMQ,
    "redis": services.REDIS,
    "nats": services.NATS,
    "kafka": services.KAFKA,
}


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def setup(kind: str, pg_async_url: str, pg_engine: Any, tmp_path: Path) -> Any:
    """A producer (the test's harness) and a way to start workers."""
    producer = Harness(kind, [])
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {
        "INBOX_TEST_DATABASE_URL": pg_async_url,
        "INBOX_TEST_BROKER": kind,
        "INBOX_TEST_BROKER_URL": URLS[kind],
        "INBOX_TEST_SOURCE": producer.source,
        "INBOX_TEST_MARKERS": str(markers),
        "INBOX_TEST_ARRIVALS": str(tmp_path / "arrivals.log"),
    }
    started: list[FastStreamWorker] = []

    async def start(wait: bool = True, **extra: str) -> FastStreamWorker:
        number = len(started) + 1
        worker = FastStreamWorker(
            APP,
            env | {"INBOX_TEST_WORKER": f"w{number}"} | extra,
            tmp_path / f"worker-{number}.log",
        )
        started.append(worker)
        if wait:
            await eventually(worker.ready, timeout=60, what="the worker to start")
        return worker

    yield start, producer, markers
    for worker in started:
        worker.kill()
    await producer.cleanup()


def inbox_rows(pg_engine: Any, table: str = "consumer_inbox") -> int:
    with pg_engine.connect() as conn:
        return int(conn.scalar(text(f"SELECT count(*) FROM {table}")))


def applied(pg_engine: Any) -> int:
    with pg_engine.connect() as conn:
        return effects(conn, 7)


@pytest.mark.parametrize(
    ("point", "claims"),
    [("in_body", "library"), ("after_commit", "library"), ("after_commit", "compact")],
)
async def test_faststream_crash__killed_worker_message_is_redelivered_and_applied_once(
    setup, pg_engine, point, claims
):
    if claims == "compact":  # every worker claims in the compact table alone
        with pg_engine.begin() as conn:
            switch_claims(conn, InboxSchema(), by="test")
    await _killed_at(setup, pg_engine, point, claims)


@pytest.mark.parametrize("kind", ["kafka"])
async def test_faststream_crash__kafka_member_killed_before_the_claim_loses_nothing(
    setup, pg_engine, kind
):
    # Kafka reads ahead of the claim (the record is fetched, the offset not committed): a
    # member killed before the claim leaves the message to the next owner of the partition.
    await _killed_at(setup, pg_engine, "before_claim")


async def _killed_at(setup: Any, pg_engine: Any, point: str, claims: str = "library") -> None:
    start, producer, markers = setup
    table = "inbox_claims" if claims == "compact" else "consumer_inbox"
    # Given a worker that will stop at `point` on its first message
    first = await start(INBOX_TEST_PAUSE_AT=point, INBOX_TEST_CLAIMS=claims)
    async with producer.broker:
        await producer.publish(
            {"account": 7, "delta": 10}, identity_headers(producer="orders", message_id="o-1")
        )
    await eventually((markers / f"{point}.paused").exists, timeout=30, what=point)
    committed = inbox_rows(pg_engine, table)
    # When it is killed there (after_commit: the commit is durable, the ack never sent)
    first.kill()
    assert committed == (1 if point == "after_commit" else 0)
    # Then a fresh worker gets the message again and the effect exists exactly once
    second = await start(INBOX_TEST_CLAIMS=claims)
    if point == "after_commit":
        await eventually(
            lambda: "duplicate delivery skipped: consumer=billing" in second.output(),
            timeout=60,
            what="the redelivery, skipped as a duplicate",
        )
    else:
        await eventually(lambda: applied(pg_engine) == 1, timeout=60, what="the effect")
    await asyncio.sleep(1)  # a redelivery processed twice would show up here
    second.stop()
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
    assert inbox_rows(pg_engine, table) == 1
    assert await producer.leftover() == 0  # acknowledged by the second worker


@pytest.mark.parametrize("kind", ["nats"])
async def test_faststream_crash__a_batch_that_kills_its_worker_is_poison_per_message(
    setup, pg_engine, kind
):
    # Given a NATS batch subscriber with redelivery_limit=0, whose worker is killed in the
    # handler of the first batch of two messages (JetStream counts each one's deliveries)
    start, producer, markers = setup
    limits = {"INBOX_TEST_BATCH": "1", "INBOX_TEST_REDELIVERY_LIMIT": "0"}
    first = await start(INBOX_TEST_PAUSE_AT="in_body", **limits)
    async with producer.broker:
        for number in (1, 2):
            await producer.publish(
                {"account": 7, "delta": 10},
                identity_headers(producer="orders", message_id=f"b-{number}"),
            )
    await eventually((markers / "in_body.paused").exists, timeout=30, what="in_body")
    first.kill()
    # When a fresh worker gets the batch again (each message delivered a second time)
    second = await start(**limits)
    await eventually(
        lambda: poison(pg_engine) == [("b-1", "redelivery_limit"), ("b-2", "redelivery_limit")],
        timeout=60,
        what="each message of the batch kept as poison by the redelivery limit",
    )
    await asyncio.sleep(1)
    second.stop()
    # Then each message is kept as poison, none applied, none left with the broker
    assert applied(pg_engine) == 0
    assert inbox_rows(pg_engine) == 0
    assert await producer.leftover() == 0


def poison(pg_engine: Any) -> list[tuple[str, str]]:
    with pg_engine.connect() as conn:
        rows = conn.execute(text("SELECT message_id, reason_code FROM inbox_poison"))
        return sorted((str(row[0]), str(row[1])) for row in rows)


async def test_faststream_crash__worker_refuses_to_start_with_ack_first(setup, pg_engine):
    start, producer, _ = setup
    # Given a message waiting, and a worker whose inbox subscriber acks first
    await producer.prepare_source()
    async with producer.broker:
        await producer.publish(
            {"account": 7, "delta": 10}, identity_headers(producer="orders", message_id="o-1")
        )
    worker = await start(wait=False, INBOX_TEST_ACK_POLICY="ack_first")
    # When it starts, the guard stops it before any subscriber consumes
    await asyncio.to_thread(worker.proc.wait, 30)
    assert worker.proc.returncode != 0
    assert "the inbox refuses to start these subscribers" in worker.output()
    assert "ACK_FIRST" in worker.output()
    assert applied(pg_engine) == 0
    assert await producer.leftover() == 1


# -- a graceful stop (SIGTERM) ---------------------------------------------------------------
#
# FastStream stops a subscriber by ceasing to process (a message delivered from then on is
# left unacknowledged, without reaching any middleware, the inbox's included), waits up to
# the broker's graceful_timeout for the messages in hand, then cancels its consumer and
# closes the connection: RabbitMQ delivers every unacknowledged message again, flagged
# redelivered. To the worker that gets it, such a copy is a delivery that ended without an
# outcome, as after a death: docs/explanation/limits.md, "What counts as a worker dying".


async def _stopped_with_a_slow_credit(
    setup: Any, limit: str, copies: int, **extra: str
) -> dict[str, str]:
    """A worker with a slow credit (o-1, account 9) in hand is SIGTERMed; while it waits
    for that credit, ``copies`` copies of o-2 (account 7) are delivered to it."""
    start, producer, markers = setup
    arrivals = markers.parent / "arrivals.log"
    settings = {"INBOX_TEST_REDELIVERY_LIMIT": limit, "INBOX_TEST_SLOW": "9:4"} | extra
    first = await start(**settings)
    async with producer.broker:
        await producer.publish(
            {"account": 9, "delta": 1}, identity_headers(producer="orders", message_id="o-1")
        )
        await eventually(arrivals.exists, timeout=30, what="the slow credit in hand")
        first.proc.terminate()
        await eventually(
            lambda: "FastStream app shutting down" in first.output(),
            timeout=10,
            what="the worker stopping",
        )
        await asyncio.sleep(0.5)  # its subscriber has stopped processing by now
        for _ in range(copies):
            await producer.publish(
                {"account": 7, "delta": 10}, identity_headers(producer="orders", message_id="o-2")
            )
    await asyncio.to_thread(first.proc.wait, 30)
    # The copies reached no middleware of the stopping worker: one arrival, the slow one
    assert len(arrivals.read_text().splitlines()) == 1
    return settings


@pytest.mark.parametrize("kind", ["rabbit"])
@pytest.mark.parametrize(("limit", "kept"), [("1", []), ("0", [("o-2", "redelivery_limit")])])
async def test_faststream_crash__a_message_delivered_while_its_worker_stops_counts_as_no_outcome(
    setup, pg_engine, kind, limit, kept
):
    # Given a worker SIGTERMed with a slow credit in hand, to which a message is delivered
    # while it waits for that credit (the message is left unacknowledged, then redelivered)
    settings = await _stopped_with_a_slow_credit(setup, limit, copies=1)
    start, producer, _ = setup
    with pg_engine.connect() as conn:
        assert effects(conn, 9) == 1  # the credit in hand was finished, within the grace
    # When a fresh worker gets the message again
    second = await start(**settings)
    await eventually(
        lambda: applied(pg_engine) + len(poison(pg_engine)) == 1,
        timeout=60,
        what="the redelivered message settled",
    )
    await asyncio.sleep(1)
    second.stop()
    # Then that delivery counts as one that ended without an outcome: within a limit of 1
    # the message is applied; a limit of 0 keeps it as poison (redelivery_limit)
    assert poison(pg_engine) == kept
    assert applied(pg_engine) == (0 if kept else 1)
    assert await producer.leftover() == 0


@pytest.mark.parametrize("kind", ["rabbit"])
async def test_faststream_crash__copies_left_by_one_stop_count_once_each(setup, pg_engine, kind):
    # Explorer seed 5009. Given three copies of one intent delivered to a worker while it
    # stops, under redelivery_limit=1, and a fresh worker that gets them again together
    # (the first copy's handler slow, so the other two arrive while it is in flight)
    settings = await _stopped_with_a_slow_credit(setup, "1", copies=3, INBOX_TEST_SLOW="9,7:4")
    start, producer, _ = setup
    second = await start(**settings)
    await eventually(lambda: applied(pg_engine) == 1, timeout=60, what="the intent applied")
    await asyncio.sleep(1)
    second.stop()
    # Then each copy's redelivery counted against the one intent: the second and third are
    # past the limit and kept as poison (redelivery_limit, pending beside the effect: the
    # copies were in flight together), the first applied once
    assert poison(pg_engine) == [("o-2", "redelivery_limit")]
    assert applied(pg_engine) == 1
    assert await producer.leftover() == 0


@pytest.mark.parametrize("kind", ["rabbit"])
async def test_faststream_crash__a_delivery_past_the_graceful_timeout_counts_as_no_outcome(
    setup, pg_engine, kind
):
    # Given a worker SIGTERMed with a credit in hand that outlasts its graceful_timeout
    # (FastStream then closes the connection, and the handler is cancelled when the
    # process ends: the delivery is left unacknowledged), under redelivery_limit=0
    start, producer, markers = setup
    arrivals = markers.parent / "arrivals.log"
    settings = {
        "INBOX_TEST_REDELIVERY_LIMIT": "0",
        "INBOX_TEST_SLOW": "9:4",
        "INBOX_TEST_GRACEFUL_TIMEOUT": "1",
    }
    first = await start(**settings)
    async with producer.broker:
        await producer.publish(
            {"account": 9, "delta": 1}, identity_headers(producer="orders", message_id="o-1")
        )
    await eventually(arrivals.exists, timeout=30, what="the slow credit in hand")
    first.proc.terminate()
    await asyncio.to_thread(first.proc.wait, 30)
    # When a fresh worker gets it again
    second = await start(**settings)
    await eventually(lambda: poison(pg_engine) != [], timeout=60, what="the poison row")
    await asyncio.sleep(1)
    second.stop()
    # Then the cancelled delivery was one without an outcome, as after a death
    assert poison(pg_engine) == [("o-1", "redelivery_limit")]
    with pg_engine.connect() as conn:
        assert effects(conn, 9) == 0
    assert await producer.leftover() == 0
