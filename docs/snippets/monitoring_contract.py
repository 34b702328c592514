"""A producer's own test: every message it publishes carries a stable identity."""

from typing import Any

from inbox_middleware.dramatiq import identity
from inbox_middleware.testing import producer_contract


def place_order(charge: Any, order_id: int, amount: int) -> None:
    """The producer code under test: one intent, one id derived from the order."""
    charge.send_with_options(
        args=(order_id, amount), **identity(producer="shop", message_id=f"order-{order_id}")
    )


def test_place_order_sends_a_stable_identity(broker: Any, charge: Any) -> None:
    with producer_contract(broker) as contract:
        # Sending the same intent again (a retry, a replay) must reuse its id
        contract.same_intent(lambda: place_order(charge, 42, 10))
    assert [m.identity.message_id for m in contract.messages] == ["order-42", "order-42"]
