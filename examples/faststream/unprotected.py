"""The same handler and transaction without the inbox, for contrast and measurement.

    faststream run unprotected:app

Every delivery applies its effect, and FastStream acknowledges after the handler returns.
"""

from __future__ import annotations

from typing import Any

from accounts import BROKER_URL, PREFETCH, QUEUE, credit, engine_from_env
from faststream import FastStream
from faststream.rabbit import Channel, RabbitBroker, RabbitQueue
from sqlalchemy.ext.asyncio import AsyncSession

engine = engine_from_env()
broker = RabbitBroker(BROKER_URL, default_channel=Channel(prefetch_count=PREFETCH))
app = FastStream(broker)
app.after_shutdown(engine.dispose)


@broker.subscriber(RabbitQueue(QUEUE, durable=True))
async def add_credit(order: dict[str, Any]) -> None:
    async with AsyncSession(engine) as session, session.begin():
        await credit(session, order["account_id"], order["amount"], order["order_id"])
