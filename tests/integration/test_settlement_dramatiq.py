"""Every Dramatiq delivery ends in a settlement the inbox chose: the paths that lost
messages before the consumption core, with a real worker on Redis and RabbitMQ.

1. an actor that swallows a database error leaves its transaction aborted: COMMIT
   silently rolls back, so the attempt must fail instead of being acked (sync and async);
5. hand-backs (the database down) spend none of Retries' budget: 25 of them, then
   success, and no dead letter;
6. a message that exceeds its time limit on every attempt is kept as poison when Retries
   gives up, not dead-lettered without a record; but a time limit that runs out while the
   claim waits or the COMMIT runs fails nothing (whether it committed is for the
   redelivery to find out), in a sync actor and an async one;
7. a redriven poison message starts its attempts (and Dramatiq's retries) again.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator

import dramatiq
import pytest
from sqlalchemy import create_engine, select, text
from sqlalchemy.exc import IntegrityError

from inbox_middleware._core import faults
from inbox_middleware._operate import repair
from inbox_middleware._storage import InboxSchema
from inbox_middleware.dramatiq import (
    InboxMiddleware,
    current_async_session,
    current_session,
    identity,
)
from inbox_middleware.dramatiq._repair import DramatiqRepublisher

from ..apps.domain import apply_credit, apply_credit_async, balance, effects
from ..support.dramatiq_worker import drain, running_worker
from ..support.proxy import Proxy
from ..support.workers import wait_for
from .test_dramatiq import dead_letters

NAMING = InboxSchema()


def poison_rows(engine) -> list[dict]:
    with engine.connect() as conn:
        rows = conn.execute(select(NAMING.tables.poison)).mappings().all()
    return [dict(row) for row in rows]


def claims(engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(text("SELECT count(*) FROM consumer_inbox")) or 0)


def send(actor, *args, message_id="ord-1"):
    return actor.send_with_options(args=args, **identity(producer="orders", message_id=message_id))


# -- 1. an aborted transaction is a failed attempt, never an ack -----------------------------


def test_settlement__swallowed_database_error_fails_then_poisons(broker, queue, pg_engine):
    broker.add_middleware(InboxMiddleware(pg_engine))

    # Given an actor that applies its effect, then catches a failing INSERT without a
    # savepoint, which leaves the transaction aborted
    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=1)
    def add_credit(account_id: int, delta: int) -> None:
        session = current_session()
        apply_credit(session, "billing", account_id, delta)
        try:  # noqa: SIM105 - the mistake under test
            session.execute(text("INSERT INTO accounts (id) VALUES (:a)"), {"a": account_id})
        except IntegrityError:
            pass

    with running_worker(broker) as worker:
        send(add_credit, 7, 10)
        drain(broker, queue, worker)

    # Then no attempt was acked as committed: poison with the reason, nothing applied
    [row] = poison_rows(pg_engine)
    assert (row["reason_code"], row["attempts"]) == ("inbox_error", 2)
    assert "TransactionAborted" in row["error"]
    wait_for(lambda: dead_letters(broker, queue) == 1, timeout=10, what="the dead letter")
    assert claims(pg_engine) == 0
    with pg_engine.connect() as conn:
        assert effects(conn) == 0


def test_settlement__swallowed_database_error_in_an_async_actor(
    broker, queue, pg_engine, pg_async_engine
):
    broker.add_middleware(InboxMiddleware(pg_async_engine))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=0)
    async def add_credit(account_id: int, delta: int) -> None:
        session = current_async_session()
        await apply_credit_async(session, "billing", account_id, delta)
        try:  # noqa: SIM105 - the mistake under test
            await session.execute(text("INSERT INTO accounts (id) VALUES (:a)"), {"a": account_id})
        except IntegrityError:
            pass

    with running_worker(broker) as worker:
        send(add_credit, 7, 10)
        drain(broker, queue, worker)

    [row] = poison_rows(pg_engine)
    assert "TransactionAborted" in row["error"]
    assert claims(pg_engine) == 0
    with pg_engine.connect() as conn:
        assert effects(conn) == 0


# -- 5. hand-backs spend no retry ---------------------------------------------------------------


def test_settlement__25_hand_backs_then_success_and_no_dead_letter(
    broker, queue, pg_url, pg_engine
):
    # Given a worker whose database is down, an actor with max_retries=2, and a
    # hand-back delay of 20 ms
    proxy = Proxy(("127.0.0.1", 5432))
    engine = create_engine(
        pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"), pool_pre_ping=True
    )
    middleware = InboxMiddleware(engine)
    broker.add_middleware(middleware)
    handed_back = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=2)
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    backoff = middleware.backoffs[add_credit.actor_name]
    backoff.first = backoff.limit = 0.02
    original = middleware._hand_back_delay

    def counting(settlement, pending):
        handed_back.append(pending.message.options.get("retries", 0))
        return original(settlement, pending)

    middleware._hand_back_delay = counting
    try:
        with running_worker(broker) as worker:
            proxy.down()
            send(add_credit, 7, 10)
            # When the message is handed back 25 times
            wait_for(lambda: len(handed_back) >= 25, timeout=60, what="25 hand-backs")
            # Then, once the database is back, it is applied: no retry was spent
            proxy.up()
            drain(broker, queue, worker)
            wait_for(lambda: _effects(pg_engine) == 1, timeout=20, what="the effect")
    finally:
        engine.dispose()
        proxy.close()
    assert set(handed_back) == {0}
    assert dead_letters(broker, queue) == 0
    assert poison_rows(pg_engine) == []
    with pg_engine.connect() as conn:
        assert balance(conn, 7) == 10


def _effects(engine) -> int:
    with engine.connect() as conn:
        return effects(conn)


# -- 6. a time limit on every attempt ends in poison ---------------------------------------------


def test_settlement__time_limit_on_every_attempt_is_kept_as_poison(broker, queue, pg_engine):
    broker.add_middleware(InboxMiddleware(pg_engine))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=1, time_limit=300)
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)
        for _ in range(50):  # interruptible: the time limit lands between these
            time.sleep(0.05)

    with running_worker(broker) as worker:
        send(add_credit, 7, 10)
        drain(broker, queue, worker)

    [row] = poison_rows(pg_engine)
    assert (row["reason_code"], row["attempts"]) == ("retries_exhausted", 2)
    assert "TimeLimitExceeded" in row["error"]
    wait_for(lambda: dead_letters(broker, queue) == 1, timeout=10, what="the dead letter")
    with pg_engine.connect() as conn:
        assert effects(conn) == 0


# -- 6b. a time limit that runs out in the inbox's work, not the handler's ----------------------


@contextlib.contextmanager
def slow_commit(engine) -> Iterator[str]:
    """A table whose rows make the COMMIT that writes them take 2.5 s (a deferred
    trigger sleeps in it): its name."""
    table = f"slow_commit_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {table} (id int)"))
        conn.execute(
            text(
                f"CREATE FUNCTION {table}() RETURNS trigger LANGUAGE plpgsql "
                "AS $$ BEGIN PERFORM pg_sleep(2.5); RETURN NULL; END $$"
            )
        )
        conn.execute(
            text(
                f"CREATE CONSTRAINT TRIGGER {table} AFTER INSERT ON {table} "
                f"DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {table}()"
            )
        )
    try:
        yield table
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE {table}"))
            conn.execute(text(f"DROP FUNCTION {table}()"))


@contextlib.contextmanager
def claims_held(engine, seconds: float) -> Iterator[None]:
    """Claims wait ``seconds`` from now: another transaction locks the claims' table."""
    locked = threading.Event()

    def hold() -> None:
        with engine.begin() as conn:
            conn.execute(text("LOCK TABLE consumer_inbox IN SHARE ROW EXCLUSIVE MODE"))
            locked.set()
            time.sleep(seconds)

    holder = threading.Thread(target=hold)
    holder.start()
    locked.wait(10)
    try:
        yield
    finally:
        holder.join()


@pytest.mark.parametrize("where", ["claim", "commit"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_settlement__a_time_limit_in_the_claim_or_the_commit_of_the_last_attempt_fails_nothing(
    broker, queue, pg_engine, pg_async_engine, where, kind
):
    # Given an actor with no retry left and an on_success callback, whose claim waits for
    # a lock, or whose COMMIT outlasts its time limit (a deferred trigger sleeps in it)
    broker.add_middleware(InboxMiddleware(pg_async_engine if kind == "async" else pg_engine))
    stack = contextlib.ExitStack()
    table = stack.enter_context(slow_commit(pg_engine)) if where == "commit" else None
    slow = text(f"INSERT INTO {table} VALUES (1)") if table else None

    if kind == "async":

        @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=0, time_limit=200)
        async def add_credit(account_id: int, delta: int) -> int:
            session = current_async_session()
            await apply_credit_async(session, "billing", account_id, delta)
            if slow is not None:
                await session.execute(slow)
            return delta

    else:

        @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=0, time_limit=200)
        def add_credit(account_id: int, delta: int) -> int:
            session = current_session()
            apply_credit(session, "billing", account_id, delta)
            if slow is not None:
                session.execute(slow)
            return delta

    if kind == "async":

        @dramatiq.actor(queue_name=queue, inbox_consumer="audit")
        async def audited(message: dict, result: int) -> None:
            await apply_credit_async(current_async_session(), "audit", 99, result)

    else:

        @dramatiq.actor(queue_name=queue, inbox_consumer="audit")
        def audited(message: dict, result: int) -> None:
            apply_credit(current_session(), "audit", 99, result)

    # asyncpg cancels the COMMIT with the coroutine Dramatiq cancels: it never commits
    cancelled = kind == "async" and where == "commit"
    with stack, running_worker(broker) as worker:
        # When the time limit runs out there, not in the actor's own code
        held = claims_held(pg_engine, 2.5) if where == "claim" else contextlib.nullcontext()
        with held:
            add_credit.send_with_options(
                args=(7, 10), on_success="audited", **identity(producer="orders", message_id="t-1")
            )
            time.sleep(0.5)  # received, and waiting
        drain(broker, queue, worker)
        if not cancelled:
            wait_for(lambda: _effects(pg_engine) >= 2, timeout=30, what="the callback's effect")
            drain(broker, queue, worker)
    if cancelled:
        # Then, read once the COMMIT had ended, the last attempt failed: kept as poison
        [row] = poison_rows(pg_engine)
        assert (row["reason_code"], row["attempts"]) == ("retries_exhausted", 1)
        assert "TimeLimitExceeded" in row["error"]
        wait_for(lambda: dead_letters(broker, queue) == 1, timeout=10, what="the dead letter")
        assert claims(pg_engine) == 0
        with pg_engine.connect() as conn:
            assert effects(conn) == 0
        return
    # Then it is applied once and its callback once; no poison row or dead letter says
    # it failed (whether the COMMIT committed was read once it had ended)
    assert poison_rows(pg_engine) == []
    assert dead_letters(broker, queue) == 0
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), effects(conn, 99)) == (1, 1)


# -- 6c. a time limit that runs out while the inbox records a failure -----------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_settlement__a_time_limit_in_the_inbox_s_own_record_spends_no_retry(
    broker, queue, pg_engine, pg_async_engine, kind
):
    # Given an actor with one retry whose first two attempts fail, each time counting the
    # failure outlasts its time limit (the inbox's record step waits, where the time limit
    # lands), and the third succeeds
    middleware = InboxMiddleware(pg_async_engine if kind == "async" else pg_engine)
    broker.add_middleware(middleware)
    attempts: list[int] = []
    retries: list[int] = []
    waited: set[int] = set()

    def slow_record(point: str, message_id: str | None) -> None:
        attempt = len(attempts)
        if point != "record" or message_id != "ord-1" or attempt > 2 or attempt in waited:
            return
        waited.add(attempt)
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:  # interruptible: the time limit lands here
            time.sleep(0.02)

    def attempt() -> None:
        message = dramatiq.middleware.CurrentMessage.get_current_message()
        attempts.append(1)
        retries.append(message.options.get("retries", 0) if message else -1)
        if len(attempts) <= 2:
            raise RuntimeError(f"attempt {len(attempts)} fails")

    # a second for the handler and the rollback before the record, however busy the host
    options = {"max_retries": 1, "time_limit": 1000, "min_backoff": 10, "max_backoff": 20}
    if kind == "async":

        @dramatiq.actor(queue_name=queue, inbox_consumer="billing", **options)
        async def add_credit(account_id: int, delta: int) -> None:
            attempt()
            await apply_credit_async(current_async_session(), "billing", account_id, delta)

    else:

        @dramatiq.actor(queue_name=queue, inbox_consumer="billing", **options)
        def add_credit(account_id: int, delta: int) -> None:
            attempt()
            apply_credit(current_session(), "billing", account_id, delta)

    backoff = middleware.backoffs[add_credit.actor_name]
    backoff.first = backoff.limit = 0.02
    broker.add_middleware(dramatiq.middleware.CurrentMessage())
    faults.hook = slow_record
    try:
        with running_worker(broker) as worker:
            send(add_credit, 7, 10)
            wait_for(lambda: _effects(pg_engine) == 1, timeout=30, what="the effect")
            drain(broker, queue, worker)
    finally:
        faults.hook = None
    # Then both interruptions were the inbox's: handed back, no retry of Dramatiq's spent,
    # nothing dead-lettered, applied once
    assert waited == {1, 2}
    assert retries == [0, 0, 0]
    assert dead_letters(broker, queue) == 0
    assert poison_rows(pg_engine) == []
    assert _effects(pg_engine) == 1


# -- 7. a redrive starts again --------------------------------------------------------------------


def test_settlement__redriven_poison_gets_its_attempts_back(broker, queue, pg_engine):
    broker.add_middleware(InboxMiddleware(pg_engine))
    failures = {"left": 100}

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=1)
    def add_credit(account_id: int, delta: int) -> None:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("flaky downstream")
        apply_credit(current_session(), "billing", account_id, delta)

    with running_worker(broker) as worker:
        send(add_credit, 7, 10)
        drain(broker, queue, worker)
        [row] = poison_rows(pg_engine)
        # When it is redriven, and its first attempt after the repair fails once more
        failures["left"] = 1
        with pg_engine.connect() as conn:
            repair.redrive(
                conn,
                NAMING,
                "poison",
                row["id"],
                by="test",
                publisher=DramatiqRepublisher(broker),
            )
        drain(broker, queue, worker)
        wait_for(lambda: _effects(pg_engine) == 1, timeout=20, what="the repaired effect")

    # Then that failure was retried, not poisoned again: applied once, recovered
    [row] = poison_rows(pg_engine)
    assert row["decision"] == "recovered"
    with pg_engine.connect() as conn:
        assert balance(conn, 7) == 10
