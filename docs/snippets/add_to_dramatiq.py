"""An existing Dramatiq service with the inbox added (the "add the inbox to an existing
Dramatiq service" guide). The service's worker module builds the broker and the engine,
adds the middleware, then declares its actors; producers import that same module."""

from __future__ import annotations

from typing import Any

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from sqlalchemy import Engine, text

from inbox_middleware import engine_from_url
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity


def make_broker(url: str) -> RabbitmqBroker:
    # --8<-- [start:broker]
    # Publisher confirms: a retry or a quarantined copy is on the server before the
    # original message is acknowledged.
    return RabbitmqBroker(url=url, confirm_delivery=True)
    # --8<-- [end:broker]


def make_engine(database_url: str, worker_threads: int) -> Engine:
    # --8<-- [start:engine]
    # The DATABASE_URL the command line takes (postgres://, postgresql://, any driver):
    # a synchronous engine over psycopg.
    return engine_from_url(
        database_url,
        # Each worker thread holds one connection for as long as it processes a message.
        connections=worker_threads,
        # A statement blocked in the database is beyond Dramatiq's time limit: bound it here.
        connect_args={"options": "-c statement_timeout=30s"},
    )
    # --8<-- [end:engine]


def protect(broker: dramatiq.Broker, engine: Engine) -> None:
    # --8<-- [start:middleware]
    broker.add_middleware(
        InboxMiddleware(
            engine,
            # Until every producer sends identities (and the messages queued before them
            # are gone), run messages without one unprotected, with a warning each.
            missing_identity="process",
        )
    )
    # --8<-- [end:middleware]


def declare(queue: str) -> dramatiq.Actor[Any, Any]:
    # --8<-- [start:actor]
    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", inbox_handler_version="1")
    def add_credit(account_id: int, amount: int) -> None:
        # Before: `with Session(engine) as session, session.begin():` around these lines.
        # Now the inbox opens the transaction, with the claim in it, and commits it.
        current_session().execute(
            text("UPDATE accounts SET balance = balance + :amount WHERE id = :id"),
            {"amount": amount, "id": account_id},
        )

    # --8<-- [end:actor]
    return add_credit


def send(add_credit: dramatiq.Actor[Any, Any], order_id: str, account_id: int, amount: int) -> None:
    # --8<-- [start:send]
    # Before: add_credit.send(account_id, amount)
    add_credit.send_with_options(
        args=(account_id, amount), **identity(producer="orders", message_id=order_id)
    )
    # --8<-- [end:send]
