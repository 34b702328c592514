"""The Dramatiq adapter with a real worker on real Redis and RabbitMQ brokers."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import pytest
from dramatiq.middleware import Middleware
from sqlalchemy import text

from inbox_middleware._core.exceptions import ClaimInProgress, InvalidIdentity
from inbox_middleware._storage import InboxSchema
from inbox_middleware.dramatiq import (
    InboxMiddleware,
    current_async_session,
    current_session,
    identity,
)
from inbox_middleware.dramatiq._middleware import ActorConfigurationError, WorkerBootError

from ..apps.domain import apply_credit, apply_credit_async, balance, effects
from ..support import engines, services
from ..support.dramatiq_worker import drain, running_worker
from ..support.proxy import Proxy
from ..support.workers import wait_for


@dataclass
class Recorder(Middleware):
    """What happened to each delivery, as the worker saw it."""

    skipped: list[str] = field(default_factory=list)
    failures: list[BaseException] = field(default_factory=list)
    started: dict[str, float] = field(default_factory=dict)
    skipped_at: dict[str, list[float]] = field(default_factory=dict)
    retries: dict[str, list[int]] = field(default_factory=dict)

    def before_process_message(self, broker: Any, message: Any) -> None:
        self.started[message.message_id] = time.monotonic()

    def after_process_message(self, broker, message, *, result=None, exception=None):
        if exception is not None:
            self.failures.append(exception)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        self.skipped.append(message.message_id)
        self.skipped_at.setdefault(message.message_id, []).append(time.monotonic())
        self.retries.setdefault(message.message_id, []).append(message.options.get("retries", 0))


def send(actor, *args, message_id="ord-1", **kwargs):
    return actor.send_with_options(
        args=args, kwargs=kwargs, **identity(producer="orders", message_id=message_id)
    )


def dead_letters(broker: dramatiq.Broker, queue: str) -> int:
    return _depth(broker, f"{queue}.XQ")


def quarantined(broker: dramatiq.Broker, queue: str) -> int:
    return _depth(broker, f"{queue}.quarantine")


def _depth(broker: dramatiq.Broker, name: str) -> int:
    if hasattr(broker, "client"):  # Redis: dead letters are a sorted set, queues lists
        key = f"{broker.namespace}:{name}"
        return broker.client.zcard(key) if name.endswith(".XQ") else broker.client.llen(key)
    try:
        return broker.channel.queue_declare(name, passive=True).method.message_count
    except Exception:
        del broker.channel
        return 0


@pytest.fixture
def recorder(broker) -> Recorder:
    recorder = Recorder()
    broker.add_middleware(recorder)
    return recorder


@pytest.fixture
def inbox(broker, pg_engine, recorder) -> InboxMiddleware:
    middleware = InboxMiddleware(pg_engine, lock_timeout=10)
    broker.add_middleware(middleware)
    return middleware


@pytest.fixture
def add_credit(inbox, queue):
    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", inbox_handler_version="3")
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    return add_credit


def test_dramatiq__sequential_duplicate_has_one_effect(broker, queue, pg_engine, add_credit):
    with running_worker(broker) as worker:
        send(add_credit, 7, 10)
        drain(broker, queue, worker)
        send(add_credit, 7, 10)
        send(add_credit, account_id=7, delta=10)  # keyword call: the same intent
        drain(broker, queue, worker)

    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
        row = conn.execute(text("SELECT * FROM consumer_inbox")).mappings().one()
    assert (row["consumer_name"], row["producer_name"], row["message_id"]) == (
        "billing",
        "orders",
        "ord-1",
    )
    assert (row["handler_version"], row["hash_scheme"]) == ("3", "dramatiq.v2")
    assert dead_letters(broker, queue) == 0


def test_dramatiq__conflict_is_quarantined_not_run_and_acked(
    broker, queue, pg_engine, add_credit, recorder
):
    # Given a processed intent
    with running_worker(broker) as worker:
        send(add_credit, 7, 10)
        drain(broker, queue, worker)
        # When the producer reuses its id for another payload
        conflicting = send(add_credit, 7, 99)
        drain(broker, queue, worker)
        # Then the body does not run, the message is acked (not dead-lettered) and a
        # worker started the usual way leaves the quarantine queue alone
        time.sleep(0.5)
        assert conflicting.message_id in recorder.skipped

    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
        row = conn.execute(select_quarantine()).mappings().one()
    assert (row["message_id"], row["decision"], row["attempts"]) == ("ord-1", "pending", 1)
    assert (row["source"], row["handler_version"]) == (queue, "3")
    assert b'"args":[7,99]' in bytes(row["payload"])
    assert row["headers"]["inbox_message_id"] == "ord-1"
    assert quarantined(broker, queue) == 1
    assert dead_letters(broker, queue) == 0


def select_quarantine():
    from sqlalchemy import select

    return select(InboxSchema().tables.quarantine)


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({}, "has no inbox_producer and no inbox_message_id"),
        ({"inbox_producer": "orders"}, "has no inbox_message_id"),
        ({"inbox_producer": "orders", "inbox_message_id": 42}, "inbox_message_id must be text"),
        ({"inbox_producer": "orders", "inbox_message_id": "x" * 300}, "inbox_message_id is 300"),
        ({"inbox_producer": "o\x00", "inbox_message_id": "m"}, "inbox_producer contains U"),
    ],
)
def test_dramatiq__unusable_identity_is_dead_lettered_with_a_clear_log(
    broker, queue, pg_engine, add_credit, caplog, options, reason
):
    caplog.set_level(logging.ERROR, logger="inbox_middleware")
    with running_worker(broker) as worker:
        add_credit.send_with_options(args=(7, 10), **options)
        drain(broker, queue, worker)
    wait_for(lambda: dead_letters(broker, queue) == 1, timeout=5, what="a dead letter")
    assert reason in caplog.text
    assert "rejecting a message" in caplog.text
    with pg_engine.connect() as conn:
        assert effects(conn) == 0


def test_dramatiq__payload_without_canonical_form_is_dead_lettered(
    broker, queue, pg_engine, add_credit, caplog
):
    caplog.set_level(logging.ERROR, logger="inbox_middleware")
    with running_worker(broker) as worker:
        send(add_credit, 7, float("nan"))
        send(add_credit, 7, 10, 11, message_id="ord-2")  # does not fit the signature
        drain(broker, queue, worker)
    wait_for(lambda: dead_letters(broker, queue) == 2, timeout=5, what="two dead letters")
    assert "nan at $.args.delta is not a JSON number" in caplog.text
    assert "do not match add_credit(account_id, delta): too many positional" in caplog.text
    with pg_engine.connect() as conn:
        assert effects(conn) == 0


def test_identity_helper__refuses_bad_values_at_the_producer():
    with pytest.raises(InvalidIdentity, match="message_id is empty"):
        identity(producer="orders", message_id="")


def test_dramatiq__exception_after_claim_is_retried_and_applied_once(
    broker, queue, pg_engine, inbox
):
    attempts = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def flaky(account_id: int, delta: int) -> None:
        attempts.append(1)
        apply_credit(current_session(), "billing", account_id, delta)
        if len(attempts) == 1:
            raise ConnectionError("payment gateway timed out")

    with running_worker(broker) as worker:
        send(flaky, 7, 10)
        drain(broker, queue, worker)

    assert len(attempts) == 2
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)


def test_dramatiq__handler_commit_fails_the_message_with_nothing_applied(
    broker, queue, pg_engine, inbox, caplog
):
    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=0)
    def commits(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)
        current_session().commit()

    with running_worker(broker) as worker:
        send(commits, 7, 10)
        drain(broker, queue, worker)

    assert "the handler called commit(); the inbox commits when the handler returns" in (
        caplog.text
    )
    wait_for(lambda: dead_letters(broker, queue) == 1, timeout=5, what="a dead letter")
    with pg_engine.connect() as conn:
        assert effects(conn) == 0
        assert conn.scalar(text("SELECT count(*) FROM consumer_inbox")) == 0


def test_dramatiq__duplicate_of_a_long_handler_waits_lock_timeout_then_is_skipped(
    broker, queue, pg_engine, recorder
):
    # Given a handler that holds its claim for 3 s, and a 0.5 s lock_timeout
    broker.add_middleware(InboxMiddleware(pg_engine, lock_timeout=0.5, in_progress_delay=300))
    holding = threading.Event()

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def slow(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)
        holding.set()
        time.sleep(3)

    with running_worker(broker, threads=2) as worker:
        first = send(slow, 7, 10)
        assert holding.wait(10)
        # When its duplicate arrives (same intent, new broker message)
        duplicate = send(slow, 7, 10)
        started = time.monotonic()
        handed_back = wait_for(
            lambda: recorder.skipped_at.get(duplicate.message_id),
            timeout=5,
            what="the duplicate to give up",
        )
        waited = handed_back[0] - started
        drain(broker, queue, worker)

    # Then it waited about lock_timeout, was handed back (re-enqueued with a delay, the
    # copy skipped, no retry spent), and was then skipped as a duplicate
    assert not [f for f in recorder.failures if isinstance(f.__cause__, ClaimInProgress)]
    assert waited < 2.5
    assert recorder.skipped.count(duplicate.message_id) >= 2
    assert set(recorder.retries[duplicate.message_id]) == {0}
    assert first.message_id not in recorder.skipped
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 1


def test_dramatiq__sixteen_concurrent_deliveries_in_threads_have_one_effect(
    broker, queue, pg_engine, inbox, recorder
):
    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def slow(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)
        time.sleep(1)

    with running_worker(broker, threads=16) as worker:
        for _ in range(16):
            send(slow, 7, 10)
        drain(broker, queue, worker)

    assert len(recorder.skipped) == 15
    starts = sorted(recorder.started.values())
    assert starts[-1] - starts[0] < 1, "the deliveries should have overlapped"
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)


def test_dramatiq__async_actor_is_protected_too(broker, queue, pg_engine, pg_async_url, recorder):
    async_engine = engines.async_engine(pg_async_url)
    broker.add_middleware(InboxMiddleware(pg_engine, async_engine=async_engine))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing-async")
    async def add_credit_async(account_id: int, delta: int) -> None:
        await apply_credit_async(current_async_session(), "billing", account_id, delta)

    with running_worker(broker) as worker:
        send(add_credit_async, 7, 10)
        drain(broker, queue, worker)
        send(add_credit_async, 7, 10)
        send(add_credit_async, 7, 50)
        drain(broker, queue, worker)

    assert len(recorder.skipped) == 2
    assert quarantined(broker, queue) == 1
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)


def test_dramatiq__time_limit_mid_transaction_invalidates_the_connection(
    broker, queue, pg_engine, inbox
):
    # Given an actor whose first attempt is interrupted by the time limit mid-statement
    attempts = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", time_limit=1000)
    def sometimes_slow(account_id: int, delta: int) -> None:
        attempts.append(1)
        apply_credit(current_session(), "billing", account_id, delta)
        if len(attempts) == 1:
            current_session().execute(text("SELECT pg_sleep(3)"))

    with running_worker(broker) as worker:
        send(sometimes_slow, 7, 10)
        drain(broker, queue, worker)

    # Then the interrupted attempt left nothing behind and the retry applied it once
    assert len(attempts) == 2
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
        idle = conn.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' "
                "AND datname = current_database()"
            )
        )
    assert idle == 0


def test_dramatiq__database_down_at_claim_time_retries_and_loses_nothing(
    broker, queue, pg_url, pg_engine, recorder
):
    # Given a worker whose database connection runs through a proxy we can break
    proxy = Proxy(services.postgres_address())
    engine = engines.sync_engine(services.via_port(pg_url, proxy.port), pool_pre_ping=True)
    broker.add_middleware(InboxMiddleware(engine))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    try:
        with running_worker(broker) as worker:
            proxy.down()
            sent = send(add_credit, 7, 10)
            # When the claim cannot reach the database, the attempt is handed back (the
            # message re-enqueued with a delay, no retry spent)
            wait_for(lambda: sent.message_id in recorder.skipped, timeout=10, what="a hand-back")
            assert not recorder.failures
            with pg_engine.connect() as conn:
                assert effects(conn) == 0
            # Then, once the database is back, the retry processes it exactly once
            proxy.up()
            drain(broker, queue, worker)
    finally:
        engine.dispose()
        proxy.close()
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
    assert dead_letters(broker, queue) == 0


def test_dramatiq__direct_call_runs_without_the_inbox(pg_engine, add_credit):
    add_credit(7, 10)
    add_credit(7, 10)
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 2
        assert conn.scalar(text("SELECT count(*) FROM consumer_inbox")) == 0


def test_dramatiq__worker_refuses_to_boot_without_the_schema(broker, queue, pg_engine):
    naming = InboxSchema(schema="never_migrated")
    broker.add_middleware(InboxMiddleware(pg_engine, naming=naming, startup_patience=0))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None: ...

    worker = dramatiq.Worker(broker, worker_threads=1)
    with pytest.raises(WorkerBootError, match="do not exist; run `inbox-middleware migrate`"):
        worker.start()
    worker.stop()


def test_declaration__errors_reach_the_declaring_code(broker, queue, inbox, add_credit):
    with pytest.raises(ActorConfigurationError, match="both declare inbox_consumer='billing'"):

        @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
        def other(x: int) -> None: ...

    with pytest.raises(ActorConfigurationError, match="inbox_consumer is empty"):

        @dramatiq.actor(queue_name=queue, inbox_consumer="")
        def nameless(x: int) -> None: ...


@dataclass
class DeadlineAtSkip(Middleware):
    """Added last, so Dramatiq calls it first after a skip: the thread's TimeLimit
    deadline as Dramatiq's handling of the SkipMessage begins (None: no limit running)."""

    time_limit: Any
    seen: list[float | None] = field(default_factory=list)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        self.seen.append(self.time_limit.manager.deadlines.get(threading.get_ident()))


def test_dramatiq__a_skipped_message_has_no_time_limit_left_once_the_inbox_has_settled_it(
    broker, queue, pg_engine, add_credit
):
    # Given Dramatiq's TimeLimit, which raises its exception into the worker thread from
    # another thread: in Dramatiq's handling of a SkipMessage (no try around it), that
    # kills the worker thread (Dramatiq issue 445; the explorer's seed 800039: a worker
    # process whose only thread died, its messages held until it stopped)
    (time_limit,) = [m for m in broker.middleware if isinstance(m, dramatiq.middleware.TimeLimit)]
    probe = DeadlineAtSkip(time_limit)
    broker.add_middleware(probe)
    with running_worker(broker) as worker:
        # When a message is applied, then its copy skipped as a duplicate
        send(add_credit, 7, 10)
        drain(broker, queue, worker)
        send(add_credit, 7, 10)
        drain(broker, queue, worker)

    # Then the inbox ended the copy's time limit in the actor call, before raising
    # SkipMessage: a limit running out there is an exception of the actor call
    assert probe.seen == [None]
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
