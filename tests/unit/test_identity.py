from datetime import UTC, datetime
from decimal import Decimal

import pytest

from inbox_middleware._core.canonical_v1 import canonical_json
from inbox_middleware._core.exceptions import InvalidIdentity, MissingIdentity, PayloadNotHashable
from inbox_middleware._core.identity import (
    MAX_MESSAGE_ID_LENGTH,
    MessageIdentity,
    hash_bytes,
    jsonable,
)

# The canonical_json tests below are the frozen v1 form's (dramatiq.v1, faststream-json.v1,
# fx1 effect ids): they must keep passing unchanged. The current scheme's are in
# test_canonical.py.


def test_parse__accepts_text_and_utf8_bytes():
    identity = MessageIdentity.parse(producer=b"orders", message_id="ord-42", tenant="acme")
    assert identity == MessageIdentity("orders", "ord-42", "acme")


def test_parse__missing_values_name_the_senders_field():
    with pytest.raises(MissingIdentity, match="no x-inbox-message-id") as info:
        MessageIdentity.parse(
            producer="orders", message_id=None, names={"message_id": "x-inbox-message-id"}
        )
    assert info.value.field == "x-inbox-message-id"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("", "is empty"),
        ("x" * (MAX_MESSAGE_ID_LENGTH + 1), "characters long"),
        ("a\x00b", r"U\+0000"),
        ("a\nb", r"U\+000A"),
        (" padded", "white space"),
        (42, "must be text, got int"),
        (b"\xff\xfe", "not valid UTF-8"),
        ("\ud800", r"U\+D800"),
    ],
)
def test_parse__malformed_message_id_is_refused_with_its_reason(value, reason):
    with pytest.raises(InvalidIdentity, match=reason) as info:
        MessageIdentity.parse(producer="orders", message_id=value)
    assert info.value.field == "message_id"


def test_parse__sql_metacharacters_are_plain_text():
    identity = MessageIdentity.parse(producer="o'; DROP TABLE x; --", message_id='"$1\\')
    assert identity.producer == "o'; DROP TABLE x; --"


def test_parse__produced_at_needs_a_time_zone():
    parsed = MessageIdentity.parse(
        producer="p", message_id="m", produced_at="2026-11-30T10:00:00+00:00"
    )
    assert parsed.produced_at == datetime(2026, 11, 30, 10, tzinfo=UTC)
    with pytest.raises(InvalidIdentity, match="no time zone"):
        MessageIdentity.parse(producer="p", message_id="m", produced_at="2026-11-30T10:00:00")
    with pytest.raises(InvalidIdentity, match="not an ISO 8601"):
        MessageIdentity.parse(producer="p", message_id="m", produced_at="yesterday")


# RFC 8785 section 3.2.2's own example, with its expected output.
RFC8785_INPUT = {
    "numbers": [333333333.33333329, 1e30, 4.50, 2e-3, 0.000000000000000000000000001],
    "string": "\u20ac$\u000f\u000aA'\u0042\u0022\u005c\\\"/",
    "literals": [None, True, False],
}
RFC8785_OUTPUT = (
    '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
    '"string":"\u20ac$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
)


def test_parse__produced_at_that_leaves_the_calendar_in_utc_is_refused():
    with pytest.raises(InvalidIdentity, match="out of range once converted to UTC") as info:
        MessageIdentity.parse(producer="p", message_id="m", produced_at="0001-01-01T00:00:00+14:00")
    assert info.value.field == "produced_at"


def test_jsonable__text_holding_nul_is_stored_as_its_repr():
    # JSON allows U+0000 in a string; PostgreSQL's jsonb does not.
    assert jsonable({"h": "a\x00b"}) == repr({"h": "a\x00b"})
    assert jsonable({"h": ["ok", 1]}) == {"h": ["ok", 1]}
    assert jsonable(object()).startswith("<object")


def test_canonical_json__matches_rfc8785_example():
    assert canonical_json(RFC8785_INPUT).decode() == RFC8785_OUTPUT


def test_canonical_json__sorts_keys_by_utf16_code_units():
    # RFC 8785 section 3.2.3's keys: the emoji (a surrogate pair, D83D) sorts before the
    # last one. We also normalise to NFC, which turns U+FB33 into U+05D3 U+05BC.
    keys = ["\u20ac", "\r", "\ufb33", "1", "\U0001f600", "\u0080", "\u00f6"]
    encoded = canonical_json(dict.fromkeys(keys, 0)).decode()
    order = ["\\r", "1", "\u0080", "\u00f6", "\u05d3\u05bc", "\u20ac", "\U0001f600"]
    assert encoded == "{" + ",".join(f'"{key}":0' for key in order) + "}"
    assert canonical_json({"\ufb00": 0, "\U0001f600": 0}) == '{"\U0001f600":0,"\ufb00":0}'.encode()


@pytest.mark.parametrize(
    ("number", "text"),
    [
        (0.0, "0"),
        (-0.0, "0"),
        (10.0, "10"),
        (1e20, "100000000000000000000"),
        (1e21, "1e+21"),
        (1e-6, "0.000001"),
        (1e-7, "1e-7"),
        (123e-20, "1.23e-18"),
        (5e-324, "5e-324"),
        (1.7976931348623157e308, "1.7976931348623157e+308"),
        (-1.5, "-1.5"),
        (2**60, "1152921504606846976"),
        (9007199254740993, "9007199254740993"),
        (Decimal("10.00"), "10"),
        (Decimal("0.5"), "0.5"),
    ],
)
def test_canonical_json__numbers_use_the_shortest_round_trip_form(number, text):
    assert canonical_json(number).decode() == text


def test_canonical_json__same_value_same_hash_whatever_the_spelling():
    one, other = {"a": 10, "b": "e\u0301"}, {"b": "\u00e9", "a": 10.0}
    assert hash_bytes(canonical_json(one), "s") == hash_bytes(canonical_json(other), "s")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (float("nan"), "not a JSON number"),
        ({"a": [float("inf")]}, r"\$\.a\[0\]"),
        ({1: "x"}, "not text"),
        (object(), "has no canonical JSON form"),
        (b"bytes", "has no canonical JSON form"),
        ("\udcff", "lone surrogate"),
        ({"e\u0301": 1, "\u00e9": 2}, "normalise"),
    ],
)
def test_canonical_json__values_without_a_canonical_form_are_refused(value, reason):
    with pytest.raises(PayloadNotHashable, match=reason):
        canonical_json(value)


def test_canonical_json__refuses_absurd_nesting_instead_of_recursing_forever():
    value: list = []
    for _ in range(500):
        value = [value]
    with pytest.raises(PayloadNotHashable, match="nested deeper"):
        canonical_json(value)
