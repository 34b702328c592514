"""Tutorial, Dramatiq: one order sent three times. Run it from ``examples/dramatiq``, next
to a running worker (``dramatiq service``)::

    python ../../docs/snippets/tutorial/dramatiq_one_order.py
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path.cwd()))  # the example's modules, when run from its folder
    # --8<-- [start:send]
    from service import add_credit, broker

    from inbox_middleware.dramatiq import StampIdentity

    # Messages to add_credit: producer "orders", intent id from the order_id argument.
    broker.add_middleware(StampIdentity("orders", "order_id", actors={"add_credit"}))

    add_credit.send(1, 25, "order-1000")  # the order
    add_credit.send(1, 25, "order-1000")  # sent again: a duplicate
    add_credit.send(1, 99, "order-1000")  # another amount: a conflict
    # --8<-- [end:send]


if __name__ == "__main__":
    main()
