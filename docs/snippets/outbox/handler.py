"""An inbox actor that credits an account and records the receipt e-mail to send."""

import dramatiq
from sqlalchemy import text

from inbox_middleware import outbox
from inbox_middleware.dramatiq import current_session


@dramatiq.actor(inbox_consumer="billing")
def add_credit(account_id: int, amount: int) -> None:
    session = current_session()
    session.execute(
        text("UPDATE accounts SET balance = balance + :amount WHERE id = :id"),
        {"amount": amount, "id": account_id},
    )
    # Committed with the credit, or rolled back with it. The effect id is derived from
    # this message's inbox identity: a retry of this message records the same id.
    outbox.add(
        session,
        destination="receipts",
        payload={"account_id": account_id, "amount": amount},
    )
