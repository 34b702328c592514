"""The session a handler receives: it joins the claim's transaction and cannot end it."""

from __future__ import annotations

from typing import NoReturn

from sqlalchemy.orm import Session

from .._core.exceptions import HandlerTransactionError

__all__ = ["ClaimSession"]


class ClaimSession(Session):
    """A `Session` inside the inbox's transaction.

    The claim row and everything the handler writes commit together, after the handler
    returns; an exception from the handler rolls both back. Ending the transaction early
    would split them (a committed claim without its effects, or effects without a claim),
    so `commit`, `rollback`, `close`, `invalidate` and `reset` raise
    `HandlerTransactionError`; so do the connection's own ``commit()`` and ``rollback()``
    and a ``COMMIT`` or ``ROLLBACK`` statement (see `base.guard_transaction`).

    Savepoints are fine: ``with session.begin_nested(): ...`` rolls back only its own
    block. To write through your own sessionmaker or repository, bind it to this
    session's connection (see the "join the inbox transaction" guide).

    The async handler receives an `AsyncSession` whose ``sync_session`` is one of these,
    so its ``await session.commit()`` is refused the same way.
    """

    def commit(self) -> NoReturn:
        raise HandlerTransactionError(
            "the handler called commit(); the inbox commits when the handler returns"
        )

    def rollback(self) -> NoReturn:
        raise HandlerTransactionError(
            "the handler called rollback(); raise an exception to abandon the message"
        )

    def close(self) -> NoReturn:
        raise HandlerTransactionError("the handler called close(); the inbox owns this session")

    def invalidate(self) -> NoReturn:
        raise HandlerTransactionError(
            "the handler called invalidate(); raise an exception to abandon the message"
        )

    def reset(self) -> NoReturn:
        raise HandlerTransactionError("the handler called reset(); the inbox owns this session")
