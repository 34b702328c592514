"""What a handler does to the claim's transaction, on the real PostgreSQL through both
drivers (psycopg for `Inbox`, asyncpg for `AsyncInbox`).

A savepoint written in plain SQL that the handler rolls back to after a failing
statement heals the transaction: the attempt commits. A failing statement the handler
swallows without one leaves it aborted: the attempt is refused, never acked.
"""

from __future__ import annotations

from typing import Any

import dramatiq
import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from inbox_middleware._core.exceptions import HandlerTransactionError, TransactionAborted
from inbox_middleware._core.protocol import Decision
from inbox_middleware._storage import AsyncInbox, Inbox, InboxSchema
from inbox_middleware._storage.base import ABORTED
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity
from inbox_middleware.faststream import FastStreamInbox, InboxSession

from ..apps.domain import apply_credit, apply_credit_async, balance, effects
from ..support.dramatiq_worker import drain, running_worker
from ..support.engines import async_engine, sync_engine
from ..support.faststream_brokers import Harness, Seen, eventually, recorder
from ..support.workers import wait_for
from .test_claim import delivery, inbox_rows
from .test_dramatiq import dead_letters
from .test_faststream import ORDER, ident

DUPLICATE_ACCOUNT = text("INSERT INTO accounts (id, balance) VALUES (1, 0)")


def healed(session: Session) -> str:
    apply_credit(session, "billing", 1, 10)
    session.execute(text("SAVEPOINT heal"))
    try:
        session.execute(DUPLICATE_ACCOUNT)  # account 1 exists: a unique violation
    except IntegrityError:
        session.execute(text("ROLLBACK TO SAVEPOINT heal"))
    session.execute(text("RELEASE SAVEPOINT heal"))
    apply_credit(session, "billing", 1, 5)
    return "applied"


async def healed_async(session: Any) -> str:
    await apply_credit_async(session, "billing", 1, 10)
    await session.execute(text("SAVEPOINT heal"))
    try:
        await session.execute(DUPLICATE_ACCOUNT)
    except IntegrityError:
        await session.execute(text("ROLLBACK TO SAVEPOINT heal"))
    await session.execute(text("RELEASE SAVEPOINT heal"))
    await apply_credit_async(session, "billing", 1, 5)
    return "applied"


async def swallowed_async(session: Any) -> None:
    await apply_credit_async(session, "billing", 1, 10)
    await session.execute(text("SAVEPOINT heal"))
    try:  # noqa: SIM105 - the mistake under test
        await session.execute(DUPLICATE_ACCOUNT)
    except IntegrityError:
        pass  # no ROLLBACK TO SAVEPOINT: the transaction stays aborted


def test_handler_transaction__plain_sql_savepoint_heals_it_psycopg(pg_engine):
    # Given a handler that runs a failing INSERT under a SAVEPOINT it wrote in plain SQL,
    # and rolls back to it when the INSERT fails
    inbox = Inbox(pg_engine)
    # When it is processed
    outcome = inbox.process(delivery(), healed)
    # Then the transaction committed, the claim and both credits with it
    assert (outcome.decision, outcome.result) == (Decision.FIRST, "applied")
    assert inbox_rows(pg_engine) == 1
    with pg_engine.connect() as conn:
        assert (balance(conn, 1), effects(conn)) == (15, 2)


async def test_handler_transaction__plain_sql_savepoint_heals_it_asyncpg(
    pg_async_engine, pg_engine
):
    inbox = AsyncInbox(pg_async_engine)
    outcome = await inbox.process(delivery(), healed_async)
    assert (outcome.decision, outcome.result) == (Decision.FIRST, "applied")
    assert inbox_rows(pg_engine) == 1
    with pg_engine.connect() as conn:
        assert (balance(conn, 1), effects(conn)) == (15, 2)


async def test_handler_transaction__savepoint_not_rolled_back_to_stays_refused_asyncpg(
    pg_async_engine, pg_engine
):
    # Given a handler that swallows the failure and never rolls back to its savepoint
    inbox = AsyncInbox(pg_async_engine)
    # Then its COMMIT is refused, and nothing of it committed
    with pytest.raises(TransactionAborted):
        await inbox.process(delivery(), swallowed_async)
    assert inbox_rows(pg_engine) == 0
    with pg_engine.connect() as conn:
        assert effects(conn) == 0
    # And the next attempt on the same pooled connection is judged afresh
    outcome = await inbox.process(delivery(), healed_async)
    assert outcome.decision is Decision.FIRST
    assert inbox_rows(pg_engine) == 1


async def test_handler_transaction__begin_nested_heals_it_asyncpg(pg_async_engine, pg_engine):
    # Given a handler whose failing INSERT runs in session.begin_nested(): SQLAlchemy rolls
    # back to its savepoint, which heals the transaction the failure marked as aborted
    inbox = AsyncInbox(pg_async_engine)
    marks = []

    async def nested(session: Any) -> str:
        await apply_credit_async(session, "billing", 1, 10)
        connection = await session.connection()
        try:
            async with session.begin_nested():
                await session.execute(DUPLICATE_ACCOUNT)
        except IntegrityError:
            marks.append(connection.info.get(ABORTED))
        await apply_credit_async(session, "billing", 1, 5)
        return "applied"

    # When it is processed, then the rollback to the savepoint cleared the failure's mark
    # (no probe of the transaction is needed), and it commits whole
    outcome = await inbox.process(delivery(), nested)
    assert marks == [None]
    assert (outcome.decision, outcome.result) == (Decision.FIRST, "applied")
    with pg_engine.connect() as conn:
        assert (balance(conn, 1), effects(conn)) == (15, 2)


def test_handler_transaction__the_guard_adds_no_connection_events(pg_url, pg_async_url):
    # Given the user's engines, each given to two inboxes
    engine = sync_engine(pg_url)
    async_ = async_engine(pg_async_url)
    try:
        for _ in range(2):
            Inbox(engine)
            AsyncInbox(async_)
        # Then neither has a connection event, which would cost every transaction on it (the
        # inbox's or the application's own) a dispatcher, and the commit is guarded once
        for target in (engine, async_.sync_engine):
            assert not target._has_events
            commit = target.dialect.do_commit
            assert type(commit).__name__ == "_RefusingCommit"
            assert type(commit._commit).__name__ != "_RefusingCommit"  # type: ignore[attr-defined]
    finally:
        engine.dispose()


# -- the handler's own commit() is a programming error: poison at once, with the reason -----


def poison_rows(engine: Any) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(select(InboxSchema().tables.poison)).mappings().all()
    return [dict(row) for row in rows]


def test_handler_transaction__dramatiq_commit_in_the_actor_is_poison_at_once(
    broker, queue, pg_engine
):
    # Given an actor that commits its session itself, with Dramatiq's default retries
    broker.add_middleware(InboxMiddleware(pg_engine))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None:
        session = current_session()
        apply_credit(session, "billing", account_id, delta)
        session.commit()

    # When it is delivered
    with running_worker(broker) as worker:
        add_credit.send_with_options(
            args=(1, 10), **identity(producer="orders", message_id="ord-1")
        )
        drain(broker, queue, worker)
        # Then it is kept as poison at its first attempt, with the reason, and
        # dead-lettered: no retry over days for an error that repeats every time
        wait_for(lambda: dead_letters(broker, queue) == 1, timeout=10, what="the dead letter")
    [row] = poison_rows(pg_engine)
    assert (row["reason_code"], row["attempts"]) == ("handler_transaction", 1)
    assert "HandlerTransactionError" in row["error"]
    assert "commit()" in row["error"]
    assert inbox_rows(pg_engine) == 0
    with pg_engine.connect() as conn:
        assert effects(conn) == 0


@pytest.mark.parametrize("method", ["commit", "rollback", "close"])
async def test_handler_transaction__faststream_commit_in_the_handler_is_poison_at_once(
    method, pg_async_engine, pg_engine
):
    # Given a handler that ends its session's transaction itself (max_attempts 10)
    seen = Seen()
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.2))
    h = Harness("rabbit", [recorder(seen), inbox.middleware])
    inbox.guard(h.broker)
    try:

        @h.subscribe(inbox.consumer("billing"))
        async def handle(body: dict[str, Any], session: InboxSession) -> None:
            await apply_credit_async(session, "billing", body["account"], body["delta"])
            await getattr(session, method)()

        async with h.broker:
            await h.broker.start()
            await h.publish(ORDER, ident())
            # When it is delivered
            await eventually(lambda: poison_rows(pg_engine), timeout=20, what="the poison row")
    finally:
        await h.cleanup()
    # Then it is poison at its first attempt, with the reason
    [row] = poison_rows(pg_engine)
    assert (row["reason_code"], row["attempts"]) == ("handler_transaction", 1)
    assert f"{method}()" in row["error"]
    assert inbox_rows(pg_engine) == 0
    with pg_engine.connect() as conn:
        assert effects(conn) == 0


# -- the handler ends the claim's transaction by other means: refused before it does --------


def rolls_back_in_sql(session: Session) -> None:
    apply_credit(session, "billing", 1, 10)
    session.execute(text("ROLLBACK"))


def commits_in_sql_then_fails(session: Session) -> None:
    apply_credit(session, "billing", 1, 10)
    session.execute(text("commit"))
    apply_credit(session, "billing", 2, 5)


def commits_the_connection(session: Session) -> None:
    apply_credit(session, "billing", 1, 10)
    session.connection().commit()


def rolls_back_the_connection(session: Session) -> None:
    apply_credit(session, "billing", 1, 10)
    session.connection().rollback()


def ends_it_in_sql_after_a_comment(session: Session) -> None:
    apply_credit(session, "billing", 1, 10)
    session.execute(text("/* done */ END"))


def invalidates(session: Session) -> None:
    apply_credit(session, "billing", 1, 10)
    session.invalidate()


def rolls_back_on_the_driver(session: Session) -> None:
    apply_credit(session, "billing", 1, 10)
    session.connection().connection.dbapi_connection.execute("ROLLBACK")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "handler",
    [
        rolls_back_in_sql,
        commits_in_sql_then_fails,
        commits_the_connection,
        rolls_back_the_connection,
        ends_it_in_sql_after_a_comment,
        invalidates,
        rolls_back_on_the_driver,
    ],
)
def test_handler_transaction__ending_it_behind_the_inbox_is_refused_psycopg(handler, pg_engine):
    # Given a handler that ends the claim's transaction itself, by other means than its
    # session's commit() or rollback()
    inbox = Inbox(pg_engine)
    # When it is processed, then the attempt fails: never an ack with no claim, or a claim
    # committed before the handler's work is done
    with pytest.raises(HandlerTransactionError):
        inbox.process(delivery(), handler)
    assert inbox_rows(pg_engine) == 0
    with pg_engine.connect() as conn:
        assert effects(conn) == 0
    # And the pooled connection serves the next attempt as usual
    outcome = inbox.process(delivery(), healed)
    assert outcome.decision is Decision.FIRST
    assert inbox_rows(pg_engine) == 1


async def test_handler_transaction__sql_rollback_is_refused_asyncpg(pg_async_engine, pg_engine):
    inbox = AsyncInbox(pg_async_engine)

    async def rolls_back(session: Any) -> None:
        await apply_credit_async(session, "billing", 1, 10)
        await session.execute(text("ROLLBACK"))

    with pytest.raises(HandlerTransactionError):
        await inbox.process(delivery(), rolls_back)
    assert inbox_rows(pg_engine) == 0
    with pg_engine.connect() as conn:
        assert effects(conn) == 0


def rolls_back_among_statements(session: Session) -> None:
    apply_credit(session, "billing", 1, 10)
    session.execute(text("SELECT 1; ROLLBACK"))


def rolls_back_on_the_driver_then_writes(session: Session) -> None:
    apply_credit(session, "billing", 1, 10)
    session.connection().connection.dbapi_connection.execute("ROLLBACK")  # type: ignore[union-attr]
    apply_credit(session, "billing", 2, 5)  # psycopg would begin a new transaction


@pytest.mark.parametrize(
    "handler", [rolls_back_among_statements, rolls_back_on_the_driver_then_writes]
)
def test_handler_transaction__a_rollback_sqlalchemy_did_not_see_is_refused_psycopg(
    handler, pg_engine
):
    inbox = Inbox(pg_engine)
    with pytest.raises(HandlerTransactionError):
        inbox.process(delivery(), handler)
    assert inbox_rows(pg_engine) == 0
    with pg_engine.connect() as conn:
        assert effects(conn) == 0


def test_handler_transaction__a_failure_on_the_driver_caught_is_refused_psycopg(pg_engine):
    # Given a handler that runs a failing statement on psycopg's own connection (SQLAlchemy
    # never sees the error) and carries on
    def swallows(session: Session) -> None:
        apply_credit(session, "billing", 1, 10)
        raw = session.connection().connection.dbapi_connection
        try:  # noqa: SIM105 - the mistake under test
            raw.execute("INSERT INTO accounts (id, balance) VALUES (1, 0)")  # type: ignore[union-attr]
        except Exception:
            pass

    inbox = Inbox(pg_engine)
    with pytest.raises(TransactionAborted):
        inbox.process(delivery(), swallows)
    assert inbox_rows(pg_engine) == 0
