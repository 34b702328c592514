"""Real `dramatiq` worker processes, killed with SIGKILL at named points.

Each test starts workers with the command line on `tests.apps.dramatiq_app`, lets the
first message reach a point where that process stops (it writes ``<point>.paused`` and
waits), kills the whole process group, starts fresh workers and checks that the message
was redelivered and applied exactly once.

    before_claim   before the inbox INSERT          nothing was written
    in_body        after the claim and the writes,  the server rolls the transaction back
                   before the commit
    after_commit   after the commit, before the ack the redelivery must be a duplicate
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from sqlalchemy import text

from inbox_middleware._core.claims import claim_key
from inbox_middleware._storage import InboxSchema
from inbox_middleware._storage.layout import switch_claims
from inbox_middleware.dramatiq import identity

from ..apps.domain import balance, effects
from ..support import services
from ..support.workers import WorkerProcess, wait_for

APP = "tests.apps.dramatiq_app"
_CLI = [sys.executable, "-c", "from inbox_middleware.cli import run; run()"]
pytestmark = pytest.mark.slow


@pytest.fixture(params=["rabbitmq", "redis"])
def broker_kind(request) -> str:
    return request.param


@pytest.fixture
def setup(broker_kind, queue, pg_url, pg_engine, tmp_path: Path):
    """Environment for worker processes, and a producer-side broker."""
    services.require(
        services.RABBITMQ if broker_kind == "rabbitmq" else services.REDIS, broker_kind
    )
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {
        "INBOX_TEST_DATABASE_URL": pg_url,
        "INBOX_TEST_BROKER": broker_kind,
        "INBOX_TEST_BROKER_URL": services.RABBITMQ if broker_kind == "rabbitmq" else services.REDIS,
        "INBOX_TEST_NAMESPACE": f"inbox-test-{queue}",
        "INBOX_TEST_QUEUE": queue,
        "INBOX_TEST_MARKERS": str(markers),
        "INBOX_TEST_ARRIVALS": str(tmp_path / "arrivals.log"),
        "INBOX_TEST_REDIS_URL": services.REDIS,
    }
    producer = _producer(broker_kind, queue)
    started: list[WorkerProcess] = []

    def start(count: int = 1, threads: int = 4, **extra: str) -> WorkerProcess:
        worker = WorkerProcess(
            APP,
            env | extra,
            tmp_path / f"worker-{len(started)}.log",
            processes=count,
            threads=threads,
        )
        started.append(worker)
        return worker

    yield start, producer, markers, tmp_path
    for worker in started:
        worker.kill()
    _cleanup(producer, broker_kind, queue)


def _producer(kind: str, queue: str):
    if kind == "rabbitmq":
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        broker = RabbitmqBroker(url=services.RABBITMQ, confirm_delivery=True)
    else:
        from dramatiq.brokers.redis import RedisBroker

        broker = RedisBroker(url=services.REDIS, namespace=f"inbox-test-{queue}")
    # The producer only needs the actor's name and queue, not its code or the inbox.
    actor = dramatiq.actor(
        lambda account_id, delta: None, actor_name="add_credit", queue_name=queue, broker=broker
    )
    return actor


def _cleanup(actor, kind: str, queue: str) -> None:
    broker = actor.broker
    if kind == "rabbitmq":
        for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
            broker.channel.queue_delete(name)
    else:
        for key in broker.client.scan_iter(f"inbox-test-{queue}*"):
            broker.client.delete(key)
    broker.close()


def send(actor, account_id: int, delta: int, message_id: str) -> None:
    actor.send_with_options(
        args=(account_id, delta), **identity(producer="orders", message_id=message_id)
    )


def inbox_rows(pg_engine, table: str = "consumer_inbox") -> int:
    with pg_engine.connect() as conn:
        return int(conn.scalar(text(f"SELECT count(*) FROM {table}")))


def applied(pg_engine, account_id: int) -> int:
    with pg_engine.connect() as conn:
        return effects(conn, account_id)


@pytest.mark.parametrize(
    ("point", "claims"),
    [
        ("before_claim", "library"),
        ("in_body", "library"),
        ("after_commit", "library"),
        ("after_commit", "compact"),
    ],
)
def test_crash__killed_worker_message_is_redelivered_and_applied_once(
    setup, pg_engine, point, claims
):
    start, producer, markers, _ = setup
    table = "inbox_claims" if claims == "compact" else "consumer_inbox"
    if claims == "compact":  # every worker claims in the compact table alone
        with pg_engine.begin() as conn:
            switch_claims(conn, InboxSchema(), by="test")
    # Given a worker that will stop at `point` on its first message
    first = start(INBOX_TEST_PAUSE_AT=point, INBOX_TEST_CLAIMS=claims)
    send(producer, 7, 10, "ord-1")
    wait_for((markers / f"{point}.paused").exists, timeout=30, what=point)
    committed = inbox_rows(pg_engine, table)
    # When it is killed there (after_commit: the commit is durable, the ack never sent)
    first.kill()
    assert committed == (1 if point == "after_commit" else 0)
    # Then a fresh worker gets the message again and the effect exists exactly once
    second = start(INBOX_TEST_CLAIMS=claims)
    wait_for(lambda: applied(pg_engine, 7) == 1, timeout=30, what="the effect")
    time.sleep(2)  # a redelivery processed twice would show up here
    second.stop()
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
    assert inbox_rows(pg_engine, table) == 1
    if point == "after_commit":
        # One line, the library's, at INFO; Dramatiq's "was skipped" warning is dropped
        assert "[INFO] duplicate delivery skipped: consumer=billing" in second.output()
        assert "was skipped" not in second.output()


def test_crash__a_pipeline_continues_after_a_kill_between_commit_and_ack(
    setup, broker_kind, queue, pg_engine
):
    start, producer, markers, _ = setup
    # Given a pipeline of two inbox actors, and a worker that stops after the first
    # step's commit, before its ack (and before Dramatiq's Pipelines would send step two)
    broker = producer.broker
    reserve = dramatiq.actor(
        lambda account_id, delta: None, actor_name="reserve", queue_name=queue, broker=broker
    )
    ship = dramatiq.actor(lambda order: None, actor_name="ship", queue_name=queue, broker=broker)
    first = start(INBOX_TEST_PAUSE_AT="after_commit")
    step = reserve.message_with_options(
        args=(7, 10), **identity(producer="orders", message_id="p-1")
    )
    dramatiq.pipeline([step, ship.message()], broker=broker).run()
    wait_for((markers / "after_commit.paused").exists, timeout=30, what="after_commit")
    # When it is killed there, and a fresh worker gets the first step again
    first.kill()
    second = start()
    # Then the second step runs, once, with the first step's result
    wait_for(lambda: applied(pg_engine, 8) == 1, timeout=30, what="the second step")
    time.sleep(2)  # a step sent twice and applied twice would show up here
    second.stop()
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), effects(conn, 8), balance(conn, 8)) == (1, 1, 20)


def _group_of_two(producer: Any, queue: str) -> Callable[[int], str]:
    """A group of two inbox members with a completion callback (account 99), as group.run
    sends it (a barrier for two, and its options on each member), from a producer without
    the inbox; answers a function that sends member ``n`` (account ``n``), its message id."""
    from dramatiq.rate_limits import Barrier
    from dramatiq.rate_limits.backends import RedisBackend as RedisLimits

    broker = producer.broker
    member = dramatiq.actor(
        lambda account_id: None, actor_name="member", queue_name=queue, broker=broker
    )
    done = dramatiq.actor(
        lambda account_id: None, actor_name="group_done", queue_name=queue, broker=broker
    )
    barrier = str(uuid.uuid4())
    Barrier(RedisLimits(url=services.REDIS), barrier, ttl=60_000).create(2)
    group = {
        "group_completion_uuid": barrier,
        "group_completion_callbacks": [done.message(99).asdict()],
    }

    def send_member(n: int) -> str:
        return member.send_with_options(
            args=(n,), **group, **identity(producer="orders", message_id=f"m-{n}")
        ).message_id

    return send_member


def test_crash__a_group_member_killed_after_its_commit_does_not_complete_the_group_twice(
    setup, queue, pg_engine
):
    start, producer, markers, tmp_path = setup
    # Given a group of two inbox members, the second sent only later so that one worker
    # gets it
    send_member = _group_of_two(producer, queue)
    # and a worker that stops after the first member's commit: GroupCallbacks has
    # counted it, the ack is not sent
    first = start(INBOX_TEST_PAUSE_AT="after_commit")
    sent = send_member(1)
    wait_for((markers / "after_commit.paused").exists, timeout=30, what="after_commit")
    # When it is killed there, and a fresh worker gets that member again (a duplicate),
    # then the second member
    first.kill()
    second = start()
    wait_for(lambda: _deliveries(tmp_path, sent) == 2, timeout=30, what="the duplicate")
    time.sleep(1.5)  # settled, and a completion it caused would have been applied
    assert applied(pg_engine, 99) == 0  # a duplicate counted would complete the group here
    send_member(2)
    wait_for(lambda: applied(pg_engine, 99) >= 1, timeout=30, what="the completion")
    time.sleep(2)  # a second completion would show up here
    second.stop()
    # Then each member applied once, and the group completed once, after both
    assert (applied(pg_engine, 1), applied(pg_engine, 2), applied(pg_engine, 99)) == (1, 1, 1)


def test_crash__a_group_member_killed_before_the_barrier_counted_leaves_the_group_incomplete(
    setup, queue, pg_engine
):
    # What the outputs guide says of a group sent to inbox actors anyway: the barrier
    # counts deliveries, a duplicate is no party to it, so a member whose worker died
    # after its commit and before the barrier counted it is never counted.
    start, producer, markers, tmp_path = setup
    send_member = _group_of_two(producer, queue)
    # Given a worker that stops after the first member's commit, before the barrier
    first = start(INBOX_TEST_PAUSE_AT="before_barrier")
    sent = send_member(1)
    wait_for((markers / "before_barrier.paused").exists, timeout=30, what="before_barrier")
    # When it is killed there, a fresh worker gets that member again, then the second
    first.kill()
    second = start()
    wait_for(lambda: _deliveries(tmp_path, sent) == 2, timeout=30, what="the duplicate")
    send_member(2)
    wait_for(lambda: applied(pg_engine, 2) == 1, timeout=30, what="the second member")
    time.sleep(3)  # a completion would be applied by now
    second.stop()
    # Then each member applied once, and the group never completed
    assert (applied(pg_engine, 1), applied(pg_engine, 2), applied(pg_engine, 99)) == (1, 1, 0)


def test_crash__sixteen_concurrent_deliveries_across_four_processes(setup, pg_engine):
    start, producer, _, tmp_path = setup
    # Given four worker processes with four threads each (each taking at most four
    # messages at a time), and a handler that holds its claim for two seconds
    workers = start(count=4, threads=4, INBOX_TEST_SLEEP="2", dramatiq_queue_prefetch="4")
    time.sleep(3)  # let every process connect before the burst
    message_id = f"ord-{uuid.uuid4().hex[:6]}"
    # When the same intent is delivered sixteen times at once
    for _ in range(16):
        send(producer, 7, 10, message_id)
    wait_for(lambda: applied(pg_engine, 7) == 1, timeout=30, what="the effect")
    arrivals = wait_for(
        lambda: _arrivals(tmp_path / "arrivals.log", 16), timeout=30, what="16 arrivals"
    )
    time.sleep(3)
    workers.stop()
    # Then they were spread over several processes, all arrived while the first
    # transaction was still open, and the effect was applied once
    with pg_engine.connect() as conn:
        applied_at = conn.scalar(text("SELECT extract(epoch FROM applied_at) FROM ledger"))
    assert len({pid for _, pid in arrivals}) >= 2
    assert max(t for t, _ in arrivals) < float(applied_at) + 2
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)


def _deliveries(tmp_path: Path, message_id: str) -> int:
    path = tmp_path / "arrivals.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum(1 for line in lines if line.endswith(f" {message_id}"))


def _arrivals(path: Path, count: int) -> list[tuple[float, int]] | None:
    if not path.exists():
        return None
    lines = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return [(float(t), int(pid)) for t, pid, _ in lines] if len(lines) >= count else None


def test_crash__worker_refuses_to_boot_on_a_missing_schema(setup):
    start, _, _, _ = setup
    worker = start(INBOX_TEST_SCHEMA="never_migrated", INBOX_TEST_STARTUP_PATIENCE="0")
    wait_for(
        lambda: "WorkerBootError" in worker.output() or worker.proc.poll() is not None,
        timeout=30,
        what="the boot failure",
    )
    assert "do not exist; run `inbox-middleware migrate`" in worker.output()


@pytest.mark.parametrize("broker_kind", ["rabbitmq"])
@pytest.mark.parametrize(("limit", "kept"), [("1", []), ("0", [("o-2", "redelivery_limit")])])
def test_crash__a_prefetched_message_a_stopping_worker_never_started_counts_as_no_outcome(
    setup, pg_engine, broker_kind, limit, kept
):
    start, producer, _, tmp_path = setup
    # Given a worker of one thread (prefetching two messages) SIGTERMed while o-1's slow
    # body runs and o-2 waits in its memory: Dramatiq finishes o-1, and leaves o-2 to the
    # broker without running any middleware (RabbitMQ delivers it again, redelivered)
    settings = {"INBOX_TEST_SLEEP": "3", "INBOX_TEST_REDELIVERY_LIMIT": limit}
    first = start(threads=1, **settings)
    send(producer, 9, 1, "o-1")
    send(producer, 7, 10, "o-2")
    arrivals = tmp_path / "arrivals.log"
    wait_for(arrivals.exists, timeout=30, what="o-1 in hand")
    time.sleep(0.5)  # o-2 prefetched meanwhile
    first.stop()
    assert len(arrivals.read_text().splitlines()) == 1  # o-2 reached no middleware
    assert applied(pg_engine, 9) == 1
    # When a fresh worker gets o-2 again
    second = start(threads=1, **settings)
    wait_for(
        lambda: applied(pg_engine, 7) + len(_poison(pg_engine)) == 1,
        timeout=60,
        what="o-2 settled",
    )
    time.sleep(1)
    second.stop()
    # Then its delivery counts as one that ended without an outcome: within a limit of 1
    # it is applied; a limit of 0 keeps it as poison (redelivery_limit)
    assert _poison(pg_engine) == kept
    assert applied(pg_engine, 7) == (0 if kept else 1)


def _poison(pg_engine) -> list[tuple[str, str]]:
    with pg_engine.connect() as conn:
        rows = conn.execute(text("SELECT message_id, reason_code FROM inbox_poison"))
        return sorted((str(row[0]), str(row[1])) for row in rows)


def _uuid7() -> str:
    """A UUIDv7 message id: its time, then random bits."""
    value = (time.time_ns() // 1_000_000 << 80) | uuid.uuid4().int & ((1 << 80) - 1)
    value = value & ~(0xF << 76) | 0x7 << 76
    value = value & ~(0b11 << 62) | 0b10 << 62
    return str(uuid.UUID(int=value))


@pytest.mark.parametrize("broker_kind", ["rabbitmq"])
def test_crash__a_rolling_move_to_the_compact_claim_under_load_applies_each_message_once(
    setup, pg_engine, pg_url
):
    start, producer, markers, _ = setup
    # Given a worker of the earlier kind (the library's table) and a new one (compact,
    # claiming in both tables), the new one stopping on its first message after its commit
    old = start(INBOX_TEST_CLAIMS="library")
    new = start(INBOX_TEST_CLAIMS="compact", INBOX_TEST_PAUSE_AT="after_commit")
    time.sleep(3)  # both connected before the load
    first = [_uuid7() if index % 2 else f"ord-{uuid.uuid4().hex}" for index in range(200)]
    # When every message is sent twice while both run, the new one is SIGKILLed between
    # its commit and its ack and comes back, and the old one leaves
    for message_id in first:
        send(producer, 9, 1, message_id)
        send(producer, 9, 1, message_id)
    wait_for((markers / "after_commit.paused").exists, timeout=60, what="the paused commit")
    new.kill()
    again = start(INBOX_TEST_CLAIMS="compact")
    wait_for(lambda: applied(pg_engine, 9) == 200, timeout=120, what="the first 200 effects")
    old.kill()
    # ... and the operator records the switch, with copies of the first messages and new
    # ones arriving at a worker that claims in the compact table
    switched = subprocess.run(
        [*_CLI, "claims", "switch", "--yes", "--database-url", pg_url],
        capture_output=True,
        text=True,
        check=False,
    )
    assert switched.returncode == 0, switched.stderr
    later = start(INBOX_TEST_CLAIMS="compact")
    second = [_uuid7() for _ in range(100)]
    for message_id in [*first[:100], *second, *second[:50]]:
        send(producer, 9, 1, message_id)
    wait_for(lambda: applied(pg_engine, 9) == 300, timeout=120, what="all 300 effects")
    time.sleep(3)  # a copy processed twice would show up here
    again.stop()
    later.stop()
    # Then each message was applied once: none lost, none twice, across both tables
    keys = [str(uuid.UUID(bytes=claim_key("billing", "orders", "", m))) for m in second]
    with pg_engine.connect() as conn:
        assert (effects(conn, 9), balance(conn, 9)) == (300, 300)
        after = conn.scalar(
            text("SELECT count(*) FROM inbox_claims WHERE identity = ANY(CAST(:k AS uuid[]))"),
            {"k": keys},
        )
        library = conn.scalar(text("SELECT count(*) FROM consumer_inbox"))
    assert after == 100  # the messages first sent after the switch: in the compact table
    assert library >= 1  # the old worker's, kept until the purge
