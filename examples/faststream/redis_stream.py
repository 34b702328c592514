"""A Redis stream subscriber the inbox accepts: a consumer group, and a reclaiming twin.

Not an app of its own: `build` makes the broker, so the guide and its test share it."""

from typing import Any

from faststream.redis import RedisBroker, StreamSub
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from inbox_middleware.faststream import FastStreamInbox, InboxSession


def build(engine: AsyncEngine, url: str, stream: str, worker: str) -> tuple[Any, Any]:
    inbox = FastStreamInbox(engine)
    broker = inbox.guard(RedisBroker(url, middlewares=[inbox.middleware]))
    billing = inbox.consumer("billing", handler_version="1")

    # Reads new messages through the group. `worker` is unique per process.
    @broker.subscriber(
        stream=StreamSub(stream, group="billing", consumer=worker), dependencies=[billing]
    )
    # Takes back any message left pending for 30 s: a crashed worker's, or one whose
    # transaction failed. The same handler and the same inbox consumer.
    @broker.subscriber(
        stream=StreamSub(
            stream, group="billing", consumer=f"{worker}-reclaim", min_idle_time=30_000
        ),
        dependencies=[billing],
    )
    async def add_credit(order: dict[str, Any], session: InboxSession) -> None:
        await session.execute(
            text("UPDATE accounts SET balance = balance + :amount WHERE id = :id"),
            {"amount": order["amount"], "id": order["account_id"]},
        )

    return inbox, broker
