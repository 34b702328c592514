"""The payload hash scheme (RFC 8785) and the exact forms of values JSON has no form for."""

import dataclasses
import enum
import hashlib
import struct
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from uuid import UUID

import pydantic
import pytest
import rfc8785
from dramatiq import Message
from hypothesis import given, settings
from hypothesis import strategies as st

import inbox_middleware
from inbox_middleware._core.canonical import NotJSON, canonical_json, digest, loads
from inbox_middleware._core.canonical_v1 import canonical_json as canonical_v1
from inbox_middleware._core.exceptions import PayloadNotHashable
from inbox_middleware._core.identity import MessageIdentity
from inbox_middleware._core.protocol import Decision, Delivery, StoredClaim, compare
from inbox_middleware.dramatiq._payload import SCHEME, V1_SCHEME, ActorPayload, CanonicalForm
from inbox_middleware.faststream import _payload as faststream_payload
from inbox_middleware.faststream._payload import JSON_SCHEME, JSON_V1_SCHEME, RAW_SCHEME

APPENDIX_B_DOUBLE = struct.unpack(">d", bytes.fromhex("4415af1d78b58c3f"))[0]


def add_credit(account_id: int, amount: object) -> None: ...


ACTOR = ActorPayload("add_credit", add_credit, None)


def dramatiq_digest(**arguments: object) -> str:
    return ACTOR.builtin(dict(arguments)).sha256


def faststream_digest(body: bytes) -> str:
    return faststream_payload.builtin_hash(body).sha256


# -- the three cases the v1 form got wrong (each failed before this scheme) ------------------


def test_hash__doubles_are_written_as_ecmascript_writes_them():
    assert inbox_middleware.canonical_json(2.0**60) == b"1152921504606847000"
    assert inbox_middleware.canonical_json(APPENDIX_B_DOUBLE) == b"99999999999999980000"
    # the adapters' digests are those of the RFC 8785 text
    expected = hashlib.sha256(
        b'{"actor":"add_credit","args":{"account_id":1,"amount":1152921504606847000}}'
    )
    assert dramatiq_digest(account_id=1, amount=2.0**60) == expected.hexdigest()
    assert faststream_digest(b"[99999999999999983616.0]") == digest([99999999999999980000.0])
    assert (
        faststream_digest(b"[99999999999999983616.0]")
        == hashlib.sha256(b"[99999999999999980000]").hexdigest()
    )


def test_hash__strings_are_not_unicode_normalised():
    assert inbox_middleware.canonical_json("e\u0301") == '"e\u0301"'.encode()
    assert dramatiq_digest(account_id=1, amount="e\u0301") != dramatiq_digest(
        account_id=1, amount="\u00e9"
    )
    assert faststream_digest('{"k": "e\u0301"}'.encode()) != faststream_digest(
        '{"k": "\u00e9"}'.encode()
    )


def test_hash__a_decimal_is_hashed_exactly_not_through_a_float():
    assert inbox_middleware.canonical_json(Decimal("100.00000000000000001")) != (
        inbox_middleware.canonical_json(Decimal("100"))
    )
    assert dramatiq_digest(account_id=1, amount=Decimal("100.00000000000000001")) != (
        dramatiq_digest(account_id=1, amount=Decimal("100"))
    )


# -- RFC 8785, as the rfc8785 package writes it ---------------------------------------------


def test_canonical_json__is_the_rfc8785_package_for_json_values():
    value = {"z": [1, 2.5, -0.0, None, True], "a": {"\u20ac": "x", "\r": 1e21}, "é": "\U0001f600"}
    assert canonical_json(value) == rfc8785.dumps(value)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (2**53, "9007199254740992"),
        (2**63 + 1, "9223372036854775809"),
        (-(2**70), "-1180591620717411303424"),
        (
            {"ids": [2**64, 1.5, "x"], "n": 2**60},
            '{"ids":[18446744073709551616,1.5,"x"],"n":1152921504606846976}',
        ),
    ],
)
def test_canonical_json__integers_beyond_the_safe_range_keep_their_exact_digits(value, text):
    # The one deviation from RFC 8785 (which reads them as doubles: rfc8785 refuses them).
    assert canonical_json(value).decode() == text
    with pytest.raises(rfc8785.IntegerDomainError):
        rfc8785.dumps(value)


def test_canonical_json__integers_in_the_safe_range_are_rfc8785s():
    for value in (2**53 - 1, -(2**53 - 1), 0, -1):
        assert canonical_json(value) == rfc8785.dumps(value)


def test_canonical_json__distinct_64_bit_ids_never_collapse():
    assert canonical_json(2**60) != canonical_json(2**60 + 1)


# -- the documented forms of values JSON has no form for ------------------------------------


class Colour(enum.Enum):
    RED = "red"
    NUMBERED = 3


class Level(enum.IntEnum):
    HIGH = 2


@dataclasses.dataclass
class Line:
    sku: str
    qty: int = 1


class Order(pydantic.BaseModel):
    id: str
    total: Decimal
    note: str = "none"
    at: datetime | None = None


PARIS = timezone(timedelta(hours=1))


@pytest.mark.parametrize(
    ("value", "form"),
    [
        (Decimal("100.00000000000000001"), "100.00000000000000001"),
        (Decimal("100"), "100"),
        (Decimal("100.00"), "100"),
        (Decimal("1E+3"), "1000"),
        (Decimal("-0.0012300"), "-0.00123"),
        (Decimal("-0"), "0"),
        (Decimal("0E-7"), "0"),
        (Decimal("1.5"), "1.5"),
        (datetime(2026, 12, 1, 10, 30, tzinfo=PARIS), "2026-12-01T09:30:00Z"),
        (datetime(2026, 12, 1, 9, 30, tzinfo=UTC), "2026-12-01T09:30:00Z"),
        (datetime(2026, 12, 1, 9, 30, 0, 500, tzinfo=UTC), "2026-12-01T09:30:00.000500Z"),
        (datetime(2026, 12, 1, 9, 30), "2026-12-01T09:30:00"),
        (date(2026, 12, 1), "2026-12-01"),
        (time(9, 30, 5), "09:30:05"),
        (UUID("0F8FAD5B-D9CB-469F-A165-70867728950E"), "0f8fad5b-d9cb-469f-a165-70867728950e"),
        (b"\x00\xffhi", "AP9oaQ=="),
        (bytearray(b"ab"), "YWI="),
        (Colour.RED, "red"),
    ],
)
def test_canonical_json__non_json_scalars_have_one_exact_text_form(value, form):
    assert canonical_json(value) == rfc8785.dumps(form)
    assert canonical_json({"v": value}) == rfc8785.dumps({"v": form})


def test_canonical_json__containers_and_objects_have_documented_forms():
    assert canonical_json((1, "a")) == b'[1,"a"]'
    assert canonical_json({3, 1, "b"}) == canonical_json(frozenset({"b", 1, 3})) == b'["b",1,3]'
    assert canonical_json([Colour.NUMBERED, Level.HIGH]) == b"[3,2]"
    assert canonical_json({Colour.RED: 1}) == b'{"red":1}'
    assert canonical_json(Line("A-1")) == b'{"qty":1,"sku":"A-1"}'
    # a model hashes what was set: an omitted default is not the default written out
    assert canonical_json(Order(id="o-1", total=Decimal("9.90"))) == b'{"id":"o-1","total":"9.9"}'
    assert canonical_json(Order(id="o-1", total=Decimal("9.9"), note="none")) == (
        b'{"id":"o-1","note":"none","total":"9.9"}'
    )
    nested = {"order": Order(id="o", total=Decimal(1), at=datetime(2026, 1, 1, tzinfo=UTC))}
    assert canonical_json(nested) == b'{"order":{"at":"2026-01-01T00:00:00Z","id":"o","total":"1"}}'


def test_canonical_json__aware_datetimes_of_one_instant_hash_alike_naive_ones_do_not():
    aware = datetime(2026, 12, 1, 10, 30, tzinfo=PARIS)
    assert digest(aware) == digest(aware.astimezone(UTC))
    assert digest(aware.replace(tzinfo=None)) != digest(aware)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (float("nan"), r"nan at \$ is not a JSON number"),
        ({"a": [float("inf")]}, r"\$\.a\[0\]"),
        ({1: "x"}, "not text"),
        (object(), "object at \\$ has no canonical form"),
        (timedelta(1), "timedelta"),
        ("\udcff", "lone surrogate"),
        ({"k": "\ud800"}, r"lone surrogate"),
        (Decimal("NaN"), "not a number"),
        (Decimal("1E+5000"), "digits"),
        (datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=14))), "out of range"),
    ],
)
def test_canonical_json__values_without_a_canonical_form_are_refused(value, reason):
    with pytest.raises(PayloadNotHashable, match=reason):
        canonical_json(value)


def test_canonical_json__refuses_absurd_nesting_instead_of_crashing():
    value: list = []
    for _ in range(5000):
        value = [value]
    with pytest.raises(PayloadNotHashable, match="nested too deeply"):
        canonical_json(value)
    with pytest.raises(PayloadNotHashable, match="nested too deeply"):
        canonical_json([value, Decimal(1)])


# -- reading a body ---------------------------------------------------------------------------


def test_loads__integers_exact_numbers_with_a_fraction_as_doubles():
    assert loads(b"[12345678901234567890, 100.00000000000000001, 1e2]") == [
        12345678901234567890,
        100.0,
        100.0,
    ]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"a": NaN}', "NaN is not a JSON number"),
        (b"[Infinity]", "Infinity"),
        (b'{"a": 1, "a": 2}', "repeats the object key 'a'"),
        (b"[" + b"1" * 5000 + b"]", "too long"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
)
def test_loads__json_without_a_canonical_form_is_refused(body, reason):
    with pytest.raises(PayloadNotHashable, match=reason):
        loads(body)


@pytest.mark.parametrize("body", [b"\xff\xfe", b"not json", b"", b'{"a": 1', b"\xef\xbb\xbf{}"])
def test_loads__what_is_not_json_text_says_so(body):
    with pytest.raises(NotJSON):
        loads(body)


# -- the FastStream body: JSON, bytes, and no silent fallback --------------------------------


def test_faststream_hash__a_json_body_without_a_canonical_form_is_refused_not_hashed_as_bytes():
    for body in (b'{"a": NaN}', b'{"a": 1, "a": 2}', b'["\\ud800"]', b"[1e400]"):
        with pytest.raises(PayloadNotHashable):
            faststream_payload.builtin_hash(body)


def test_faststream_hash__a_body_that_is_not_json_is_hashed_as_its_bytes():
    assert faststream_payload.builtin_hash(b"\x00\x01binary") == faststream_payload.PayloadHash(
        RAW_SCHEME, hashlib.sha256(b"\x00\x01binary").hexdigest()
    )
    assert faststream_payload.builtin_hash(b'{"b":1, "a":2}').scheme == JSON_SCHEME


# -- older schemes stay comparable -----------------------------------------------------------


def message(**arguments: object) -> Message:
    return Message(queue_name="q", actor_name="add_credit", args=(), kwargs=arguments, options={})


def test_dramatiq_rehash__a_v1_claim_is_compared_under_v1():
    arguments = {"account_id": 1, "amount": 2.0**60}
    v1 = hashlib.sha256(canonical_v1({"actor": "add_credit", "args": arguments})).hexdigest()
    assert ACTOR.builtin(arguments).scheme == SCHEME
    assert ACTOR.builtin(arguments).sha256 != v1  # the forms differ for this payload
    assert ACTOR.rehash(arguments, V1_SCHEME) == v1
    assert ACTOR.rehash(arguments, "dramatiq.v0") is None
    # a payload v1 could not hash is not the payload a v1 claim holds
    assert ACTOR.rehash({"account_id": 1, "amount": datetime(2026, 1, 1)}, V1_SCHEME) == ""


def test_faststream_rehash__a_v1_claim_is_compared_under_v1():
    body = '{"name": "e\u0301", "n": 1152921504606846976.0}'.encode()
    digest_v2, rehash = faststream_payload.payload_hash(body, {}, None)
    v1 = hashlib.sha256(canonical_v1(loads(body))).hexdigest()
    assert digest_v2.sha256 != v1
    assert rehash(JSON_V1_SCHEME) == v1
    assert rehash(JSON_SCHEME) == digest_v2.sha256
    assert rehash(RAW_SCHEME) == hashlib.sha256(body).hexdigest()


@pytest.mark.parametrize("body", [b"", b"\xff\xfe", b"plain text", b"[1,"])
def test_faststream_rehash__a_body_that_is_not_json_is_not_the_payload_of_a_json_claim(body):
    # A copy that is not JSON met a claim hashed as JSON: no form under that scheme, so a
    # conflict, where it used to raise NotJSON and fail at every redelivery.
    ours, rehash = faststream_payload.payload_hash(body, {}, None)
    assert ours.scheme == RAW_SCHEME
    assert rehash(JSON_SCHEME) == ""
    assert rehash(JSON_V1_SCHEME) == ""
    json_claim = faststream_payload.builtin_hash(b'{"delta":2}')
    assert json_claim.scheme == JSON_SCHEME
    copy = Delivery("billing", MessageIdentity("orders", "o-1"), ours, rehash=rehash)
    stored = StoredClaim(json_claim.sha256, JSON_SCHEME, "1", datetime.now(UTC))
    assert compare(stored, copy) == (Decision.CONFLICT, True)


def test_custom_forms__a_json_valued_form_is_versioned_with_the_canonical_json():
    form = CanonicalForm("credit.v1", lambda name, args: {"amount": args["amount"]})
    actor = ActorPayload("add_credit", add_credit, form)
    arguments = {"account_id": 1, "amount": "e\u0301"}
    hashed = actor.hash(arguments)
    assert hashed.scheme == "custom.v2:credit.v1"
    assert hashed.sha256 == digest({"amount": "e\u0301"})
    old = hashlib.sha256(canonical_v1({"amount": "e\u0301"})).hexdigest()
    assert actor.rehash(arguments, "custom:credit.v1") == old != hashed.sha256
    as_bytes = ActorPayload("add_credit", add_credit, CanonicalForm("b", lambda n, a: b"x"))
    assert as_bytes.hash(arguments).scheme == "custom:b"


# -- the standard library's writer for plain JSON, byte for byte rfc8785's ----------------


def _same_form(value: object) -> None:
    """canonical_json and the rfc8785-only form agree, or refuse alike."""
    from inbox_middleware._core.canonical import _rfc8785_form

    try:
        expected: object = _rfc8785_form(value)
    except Exception as exc:
        expected = type(exc)
    try:
        got: object = canonical_json(value)
    except Exception as exc:
        got = type(exc)
    assert got == expected, value


_TEXT = st.text(st.characters(codec=None, categories=None), max_size=12)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**54), max_value=2**54)
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | _TEXT
    | st.sampled_from(["\x00", "\x1f", "\x7f", "\u2028", "\ud800", '"\\/', "\U0001f600", "\ufffd"])
)
_KEYS = _TEXT | st.sampled_from(["a", "b", "\ue000", "\U0001f600", "é", "A", "_", ""])
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(_KEYS, inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=3000, deadline=None)
@given(_JSON)
def test_canonical_json__the_plain_writer_is_rfc8785s_form_byte_for_byte(value):
    _same_form(value)


def _nested(depth: int) -> object:
    value: object = "deep"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "value",
    [
        {"\U0001f600": 1, "\ue000": 2},  # UTF-16 order is not code point order here
        {"b": [1, 2**53 - 1, -(2**53) + 1], "a": {"z": None, "y": True}},
        [2**53, -(2**53)],  # beyond the safe integers: exact digits
        {"a": 1.0, "b": 1e21, "c": -0.0},  # floats: ECMAScript's form
        {"s": '\x00\x08\x0c\n\r\t\x1f\x7f"\\/é\u2028'},
        ["lone \ud800 surrogate"],
        _nested(70),  # deeper than the plain writer goes
        ("tuple", True),
        {"k": Decimal("1.5")},
    ],
)
def test_canonical_json__edge_values_take_the_same_form(value):
    _same_form(value)


@pytest.mark.parametrize("value", [{"\ud800": 1}, {"a": {"\udfff": None}}, [{"\ud83d": "x"}]])
def test_canonical_json__a_lone_surrogate_in_a_key_has_no_form(value):
    # A JSON body may escape one ("\ud800"), which json reads as a lone surrogate.
    with pytest.raises(PayloadNotHashable, match="lone surrogate"):
        canonical_json(value)
