"""What a handler receives from the inbox: its transaction's session, and for a batch the
decision on each message.

The middleware opens the claim's transaction and sets the current attempt before
FastStream resolves the handler's dependencies, which read it back from here.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any

from fast_depends import Depends
from sqlalchemy.ext.asyncio import AsyncSession

from ..direct import DirectPublishPolicy
from ..exceptions import ConfigurationError, HandlerTransactionError
from ..identity import MessageIdentity
from ..protocol import Decision

__all__ = [
    "BatchItem",
    "InboxBatch",
    "InboxSession",
    "ManualSettling",
    "current_attempt",
    "refuse_manual_settling",
]


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One message of a batch, as the inbox decided it.

    The handler's body holds the first-seen messages only, in batch order; the items tell
    what became of every message, the skipped ones included.
    """

    index: int
    """Position in the batch as delivered."""
    decision: Decision | None
    """FIRST (in the handler's body), DUPLICATE or CONFLICT; None when it was rejected."""
    identity: MessageIdentity | None = None
    rejected: str | None = None
    """Why the message was rejected to the dead-letter destination."""


@dataclass(frozen=True, slots=True)
class Attempt:
    session: AsyncSession
    batch: tuple[BatchItem, ...] = ()
    consumer: str = ""
    direct_publish: DirectPublishPolicy = "warn"


_attempt: ContextVar[Attempt | None] = ContextVar("inbox_middleware_faststream", default=None)


def current_attempt() -> Attempt | None:
    return _attempt.get()


def set_attempt(attempt: Attempt | None) -> object:
    return _attempt.set(attempt)


def reset_attempt(token: object) -> None:
    _attempt.reset(token)  # type: ignore[arg-type]


_OUTSIDE = (
    "{what} is available only in a handler whose subscriber declares "
    "dependencies=[inbox.consumer(...)], on a broker created with "
    "middlewares=[inbox.middleware]"
)


async def _session() -> AsyncSession:
    # async: FastStream's dependency resolver runs a sync dependency in a worker thread
    attempt = _attempt.get()
    if attempt is None:
        raise ConfigurationError(_OUTSIDE.format(what="InboxSession"))
    return attempt.session


async def _batch() -> tuple[BatchItem, ...]:
    attempt = _attempt.get()
    if attempt is None:
        raise ConfigurationError(_OUTSIDE.format(what="InboxBatch"))
    return attempt.batch


InboxSession = Annotated[AsyncSession, Depends(_session, cast=False)]
"""The claim transaction's `AsyncSession`: what the handler writes through it commits
together with the message's claim, before the message is acknowledged. Its ``commit()``,
``rollback()`` and ``close()`` are refused; raise to abandon the message."""

InboxBatch = Annotated[tuple[BatchItem, ...], Depends(_batch, cast=False)]
"""In a batch handler: a `BatchItem` for every message of the batch, in delivery order."""


class ManualSettling:
    """While the handler runs, the message's ``ack``, ``nack`` and ``reject`` raise."""

    def __init__(self, message: Any) -> None:
        self.message = message
        self.saved = {
            name: message.__dict__[name]
            for name in ("ack", "nack", "reject")
            if name in getattr(message, "__dict__", {})
        }
        for name in ("ack", "nack", "reject"):
            setattr(message, name, partial(_refused, name))

    def restore(self) -> None:
        for name in ("ack", "nack", "reject"):
            if name in self.saved:
                setattr(self.message, name, self.saved[name])
            else:
                self.message.__dict__.pop(name, None)


def refuse_manual_settling(message: Any) -> ManualSettling:
    """Until ``restore()``, the message's own ``ack``, ``nack`` and ``reject`` raise."""
    return ManualSettling(message)


async def _refused(name: str, *args: Any, **kwargs: Any) -> None:
    exception = {"ack": "AckMessage", "nack": "NackMessage", "reject": "RejectMessage"}[name]
    raise HandlerTransactionError(
        f"the handler called message.{name}(), but the inbox settles this message itself, "
        f"after its commit or rollback: raise faststream.exceptions.{exception} instead"
    )
