"""Tutorial, FastStream: one order published three times. Run it from
``examples/faststream``, next to a running app (``faststream run service:app``)::

    python ../../docs/snippets/tutorial/faststream_one_order.py
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path


async def main() -> None:
    sys.path.insert(0, str(Path.cwd()))  # the example's modules, when run from its folder
    # --8<-- [start:publish]
    from accounts import BROKER_URL, QUEUE
    from faststream.rabbit import RabbitBroker

    from inbox_middleware.faststream import identity_headers

    order = {"account_id": 1, "amount": 25, "order_id": "order-1000"}
    headers = identity_headers(producer="orders", message_id="order-1000")
    async with RabbitBroker(BROKER_URL) as broker:
        await broker.publish(order, QUEUE, headers=headers, persist=True)  # the order
        # The app runs the messages it holds at once, so copies sent together reach the
        # inbox in any order; here the order goes first, and its copies a moment later.
        await asyncio.sleep(1)
        await broker.publish(order, QUEUE, headers=headers, persist=True)  # again: a duplicate
        conflict = {**order, "amount": 99}  # the same order id for another amount
        await broker.publish(conflict, QUEUE, headers=headers, persist=True)
    # --8<-- [end:publish]


if __name__ == "__main__":
    asyncio.run(main())
