"""An existing FastStream service on RabbitMQ with the inbox added (the "add the inbox to
an existing FastStream service" guide)."""

from __future__ import annotations

from typing import Any

from faststream import FastStream
from faststream.rabbit import Channel, RabbitBroker, RabbitQueue
from sqlalchemy import text

from inbox_middleware import engine_from_url
from inbox_middleware.faststream import FastStreamInbox, InboxSession


def build(database_url: str, broker_url: str, queue: str) -> tuple[FastStream, RabbitBroker]:
    # --8<-- [start:app]
    prefetch = 16  # messages each subscriber takes from RabbitMQ at once
    # The DATABASE_URL the command line takes, as an AsyncEngine over asyncpg; each
    # message in progress holds one connection until its transaction ends.
    engine = engine_from_url(database_url, asynchronous=True, connections=prefetch)
    inbox = FastStreamInbox(engine)
    broker = RabbitBroker(
        broker_url,
        middlewares=[inbox.middleware],
        default_channel=Channel(prefetch_count=prefetch),
    )
    app = FastStream(inbox.guard(broker))  # refuses what it cannot protect, before consuming
    app.after_shutdown(engine.dispose)
    # --8<-- [end:app]

    # --8<-- [start:subscriber]
    @broker.subscriber(
        RabbitQueue(queue, durable=True),  # no ack_policy: the inbox acks after its commit
        dependencies=[
            # missing_identity="process" until every producer sends identities
            inbox.consumer("billing", handler_version="1", missing_identity="process")
        ],
    )
    async def add_credit(order: dict[str, Any], session: InboxSession) -> None:
        # Before: `async with AsyncSession(engine) as session, session.begin():`
        await session.execute(
            text("UPDATE accounts SET balance = balance + :amount WHERE id = :id"),
            {"amount": order["amount"], "id": order["account_id"]},
        )

    # --8<-- [end:subscriber]
    return app, broker
