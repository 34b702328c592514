"""The account-credit domain shared by the protected and the unprotected workers."""

from __future__ import annotations

import os

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from inbox_middleware import engine_from_url, migrate

DATABASE_URL = os.environ.get(
    "DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/inbox_demo"
)
BROKER_URL = os.environ.get("BROKER_URL", "redis://127.0.0.1:6379/0")
QUEUE = os.environ.get("ACCOUNTS_QUEUE", "accounts")


# --8<-- [start:credit]
def credit(session: Session, account_id: int, amount: int, order_id: str) -> None:
    """Credit an account for an order and journal it. Not idempotent on its own."""
    session.execute(
        text("UPDATE accounts SET balance = balance + :amount WHERE id = :id"),
        {"amount": amount, "id": account_id},
    )
    session.execute(
        text("INSERT INTO credits (account_id, amount, order_id) VALUES (:id, :amount, :order)"),
        {"id": account_id, "amount": amount, "order": order_id},
    )


# --8<-- [end:credit]


def engine_from_env() -> Engine:
    # The URL the command line takes too (postgres://, any driver): psycopg, 8 threads.
    return engine_from_url(DATABASE_URL, connections=8)


def reset_database(engine: Engine, accounts: int) -> None:
    """Create (or empty) the demo's tables and the inbox tables."""
    migrate(engine)
    with engine.begin() as conn:
        for statement in (
            "CREATE TABLE IF NOT EXISTS accounts (id integer PRIMARY KEY, balance bigint NOT NULL)",
            "CREATE TABLE IF NOT EXISTS credits (account_id integer NOT NULL, "
            "amount bigint NOT NULL, order_id text NOT NULL)",
            "DELETE FROM accounts",
            "DELETE FROM credits",
            "DELETE FROM consumer_inbox",
            "DELETE FROM inbox_quarantine",
        ):
            conn.execute(text(statement))
        conn.execute(
            text("INSERT INTO accounts (id, balance) VALUES (:id, 0)"),
            [{"id": n} for n in range(1, accounts + 1)],
        )


def make_broker():  # type: ignore[no-untyped-def]
    if BROKER_URL == "stub":
        from dramatiq.brokers.stub import StubBroker

        return StubBroker()
    if BROKER_URL.startswith("amqp"):
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=BROKER_URL, confirm_delivery=True)
    from dramatiq.brokers.redis import RedisBroker

    return RedisBroker(url=BROKER_URL, namespace=os.environ.get("REDIS_NAMESPACE", "inbox-demo"))
