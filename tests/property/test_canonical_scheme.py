"""The hash scheme against the `rfc8785` package on random documents.

The scheme's JSON path is `rfc8785.dumps` itself, so what is tested here is what this
library adds around it: the exact-integer writer used when a document holds an integer
beyond +-(2**53 - 1) (its structure must be RFC 8785's), the JSON reader used for bodies,
and the forms given to values JSON has no form for (the hooks), each checked against an
expected value built independently of the library.
"""

from __future__ import annotations

import base64
import enum
import json
from datetime import UTC, datetime
from decimal import Decimal

import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from inbox_middleware._core.canonical import _exact, canonical_json, loads

SAFE = 2**53 - 1
SETTINGS = settings(max_examples=1000, deadline=None)

text = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)
doubles = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(
    [5e-324, -5e-324, 2.2250738585072014e-308, -0.0, 1e21, 1e-7, 2.0**60, 9007199254740993.0]
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-SAFE, SAFE) | doubles | text,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(text, inner, max_size=5),
    max_leaves=40,
)


@SETTINGS
@given(json_values)
def test_scheme__json_documents_are_rfc8785_byte_for_byte(value):
    expected = rfc8785.dumps(value)
    assert canonical_json(value) == expected
    assert b"".join(_exact(value)) == expected  # the writer for documents with big integers
    assert canonical_json(loads(json.dumps(value))) == expected  # a body's JSON text


class Colour(enum.Enum):
    RED = "red"
    BLUE = 2


def _decimal_text(value: Decimal) -> str:
    """Independent of the library: Python's fixed-point formatting, trimmed."""
    fixed = f"{value:f}"
    if "." in fixed:
        fixed = fixed.rstrip("0").rstrip(".")
    return "0" if fixed in ("0", "-0") else fixed


def _datetime_text(value: datetime) -> str:
    date = f"{value.year:04d}-{value.month:02d}-{value.day:02d}"
    clock = f"{value.hour:02d}:{value.minute:02d}:{value.second:02d}"
    fraction = f".{value.microsecond:06d}" if value.microsecond else ""
    return f"{date}T{clock}{fraction}" + ("Z" if value.tzinfo else "")


hooked = st.one_of(
    st.decimals(allow_nan=False, allow_infinity=False, places=None)
    .filter(lambda d: abs(d.adjusted()) < 200)
    .map(lambda d: (d, _decimal_text(d))),
    st.datetimes(timezones=st.just(UTC) | st.none()).map(lambda dt: (dt, _datetime_text(dt))),
    st.uuids().map(lambda u: (u, str(u))),
    st.binary(max_size=20).map(lambda b: (b, base64.b64encode(b).decode())),
    st.sampled_from(list(Colour)).map(lambda c: (c, c.value)),
    st.integers().map(lambda n: (n, n)).filter(lambda p: abs(p[0]) <= SAFE),
    text.map(lambda s: (s, s)),
)


@SETTINGS
@given(st.lists(st.tuples(text, hooked), max_size=6))
def test_scheme__values_json_lacks_get_their_documented_form(items):
    value = {key: [original, (original,)] for key, (original, _) in items}
    expected = {key: [form, [form]] for key, (_, form) in items}
    assert canonical_json(value) == rfc8785.dumps(expected)


@SETTINGS
@given(st.lists(st.integers(-(2**80), 2**80), max_size=6))
def test_scheme__integers_keep_their_exact_digits_and_read_back(numbers):
    encoded = canonical_json({"n": numbers})
    assert encoded == ('{"n":[' + ",".join(map(str, numbers)) + "]}").encode()
    assert loads(encoded) == {"n": numbers}
