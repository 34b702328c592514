"""What a destination is: the `Effect` it receives, the `Destination` interface, and the
`Destinations` registry a dispatcher delivers through.

A destination turns one effect into one remote call and passes ``effect.effect_id``
along as the idempotency key (an ``Idempotency-Key`` header, a message's inbox
identity, ...). It may be called again for the same effect after a timeout, a crash or a
lost lease, so the remote must deduplicate on that key: that, not the dispatcher, is
what makes the effect happen once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from .._core.exceptions import ConfigurationError, IdentityError
from .._core.identity import MAX_NAME_LENGTH, validate_name

__all__ = ["Destination", "Destinations", "Effect", "validate_destination"]


@dataclass(frozen=True, slots=True)
class Effect:
    """One effect as the dispatcher hands it to a destination."""

    effect_id: str
    """Stable id of the effect: the idempotency key to give the remote."""
    destination: str
    payload: Any
    """The JSON value given to `outbox.add`."""
    headers: Mapping[str, str] = field(default_factory=dict)
    attempt: int = 1
    """1 for the first delivery attempt, 2 for the first retry, ..."""
    created_at: datetime | None = None


@runtime_checkable
class Destination(Protocol):
    """Where effects of one destination name are delivered.

    ``deliver`` must finish within ``timeout`` seconds (the dispatcher also cancels it
    then) and either return the remote's answer, a JSON value recorded as the effect's
    ``remote_result``, or raise: `PermanentDeliveryError` when retrying cannot help
    (the effect fails at once), anything else to be retried with backoff. A timeout is
    ambiguous (the remote may have applied the effect): the retry carries the same
    effect id, which the remote uses to answer without applying it again.

    A destination that holds connections may also define ``async def aclose()``; the
    dispatcher calls it when it stops.
    """

    async def deliver(self, effect: Effect, timeout: float) -> Any: ...


def validate_destination(name: object) -> str:
    try:
        return validate_name(name, "destination", max_length=MAX_NAME_LENGTH)
    except IdentityError as exc:
        raise ConfigurationError(str(exc)) from None


class Destinations(Mapping[str, Destination]):
    """Named destinations: ``Destinations({"email": EmailDestination(...)})``.

    A dispatcher leases only effects whose destination it has, so dispatchers can be
    split by destination; an effect for a name no dispatcher knows stays pending and
    shows in ``inbox-middleware outbox list``.
    """

    def __init__(self, destinations: Mapping[str, Destination] | None = None) -> None:
        self._destinations: dict[str, Destination] = {}
        for name, destination in (destinations or {}).items():
            self.register(name, destination)

    def register(self, name: str, destination: Destination) -> Destination:
        """Deliver effects recorded for ``name`` through ``destination``; returns it."""
        name = validate_destination(name)
        if not callable(getattr(destination, "deliver", None)):
            raise ConfigurationError(
                f"destination {name!r} has no deliver(effect, timeout) method: "
                f"got {type(destination).__name__}"
            )
        if name in self._destinations:
            raise ConfigurationError(f"destination {name!r} is registered twice")
        self._destinations[name] = destination
        return destination

    def __getitem__(self, name: str) -> Destination:
        return self._destinations[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._destinations)

    def __len__(self) -> int:
        return len(self._destinations)

    async def aclose(self) -> None:
        """Close every destination that holds resources (has ``aclose``)."""
        for destination in self._destinations.values():
            close: Any = getattr(destination, "aclose", None)
            if callable(close):
                await close()
