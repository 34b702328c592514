"""Dramatiq producers that keep their plain ``send()`` calls (the message identities guide):
an actor whose argument is the intent id, and a producer middleware for another actor.

Load it after the broker has its `InboxMiddleware`, as a worker module would be.
"""

from __future__ import annotations

import dramatiq
from sqlalchemy import text

from inbox_middleware.dramatiq import StampIdentity, current_session


# --8<-- [start:actor]
@dramatiq.actor(
    inbox_consumer="billing",
    inbox_producer="orders",  # who names the intents
    inbox_message_id_from="order_id",  # the argument that is the intent id
)
def add_credit(order_id: str, account_id: int, amount: int) -> None:
    current_session().execute(
        text("UPDATE accounts SET balance = balance + :amount WHERE id = :id"),
        {"amount": amount, "id": account_id},
    )


def credit_order(order_id: str, account_id: int, amount: int) -> None:
    add_credit.send(order_id, account_id, amount)  # no send_with_options needed
    # --8<-- [end:actor]


# --8<-- [start:producer]
def stamp_refunds(broker: dramatiq.Broker) -> None:
    """Stamp refund messages with an id computed from their arguments."""
    broker.add_middleware(
        StampIdentity(
            "payments",
            lambda message: f"refund-{message.args[0]}",  # the same for every resend
            actors={"refund"},
        )
    )
    # --8<-- [end:producer]
