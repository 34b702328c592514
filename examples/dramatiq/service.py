"""The account-credit worker, protected by the inbox.

    dramatiq service              # run from this folder

`add_credit` runs once per order, however often its message is delivered: the claim
and the two writes commit together, and a redelivery finds the claim and is skipped.
"""

from __future__ import annotations

import dramatiq
from accounts import QUEUE, credit, engine_from_env, make_broker

from inbox_middleware.dramatiq import InboxMiddleware, current_session

# --8<-- [start:setup]
broker = make_broker()
engine = engine_from_env()
broker.add_middleware(InboxMiddleware(engine))
dramatiq.set_broker(broker)
# --8<-- [end:setup]


# --8<-- [start:actor]
@dramatiq.actor(queue_name=QUEUE, inbox_consumer="billing", inbox_handler_version="1")
def add_credit(account_id: int, amount: int, order_id: str) -> None:
    credit(current_session(), account_id, amount, order_id)


# --8<-- [end:actor]
