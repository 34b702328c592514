"""Message identity and the canonical payload hash.

An identity names one producer intent: ``(producer, message_id)``, optionally scoped by a
tenant. The consumer half of the inbox key never comes from the message; adapters take
it from the actor or subscriber declaration.

The payload hash tells a redelivery (same intent, same payload) from an identity
conflict (same intent, different payload). It is the SHA-256 of a canonical form, and
the name of the scheme that produced it is stored beside it, so a later version can
change the canonical form and still recognise redeliveries hashed the old way.

Canonical JSON follows RFC 8785 (JCS): object keys sorted by UTF-16 code units, no
insignificant white space, numbers in the shortest form that round-trips (``10.0`` and
``10`` are the same number), and strings normalised to Unicode NFC. Integers are written
exactly rather than through a double, so two distinct large IDs never collapse.
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from json.encoder import encode_basestring
from typing import Any

from .exceptions import InvalidIdentity, MissingIdentity, PayloadNotHashable

# The C string escaper json.dumps uses: quotes, escapes \\, \" and control characters.
_quote: Callable[[str], str] = encode_basestring

__all__ = [
    "MAX_MESSAGE_ID_LENGTH",
    "MAX_NAME_LENGTH",
    "MessageIdentity",
    "PayloadHash",
    "canonical_json",
    "hash_bytes",
    "hash_json",
    "jsonable",
    "validate_name",
]

MAX_NAME_LENGTH = 128
"""Longest consumer, producer or tenant name, in characters."""

MAX_MESSAGE_ID_LENGTH = 256
"""Longest message id, in characters."""

MAX_NESTING = 128
"""Deepest nesting of arrays and objects a hashed payload may have."""

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
    """Hash a JSON-like value in its canonical form (see `canonical_json`)."""
    return hash_bytes(canonical_json(value), scheme)


def canonical_json(value: object) -> bytes:
    """Encode ``value`` in RFC 8785 canonical JSON, as UTF-8 bytes.

    Accepts what `json.loads` produces (plus tuples, and `Decimal` without a fraction
    overflow); anything else raises `PayloadNotHashable` naming the JSON path of the
    offending value, since a payload without a canonical form cannot be deduplicated.
    """
    parts: list[str] = []
    try:
        _encode(value, parts, 0)
        return "".join(parts).encode("utf-8")
    except _Unencodable:
        pass  # find where, on the slow path, so the common path keeps no JSON path
    except UnicodeEncodeError as exc:  # a lone surrogate slipped in through a key
        raise PayloadNotHashable(f"payload holds text that is not valid Unicode: {exc}") from None
    _explain(value, "$", 0)
    raise AssertionError("unreachable: the value was refused, then found acceptable")


class _Unencodable(Exception):
    """Raised by the fast encoder; `_explain` then finds the offending value's path."""


def _encode(value: object, out: list[str], depth: int) -> None:
    kind = type(value)
    if kind is str:
        out.append(_string(value))  # type: ignore[arg-type]
    elif kind is int:
        out.append(str(value))
    elif kind is dict:
        _encode_object(value, out, depth)  # type: ignore[arg-type]
    elif value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif kind is list or kind is tuple:
        if depth >= MAX_NESTING:
            raise _Unencodable
        items: Any = value
        out.append("[")
        for index, item in enumerate(items):
            if index:
                out.append(",")
            _encode(item, out, depth + 1)
        out.append("]")
    elif isinstance(value, float | Decimal):
        out.append(_number(value))
    elif isinstance(value, int):  # subclasses of int, after bool
        out.append(str(int(value)))
    elif isinstance(value, str):
        out.append(_string(str(value)))
    elif isinstance(value, list | tuple):
        _encode(list(value), out, depth)
    elif isinstance(value, Mapping):
        _encode_object(value, out, depth)
    else:
        raise _Unencodable


def _encode_object(value: Mapping[Any, Any], out: list[str], depth: int) -> None:
    if depth >= MAX_NESTING:
        raise _Unencodable
    keys = list(value)
    if all(type(key) is str and key.isascii() for key in keys):
        # ASCII keys are already NFC, and their code point order is their UTF-16 order.
        ordered = [(key, key) for key in sorted(keys)]
    else:
        ordered = _normal_keys(value)
    out.append("{")
    for index, (key, original) in enumerate(ordered):
        if index:
            out.append(",")
        out.append(_string(key))
        out.append(":")
        _encode(value[original], out, depth + 1)
    out.append("}")


def _normal_keys(value: Mapping[Any, Any]) -> list[tuple[str, Any]]:
    normal: dict[str, Any] = {}
    for key in value:
        if not isinstance(key, str):
            raise _Unencodable
        form = unicodedata.normalize("NFC", key)
        if form in normal:
            raise _Unencodable
        normal[form] = key
    return [(key, normal[key]) for key in sorted(normal, key=_utf16_order)]


def _utf16_order(key: str) -> bytes:
    return key.encode("utf-16-be", "surrogatepass")


def _string(value: str) -> str:
    if not value.isascii():
        if _LONE_SURROGATE.search(value):
            raise _Unencodable
        if not unicodedata.is_normalized("NFC", value):
            value = unicodedata.normalize("NFC", value)
    return _quote(value)


def _explain(value: object, path: str, depth: int) -> None:
    """Raise `PayloadNotHashable` for the first value without a canonical form."""
    if depth > MAX_NESTING:
        raise PayloadNotHashable(f"payload is nested deeper than {MAX_NESTING} levels", path=path)
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, float | Decimal):
        try:
            _number(value)
        except _Unencodable:
            raise PayloadNotHashable(f"{value} at {path} is not a JSON number", path=path) from None
    elif isinstance(value, str):
        if _LONE_SURROGATE.search(value):
            raise PayloadNotHashable(f"text at {path} holds a lone surrogate", path=path)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _explain(item, f"{path}[{index}]", depth + 1)
    elif isinstance(value, Mapping):
        seen: set[str] = set()
        for key, item in value.items():
            if not isinstance(key, str):
                raise PayloadNotHashable(
                    f"object key {key!r} at {path} is a {type(key).__name__}, not text",
                    path=path,
                )
            normal = unicodedata.normalize("NFC", key)
            if normal in seen:
                raise PayloadNotHashable(f"two keys at {path} normalise to {normal!r}", path=path)
            seen.add(normal)
            _explain(key, path, depth + 1)
            _explain(item, f"{path}.{key}", depth + 1)
    else:
        raise PayloadNotHashable(
            f"a {type(value).__name__} at {path} has no canonical JSON form; "
            "pass JSON values or supply a canonical-form hook",
            path=path,
        )


_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _number(value: float | Decimal) -> str:
    """Format a number as ECMAScript's Number.prototype.toString does (RFC 8785 3.2.2.3)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise _Unencodable
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise _Unencodable
        if value == value.to_integral_value():
            return str(int(value))
        value = float(value)
    if value == 0:
        return "0"
    if value.is_integer() and abs(value) < 1e21:
        return str(int(value))
    sign, digit_tuple, exponent = Decimal(repr(value)).as_tuple()
    digits = "".join(map(str, digit_tuple)).rstrip("0")
    assert isinstance(exponent, int)
    point = len("".join(map(str, digit_tuple))) + exponent  # value = 0.<digits> * 10**point
    text = _place_point(digits, point)
    return "-" + text if sign else text


def _place_point(digits: str, point: int) -> str:
    count = len(digits)
    if count <= point <= 21:
        return digits + "0" * (point - count)
    if 0 < point <= 21:
        return f"{digits[:point]}.{digits[point:]}"
    if -6 < point <= 0:
        return "0." + "0" * -point + digits
    exponent = point - 1
    mantissa = digits[0] + ("." + digits[1:] if count > 1 else "")
    return f"{mantissa}e{'+' if exponent > 0 else '-'}{abs(exponent)}"


def jsonable(value: object) -> object:
    """``value`` if it has a JSON form that can be stored, else its ``repr``: for storing
    headers as JSON. PostgreSQL's jsonb refuses text holding NUL, which JSON allows."""
    try:
        canonical_json(value)
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


CanonicalForm = Callable[[Any], object]
"""A user hook: takes the adapter's payload, returns a JSON-like value or bytes to hash."""
