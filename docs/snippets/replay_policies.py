"""The three replay policies, as code. Which one a replay needs depends on what the
handler's output is: a derived view, a projection of its own, or business state."""

from __future__ import annotations

from collections.abc import Iterable

import dramatiq
from sqlalchemy import Connection, text

from inbox_middleware.dramatiq import current_session, identity


# --8<-- [start:no-reapplication]
def rebuild_balances_view(conn: Connection) -> None:
    """Policy 1, no reapplication: the fixed code rebuilds the derived view from the
    business tables; the inbox keeps treating old messages as what they are, duplicates."""
    conn.execute(text("DELETE FROM balances_view"))
    conn.execute(
        text(
            "INSERT INTO balances_view (account_id, balance) "
            "SELECT account_id, sum(delta) FROM ledger GROUP BY account_id"
        )
    )


# --8<-- [end:no-reapplication]


# --8<-- [start:versioned-projection]
def declare_projection(version: int, queue: str) -> dramatiq.Actor:
    """Policy 2, versioned projection: the version is part of the consumer's name, so the
    new projection consumes every message once more, beside the old one's claims."""

    @dramatiq.actor(
        queue_name=queue,
        actor_name=f"project_credit_v{version}",
        inbox_consumer=f"balances-projection-v{version}",
        inbox_handler_version=str(version),
    )
    def project_credit(account_id: int, delta: int) -> None:
        current_session().execute(
            text(
                "INSERT INTO projection (version, account_id, balance) VALUES (:v, :a, :d) "
                "ON CONFLICT (version, account_id) DO UPDATE "
                "SET balance = projection.balance + :d"
            ),
            {"v": version, "a": account_id, "d": delta},
        )

    return project_credit


# --8<-- [end:versioned-projection]


# --8<-- [start:compensated-migration]
def compensate(
    add_credit: dramatiq.Actor, migration: str, corrections: Iterable[tuple[str, int, int]]
) -> None:
    """Policy 3, compensated migration: a controlled replay that sends each correction as
    an intent of its own, named by the migration and the message it corrects. Running the
    migration twice sends the same intents: each correction is applied once."""
    for message_id, account_id, missing in corrections:
        add_credit.send_with_options(
            args=(account_id, missing),
            **identity(producer=f"migration:{migration}", message_id=message_id),
        )


# --8<-- [end:compensated-migration]
