"""The same for an ``async def`` handler (FastStream, or an async Dramatiq actor): your
own AsyncSession or repository inside the inbox's transaction."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

# Your application's own factory, as you already have it.
AppSession = async_sessionmaker(expire_on_commit=False)


class AccountRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def credit(self, account_id: int, amount: int) -> None:
        await self.session.execute(
            text("UPDATE accounts SET balance = balance + :amount WHERE id = :id"),
            {"amount": amount, "id": account_id},
        )
        await self.session.commit()  # releases a savepoint: see below


async def add_credit(inbox_session: AsyncSession, account_id: int, amount: int) -> None:
    """The body of an inbox handler; ``inbox_session`` is its `InboxSession` (FastStream)
    or ``current_async_session()`` (Dramatiq)."""
    connection = await inbox_session.connection()  # the inbox transaction's connection
    async with AppSession(bind=connection, join_transaction_mode="create_savepoint") as session:
        await AccountRepository(session).credit(account_id, amount)
