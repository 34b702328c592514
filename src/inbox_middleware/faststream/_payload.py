"""From a FastStream message to a `Delivery`: its identity (headers) and its payload hash.

The identity travels in the ``x-inbox-*`` headers (`inbox_middleware._core.headers`). FastStream
invents a random ``message_id`` for a message published without one, so that id is never
read as an identity, except through the explicit ``missing_identity="broker_id"`` opt-in,
which uses what the broker itself keeps stable across redeliveries (see `brokers`).

The payload hash is the body's canonical JSON when the body is JSON, else its raw bytes:
``{"a": 1, "b": 2}`` and ``{"b":2,"a":1}`` are one payload, and a binary body is compared
byte for byte. The scheme name stored with the hash says which form was used. A body that
is JSON text but has no canonical form (``NaN``, a repeated key, a lone surrogate) is
refused (`PayloadNotHashable`), never hashed as bytes instead: whether two copies are
one payload must not depend on which form each happened to get.

Schemes: ``faststream-json.v2`` is `inbox_middleware._core.canonical` (RFC 8785) of the body as
`inbox_middleware._core.canonical.loads` reads it, a JSON text any RFC 8785 implementation
reproduces; claims hashed by ``faststream-json.v1`` (the frozen
`inbox_middleware._core.canonical_v1`) are still compared under it; ``faststream-raw.v1`` is
the SHA-256 of the bytes.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from faststream import BaseMiddleware

from .._core import canonical_v1
from .._core.canonical import CanonicalForm, NotJSON, canonical_json, loads
from .._core.exceptions import PayloadNotHashable
from .._core.headers import MESSAGE_ID, PRODUCED_AT, PRODUCER, TENANT
from .._core.identity import MessageIdentity, PayloadHash, hash_bytes
from .._core.protocol import Delivery

__all__ = [
    "JSON_SCHEME",
    "JSON_V1_SCHEME",
    "RAW_SCHEME",
    "CanonicalForm",
    "StampIdentity",
    "headers_identity",
    "identity_headers",
    "json_headers",
    "payload_hash",
]

JSON_SCHEME = "faststream-json.v2"
"""RFC 8785 canonical JSON of the decoded body, SHA-256."""

JSON_V1_SCHEME = "faststream-json.v1"
"""The v1 canonical JSON of the decoded body: claims hashed by it are compared under it."""

RAW_SCHEME = "faststream-raw.v1"
"""SHA-256 of the body's bytes, for a body that is not JSON."""

_NAMES = {
    "producer": PRODUCER,
    "message_id": MESSAGE_ID,
    "tenant": TENANT,
    "produced_at": PRODUCED_AT,
}


def identity_headers(
    *,
    producer: str,
    message_id: str,
    tenant: str | None = None,
    produced_at: datetime | str | None = None,
) -> dict[str, str]:
    """Headers carrying a producer intent id; validated here, at the producer.

    >>> await broker.publish(order, "orders", headers=identity_headers(
    ...     producer="shop", message_id=f"order-{order.id}"), persist=True)
    """
    parsed = MessageIdentity.parse(
        producer=producer,
        message_id=message_id,
        tenant=tenant,
        produced_at=produced_at,
        names=_NAMES,
    )
    headers = {PRODUCER: parsed.producer, MESSAGE_ID: parsed.message_id}
    if parsed.tenant:
        headers[TENANT] = parsed.tenant
    if parsed.produced_at is not None:
        headers[PRODUCED_AT] = parsed.produced_at.isoformat()
    return headers


def headers_identity(headers: Mapping[str, Any]) -> MessageIdentity:
    """Read and validate the identity a producer put in the headers.

    Raises `MissingIdentity` or `InvalidIdentity` naming the header to fix.
    """
    return MessageIdentity.parse(
        producer=headers.get(PRODUCER),
        message_id=headers.get(MESSAGE_ID),
        tenant=headers.get(TENANT),
        produced_at=headers.get(PRODUCED_AT),
        names=_NAMES,
    )


class StampIdentity:
    """A broker middleware that stamps the identity headers on what a producer publishes.

    ``message_id`` derives the intent id from the message body (``lambda order:
    f"order-{order['id']}"``); it must give the same id whenever the same intent is
    published again. Only messages published to ``destinations`` (queue names or routing
    keys, streams, subjects, topics) are stamped: a broker also publishes replies,
    quarantined messages and dead letters, which are not this producer's intents. A
    message that already carries ``x-inbox-message-id`` keeps it; one for which neither
    gives an id is refused here, at the producer, rather than sent without one::

        broker = RabbitBroker(url, middlewares=[
            StampIdentity("shop", lambda order: f"order-{order['id']}", destinations={"orders"})
        ])
    """

    def __init__(
        self,
        producer: str,
        message_id: Callable[[Any], str | None] | None = None,
        *,
        destinations: Collection[str],
        tenant: str | None = None,
    ) -> None:
        identity_headers(producer=producer, message_id="-", tenant=tenant)  # validate early
        if isinstance(destinations, str):
            raise TypeError("destinations is a collection of names, not one string")
        self.producer = producer
        self.message_id = message_id
        self.destinations = frozenset(destinations)
        self.tenant = tenant

    def __call__(self, msg: Any, /, *, context: Any) -> BaseMiddleware:
        return _Stamp(msg, context=context, stamp=self)

    def stamp(self, cmd: Any) -> None:
        if cmd.destination not in self.destinations:
            return
        headers = dict(cmd.headers or {})
        message_id = headers.get(MESSAGE_ID)
        if message_id is None and self.message_id is not None:
            message_id = self.message_id(cmd.body)
        stamped = identity_headers(
            producer=headers.get(PRODUCER, self.producer),
            message_id=message_id,  # type: ignore[arg-type]  # None: refused, naming the header
            tenant=headers.get(TENANT, self.tenant),
            produced_at=headers.get(PRODUCED_AT),
        )
        cmd.headers = headers | stamped


class _Stamp(BaseMiddleware):
    def __init__(self, msg: Any, /, *, context: Any, stamp: StampIdentity) -> None:
        super().__init__(msg, context=context)
        self.stamp = stamp

    async def publish_scope(self, call_next: Callable[[Any], Awaitable[Any]], cmd: Any) -> Any:
        self.stamp.stamp(cmd)
        return await call_next(cmd)


def payload_hash(
    body: bytes, headers: Mapping[str, Any], canonical: CanonicalForm | None
) -> tuple[PayloadHash, Callable[[str], str | None]]:
    """The body's hash under the subscriber's scheme, and a function that hashes it under
    an older scheme (for redeliveries hashed before a scheme change)."""

    def rehash(scheme: str) -> str | None:
        try:
            return _rehash(body, headers, canonical, scheme)
        except PayloadNotHashable:
            # No form under that scheme, so not the payload a claim hashed by it holds.
            return ""

    if canonical is not None:
        form = _custom_form(canonical, body, headers)
        if isinstance(form, bytes | bytearray):
            return hash_bytes(bytes(form), f"custom:{canonical.scheme}"), rehash
        return hash_bytes(canonical_json(form), f"custom.v2:{canonical.scheme}"), rehash
    return builtin_hash(body), rehash


def builtin_hash(body: bytes) -> PayloadHash:
    """The built-in hash: the canonical JSON of a JSON body, else the SHA-256 of the bytes.

    Raises `PayloadNotHashable` for a JSON body without a canonical form.
    """
    try:
        value = loads(body)
    except NotJSON:
        return hash_bytes(body, RAW_SCHEME)
    return hash_bytes(canonical_json(value), JSON_SCHEME)


def _rehash(
    body: bytes, headers: Mapping[str, Any], canonical: CanonicalForm | None, scheme: str
) -> str | None:
    if scheme == JSON_SCHEME:
        hashed = builtin_hash(body)
        # not JSON (hashed as bytes): not the payload a claim hashed as JSON holds
        return hashed.sha256 if hashed.scheme == JSON_SCHEME else ""
    if scheme == JSON_V1_SCHEME:
        value = _v1_json(body)
        if value is _NOT_JSON:
            return ""
        return hash_bytes(canonical_v1.canonical_json(value), scheme).sha256
    if scheme == RAW_SCHEME:
        return hash_bytes(body, RAW_SCHEME).sha256
    if canonical is not None and scheme.endswith(f":{canonical.scheme}"):
        form = _custom_form(canonical, body, headers)
        if scheme == f"custom:{canonical.scheme}":  # bytes, or a JSON value hashed by v1
            if isinstance(form, bytes | bytearray):
                return hash_bytes(bytes(form), scheme).sha256
            return hash_bytes(canonical_v1.canonical_json(form), scheme).sha256
        if scheme == f"custom.v2:{canonical.scheme}" and not isinstance(form, bytes | bytearray):
            return hash_bytes(canonical_json(form), scheme).sha256
    return None


def _custom_form(canonical: CanonicalForm, body: bytes, headers: Mapping[str, Any]) -> object:
    try:
        return canonical.function(body, headers)
    except Exception as exc:
        raise PayloadNotHashable(
            f"the canonical form {canonical.scheme!r} failed: {type(exc).__name__}: {exc}"
        ) from exc


_NOT_JSON: Any = object()


def _v1_json(body: bytes) -> Any:
    """The decoded body as ``faststream-json.v1`` read it (frozen), else `_NOT_JSON`."""
    try:
        text = body.decode("utf-8")
        value = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
        canonical_v1.canonical_json(value)
    except (UnicodeDecodeError, ValueError, PayloadNotHashable, RecursionError):
        return _NOT_JSON
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate object key")
    return result


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def json_headers(headers: Mapping[str, Any]) -> dict[str, Any]:
    """The headers as JSON values, for the quarantine row (bytes decoded, others shown)."""
    kept: dict[str, Any] = {}
    for name, raw in headers.items():
        value = raw
        if isinstance(raw, bytes | bytearray):
            value = bytes(raw).decode("utf-8", "backslashreplace")
        try:
            canonical_v1.canonical_json(value)  # a plain JSON value
            kept[str(name)] = value
        except PayloadNotHashable:
            kept[str(name)] = repr(value)
    return kept


def delivery(
    *,
    consumer: str,
    identity: MessageIdentity,
    body: bytes,
    headers: Mapping[str, Any],
    handler_version: str,
    source: str,
    canonical: CanonicalForm | None,
    content_type: str | None = None,
) -> Delivery:
    digest, rehash = payload_hash(body, headers, canonical)
    return Delivery(
        consumer=consumer,
        identity=identity,
        payload_hash=digest,
        handler_version=handler_version,
        source=source,
        payload=body,
        payload_format="faststream",
        headers=TextHeaders(headers, content_type),
        received_at=datetime.now(UTC),
        rehash=rehash,
    )


class TextHeaders(Mapping[str, Any]):
    """The headers with bytes values read as text, converted only when a row keeps them;
    with the content type (a message property on RabbitMQ) as ``content-type``, so that
    a republished message is decoded as the original was."""

    def __init__(self, headers: Mapping[str, Any], content_type: str | None = None) -> None:
        self._headers = headers
        self._content_type = content_type if "content-type" not in headers else None

    def __getitem__(self, name: str) -> Any:
        if name == "content-type" and self._content_type is not None:
            return self._content_type
        value = self._headers[name]
        if isinstance(value, bytes | bytearray):
            return bytes(value).decode("utf-8", "backslashreplace")
        return value

    def __iter__(self) -> Iterator[str]:
        yield from (str(name) for name in self._headers)
        if self._content_type is not None:
            yield "content-type"

    def __len__(self) -> int:
        return len(self._headers) + (self._content_type is not None)
