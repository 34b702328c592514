"""What a handler does to the claim's transaction, on the real PostgreSQL through both
drivers (psycopg for `Inbox`, asyncpg for `AsyncInbox`).

A savepoint written in plain SQL that the handler rolls back to after a failing
statement heals the transaction: the attempt commits. A failing statement the handler
swallows without one leaves it aborted: the attempt is refused, never acked.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from inbox_middleware.exceptions import TransactionAborted
from inbox_middleware.protocol import Decision
from inbox_middleware.storage import AsyncInbox, Inbox

from ..apps.domain import apply_credit, apply_credit_async, balance, effects
from .test_claim import delivery, inbox_rows

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
