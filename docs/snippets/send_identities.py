"""Producers naming their intents, and an actor whose payload hash leaves out a field that
legitimately differs between copies of one intent (the message identities guide).

Load it after the broker has its `InboxMiddleware`, as a worker module would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import dramatiq
from sqlalchemy import text

from inbox_middleware.dramatiq import CanonicalForm, current_session, identity


@dataclass(frozen=True, slots=True)
class Order:
    """The producer's own record of an intent, created once."""

    id: str
    shop_id: str
    account_id: int
    amount: int
    created_at: datetime


# --8<-- [start:canonical]
def without_trace(actor_name: str, arguments: dict[str, Any]) -> object:
    """The payload as the producer meant it: the call without its per-send trace id."""
    kept = {name: value for name, value in arguments.items() if name != "trace_id"}
    return {"actor": actor_name, "args": kept}


WITHOUT_TRACE = CanonicalForm(scheme="credit-without-trace.v1", function=without_trace)


@dramatiq.actor(inbox_consumer="billing", inbox_canonical_form=WITHOUT_TRACE)
def add_credit(account_id: int, amount: int, trace_id: str) -> None:
    current_session().execute(
        text("UPDATE accounts SET balance = balance + :amount WHERE id = :id"),
        {"amount": amount, "id": account_id},
    )


# --8<-- [end:canonical]


def send_credit(order: Order, trace_id: str) -> None:
    """Send the order's credit; ``trace_id`` is new on every send (this one's trace)."""
    # --8<-- [start:send]
    add_credit.send_with_options(
        args=(order.account_id, order.amount, trace_id),
        **identity(
            producer="orders",  # who names the intent
            message_id=order.id,  # created once with the order, the same on every send
            tenant=order.shop_id,  # ids are unique per shop only
            produced_at=order.created_at,  # optional: lets the inbox spot very late copies
        ),
    )
    # --8<-- [end:send]
