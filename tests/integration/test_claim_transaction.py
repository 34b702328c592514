"""Before any ack, the inbox knows that the transaction which committed is the claim's and
that it did commit: every way a handler can end or spoil the claim's transaction, on the
real PostgreSQL through asyncpg (`AsyncInbox`, FastStream's path) and psycopg (`Inbox`,
Dramatiq's), including statements run on the driver's own connection, which SQLAlchemy
never sees.

Each misuse ends in a failed attempt: nothing acked without the claim and the effect
committed together; the message is retried (or recorded as poison), never lost.
"""

from __future__ import annotations

from typing import Any

import dramatiq
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from inbox_middleware._core.exceptions import HandlerTransactionError, TransactionAborted
from inbox_middleware._core.protocol import Decision
from inbox_middleware._storage import AsyncInbox, Inbox
from inbox_middleware.dramatiq import InboxMiddleware, current_session
from inbox_middleware.faststream import FastStreamInbox, InboxSession

from ..apps.domain import apply_credit, apply_credit_async, effects
from ..support.dramatiq_worker import drain, running_worker
from ..support.engines import async_engine
from ..support.faststream_brokers import Harness, Seen, eventually, recorder
from .test_claim import delivery, inbox_rows
from .test_dramatiq import dead_letters, send
from .test_faststream import ORDER, ident
from .test_handler_transaction import healed, healed_async, poison_rows

DUPLICATE_ACCOUNT = "INSERT INTO accounts (id, balance) VALUES (1, 0)"


async def _raw(session: Any) -> Any:
    """asyncpg's own connection under the handler's session."""
    return (await (await session.connection()).get_raw_connection()).driver_connection


async def raw_failure_caught(session: Any) -> None:
    await apply_credit_async(session, "billing", 1, 10)
    try:  # noqa: SIM105 - the mistake under test
        await (await _raw(session)).execute(DUPLICATE_ACCOUNT)
    except Exception:
        pass  # the transaction is aborted; SQLAlchemy never saw the error


async def raw_rollback(session: Any) -> None:
    await apply_credit_async(session, "billing", 1, 10)
    await (await _raw(session)).execute("ROLLBACK")


async def raw_rollback_then_writes(session: Any) -> None:
    await apply_credit_async(session, "billing", 1, 10)
    await (await _raw(session)).execute("ROLLBACK; BEGIN")
    await apply_credit_async(session, "billing", 2, 5)


async def raw_commit_then_writes(session: Any) -> None:
    await apply_credit_async(session, "billing", 1, 10)
    await (await _raw(session)).execute("COMMIT; BEGIN")
    await apply_credit_async(session, "billing", 2, 5)


async def sql_rollback(session: Any) -> None:
    await apply_credit_async(session, "billing", 1, 10)
    await session.execute(text("ROLLBACK"))


async def sql_commit(session: Any) -> None:
    await apply_credit_async(session, "billing", 1, 10)
    await session.execute(text("COMMIT"))
    await apply_credit_async(session, "billing", 2, 5)


async def invalidates(session: Any) -> None:
    await apply_credit_async(session, "billing", 1, 10)
    await session.invalidate()


async def connection_commit(session: Any) -> None:
    await apply_credit_async(session, "billing", 1, 10)
    await (await session.connection()).commit()


async def connection_rollback(session: Any) -> None:
    await apply_credit_async(session, "billing", 1, 10)
    await (await session.connection()).rollback()


ASYNC_MISUSES = [
    raw_failure_caught,
    raw_rollback,
    raw_rollback_then_writes,
    sql_rollback,
    sql_commit,
    invalidates,
    connection_commit,
    connection_rollback,
]


@pytest.mark.parametrize("handler", ASYNC_MISUSES)
async def test_claim_transaction__misuse_never_commits_apart_asyncpg(
    handler, pg_async_engine, pg_engine
):
    # Given a handler that ends or spoils the claim's transaction, by any means
    inbox = AsyncInbox(pg_async_engine)
    # When it is processed, then the attempt fails: the caller does not ack
    with pytest.raises(HandlerTransactionError):
        await inbox.process(delivery(), handler)
    # And neither the claim nor any effect committed: the redelivery is first seen
    assert inbox_rows(pg_engine) == 0
    with pg_engine.connect() as conn:
        assert effects(conn) == 0
    outcome = await inbox.process(delivery(), healed_async)
    assert outcome.decision is Decision.FIRST
    assert inbox_rows(pg_engine) == 1


async def test_claim_transaction__raw_commit_is_never_acked_asyncpg(pg_async_engine, pg_engine):
    # Given a handler that commits on asyncpg's own connection (what it did before the
    # COMMIT is committed with the claim, out of the inbox's reach), then writes more
    inbox = AsyncInbox(pg_async_engine)
    # Then the attempt fails all the same: the transaction committing is not the claim's
    with pytest.raises(HandlerTransactionError):
        await inbox.process(delivery(), raw_commit_then_writes)
    # And what followed the COMMIT did not commit
    with pg_engine.connect() as conn:
        assert effects(conn) == 1


async def test_claim_transaction__a_write_after_a_raw_commit_is_refused_asyncpg(
    pg_async_engine, pg_engine
):
    # Given a handler that commits on asyncpg's own connection, then writes through its
    # session (which, with no transaction open, would commit that write on its own)
    inbox = AsyncInbox(pg_async_engine)

    async def commits_then_writes(session: Any) -> None:
        await apply_credit_async(session, "billing", 1, 10)
        await (await _raw(session)).execute("COMMIT")
        await apply_credit_async(session, "billing", 2, 5)

    # Then the write is refused before it is sent: only what preceded the COMMIT committed
    with pytest.raises(HandlerTransactionError):
        await inbox.process(delivery(), commits_then_writes)
    with pg_engine.connect() as conn:
        assert effects(conn) == 1
        assert conn.scalar(text("SELECT count(*) FROM ledger WHERE account_id = 2")) == 0


def raw_failure_caught_psycopg(session: Session) -> None:
    apply_credit(session, "billing", 1, 10)
    raw = session.connection().connection.dbapi_connection
    try:  # noqa: SIM105 - the mistake under test
        raw.execute(DUPLICATE_ACCOUNT)  # type: ignore[union-attr]
    except Exception:
        pass


def raw_rollback_then_begin_psycopg(session: Session) -> None:
    apply_credit(session, "billing", 1, 10)
    raw = session.connection().connection.dbapi_connection
    raw.pgconn.exec_(b"ROLLBACK; BEGIN")  # type: ignore[union-attr]
    apply_credit(session, "billing", 2, 5)


@pytest.mark.parametrize("handler", [raw_failure_caught_psycopg, raw_rollback_then_begin_psycopg])
def test_claim_transaction__misuse_never_commits_apart_psycopg(handler, pg_engine):
    inbox = Inbox(pg_engine)
    with pytest.raises(HandlerTransactionError):
        inbox.process(delivery(), handler)
    assert inbox_rows(pg_engine) == 0
    with pg_engine.connect() as conn:
        assert effects(conn) == 0
    assert inbox.process(delivery(), healed).decision is Decision.FIRST


@pytest.mark.parametrize("handler", [raw_failure_caught, raw_rollback_then_writes, raw_rollback])
async def test_claim_transaction__faststream_retries_until_poison(
    handler, pg_async_engine, pg_engine
):
    # Given a FastStream subscriber on RabbitMQ whose handler spoils the claim's transaction
    # on asyncpg's own connection at every attempt (max_attempts 3)
    seen = Seen()
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.2), max_attempts=3)
    h = Harness("rabbit", [recorder(seen), inbox.middleware])
    inbox.guard(h.broker)
    try:

        @h.subscribe(inbox.consumer("billing"))
        async def handle(body: dict[str, Any], session: InboxSession) -> None:
            await handler(session)

        async with h.broker:
            await h.broker.start()
            await h.publish(ORDER, ident())
            # When it is delivered, then it is never acked as processed: each attempt
            # fails and is counted, and the last one keeps it as poison
            await eventually(lambda: poison_rows(pg_engine), timeout=30, what="the poison row")
    finally:
        await h.cleanup()
    [row] = poison_rows(pg_engine)
    assert row["attempts"] == 3
    assert inbox_rows(pg_engine) == 0
    with pg_engine.connect() as conn:
        assert effects(conn) == 0


@pytest.mark.parametrize(
    "message_id",
    ["it's", "back\\slash", "$1", "%(message_id)s", "a'; DROP TABLE consumer_inbox; --", "é€𝄞"],
)
async def test_claim_transaction__asyncpg_claim_sent_with_its_begin_stores_values_as_sent(
    message_id, pg_async_engine, pg_engine
):
    # Given the claim sent with its BEGIN as one simple-protocol message, values as literals
    inbox = AsyncInbox(pg_async_engine)
    owned = []

    async def look(session: Any) -> None:
        adapter = (await (await session.connection()).get_raw_connection()).dbapi_connection
        owned.append(type(adapter._transaction).__name__)
        await apply_credit_async(session, "billing", 1, 10)

    # When it is delivered twice
    first = await inbox.process(delivery(message_id), look)
    second = await inbox.process(delivery(message_id), look)
    # Then the inbox owned the transaction, and the values were stored as sent
    assert (first.decision, second.decision) == (Decision.FIRST, Decision.DUPLICATE)
    assert owned == ["InboxTransaction"]
    with pg_engine.connect() as conn:
        stored = conn.execute(text("SELECT message_id FROM consumer_inbox")).scalars().all()
        assert (stored, effects(conn)) == ([message_id], 1)


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
@pytest.mark.parametrize("misuse", [raw_failure_caught_psycopg, raw_rollback_then_begin_psycopg])
def test_claim_transaction__dramatiq_retries_then_applies_once(misuse, broker, queue, pg_engine):
    # Given a Dramatiq actor on Redis whose first attempt spoils the claim's transaction on
    # psycopg's own connection, and whose second attempt behaves
    broker.add_middleware(InboxMiddleware(pg_engine))
    attempts = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=3, min_backoff=10)
    def add_credit(account_id: int, delta: int) -> None:
        attempts.append(len(attempts) + 1)
        if len(attempts) == 1:
            misuse(current_session())
            return
        apply_credit(current_session(), "billing", account_id, delta)

    # When it is delivered
    with running_worker(broker) as worker:
        send(add_credit, 1, 10)
        drain(broker, queue, worker)
    # Then the spoiled attempt was not acked: it was retried, and applied once
    assert len(attempts) == 2
    assert dead_letters(broker, queue) == 0
    assert inbox_rows(pg_engine) == 1
    with pg_engine.connect() as conn:
        assert effects(conn) == 1


async def test_claim_transaction__without_standard_strings_asyncpg_takes_the_parameters_path(
    pg_engine, pg_async_url
):
    # Given a connection where a backslash in a literal would be an escape
    engine = async_engine(
        pg_async_url, connect_args={"server_settings": {"standard_conforming_strings": "off"}}
    )
    inbox = AsyncInbox(engine)
    try:
        # When a claim is sent, then its values go as parameters (stored as sent) in
        # SQLAlchemy's own transaction, and an aborted transaction is still refused
        outcome = await inbox.process(delivery("back\\slash"), healed_async)
        assert outcome.decision is Decision.FIRST
        with pytest.raises(TransactionAborted):
            await inbox.process(delivery("other"), raw_failure_caught)
    finally:
        await engine.dispose()
    with pg_engine.connect() as conn:
        stored = conn.execute(text("SELECT message_id FROM consumer_inbox")).scalars().all()
    assert stored == ["back\\slash"]


@pytest.mark.parametrize("misuse", [raw_failure_caught, raw_rollback, raw_rollback_then_writes])
async def test_claim_transaction__batch_misuse_never_commits_apart_asyncpg(
    misuse, pg_async_engine, pg_engine
):
    # Given a batch whose handler spoils the claim's transaction on asyncpg's own connection
    inbox = AsyncInbox(pg_async_engine)
    batch = [delivery("m-1"), delivery("m-2")]

    async def handler(session: Any, verdicts: Any) -> None:
        await misuse(session)

    # Then the batch's attempt fails, and nothing of it committed
    with pytest.raises(HandlerTransactionError):
        await inbox.process_batch(batch, handler)
    assert inbox_rows(pg_engine) == 0
    with pg_engine.connect() as conn:
        assert effects(conn) == 0
    # And the next attempt claims the whole batch
    committed = await inbox.process_batch(batch, lambda session, verdicts: healed_async(session))
    assert committed.decisions == (Decision.FIRST, Decision.FIRST)


@pytest.mark.parametrize("misuse", [raw_failure_caught_psycopg, raw_rollback_then_begin_psycopg])
def test_claim_transaction__batch_misuse_never_commits_apart_psycopg(misuse, pg_engine):
    inbox = Inbox(pg_engine)
    batch = [delivery("m-1"), delivery("m-2")]
    with pytest.raises(HandlerTransactionError):
        inbox.process_batch(batch, lambda session, verdicts: misuse(session))
    assert inbox_rows(pg_engine) == 0
    with pg_engine.connect() as conn:
        assert effects(conn) == 0
    assert inbox.process_batch(batch, lambda s, v: healed(s)).decisions == (
        Decision.FIRST,
        Decision.FIRST,
    )
