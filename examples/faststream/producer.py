"""Send orders to the worker, with the failures brokers and producers really produce.

Each order is one intent with its own id. Some are published again (a producer retry
after a lost confirmation). Later, some ids are reused for another amount (a producer
bug: an identity conflict, which the inbox quarantines).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from inbox_middleware.faststream import identity_headers


@dataclass
class Sent:
    intents: int = 0
    duplicates: int = 0
    conflicts: int = 0
    expected: Counter[int] = field(default_factory=Counter)

    @property
    def messages(self) -> int:
        return self.intents + self.duplicates + self.conflicts


def _orders(count: int, accounts: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "account_id": rng.randint(1, accounts),
            "amount": rng.randint(1, 100),
            "order_id": f"order-{n}",
        }
        for n in range(count)
    ]


# --8<-- [start:send]
async def send_orders(
    broker: Any, queue: str, *, orders: int, accounts: int, seed: int = 7
) -> Sent:
    """Every order once, every third one twice (a retry right after the first publish)."""
    sent = Sent()
    for number, order in enumerate(_orders(orders, accounts, seed)):
        headers = identity_headers(producer="orders", message_id=order["order_id"])
        # persist: RabbitMQ keeps the message on disk (FastStream's default is transient)
        await broker.publish(order, queue, headers=headers, persist=True)
        sent.intents += 1
        sent.expected[order["account_id"]] += order["amount"]
        if number % 3 == 0:
            await broker.publish(order, queue, headers=headers, persist=True)
            sent.duplicates += 1
    return sent


# --8<-- [end:send]


async def send_conflicts(
    broker: Any, queue: str, sent: Sent, *, orders: int, accounts: int, seed: int = 7
) -> None:
    """Reuse every tenth order's id for another amount."""
    for order in _orders(orders, accounts, seed)[::10]:
        headers = identity_headers(producer="orders", message_id=order["order_id"])
        await broker.publish(
            {**order, "amount": order["amount"] + 1}, queue, headers=headers, persist=True
        )
        sent.conflicts += 1
