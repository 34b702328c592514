"""Message identity, and the payload hash's value type.

An identity names one producer intent: ``(producer, message_id)``, optionally scoped by a
tenant. The consumer half of the inbox key never comes from the message; adapters take
it from the actor or subscriber declaration.

The payload hash tells a redelivery (same intent, same payload) from an identity
conflict (same intent, different payload). It is the SHA-256 of a canonical form
(`inbox_middleware._core.canonical`), and the name of the scheme that produced it is stored
beside it, so a later version can change the canonical form and still recognise
redeliveries hashed the old way (`inbox_middleware._core.canonical_v1`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from . import canonical_v1
from .canonical import canonical_json
from .exceptions import InvalidIdentity, MissingIdentity, PayloadNotHashable

__all__ = [
    "MAX_MESSAGE_ID_LENGTH",
    "MAX_NAME_LENGTH",
    "MessageIdentity",
    "PayloadHash",
    "hash_bytes",
    "hash_json",
    "jsonable",
    "validate_name",
]

MAX_NAME_LENGTH = 128
"""Longest consumer, producer or tenant name, in characters."""

MAX_MESSAGE_ID_LENGTH = 256
"""Longest message id, in characters."""

# Control characters, including NUL (PostgreSQL text cannot hold it), and lone surrogates.
_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def validate_name(value: object, field: str, *, max_length: int, allow_empty: bool = False) -> str:
    """Return ``value`` if it is acceptable identity text, else raise `InvalidIdentity`.

    Bytes are accepted when they are valid UTF-8 (header values often arrive as bytes).
    Values are never trimmed or coerced: ``"42"`` and ``42`` are not the same identity,
    so a non-text value is refused rather than converted.
    """
    if isinstance(value, bytes | bytearray):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidIdentity(f"{field} is not valid UTF-8", field=field) from None
    if not isinstance(value, str):
        raise InvalidIdentity(f"{field} must be text, got {type(value).__name__}", field=field)
    if not value and not allow_empty:
        raise InvalidIdentity(f"{field} is empty", field=field)
    if len(value) > max_length:
        raise InvalidIdentity(
            f"{field} is {len(value)} characters long; the limit is {max_length}", field=field
        )
    if match := _FORBIDDEN.search(value):
        raise InvalidIdentity(
            f"{field} contains U+{ord(match.group()):04X} at position {match.start()}; "
            "control characters and lone surrogates are not allowed",
            field=field,
        )
    if value.strip() != value:
        raise InvalidIdentity(f"{field} has leading or trailing white space", field=field)
    return value


def parse_timestamp(value: object, field: str) -> datetime | None:
    """Parse an optional producer timestamp: an aware `datetime` or an ISO 8601 string."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        value = validate_name(value, field, max_length=64)
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise InvalidIdentity(
                f"{field} is not an ISO 8601 timestamp: {str(value)[:64]!r}", field=field
            ) from None
    if not isinstance(value, datetime):
        raise InvalidIdentity(
            f"{field} must be an ISO 8601 string or a datetime, got {type(value).__name__}",
            field=field,
        )
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidIdentity(f"{field} has no time zone", field=field)
    try:
        value.astimezone(UTC)  # a driver converts it; year 1 at +14:00 is year 0 in UTC
    except OverflowError:
        raise InvalidIdentity(
            f"{field} is out of range once converted to UTC: {value.isoformat()}", field=field
        ) from None
    return value


@dataclass(frozen=True, slots=True)
class MessageIdentity:
    """A producer-assigned, immutable intent id.

    Build it with `MessageIdentity.parse` for untrusted values: the constructor does not
    validate, so that adapters which already validated do not pay twice.
    """

    producer: str
    message_id: str
    tenant: str = ""
    produced_at: datetime | None = None

    @classmethod
    def parse(
        cls,
        *,
        producer: object,
        message_id: object,
        tenant: object = None,
        produced_at: object = None,
        names: Mapping[str, str] | None = None,
    ) -> MessageIdentity:
        """Validate raw values taken from a message.

        Raises `MissingIdentity` when the producer or message id is absent (``None``),
        `InvalidIdentity` when a value is present but unusable. ``names`` maps the fields
        (``producer``, ``message_id``, ``tenant``, ``produced_at``) to what the message
        calls them (an option or header name), so errors name what the sender must fix.
        """
        names = names or {}

        def name(field: str) -> str:
            return names.get(field, field)

        missing = [
            name(field)
            for field, value in (("producer", producer), ("message_id", message_id))
            if value is None
        ]
        if missing:
            raise MissingIdentity(
                f"the message has no {' and no '.join(missing)}", field=missing[0]
            )
        return cls(
            producer=validate_name(producer, name("producer"), max_length=MAX_NAME_LENGTH),
            message_id=validate_name(
                message_id, name("message_id"), max_length=MAX_MESSAGE_ID_LENGTH
            ),
            tenant=(
                ""
                if tenant is None
                else validate_name(
                    tenant, name("tenant"), max_length=MAX_NAME_LENGTH, allow_empty=True
                )
            ),
            produced_at=parse_timestamp(produced_at, name("produced_at")),
        )

    def key(self, consumer: str) -> tuple[str, str, str, str]:
        """The inbox primary key for ``consumer``."""
        return (consumer, self.producer, self.tenant, self.message_id)


@dataclass(frozen=True, slots=True)
class PayloadHash:
    """A payload fingerprint: the scheme that made it and the hex SHA-256."""

    scheme: str
    sha256: str


def hash_bytes(data: bytes, scheme: str) -> PayloadHash:
    return PayloadHash(scheme, hashlib.sha256(data).hexdigest())


def hash_json(value: object, scheme: str) -> PayloadHash:
    """Hash a value in its canonical form (`inbox_middleware._core.canonical.canonical_json`)."""
    return hash_bytes(canonical_json(value), scheme)


def jsonable(value: object) -> object:
    """``value`` if it has a JSON form that can be stored, else its ``repr``: for storing
    headers as JSON. PostgreSQL's jsonb refuses text holding NUL, which JSON allows."""
    try:  # a check of plain JSON values, which the v1 form accepts and nothing more
        canonical_v1.canonical_json(value)
    except PayloadNotHashable:
        return repr(value)
    return repr(value) if _holds_nul(value) else value


def _holds_nul(value: object) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, Mapping):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_holds_nul(item) for item in value)
    return False
