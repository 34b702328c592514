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

On an `AsyncSession`, `Floor.run_async` awaits the update between the claim's ``run_sync``
and the commit's, as an async handler awaits its statements and as the inbox runs them;
`Floor.run` in one ``run_sync`` is cheaper still, but no async handler is written so.

Used by ``python -m bench.hotpath --floor`` (both drivers; on asyncpg, `run_async`) and
the FastStream benchmark's ``floor`` (`run_async`) and ``floor_sync`` (`run`) modes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession
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
        first seen, and commit with the claim's check."""
        if self.claim(session, delivery):
            update(session)
        else:
            self.look_up(session, delivery)
        self.commit(session)

    async def run_async(
        self,
        session: AsyncSession,
        delivery: Delivery,
        update: Callable[[AsyncSession], Awaitable[Any]],
    ) -> None:
        """`run` on an `AsyncSession`, the update awaited on it as an async handler awaits
        its statements: the claim and the commit each in a ``run_sync`` of their own, as
        the inbox runs them (a handler's awaits cannot run inside one)."""
        if await session.run_sync(self.claim, delivery):
            await update(session)
        else:
            await session.run_sync(self.look_up, delivery)
        await session.run_sync(self.commit)

    def claim(self, session: Session, delivery: Delivery) -> bool:
        """BEGIN and the claim in one round trip: whether ``delivery`` is first seen."""
        conn = session.connection()
        claim = Claim(delivery)
        _, params = self.statements.statement(claim)
        dbapi = conn.connection.dbapi_connection
        return bool(on_driver(conn, dbapi, self.compiled[Claim], claim, params))

    def look_up(self, session: Session, delivery: Delivery) -> None:
        """The stored claim, read (its mark lets the checked COMMIT pass)."""
        conn = session.connection()
        look_up = LookUp(delivery)
        _, params = self.statements.statement(look_up)
        on_driver(conn, conn.connection.dbapi_connection, self.compiled[LookUp], look_up, params)

    @staticmethod
    def commit(session: Session) -> None:
        """The checked COMMIT, then the session's own."""
        commit_checked(session.connection())
        session.commit()
