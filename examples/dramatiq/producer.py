"""Send orders to the worker, with the failures brokers and producers really produce.

Each order is one intent with its own id. Some are delivered again (a producer retry
after a lost confirmation, a broker redelivery). Later, some ids are reused for another
amount (a producer bug: an identity conflict).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from inbox_middleware.dramatiq import identity


@dataclass
class Sent:
    intents: int = 0
    duplicates: int = 0
    conflicts: int = 0
    expected: Counter[int] = field(default_factory=Counter)

    @property
    def messages(self) -> int:
        return self.intents + self.duplicates + self.conflicts


def _orders(count: int, accounts: int, seed: int) -> list[tuple[int, int, str]]:
    rng = random.Random(seed)
    return [(rng.randint(1, accounts), rng.randint(1, 100), f"order-{n}") for n in range(count)]


# --8<-- [start:send]
def send_orders(actor, *, orders: int, accounts: int, seed: int = 7) -> Sent:
    """Every order once, every third one twice (a retry right after the first send)."""
    sent = Sent()
    for number, (account, amount, order_id) in enumerate(_orders(orders, accounts, seed)):
        options = identity(producer="orders", message_id=order_id)
        actor.send_with_options(args=(account, amount, order_id), **options)
        sent.intents += 1
        sent.expected[account] += amount
        if number % 3 == 0:
            actor.send_with_options(args=(account, amount, order_id), **options)
            sent.duplicates += 1
    return sent


# --8<-- [end:send]


def send_conflicts(actor, sent: Sent, *, orders: int, accounts: int, seed: int = 7) -> None:
    """Reuse every tenth order's id for another amount."""
    for account, amount, order_id in _orders(orders, accounts, seed)[::10]:
        options = identity(producer="orders", message_id=order_id)
        actor.send_with_options(args=(account, amount + 1, order_id), **options)
        sent.conflicts += 1
