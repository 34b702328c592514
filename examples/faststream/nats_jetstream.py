"""A NATS JetStream subscriber the inbox accepts: a stream keeps the subject, and a durable
pull consumer reads it (FastStream's recommended way), acked by the inbox after its commit.

Not an app of its own: `build` makes the broker, so the guide and its test share it."""

from typing import Any

from faststream.nats import ConsumerConfig, JStream, NatsBroker, PullSub
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from inbox_middleware.faststream import FastStreamInbox, InboxSession


def build(
    engine: AsyncEngine, servers: str, subject: str = "orders", stream: str = "ORDERS"
) -> tuple[Any, Any]:
    inbox = FastStreamInbox(engine)
    broker = inbox.guard(NatsBroker(servers, middlewares=[inbox.middleware]))

    # --8<-- [start:subscriber]
    @broker.subscriber(
        subject,
        # A JetStream stream keeps the subject's messages (core NATS is at most once: the
        # start-up check refuses it); FastStream creates the stream when it is missing.
        stream=JStream(stream, subjects=[subject]),
        # A durable pull consumer: it survives the worker, and its place in the stream too.
        durable="billing",
        pull_sub=PullSub(batch_size=16),
        # Not acknowledged within ack_wait (a worker died): JetStream delivers it again.
        # Leave max_deliver unlimited: at its end JetStream drops the message.
        config=ConsumerConfig(ack_wait=30),
        dependencies=[inbox.consumer("billing", handler_version="1")],
    )
    async def add_credit(order: dict[str, Any], session: InboxSession) -> None:
        await session.execute(
            text("UPDATE accounts SET balance = balance + :amount WHERE id = :id"),
            {"amount": order["amount"], "id": order["account_id"]},
        )

    # --8<-- [end:subscriber]
    return inbox, broker
