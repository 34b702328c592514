"""The domain the tests protect: accounts, and a ledger with one row per applied effect.

Counting ledger rows is how every test checks "exactly one effect".
"""

from __future__ import annotations

import os

from sqlalchemy import Connection, text
from sqlalchemy.orm import Session

POSTGRES_DDL = [
    "CREATE TABLE IF NOT EXISTS accounts (id integer PRIMARY KEY, balance bigint NOT NULL)",
    """CREATE TABLE IF NOT EXISTS ledger (
        id bigserial PRIMARY KEY,
        consumer text NOT NULL,
        account_id integer NOT NULL,
        delta bigint NOT NULL,
        pid integer NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
    )""",
]
SQLITE_DDL = [
    "CREATE TABLE IF NOT EXISTS accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL)",
    """CREATE TABLE IF NOT EXISTS ledger (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        consumer TEXT NOT NULL,
        account_id INTEGER NOT NULL,
        delta INTEGER NOT NULL,
        pid INTEGER NOT NULL,
        applied_at DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP
    )""",
]
TABLES = ("accounts", "ledger")


def create(conn: Connection) -> None:
    for statement in POSTGRES_DDL if conn.dialect.name == "postgresql" else SQLITE_DDL:
        conn.exec_driver_sql(statement)


def apply_credit(session: Session, consumer: str, account_id: int, delta: int) -> None:
    """The effect: credit an account and record it in the ledger."""
    session.execute(
        text(
            "INSERT INTO accounts (id, balance) VALUES (:a, :d) "
            "ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + :d"
        ),
        {"a": account_id, "d": delta},
    )
    session.execute(
        text("INSERT INTO ledger (consumer, account_id, delta, pid) VALUES (:c, :a, :d, :p)"),
        {"c": consumer, "a": account_id, "d": delta, "p": os.getpid()},
    )


async def apply_credit_async(session: object, consumer: str, account_id: int, delta: int) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession

    assert isinstance(session, AsyncSession)
    await session.run_sync(apply_credit, consumer, account_id, delta)


def effects(conn: Connection, account_id: int | None = None) -> int:
    """How many effects were applied (to one account, or in all)."""
    if account_id is None:
        return int(conn.scalar(text("SELECT count(*) FROM ledger")) or 0)
    return int(
        conn.scalar(text("SELECT count(*) FROM ledger WHERE account_id = :a"), {"a": account_id})
        or 0
    )


def balance(conn: Connection, account_id: int) -> int:
    value = conn.scalar(text("SELECT balance FROM accounts WHERE id = :a"), {"a": account_id})
    return int(value or 0)
