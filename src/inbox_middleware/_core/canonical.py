"""The payload hash scheme: RFC 8785 canonical JSON, and exact forms for what JSON lacks.

The digest of a payload is the hex SHA-256 of its canonical form, UTF-8 encoded. The
canonical form of JSON values is RFC 8785 (the JSON Canonicalization Scheme), byte for
byte, as the `rfc8785` package writes it: object keys sorted by their UTF-16 code units,
no white space, numbers as ECMAScript writes a double, strings as they are (no Unicode
normalisation). A producer in any language with an RFC 8785 library computes the same
digest from the JSON text it sends (`docs/reference/hash-scheme.md` has the steps and
test vectors).

One deviation: an integer beyond ±(2**53 - 1), which RFC 8785 reads as a double (so that
distinct 64-bit ids would collapse), is written as its exact digits.

Values JSON has no form for are first given one, and then canonicalised as JSON:

```
value                          form
-----                          ----
Decimal (finite)               "1.5": plain decimal digits, exact, no exponent, no
                               trailing fractional zeros, "0" for any zero
datetime with a time zone      "2026-12-01T09:30:00Z", converted to UTC, ".ffffff"
                               (six digits) only when there are microseconds
datetime without a time zone   "2026-12-01T09:30:00", never read as UTC
date, time                     their isoformat(); a time keeps its own offset
UUID                           "0f8fad5b-d9cb-469f-a165-70867728950e" (lower case)
bytes, bytearray, memoryview   base64 (RFC 4648 section 4, with padding)
tuple, list                    an array
set, frozenset                 an array, sorted by the canonical bytes of its items
Enum member                    the form of its value
pydantic model                 the object of the fields that were set (exclude_unset)
dataclass instance             the object of all its fields
int, float, str subclasses     the plain int, float or str
```

Anything else (NaN, infinities, lone surrogates, non-text object keys, other types) has
no canonical form and raises `PayloadNotHashable` naming where it is: a payload that
cannot be hashed cannot be told from a conflict, and is never hashed another way instead.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, time
from decimal import Decimal
from enum import Enum
from typing import Any
from uuid import UUID

import rfc8785

from .exceptions import PayloadNotHashable

__all__ = ["MAX_DECIMAL_LENGTH", "CanonicalForm", "NotJSON", "canonical_json", "digest", "loads"]


@dataclass(frozen=True, slots=True)
class CanonicalForm:
    """A user-supplied canonical form for a consumer's payloads.

    ``function`` returns bytes, or a JSON value to canonicalise: for a Dramatiq actor it
    receives the actor name and the bound arguments, for a FastStream subscriber the
    body's bytes and the message headers (for example to drop a field that producers fill
    in per send). ``scheme`` names the form; change it whenever the form changes, so a
    stored hash is never compared with a hash of another form.
    """

    scheme: str
    function: Callable[..., object]


MAX_DECIMAL_LENGTH = 1000
"""Longest plain notation of a `Decimal`, in characters (``Decimal("1E+999999")`` would
otherwise be written out as a million digits)."""


class NotJSON(ValueError):
    """The bytes are not a JSON text at all (not UTF-8, or not JSON's grammar)."""


def canonical_json(value: object) -> bytes:
    """The canonical form of ``value``, as UTF-8 bytes (see the module's table)."""
    if _plain_json(value, 0):
        try:
            return _dumps(value).encode()
        except UnicodeEncodeError:
            pass  # a lone surrogate: rfc8785 says why
    return _rfc8785_form(value)


def _rfc8785_form(value: object) -> bytes:
    """`canonical_json` by rfc8785 alone, for every value."""
    try:
        return rfc8785.dumps(value)  # type: ignore[arg-type]  # refuses what it cannot write
    except (rfc8785.CanonicalizationError, RecursionError, UnicodeEncodeError):
        # (rfc8785 sorts keys by their UTF-16 form, which a lone surrogate has not)
        pass  # not plain JSON in RFC 8785's domain: give the rest its form, or say where not
    try:
        plain = _plain(value, "$")
    except RecursionError:
        raise PayloadNotHashable("the payload is nested too deeply to be hashed") from None
    try:
        return rfc8785.dumps(plain)  # type: ignore[arg-type]
    except rfc8785.IntegerDomainError:
        return b"".join(_exact(plain))


def _json_writer() -> Callable[[object], str]:
    """The standard library's JSON writer for RFC 8785's layout: its C encoder made once
    (`json.dumps` builds one a call), without the cycle check, which `_plain_json`'s
    depth limit stands for."""
    settings: dict[str, Any] = {
        "ensure_ascii": False,
        "separators": (",", ":"),
        "sort_keys": True,
        "allow_nan": False,
    }
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # no C accelerator: the pure-Python writer, the same bytes
        return json.JSONEncoder(**settings).encode

    def refuse(value: object) -> object:
        raise TypeError(type(value).__name__)

    write = make(None, refuse, json.encoder.encode_basestring, None, ":", ",", True, False, False)
    return lambda value: "".join(write(value, 0))


# The common payload (objects with ASCII keys, arrays, text, safe integers, booleans, null)
# is written by the standard library's C encoder, whose output is then RFC 8785's byte for
# byte: the same escapes (\" \\ \b \f \n \r \t, other control characters as \u00xx in
# lower case, nothing else), keys in code point order, which is UTF-16 order for ASCII
# keys, no white space, integers as their digits. Anything else (a float, a non-ASCII key,
# a subclass, an integer beyond 2**53 - 1) goes through rfc8785 as before; a test holds
# the two equal over generated values.
_dumps = _json_writer()
_SAFE_INTEGER = 2**53 - 1
_PLAIN_DEPTH = 64


def _plain_json(value: object, depth: int) -> bool:
    """Whether ``value`` is JSON the standard library writes as RFC 8785 does."""
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return True
    if kind is int:
        return -_SAFE_INTEGER <= value <= _SAFE_INTEGER  # type: ignore[operator]
    if depth >= _PLAIN_DEPTH:
        return False
    if kind is dict:
        for key, item in value.items():  # type: ignore[attr-defined]
            if type(key) is not str or not key.isascii() or not _plain_json(item, depth + 1):
                return False
        return True
    if kind is list or kind is tuple:
        return all(_plain_json(item, depth + 1) for item in value)  # type: ignore[attr-defined]
    return False


def digest(value: object) -> str:
    """The hex SHA-256 of ``value``'s canonical form."""
    return hashlib.sha256(canonical_json(value)).hexdigest()


def loads(data: bytes | str) -> Any:
    """Read a JSON text the way the scheme reads a message body.

    Raises `NotJSON` when ``data`` is not JSON text, and `PayloadNotHashable` when it is
    but has no canonical form: ``NaN`` or ``Infinity``, a repeated object key, a number
    too large for a double or an integer too long to read. Integers are read exactly;
    numbers with a fraction or an exponent become the nearest double, as they do in
    JavaScript (send amounts that need more digits as strings).
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
    except UnicodeDecodeError as exc:
        raise NotJSON(f"not UTF-8: {exc}") from None
    try:
        return _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise NotJSON(str(exc)) from None
    except RecursionError:
        raise PayloadNotHashable("the JSON text is nested too deeply to be hashed") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise PayloadNotHashable(f"the JSON text repeats the object key {key!r}")
            seen.add(key)
    return result


def _no_constant(name: str) -> Any:
    raise PayloadNotHashable(f"{name} is not a JSON number")


def _integer(digits: str) -> int:
    try:
        return int(digits)
    except ValueError:  # longer than sys.get_int_max_str_digits()
        raise PayloadNotHashable(f"an integer of {len(digits)} digits is too long") from None


# One decoder for every body: ``json.loads`` with hooks builds a new one at each call (its
# scanner included), about 12 µs of a message. A decoder keeps no state between calls.
_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_int=_integer
)


def _plain(value: object, path: str) -> object:
    """``value`` as plain JSON values: dict with text keys, list, str, int, float, bool,
    None. Only reached when `rfc8785` refused ``value`` as it is."""
    if value is None or value is True or value is False:
        return value
    if isinstance(value, Enum):
        return _plain(value.value, path)
    if isinstance(value, str):
        return _text(value, path)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        number = float(value)
        if not math.isfinite(number):
            raise PayloadNotHashable(f"{number} at {path} is not a JSON number", path=path)
        return number
    if isinstance(value, Mapping):
        return _object(value, path)
    if isinstance(value, list | tuple):
        return [_plain(item, f"{path}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, set | frozenset):
        items = [_plain(item, f"{path}[]") for item in value]
        return sorted(items, key=canonical_json)
    if isinstance(value, Decimal):
        return _decimal(value, path)
    if isinstance(value, datetime):
        return _datetime(value, path)
    if isinstance(value, date | time):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
        return _object(fields, path)
    if _is_pydantic_model(value):
        fields = value.model_dump(mode="python", exclude_unset=True)  # type: ignore[attr-defined]
        return _plain(fields, path)
    raise PayloadNotHashable(
        f"a {type(value).__name__} at {path} has no canonical form; pass JSON values, one "
        "of the documented types, or supply a canonical-form hook",
        path=path,
    )


def _object(value: Mapping[Any, Any], path: str) -> dict[str, object]:
    result: dict[str, object] = {}
    for raw, item in value.items():
        key = raw.value if isinstance(raw, Enum) else raw
        if not isinstance(key, str):
            raise PayloadNotHashable(
                f"object key {key!r} at {path} is a {type(key).__name__}, not text", path=path
            )
        name = _text(key, path)
        if name in result:
            raise PayloadNotHashable(f"the object at {path} has the key {name!r} twice", path=path)
        result[name] = _plain(item, f"{path}.{name}")
    return result


def _text(value: str, path: str) -> str:
    text = str.__str__(value)  # the characters themselves, whatever a subclass's __str__
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PayloadNotHashable(f"text at {path} holds a lone surrogate", path=path) from None
    return text


def _decimal(value: Decimal, path: str) -> str:
    if not value.is_finite():
        raise PayloadNotHashable(f"{value} at {path} is not a number", path=path)
    if value.is_zero():
        return "0"
    sign, digit_tuple, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple)).lstrip("0")
    stripped = digits.rstrip("0")
    exponent += len(digits) - len(stripped)  # value = stripped * 10**exponent
    point = len(stripped) + exponent  # digits before the decimal point
    if max(point, len(stripped) - point, len(stripped)) > MAX_DECIMAL_LENGTH:
        raise PayloadNotHashable(
            f"the Decimal at {path} has more than {MAX_DECIMAL_LENGTH} digits written out",
            path=path,
        )
    if exponent >= 0:
        text = stripped + "0" * exponent
    elif point > 0:
        text = f"{stripped[:point]}.{stripped[point:]}"
    else:
        text = "0." + "0" * -point + stripped
    return "-" + text if sign else text


def _datetime(value: datetime, path: str) -> str:
    if value.tzinfo is None or value.utcoffset() is None:
        return value.isoformat()
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        message = f"the datetime at {path} is out of range in UTC"
        raise PayloadNotHashable(message, path=path) from None
    return utc.replace(tzinfo=None).isoformat() + "Z"


def _is_pydantic_model(value: object) -> bool:
    pydantic = sys.modules.get("pydantic")  # a model exists only if pydantic was imported
    return pydantic is not None and isinstance(value, pydantic.BaseModel)


def _exact(value: object) -> list[bytes]:
    """RFC 8785's form of plain values with integers written exactly whatever their size:
    the structure written here, every scalar but an integer by `rfc8785` itself."""
    out: list[bytes] = []
    _write(value, out)
    return out


def _write(value: object, out: list[bytes]) -> None:
    if type(value) is int:
        out.append(str(value).encode("ascii"))
    elif isinstance(value, dict):
        out.append(b"{")
        for index, key in enumerate(sorted(value, key=_utf16)):
            if index:
                out.append(b",")
            out.append(rfc8785.dumps(key))
            out.append(b":")
            _write(value[key], out)
        out.append(b"}")
    elif isinstance(value, list):
        out.append(b"[")
        for index, item in enumerate(value):
            if index:
                out.append(b",")
            _write(item, out)
        out.append(b"]")
    else:
        out.append(rfc8785.dumps(value))  # type: ignore[arg-type]


def _utf16(key: str) -> bytes:
    return key.encode("utf-16-be")
