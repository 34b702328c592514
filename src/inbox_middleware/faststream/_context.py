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

from .._core.direct import DirectPublishPolicy
from .._core.exceptions import ConfigurationError, HandlerTransactionError
from .._core.identity import MessageIdentity
from .._core.protocol import Decision

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


# Every method of FastStream's message classes that settles the message with the broker
# (RabbitMQ, Redis streams, NATS JetStream, Kafka): ``ack_sync`` is NATS's, ``delete``
# removes a Redis stream entry. NATS's ``in_progress`` only extends the ack deadline.
_SETTLING = ("ack", "ack_sync", "nack", "reject", "delete")
# The same on the drivers' own messages (``msg.raw_message``), where they can be refused:
# nats-py's `Msg`. aio-pika's message has no room for it (slots): its settlement is
# detected instead (`ManualSettling.settled_behind`).
_RAW_SETTLING = ("ack", "ack_sync", "nak", "term")
# Kafka's message carries its consumer, whose offset commit settles every message read.
_CONSUMER_SETTLING = ("commit",)
_INSTEAD = {
    "commit": "AckMessage",
    "ack": "AckMessage",
    "ack_sync": "AckMessage",
    "nack": "NackMessage",
    "nak": "NackMessage",
    "reject": "RejectMessage",
    "term": "RejectMessage",
    "delete": "RejectMessage",
}


class ManualSettling:
    """While the handler runs, every settling method of the messages it can reach raises:
    FastStream's message (and, for a batch, the original one in FastStream's context as
    well as the view the handler decodes), and the drivers' messages that allow it."""

    def __init__(self, *messages: Any) -> None:
        self.saved: list[tuple[Any, dict[str, Any], tuple[str, ...]]] = []
        self.raws: list[Any] = []
        seen: set[int] = set()
        for message in messages:
            if message is None or id(message) in seen:
                continue
            seen.add(id(message))
            self._refuse(message, _SETTLING, "message")
            self._refuse_consumer(message)
            raw = getattr(message, "raw_message", None)
            for one in raw if isinstance(raw, list | tuple) else (raw,):
                if one is not None and id(one) not in seen:
                    seen.add(id(one))
                    if not _settled(one):  # a test broker's may come settled already
                        self.raws.append(one)
                    self._refuse(one, _RAW_SETTLING, "message.raw_message")

    def _refuse(self, target: Any, names: tuple[str, ...], owner: str) -> None:
        own = getattr(target, "__dict__", None)
        if own is None:
            return  # no instance attributes (slots): see settled_behind
        present = tuple(name for name in names if callable(getattr(target, name, None)))
        self.saved.append((target, {name: own[name] for name in present if name in own}, present))
        for name in present:  # in the instance's dict: past a __setattr__ that refuses
            own[name] = partial(_refused, owner, name)

    def _refuse_consumer(self, message: Any) -> None:
        # The consumer is shared with the subscriber's other messages (the inbox commits
        # their offsets meanwhile): this message's reference to it is swapped for one
        # that refuses, never the consumer itself.
        own = getattr(message, "__dict__", None)
        if own is None:
            return
        consumer = own.get("consumer")
        if consumer is None or not callable(getattr(consumer, "commit", None)):
            return
        self.saved.append((message, {"consumer": consumer}, ("consumer",)))
        own["consumer"] = _RefusingConsumer(consumer)

    def settled_behind(self) -> str | None:
        """Why a driver's message was settled behind the inbox while the handler ran (the
        driver says so), or None. It cannot be undone: the broker has forgotten it."""
        for raw in self.raws:
            if _settled(raw):
                return (
                    "the handler settled message.raw_message itself (the driver's own "
                    "message), so the broker no longer holds it: the attempt is rolled back "
                    "and the message kept as poison with its payload. Raise "
                    "faststream.exceptions.AckMessage, NackMessage or RejectMessage instead"
                )
        return None

    def restore(self) -> None:
        for target, saved, present in self.saved:
            own = target.__dict__
            for name in present:
                if name in saved:
                    own[name] = saved[name]
                else:
                    own.pop(name, None)


def refuse_manual_settling(*messages: Any) -> ManualSettling:
    """Until ``restore()``, the settling methods of ``messages`` (and of their drivers'
    messages) raise."""
    return ManualSettling(*messages)


def _settled(raw: Any) -> bool:
    """Whether the driver says its message was settled: aio-pika's ``processed``,
    nats-py's ``_ackd``."""
    return getattr(raw, "processed", False) is True or getattr(raw, "_ackd", False) is True


class _RefusingConsumer:
    """A Kafka consumer as the handler's message holds it: its offset commit raises,
    everything else is the consumer's."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer
        for name in _CONSUMER_SETTLING:
            setattr(self, name, partial(_refused, "message.consumer", name))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


async def _refused(owner: str, name: str, *args: Any, **kwargs: Any) -> None:
    raise HandlerTransactionError(
        f"the handler called {owner}.{name}(), but the inbox settles this message itself, "
        f"after its commit or rollback: raise faststream.exceptions.{_INSTEAD[name]} instead"
    )
