"""The subscriber dependency that names an inbox consumer: ``inbox.consumer("billing")``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._core.exceptions import ConfigurationError
from .._core.policy import MissingIdentityPolicy
from ._context import current_attempt
from ._payload import CanonicalForm

__all__ = ["UNSET", "InboxConsumer", "MissingIdentityPolicy", "declared_by", "resolved_no_more"]


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()


@dataclass(frozen=True, slots=True, eq=False)
class InboxConsumer:
    """A subscriber's inbox declaration; also a dependency FastStream resolves per call.

    Resolving it checks that the inbox middleware is running this message, so a handler
    whose broker lacks ``middlewares=[inbox.middleware]`` fails instead of running
    unprotected. Where the middleware runs the subscriber's messages, it takes the
    dependency off the subscriber's calls at the first one (`resolved_no_more`).
    """

    inbox: object
    """The `FastStreamInbox` that declared it (which imports this module)."""
    name: str
    handler_version: str = ""
    canonical_form: CanonicalForm | None = None
    quarantine: str | None = None
    dead_letter: str | _Unset | None = UNSET
    settings: Mapping[str, Any] = field(default_factory=dict)
    """The `ConsumerPolicy` settings this subscriber overrides."""

    async def __call__(self) -> None:  # async: a sync one would run in a worker thread
        if current_attempt() is None:
            raise ConfigurationError(
                f"inbox consumer {self.name!r} is not running under the inbox middleware: "
                "create the broker with middlewares=[inbox.middleware]"
            )

    def __repr__(self) -> str:
        return f"inbox.consumer({self.name!r})"


def declared_by(value: object, owner: object) -> bool:
    """Whether ``value`` is an `InboxConsumer` that ``owner`` (a `FastStreamInbox`) made."""
    return isinstance(value, InboxConsumer) and value.inbox is owner


def resolved_no_more(subscriber: Any, owner: object) -> bool:
    """Stop FastStream resolving ``owner``'s `InboxConsumer` for each message of
    ``subscriber``, a subscriber whose messages the inbox's middleware settles: whether
    done (False while FastStream has not built its handlers' calls yet).

    What the dependency checks at each call, that the middleware runs the message, the
    middleware has shown for every message of this subscriber, before the handler runs:
    resolving it again costs FastStream's resolver (fast_depends) a nested solve a
    message, about 25 µs of the event loop's time. Only the subscriber's own calls lose
    it, so a handler subscribed on a broker without the middleware still fails. A call
    built otherwise (FastStream's FastAPI integration builds FastAPI's dependant) keeps
    it.
    """
    models: list[Any] = [getattr(call, "dependant", None) for call in subscriber.calls]
    if not models or None in models:
        return False
    for model in models:
        keys = getattr(model, "extra_dependencies", None)
        if isinstance(keys, tuple):
            model.extra_dependencies = tuple(key for key in keys if not declared_by(key, owner))
    return True
