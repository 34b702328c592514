"""The broker middleware: routes each consumed message of an inbox subscriber through its
`Subscription`, and lets every other message through untouched."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextvars import Token
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from faststream import BaseMiddleware
from faststream.message import SourceType

from .._core import direct, logs
from ._context import current_attempt
from ._telling import QuietTold

if TYPE_CHECKING:
    from faststream._internal.context.repository import ContextRepo
    from faststream.message import StreamMessage

    from ._processing import Subscription

__all__ = ["InboxMiddlewareFactory", "RoutingMiddleware"]


class Subscriptions(Protocol):
    """What the middleware asks of its `FastStreamInbox` (which builds the middleware, so
    this module does not import it)."""

    async def subscription_for(self, subscriber: Any, broker: Any) -> Subscription | None: ...

    async def hold(self, broker: Any, subscriber: Any, message: Any, error: Exception) -> Any: ...


class RoutingMiddleware(BaseMiddleware):
    """One message's pass through the inbox (FastStream builds one per message)."""

    def __init__(self, msg: Any, /, *, context: ContextRepo, inbox: Subscriptions) -> None:
        super().__init__(msg, context=context)
        self.inbox = inbox
        self.finish: list[Any] = []
        self.logs: Token[logging.Logger | None] | None = None

    async def consume_scope(
        self, call_next: Callable[[Any], Awaitable[Any]], msg: StreamMessage[Any]
    ) -> Any:
        subscriber = self.context.get_local("handler_")
        if (
            subscriber is None
            or msg.source_type is not SourceType.CONSUME
            # A message consumed inside an inbox handler (an RPC reply, get_one) belongs
            # to that handler's transaction, not to a claim of its own.
            or current_attempt() is not None
        ):
            return await call_next(msg)
        broker = self.context.get_local("broker")
        framework = _framework_logger(broker)
        if framework is not None:
            QuietTold.install(framework)
        self.logs = logs.scope(framework)  # the inbox's lines carry queue and message id
        try:
            subscription = await self.inbox.subscription_for(subscriber, broker)
        except Exception as exc:
            # Refused, or the start-up check failed: the message waits with the broker
            # (handed back: this raises, as the settlement of any message does).
            return await self.inbox.hold(broker, subscriber, msg, exc)
        if subscription is None:
            return await call_next(msg)
        return await subscription.consume(call_next, msg, self.finish)

    async def publish_scope(self, call_next: Callable[[Any], Awaitable[Any]], cmd: Any) -> Any:
        attempt = current_attempt()
        if attempt is not None:  # the handler publishes before its transaction commits
            where = getattr(cmd, "destination", None) or "a destination"
            direct.check(attempt.direct_publish, attempt.consumer, f"a publish to {where!r}")
        return await call_next(cmd)

    async def after_processed(
        self,
        exc_type: type[BaseException] | None = None,
        exc_val: BaseException | None = None,
        exc_tb: TracebackType | None = None,
    ) -> bool | None:
        # FastStream publishes a handler's result after the consume scope and before the
        # middlewares exit: a delivery whose outputs it published is acknowledged here.
        try:
            for finish in self.finish:
                await finish(exc_val)
        finally:
            if self.logs is not None:
                logs.leave(self.logs)
        return False


def _framework_logger(broker: Any) -> logging.Logger | None:
    """The logger FastStream writes a subscriber's lines with ("Received", "Processed"),
    when it is a standard one."""
    state = getattr(getattr(broker, "config", None), "logger", None)
    found = getattr(getattr(state, "logger", None), "logger", None)
    return found if isinstance(found, logging.Logger) else None


class InboxMiddlewareFactory:
    """What the broker is given (``middlewares=[inbox.middleware]``): FastStream calls it
    once per message to build a `RoutingMiddleware`."""

    def __init__(self, inbox: Subscriptions) -> None:
        self.inbox = inbox

    def __call__(self, msg: Any, /, *, context: ContextRepo) -> RoutingMiddleware:
        return RoutingMiddleware(msg, context=context, inbox=self.inbox)

    def __repr__(self) -> str:
        return "inbox.middleware"
