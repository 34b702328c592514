"""The subscriber dependency that names an inbox consumer: ``inbox.consumer("billing")``."""

from __future__ import annotations

from dataclasses import dataclass

from ..exceptions import ConfigurationError
from ..policy import MissingIdentityPolicy
from .context import current_attempt
from .payload import CanonicalForm

__all__ = ["UNSET", "InboxConsumer", "MissingIdentityPolicy", "check_policy"]


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()


@dataclass(frozen=True, slots=True, eq=False)
class InboxConsumer:
    """A subscriber's inbox declaration; also the dependency FastStream resolves per call.

    Resolving it checks that the inbox middleware is running this message, so a handler
    whose broker lacks ``middlewares=[inbox.middleware]`` fails instead of running
    unprotected.
    """

    inbox: object
    """The `FastStreamInbox` that declared it (which imports this module)."""
    name: str
    handler_version: str = ""
    missing_identity: MissingIdentityPolicy | None = None
    canonical_form: CanonicalForm | None = None
    quarantine: str | None = None
    dead_letter: str | _Unset | None = UNSET
    shadow: bool | None = None
    """Shadow mode for this subscriber; None: the inbox's setting."""

    async def __call__(self) -> None:  # async: a sync one would run in a worker thread
        if current_attempt() is None:
            raise ConfigurationError(
                f"inbox consumer {self.name!r} is not running under the inbox middleware: "
                "create the broker with middlewares=[inbox.middleware]"
            )

    def __repr__(self) -> str:
        return f"inbox.consumer({self.name!r})"


def check_policy(value: object) -> MissingIdentityPolicy:
    if value not in ("reject", "process", "broker_id"):
        raise ConfigurationError(
            f"missing_identity must be 'reject', 'process' or 'broker_id', not {value!r}"
        )
    return value
