"""From a Dramatiq message to a `Delivery`: its identity and its canonical payload.

Dramatiq messages have no headers, so the identity travels in ``message.options``, or in
one of the arguments when the actor says which (``inbox_message_id_from``, with
``inbox_producer`` beside it; see `ArgumentIdentity`). The canonical payload is the actor
name with the arguments bound to the function's signature: ``add_credit(7, 10)`` and
``add_credit(account_id=7, delta=10)`` hash alike. ``options`` are never hashed, because
retries and brokers rewrite them.

Schemes: ``dramatiq.v2`` is the canonical form of `inbox_middleware._core.canonical` (RFC 8785)
of ``{"actor": name, "args": {parameter: value}}``; claims hashed by ``dramatiq.v1`` (the
frozen `inbox_middleware._core.canonical_v1`) are still compared under it.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from dramatiq import Message
from dramatiq.broker import MessageProxy

from .._core import canonical_v1
from .._core.canonical import CanonicalForm, canonical_json
from .._core.exceptions import (
    ConfigurationError,
    InvalidIdentity,
    MissingIdentity,
    PayloadNotHashable,
)
from .._core.headers import OPTION_MESSAGE_ID, OPTION_PRODUCED_AT, OPTION_PRODUCER, OPTION_TENANT
from .._core.identity import (
    MAX_NAME_LENGTH,
    MessageIdentity,
    PayloadHash,
    hash_bytes,
    validate_name,
)
from .._core.protocol import Delivery

__all__ = [
    "BROKER_ID_PRODUCER",
    "OPTION_MESSAGE_ID",
    "OPTION_MESSAGE_ID_FROM",
    "OPTION_PRODUCED_AT",
    "OPTION_PRODUCER",
    "OPTION_TENANT",
    "SCHEME",
    "V1_SCHEME",
    "ActorIdentity",
    "ActorPayload",
    "CanonicalForm",
    "actor_identity",
    "id_text",
    "identity_options",
]

OPTION_MESSAGE_ID_FROM = "inbox_message_id_from"
"""The actor option naming the argument that is the message id."""

SCHEME = "dramatiq.v2"
"""RFC 8785 canonical JSON of ``{"actor": name, "args": {parameter: value}}``, SHA-256."""

V1_SCHEME = "dramatiq.v1"
"""The v1 canonical JSON of the same object: claims hashed by it are compared under it."""

BROKER_ID_PRODUCER = "dramatiq.message_id"
"""The producer name recorded when the opt-in ``missing_identity="broker_id"`` is used."""

# Options that describe delivery, not intent, and are noise in a quarantine record.
_VOLATILE_OPTIONS = frozenset({"traceback", "redis_message_id", "requeue_timestamp"})


@dataclass(frozen=True, slots=True)
class ActorIdentity:
    """Where an actor's messages carry their identity when their options do not: the
    actor options ``inbox_producer`` (the producer's name) and ``inbox_message_id_from``
    (the argument that is the intent id), validated at declaration by `actor_identity`::

        @dramatiq.actor(inbox_consumer="billing", inbox_producer="orders",
                        inbox_message_id_from="order_id")
        def add_credit(order_id: str, account_id: int, amount: int) -> None: ...

        add_credit.send("ord-42", 7, 10)   # identity ("orders", "ord-42"); no options needed

    An identity in the message's options always wins: ``inbox_message_id`` over the
    argument, ``inbox_producer`` over the actor's.
    """

    actor_name: str
    producer: str | None
    parameter: str | None

    def read(
        self, options: Mapping[str, Any], arguments: Callable[[], Mapping[str, Any]]
    ) -> MessageIdentity:
        """The message's identity; ``arguments`` binds the call, only if it is needed."""
        if self.producer is not None and options.get(OPTION_PRODUCER) is None:
            options = {**options, OPTION_PRODUCER: self.producer}
        if self.parameter is None or options.get(OPTION_MESSAGE_ID) is not None:
            return identity_options(options)
        bound = arguments()
        if self.parameter not in bound:
            raise MissingIdentity(
                f"the message has no {OPTION_MESSAGE_ID} and the call to {self.actor_name} "
                f"has no argument {self.parameter!r} (its {OPTION_MESSAGE_ID_FROM})",
                field=OPTION_MESSAGE_ID,
            )
        message_id = id_text(bound[self.parameter], f"argument {self.parameter!r}")
        return identity_options({**options, OPTION_MESSAGE_ID: message_id})


def id_text(value: object, field: str) -> str:
    """An argument's value as a message id: text as it is, an integer (not a bool) or a
    UUID as its usual text; anything else is refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(int(value))
    if isinstance(value, UUID):
        return str(value)
    raise InvalidIdentity(
        f"{field} is a {type(value).__name__}; a message id is text, an integer or a UUID",
        field=OPTION_MESSAGE_ID,
    )


def actor_identity(
    actor_name: str, fn: Callable[..., Any], options: Mapping[str, Any]
) -> ActorIdentity | None:
    """Validate an actor's ``inbox_producer`` and ``inbox_message_id_from`` options against
    its function's signature; None when it declares neither.

    Raises `ConfigurationError`: the producer is not a valid name, the argument is not a
    named parameter of the function (``*args`` and ``**kwargs`` cannot carry it), or
    ``inbox_message_id_from`` is given without ``inbox_producer``.
    """
    producer = options.get(OPTION_PRODUCER)
    parameter = options.get(OPTION_MESSAGE_ID_FROM)
    if producer is None and parameter is None:
        return None
    where = f"actor {actor_name!r}"
    if producer is not None:
        try:
            validate_name(producer, OPTION_PRODUCER, max_length=MAX_NAME_LENGTH)
        except InvalidIdentity as exc:
            raise ConfigurationError(f"{where}: {exc}") from None
    if parameter is not None:
        if producer is None:
            raise ConfigurationError(
                f"{where} declares {OPTION_MESSAGE_ID_FROM} without {OPTION_PRODUCER}: "
                "name the producer whose ids that argument holds"
            )
        named = {
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        }
        if parameter not in named:
            raise ConfigurationError(
                f"{where}: {OPTION_MESSAGE_ID_FROM}={parameter!r} is not a named parameter "
                f"of {actor_name}({', '.join(inspect.signature(fn).parameters)})"
            )
    return ActorIdentity(actor_name, producer, parameter)


class ActorPayload:
    """Binds and hashes one actor's arguments, and reads its messages' identity."""

    def __init__(
        self,
        actor_name: str,
        fn: Callable[..., Any],
        canonical: CanonicalForm | None,
        identity: ActorIdentity | None = None,
    ) -> None:
        self.actor_name = actor_name
        self.signature = inspect.signature(fn)
        self.canonical = canonical
        self.identity = identity
        # The usual call, positional arguments filling plain parameters, binds by zip;
        # anything else (keywords, defaults left out, *args) goes through Signature.bind.
        plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        parameters = list(self.signature.parameters.values())
        self._positional = (
            tuple(p.name for p in parameters) if all(p.kind in plain for p in parameters) else None
        )

    def message_identity(self, message: Message[Any] | MessageProxy) -> MessageIdentity:
        """The identity in the message's options, else where the actor declares it."""
        if self.identity is None:
            return identity_options(message.options)
        return self.identity.read(message.options, lambda: self.arguments(message))

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
        if isinstance(form, bytes):
            return hash_bytes(form, f"custom:{self.canonical.scheme}")
        return hash_bytes(canonical_json(form), f"custom.v2:{self.canonical.scheme}")

    def builtin(self, arguments: dict[str, Any]) -> PayloadHash:
        return hash_bytes(canonical_json({"actor": self.actor_name, "args": arguments}), SCHEME)

    def rehash(self, arguments: dict[str, Any], scheme: str) -> str | None:
        """The digest of these arguments under an older ``scheme``: None when it is not
        one this version knows, ``""`` (equal to no digest) when the arguments have no
        form under it, so they cannot be the payload a claim hashed by it holds."""
        try:
            if scheme == SCHEME:
                return self.builtin(arguments).sha256
            if scheme == V1_SCHEME:
                form = {"actor": self.actor_name, "args": arguments}
                return hash_bytes(canonical_v1.canonical_json(form), scheme).sha256
            if self.canonical is not None:
                return _custom_rehash(self.canonical, self.actor_name, arguments, scheme)
        except PayloadNotHashable:
            return ""
        return None

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
            return self.rehash(arguments, scheme)

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


def _custom_rehash(
    canonical: CanonicalForm, actor_name: str, arguments: dict[str, Any], scheme: str
) -> str | None:
    form = canonical.function(actor_name, arguments)
    if scheme == f"custom:{canonical.scheme}":  # bytes, or a JSON value hashed by v1
        data = form if isinstance(form, bytes) else canonical_v1.canonical_json(form)
        return hash_bytes(data, scheme).sha256
    if scheme == f"custom.v2:{canonical.scheme}" and not isinstance(form, bytes):
        return hash_bytes(canonical_json(form), scheme).sha256
    return None


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
