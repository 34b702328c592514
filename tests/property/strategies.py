"""Hypothesis strategies for hostile identity values and payloads, and the rules (written
down independently of the library) that say which of them are usable.

An identity value is usable when it is text, not empty (a tenant may be), within its
length limit, free of control characters and lone surrogates, and without surrounding
white space. A payload is usable when it has a canonical JSON form: JSON values only,
finite numbers, no lone surrogates, text keys (RFC 8785 normalises nothing, so keys
that are one string once normalised are two keys), nested less deep than the
interpreter can recurse.
"""

from __future__ import annotations

import math
import re
from typing import Any

from hypothesis import strategies as st

__all__ = [
    "identity_value",
    "payload",
    "produced_at",
    "usable_name",
    "usable_payload",
    "usable_timestamp",
]

NAME_LIMIT, MESSAGE_ID_LIMIT, NESTING_LIMIT = 128, 256, 500
_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")

SQL = [
    "'; DROP TABLE consumer_inbox; --",
    "o'brien",
    'x" OR "1"="1',
    "%s %(x)s :param $1 ?",
    "\\",
]
STRANGE = [
    "",
    " ",
    " leading",
    "trailing ",
    "tab\tinside",
    "nul\x00inside",
    "\udc80",
    "ünïcödé-Ω-✓",
    "e\u0301",  # decomposed: not NFC
    "\u200b",  # zero-width space: printable, not white space to str.strip
    "\x85next-line",
    "emoji-🙂",
]


FAULTS = [None, None, None, "producer", "message_id", "tenant", "produced_at", "payload"]
FAULTS += ["missing", "extra"]
"""What is wrong with a generated message: mostly nothing, else one thing."""


def usable_producer() -> st.SearchStrategy[str]:
    return st.sampled_from(["orders", "orders", "orders", "o'brien", "ünïcödé-Ω-✓"])


def usable_id() -> st.SearchStrategy[str]:
    """A few ids, so that intents repeat (duplicates) and collide (conflicts)."""
    return st.sampled_from(["o-1", "o-1", "o-2", "o-2", SQL[0], SQL[3], "\u200b", "emoji-🙂"])


def small_payload() -> st.SearchStrategy[Any]:
    """A few payloads, two of them equal once canonical (1 and 1.0)."""
    return st.sampled_from([{"delta": 1}, {"delta": 2}, {"delta": 1.0}, {"Δ": "'; --"}])


def identity_value(limit: int) -> st.SearchStrategy[Any]:
    """A value for an identity field: mostly text around the limit, sometimes another type."""
    return st.one_of(
        st.sampled_from(SQL + STRANGE),
        st.text(max_size=40),
        st.integers(limit - 2, limit + 2).map(lambda n: "x" * n),
        st.integers(1_000, 100_000).map(lambda n: "y" * n),
        st.integers(-(2**70), 2**70),
        st.none(),
        st.booleans(),
        st.lists(st.text(max_size=3), max_size=2),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
        st.floats(allow_nan=True),
    )


def produced_at() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.sampled_from(
            [
                "2024-05-01T12:00:00+00:00",
                "2024-05-01T12:00:00",  # no time zone
                "0001-01-01T00:00:00+14:00",  # before year 1 in UTC
                "9999-12-31T23:59:59-14:00",  # after year 9999 in UTC
                "yesterday",
                "",
            ]
        ),
        st.integers(),
    )


def usable_name(value: object, limit: int, allow_empty: bool = False) -> bool:
    return (
        isinstance(value, str)
        and (allow_empty or value != "")
        and len(value) <= limit
        and not _FORBIDDEN.search(value)
        and value.strip() == value
    )


def usable_timestamp(value: object) -> bool:
    if value is None:
        return True
    if not isinstance(value, str) or not usable_name(value, 64):
        return False
    from datetime import UTC, datetime

    try:
        parsed = datetime.fromisoformat(value)
        return parsed.utcoffset() is not None and parsed.astimezone(UTC).year >= 1
    except (ValueError, OverflowError):
        return False


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(SQL + STRANGE),
)


def _nest(depth: int) -> Any:
    value: Any = {"leaf": 1}
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def payload() -> st.SearchStrategy[Any]:
    """Small fixed payloads (so intents repeat and conflict), nested JSON, huge values,
    deep nesting, keys that are one string once normalised."""
    return st.one_of(
        st.sampled_from([{"delta": 1}, {"delta": 2}, {"delta": 1.0}, [], {}, "", 0]),
        st.recursive(
            _leaf,
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(st.text(max_size=8), inner, max_size=4)
            ),
            max_leaves=12,
        ),
        st.integers(50_000, 400_000).map(lambda n: {"blob": "z" * n}),
        st.sampled_from([20, 100, 200, 300]).map(_nest),
        st.just({"e\u0301": 1, "\u00e9": 2}),  # NFD and NFC spellings of one key
    )


def usable_payload(value: object, depth: int = 0) -> bool:
    """Whether ``value``, placed ``depth`` levels deep, has a canonical JSON form."""
    if value is None or isinstance(value, bool | int):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return not re.search(r"[\ud800-\udfff]", value)
    if isinstance(value, list):
        return depth < NESTING_LIMIT and all(usable_payload(v, depth + 1) for v in value)
    if isinstance(value, dict):
        keys = [k for k in value if isinstance(k, str) and usable_payload(k)]
        return (
            depth < NESTING_LIMIT
            and len(keys) == len(value)
            and all(usable_payload(v, depth + 1) for v in value.values())
        )
    return False


def lags() -> st.SearchStrategy[list[int]]:
    """Milliseconds each message of a batch (up to 16) waits before the inbox, so that
    copies of one intent reach their claims in any order."""
    return st.lists(st.integers(0, 15), min_size=16, max_size=16)


def fates_by_claim(usable: list[tuple[str, Any, Any]], applied: set[str]) -> dict[str, str]:
    """The fate each usable message (``(id, intent, payload form)``) must have, given the
    ids ``applied``: of an intent's copies exactly one, whichever claimed first; the others
    ``duplicate`` with its payload form, ``conflict`` with another."""
    winner: dict[Any, Any] = {}
    for mid, key, form in usable:
        if mid in applied:
            assert key not in winner, f"{key!r}: two copies applied"
            winner[key] = form
    fates = {}
    for mid, key, form in usable:
        assert key in winner, f"{key!r}: no copy applied"
        if mid in applied:
            fates[mid] = "applied"
        else:
            fates[mid] = "duplicate" if winner[key] == form else "conflict"
    return fates
