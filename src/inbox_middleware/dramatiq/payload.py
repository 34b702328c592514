"""From a Dramatiq message to a `Delivery`: its identity and its canonical payload.

Dramatiq messages have no headers, so the identity travels in ``message.options``. The
canonical payload is the actor name with the arguments bound to the function's
signature: ``add_credit(7, 10)`` and ``add_credit(account_id=7, delta=10)`` hash alike.
``options`` are never hashed, because retries and brokers rewrite them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from dramatiq import Message
from dramatiq.broker import MessageProxy

from ..exceptions import PayloadNotHashable
from ..identity import MessageIdentity, PayloadHash, canonical_json, hash_bytes, hash_json
from ..protocol import Delivery

__all__ = [
    "BROKER_ID_PRODUCER",
    "OPTION_MESSAGE_ID",
    "OPTION_PRODUCED_AT",
    "OPTION_PRODUCER",
    "OPTION_TENANT",
    "SCHEME",
    "ActorPayload",
    "CanonicalForm",
    "identity_options",
]

OPTION_PRODUCER = "inbox_producer"
OPTION_MESSAGE_ID = "inbox_message_id"
OPTION_TENANT = "inbox_tenant"
OPTION_PRODUCED_AT = "inbox_produced_at"

SCHEME = "dramatiq.v1"
"""Canonical JSON of ``{"actor": name, "args": {parameter: value}}``, SHA-256."""

BROKER_ID_PRODUCER = "dramatiq.message_id"
"""The producer name recorded when the opt-in ``missing_identity="broker_id"`` is used."""

# Options that describe delivery, not intent, and are noise in a quarantine record.
_VOLATILE_OPTIONS = frozenset({"traceback", "redis_message_id", "requeue_timestamp"})


@dataclass(frozen=True, slots=True)
class CanonicalForm:
    """A user-supplied canonical form for an actor's payload.

    ``function`` receives the actor name and the bound arguments and returns bytes, or a
    JSON value to canonicalise. ``scheme`` names the form; change it whenever the form
    changes, so a stored hash is never compared with a hash of another form.
    """

    scheme: str
    function: Callable[[str, dict[str, Any]], object]


class ActorPayload:
    """Binds and hashes one actor's arguments."""

    def __init__(
        self, actor_name: str, fn: Callable[..., Any], canonical: CanonicalForm | None
    ) -> None:
        self.actor_name = actor_name
        self.signature = inspect.signature(fn)
        self.canonical = canonical
        # The usual call, positional arguments filling plain parameters, binds by zip;
        # anything else (keywords, defaults left out, *args) goes through Signature.bind.
        plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        parameters = list(self.signature.parameters.values())
        self._positional = (
            tuple(p.name for p in parameters) if all(p.kind in plain for p in parameters) else None
        )

    def arguments(self, message: Message[Any] | MessageProxy) -> dict[str, Any]:
        names, args = self._positional, message.args
        if names is not None and not message.kwargs and len(args) == len(names):
            return dict(zip(names, args, strict=True))
        try:
            bound = self.signature.bind(*message.args, **message.kwargs)
        except TypeError as exc:
            parameters = ", ".join(self.signature.parameters)
            raise PayloadNotHashable(
                f"the arguments do not match {self.actor_name}({parameters}): {exc}"
            ) from None
        return dict(bound.arguments)

    def hash(self, arguments: dict[str, Any]) -> PayloadHash:
        if self.canonical is None:
            return self.builtin(arguments)
        form = self.canonical.function(self.actor_name, arguments)
        scheme = f"custom:{self.canonical.scheme}"
        return hash_bytes(form, scheme) if isinstance(form, bytes) else hash_json(form, scheme)

    def builtin(self, arguments: dict[str, Any]) -> PayloadHash:
        return hash_bytes(canonical_json({"actor": self.actor_name, "args": arguments}), SCHEME)

    def delivery(
        self,
        message: Message[Any] | MessageProxy,
        identity: MessageIdentity,
        *,
        consumer: str,
        handler_version: str,
    ) -> Delivery:
        arguments = self.arguments(message)
        payload_hash = self.hash(arguments)

        def rehash(scheme: str) -> str | None:
            return self.builtin(arguments).sha256 if scheme == SCHEME else None

        return Delivery(
            consumer=consumer,
            identity=identity,
            payload_hash=payload_hash,
            handler_version=handler_version,
            source=message.queue_name,
            payload=lambda: _kept(message),  # encoded only if a conflict or a failure keeps it
            payload_format="dramatiq",
            headers=_Options(message.options),
            received_at=datetime.now(UTC),
            rehash=rehash,
        )


def _kept(message: Message[Any] | MessageProxy) -> bytes:
    """The message as a row keeps it: without the options that describe one delivery
    (Dramatiq's Retries middleware adds the last failure's whole traceback)."""
    inner = message._message if isinstance(message, MessageProxy) else message
    options = {
        name: value for name, value in inner.options.items() if name not in _VOLATILE_OPTIONS
    }
    return dataclasses.replace(inner, options=options).encode()


def identity_options(options: Mapping[str, Any]) -> MessageIdentity:
    """Read and validate the identity a producer put in ``message.options``."""
    return MessageIdentity.parse(
        producer=options.get(OPTION_PRODUCER),
        message_id=options.get(OPTION_MESSAGE_ID),
        tenant=options.get(OPTION_TENANT),
        produced_at=options.get(OPTION_PRODUCED_AT),
        names=_OPTION_NAMES,
    )


_OPTION_NAMES = {
    "producer": OPTION_PRODUCER,
    "message_id": OPTION_MESSAGE_ID,
    "tenant": OPTION_TENANT,
    "produced_at": OPTION_PRODUCED_AT,
}


class _Options(Mapping[str, Any]):
    """The message's options without those that describe a delivery, read only when a
    row keeps them (building a filtered copy per message would cost every message)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self._options = options

    def __getitem__(self, name: str) -> Any:
        if name in _VOLATILE_OPTIONS:
            raise KeyError(name)
        return self._options[name]

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._options if name not in _VOLATILE_OPTIONS)

    def __len__(self) -> int:
        return sum(1 for _ in self)
