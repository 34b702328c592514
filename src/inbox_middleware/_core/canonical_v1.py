"""The canonical JSON of the ``.v1`` hash schemes, frozen.

``dramatiq.v1``, ``faststream-json.v1`` and the ``fx1`` outbox effect ids were computed
with this code. It is close to RFC 8785 but not it: integral doubles are written with all
their digits (``2.0**60`` gives ``1152921504606846976``, the RFC ``1152921504606847000``),
other doubles are placed from Python's ``repr`` rather than ECMAScript's algorithm, strings
and keys are normalised to Unicode NFC, and a `Decimal` with a fraction goes through
``float``. The current scheme is `inbox_middleware._core.canonical`.

Never change what this module returns: claims hashed by a ``.v1`` scheme are compared by
hashing a redelivery here again, so that a worker upgraded during traffic still tells
their redeliveries from conflicts; a changed byte would turn duplicates into conflicts.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Callable, Mapping
from decimal import Decimal
from json.encoder import encode_basestring
from typing import Any

from .exceptions import PayloadNotHashable

__all__ = ["MAX_NESTING", "canonical_json"]

# The C string escaper json.dumps uses: quotes, escapes \\, \" and control characters.
_quote: Callable[[str], str] = encode_basestring

MAX_NESTING = 128
"""Deepest nesting of arrays and objects a hashed payload may have."""


def canonical_json(value: object) -> bytes:
    """Encode ``value`` in the v1 canonical JSON (see the module), as UTF-8 bytes.

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
