"""The account-credit worker on RabbitMQ, protected by the inbox.

    faststream run service:app          # run from this folder

`add_credit` runs once per order, however often its message is delivered: the claim and
the two writes commit together, the message is acknowledged only after that, and a
redelivery finds the claim and is skipped.
"""

from __future__ import annotations

from typing import Any

from accounts import BROKER_URL, PREFETCH, QUEUE, credit, engine_from_env
from faststream import FastStream
from faststream.rabbit import Channel, RabbitBroker, RabbitQueue

from inbox_middleware.faststream import FastStreamInbox, InboxSession

# --8<-- [start:setup]
engine = engine_from_env()
inbox = FastStreamInbox(engine)
broker = RabbitBroker(
    BROKER_URL,
    middlewares=[inbox.middleware],
    default_channel=Channel(prefetch_count=PREFETCH),
)
app = FastStream(inbox.guard(broker))  # the start-up check runs before any subscriber
app.after_shutdown(engine.dispose)
# --8<-- [end:setup]


# --8<-- [start:handler]
@broker.subscriber(
    RabbitQueue(QUEUE, durable=True),
    dependencies=[inbox.consumer("billing", handler_version="1")],
)
async def add_credit(order: dict[str, Any], session: InboxSession) -> None:
    await credit(session, order["account_id"], order["amount"], order["order_id"])


# --8<-- [end:handler]
