"""The account-credit domain shared by the protected and the unprotected FastStream apps."""

from __future__ import annotations

import os

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from inbox_middleware import engine_from_url, migrate

DATABASE_URL = os.environ.get(
    "DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/inbox_demo_faststream"
)
BROKER_URL = os.environ.get("BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
QUEUE = os.environ.get("ACCOUNTS_QUEUE", "accounts")
PREFETCH = 16  # messages a worker holds at once: each one needs a pooled connection


# --8<-- [start:credit]
async def credit(session: AsyncSession, account_id: int, amount: int, order_id: str) -> None:
    """Credit an account for an order and journal it. Not idempotent on its own."""
    await session.execute(
        text("UPDATE accounts SET balance = balance + :amount WHERE id = :id"),
        {"amount": amount, "id": account_id},
    )
    await session.execute(
        text("INSERT INTO credits (account_id, amount, order_id) VALUES (:id, :amount, :order)"),
        {"id": account_id, "amount": amount, "order": order_id},
    )


# --8<-- [end:credit]


def engine_from_env() -> AsyncEngine:
    # The URL the command line takes too (postgres://, any driver): an AsyncEngine on asyncpg.
    return engine_from_url(DATABASE_URL, asynchronous=True, connections=PREFETCH)


async def reset_database(engine: AsyncEngine, accounts: int) -> None:
    """Create (or empty) the demo's tables and the inbox tables."""
    async with engine.begin() as conn:
        await conn.run_sync(migrate)
        for statement in (
            "CREATE TABLE IF NOT EXISTS accounts (id integer PRIMARY KEY, balance bigint NOT NULL)",
            "CREATE TABLE IF NOT EXISTS credits (account_id integer NOT NULL, "
            "amount bigint NOT NULL, order_id text NOT NULL)",
            "DELETE FROM accounts",
            "DELETE FROM credits",
            "DELETE FROM consumer_inbox",
            "DELETE FROM inbox_quarantine",
        ):
            await conn.execute(text(statement))
        await conn.execute(
            text("INSERT INTO accounts (id, balance) VALUES (:id, 0)"),
            [{"id": n} for n in range(1, accounts + 1)],
        )
