"""The outputs guide: a FastStream subscriber (RabbitMQ) whose result is published, and a Dramatiq
pipeline of two inbox actors. A duplicate of either answers like its first delivery.

Load it after the Dramatiq broker has its `InboxMiddleware`, as a worker module would be;
`declare_reserve` declares the FastStream subscriber on a broker and inbox it is given.
"""

from __future__ import annotations

from typing import Any

import dramatiq
from sqlalchemy import text

from inbox_middleware.dramatiq import current_session, identity
from inbox_middleware.faststream import FastStreamInbox, InboxSession


def declare_reserve(broker: Any, inbox: FastStreamInbox, orders: str, shipments: str) -> Any:
    # --8<-- [start:faststream]
    @broker.publisher(shipments, persist=True)  # RabbitMQ: a persistent result
    @broker.subscriber(orders, dependencies=[inbox.consumer("stock")])
    async def reserve(order: dict[str, int], session: InboxSession) -> dict[str, int]:
        left = await session.scalar(
            text("UPDATE accounts SET balance = balance - 1 WHERE id = :id RETURNING balance"),
            {"id": order["item"]},
        )
        return {"order": order["id"], "left": left}  # stored with the claim, then published

    # --8<-- [end:faststream]

    return reserve


# --8<-- [start:dramatiq-actors]
@dramatiq.actor(inbox_consumer="stock")
def take(order_id: str, item: int) -> dict[str, Any]:
    current_session().execute(
        text("UPDATE accounts SET balance = balance - 1 WHERE id = :id"), {"id": item}
    )
    return {"order": order_id, "item": item}


@dramatiq.actor(inbox_consumer="shipping")
def ship(taken: dict[str, Any]) -> None:
    current_session().execute(
        text("INSERT INTO ledger (consumer, account_id, delta, pid) VALUES ('ship', :i, 1, 0)"),
        {"i": taken["item"]},
    )


# --8<-- [end:dramatiq-actors]


def place(order_id: str, item: int) -> None:
    # --8<-- [start:pipeline]
    dramatiq.pipeline(
        [
            take.message_with_options(
                args=(order_id, item), **identity(producer="shop", message_id=order_id)
            ),
            ship.message(),  # its message gets an identity derived from take's
        ]
    ).run()
    # --8<-- [end:pipeline]
