"""The same actor and transaction without the inbox, for contrast and measurement.

    dramatiq unprotected

Every delivery applies its effect: a redelivered message credits the account again.
"""

from __future__ import annotations

import dramatiq
from accounts import QUEUE, credit, engine_from_env, make_broker
from sqlalchemy.orm import Session

broker = make_broker()
engine = engine_from_env()
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=QUEUE)
def add_credit(account_id: int, amount: int, order_id: str) -> None:
    with Session(engine) as session, session.begin():
        credit(session, account_id, amount, order_id)
