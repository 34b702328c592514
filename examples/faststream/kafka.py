"""A Kafka subscriber the inbox accepts: a consumer group, offsets committed on ack.

Not an app of its own: `build` makes the broker, so the guide and its test share it."""

from typing import Any

from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from inbox_middleware.faststream import FastStreamInbox, InboxSession


def build(engine: AsyncEngine, servers: str, topic: str) -> tuple[Any, Any]:
    inbox = FastStreamInbox(engine)
    broker = inbox.guard(KafkaBroker(servers, middlewares=[inbox.middleware]))

    # --8<-- [start:subscriber]
    @broker.subscriber(
        topic,
        group_id="billing",
        # Commit the offset after the inbox settled the message (not ACK_FIRST, the default).
        ack_policy=AckPolicy.ACK,
        # A new group starts at the beginning, not at the end, of what is already there.
        auto_offset_reset="earliest",
        # A member that died is noticed within 6 s, and its partitions move to another.
        session_timeout_ms=6_000,
        heartbeat_interval_ms=1_000,
        dependencies=[inbox.consumer("billing", handler_version="1")],
    )
    async def add_credit(order: dict[str, Any], session: InboxSession) -> None:
        await session.execute(
            text("UPDATE accounts SET balance = balance + :amount WHERE id = :id"),
            {"amount": order["amount"], "id": order["account_id"]},
        )

    # --8<-- [end:subscriber]
    return inbox, broker
