"""The outbox's errors, under the library's root `InboxError`.

```
InboxError
└── OutboxError                   the outbox could not record, deliver or find an effect
    ├── EffectIdRequired          outbox.add outside an inbox handler without an effect_id
    ├── InvalidEffect             a destination name, payload or header that cannot be stored
    ├── EffectNotFound            no effect with that id (the command line)
    └── DeliveryError             a destination failed; the effect is retried with backoff
        └── PermanentDeliveryError  the remote refused; retrying cannot help: failed at once
```

A destination raises `DeliveryError` (or any exception: anything else counts as a
transient failure too) and `PermanentDeliveryError` for a refusal. Database errors are
classified by `inbox_middleware._storage.errors.classify`, the library's one mapping of
driver errors; `database_error` only words its result for the outbox.
"""

from __future__ import annotations

from typing import Any

from .._core.exceptions import DatabaseUnavailable, InboxError, TransactionConflict, TransientError
from .._storage.errors import Failure, classify

__all__ = [
    "DeliveryError",
    "EffectIdRequired",
    "EffectNotFound",
    "InvalidEffect",
    "OutboxError",
    "PermanentDeliveryError",
    "database_error",
]


class OutboxError(InboxError):
    """The outbox could not record, deliver or find an effect."""


class EffectIdRequired(OutboxError):
    """outbox.add needs an explicit effect_id outside an inbox handler.

    Inside a handler the effect id is derived from the message's inbox identity and the
    effect's index; elsewhere there is nothing stable to derive it from, and an id that
    changed between two attempts would let a retried transaction record the effect twice.
    """


class InvalidEffect(OutboxError):
    """The effect cannot be recorded: its destination, payload or headers are unusable."""


class EffectNotFound(OutboxError):
    """No effect has this id."""


class DeliveryError(OutboxError):
    """A destination could not deliver the effect; it is retried with backoff.

    ``result`` is what the remote answered, if anything, recorded with the error.
    """

    def __init__(self, message: str | None = None, *, result: Any = None) -> None:
        self.result = result
        super().__init__(message)


class PermanentDeliveryError(DeliveryError):
    """The remote refused the effect; retrying cannot help, so it fails at once."""


def database_error(exc: BaseException) -> TransientError | None:
    """The library's error for a database failure met by the dispatcher, or None."""
    failure = classify(exc)
    if failure is Failure.DISCONNECTED:
        return DatabaseUnavailable(f"the database is unavailable: {_first_line(exc)}")
    if failure in (Failure.SERIALIZATION, Failure.LOCK_TIMEOUT):
        return TransactionConflict(f"the outbox's transaction conflicted: {_first_line(exc)}")
    return None


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
