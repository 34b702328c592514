"""What an inbox actor's body uses: its transaction's session, and the identity options a
producer sends."""

from __future__ import annotations

from contextvars import ContextVar
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from .._core.exceptions import InboxError
from .._core.headers import message_options
from .._core.identity import MessageIdentity

if TYPE_CHECKING:  # SQLAlchemy's asyncio support needs greenlet: imported only when used
    from sqlalchemy.ext.asyncio import AsyncSession

__all__ = ["current_async_session", "current_session", "identity"]

CONSUMER_INFO = "inbox_middleware.consumer"
"""The key of the inbox consumer's name in the running actor's ``session.info``."""

session_var: ContextVar[Session | AsyncSession | None] = ContextVar(
    "inbox_middleware_session", default=None
)


def current_session() -> Session:
    """The session of the running inbox actor's transaction (sync actors).

    Everything executed through it commits together with the message's claim.
    """
    session = session_var.get()
    if isinstance(session, Session):
        return session
    if session is not None:
        raise InboxError("this actor is async; use current_async_session()")
    raise InboxError("current_session() works only inside an actor declared with inbox_consumer")


def current_async_session() -> AsyncSession:
    """The `AsyncSession` of the running inbox actor's transaction (``async def`` actors)."""
    session = session_var.get()
    if isinstance(session, Session):
        raise InboxError("this actor is not async; use current_session()")
    if session is not None:
        return session
    raise InboxError(
        "current_async_session() works only inside an actor declared with inbox_consumer"
    )


def identity(
    *,
    producer: str,
    message_id: str,
    tenant: str | None = None,
    produced_at: datetime | str | None = None,
) -> dict[str, Any]:
    """Message options carrying a producer intent id; validated here, at the producer.

    Typed ``dict[str, Any]`` so that ``**identity(...)`` type-checks next to
    ``send_with_options``' other keyword arguments.

    >>> add_credit.send_with_options(args=(7, 10), **identity(producer="orders", message_id="o-42"))
    """
    parsed = MessageIdentity.parse(
        producer=producer, message_id=message_id, tenant=tenant, produced_at=produced_at
    )
    produced = None if parsed.produced_at is None else parsed.produced_at.isoformat()
    return message_options(parsed.producer, parsed.message_id, parsed.tenant, produced)
