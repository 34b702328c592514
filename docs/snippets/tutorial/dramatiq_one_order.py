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
    from service import add_credit

    from inbox_middleware.dramatiq import identity

    order = identity(producer="orders", message_id="order-1000")
    add_credit.send_with_options(args=(1, 25, "order-1000"), **order)  # the order
    add_credit.send_with_options(args=(1, 25, "order-1000"), **order)  # sent again: a duplicate
    add_credit.send_with_options(args=(1, 99, "order-1000"), **order)  # other amount: a conflict
    # --8<-- [end:send]


if __name__ == "__main__":
    main()
