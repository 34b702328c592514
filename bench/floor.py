"""The least the guarantee adds to a handler's transaction: its statements alone.

`Floor.run` is what an inbox would do if it were nothing but its statements: the claim
sent with the transaction's BEGIN in one round trip (as the statement prepared on the
server, as the inbox sends it), the handler's update when the claim is first seen (the
stored claim looked up when not, so that the checked COMMIT passes), the checked COMMIT;
no core, no settlement, no metrics, no logs, no traces, no guard on the handler's
transaction. It uses the library's own statements and driver calls, so it sends what
the inbox sends. Its CPU above bare is what a leaner inbox could come down to with the
same statements, the same round trips and the same session; the inbox's above it is what
the inbox's layers cost.

Used by ``python -m bench.hotpath --floor`` (both drivers) and the FastStream
benchmark's ``floor`` mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from inbox_middleware._core.protocol import Claim, Delivery, LookUp
from inbox_middleware._storage import InboxSchema
from inbox_middleware._storage.driver import commit_checked, on_driver
from inbox_middleware._storage.executors import DEFAULT_LOCK_TIMEOUT
from inbox_middleware._storage.statements import ClaimStatements


class Floor:
    """The guarantee's statements for one dialect, compiled once."""

    def __init__(self, dialect: Any) -> None:
        self.statements = ClaimStatements(InboxSchema(), "postgresql", DEFAULT_LOCK_TIMEOUT)
        self.compiled = self.statements.driver_sql(dialect)

    def run(self, session: Session, delivery: Delivery, update: Callable[[Session], Any]) -> None:
        """Claim ``delivery`` in a new transaction of ``session``, run ``update`` in it when
        first seen, and commit with the claim's check. For an `AsyncSession`, call it
        through ``run_sync``, as the inbox runs its transaction."""
        conn = session.connection()
        dbapi = conn.connection.dbapi_connection
        claim = Claim(delivery)
        _, params = self.statements.statement(claim)
        if on_driver(conn, dbapi, self.compiled[Claim], claim, params):  # first seen
            update(session)
        else:
            look_up = LookUp(delivery)
            _, params = self.statements.statement(look_up)
            on_driver(conn, dbapi, self.compiled[LookUp], look_up, params)
        commit_checked(conn)
        session.commit()
