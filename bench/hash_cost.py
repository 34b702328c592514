"""Per-message cost of the payload hash, on the Dramatiq and FastStream paths.

    .venv/bin/python -m bench.hash_cost

Prints microseconds per message (best of 5 runs of 20,000) for a typical small payload
and a larger order event; works on any version of the library, so the cost before and
after a change to the hash scheme can be compared by running it on both.
"""

from __future__ import annotations

import json
import timeit

from inbox_middleware.dramatiq._payload import ActorPayload
from inbox_middleware.faststream._payload import builtin_hash

SMALL = {"account_id": 7, "amount": 10}
ORDER = {
    "order_id": "ord-42",
    "customer": {"id": 1234, "name": "Zoë Smith", "email": "z@example.com"},
    "lines": [
        {"sku": "A-1", "qty": 2, "price": 9.99},
        {"sku": "B-7", "qty": 1, "price": 120.5},
    ],
    "total": 140.48,
    "currency": "EUR",
}


def add_credit(account_id: int, amount: int) -> None: ...


def place_order(**order: object) -> None: ...


def per_message(function, number: int = 20_000) -> float:
    return min(timeit.repeat(function, number=number, repeat=5)) / number * 1e6


def main() -> None:
    small_actor = ActorPayload("add_credit", add_credit, None)
    order_actor = ActorPayload("place_order", place_order, None)
    small_body, order_body = json.dumps(SMALL).encode(), json.dumps(ORDER).encode()
    rows = [
        ("dramatiq, small args", lambda: small_actor.builtin(SMALL)),
        ("dramatiq, order event", lambda: order_actor.builtin(ORDER)),
        ("faststream, small body", lambda: builtin_hash(small_body)),
        ("faststream, order event", lambda: builtin_hash(order_body)),
    ]
    for name, function in rows:
        print(f"{name:26} {per_message(function):6.2f} us/message  ({function().scheme})")


if __name__ == "__main__":
    main()
