"""A handler that knows when retrying cannot help (the failures guide).

Load it after the broker has its `InboxMiddleware`, as a worker module would be.
"""

from __future__ import annotations

import dramatiq
from sqlalchemy import text

from inbox_middleware import PermanentError
from inbox_middleware.dramatiq import current_session


# --8<-- [start:actor]
@dramatiq.actor(inbox_consumer="billing")
def add_credit(account_id: int, amount: int) -> None:
    credited = current_session().execute(
        text("UPDATE accounts SET balance = balance + :amount WHERE id = :id RETURNING id"),
        {"amount": amount, "id": account_id},
    )
    if credited.first() is None:
        # No retry will make this account appear: keep the message as poison, with a
        # stable reason code for operators and metrics, instead of retrying it.
        raise PermanentError("unknown_account", f"account {account_id} does not exist")


# --8<-- [end:actor]
