"""The compact claim's decisions, without a database: the key and the time it carries,
what a stored compact claim means to the protocol, and where a worker claims."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from inbox_middleware._core import claims
from inbox_middleware._core.claims import ClaimsPhase, ClaimsTable, claims_phase
from inbox_middleware._core.identity import MessageIdentity, PayloadHash
from inbox_middleware._core.protocol import Decision, Delivery, StoredClaim, compare


def uuid7(milliseconds: int) -> str:
    value = (milliseconds << 80) | (0x7 << 76) | (0b10 << 62) | 0x123456789ABC
    return str(uuid.UUID(int=value))


def ulid(milliseconds: int) -> str:
    alphabet = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    value = (milliseconds << 80) | 0xABCDEF
    return "".join(alphabet[(value >> (5 * (25 - i))) & 31] for i in range(26))


NOW = int(datetime(2026, 12, 1, tzinfo=UTC).timestamp() * 1000)


@pytest.mark.parametrize("make", [uuid7, ulid], ids=["uuid7", "ulid"])
def test_id_time__read_from_uuid7_and_ulid(make):
    assert claims.id_milliseconds(make(NOW)) == NOW
    assert claims.id_milliseconds(make(NOW).lower()) == NOW


@pytest.mark.parametrize(
    "message_id",
    [
        "0e9b5c1a-2f4e-4d8a-9c3b-7a1d2e3f4a5b",  # version 4: no time
        "8eb0d70a-f0b9-11f1-ae15-02fc00000001",  # version 1: a time, but not in order
        "order-1",
        "",
        "g" * 26,
        uuid7(NOW).replace("-", ""),  # not the canonical form
        "8" + ulid(NOW)[1:],  # beyond 48 bits
    ],
)
def test_id_time__none_for_other_ids(message_id):
    assert claims.id_milliseconds(message_id) is None


def test_claim_key__time_first_then_the_identity_digest():
    key = claims.claim_key("billing", "orders", "", uuid7(NOW))
    later = claims.claim_key("billing", "orders", "", uuid7(NOW + 1))
    assert len(key) == 16 and int.from_bytes(key[:6]) == NOW
    assert key < later  # keys rise with the id's time
    # every part of the identity counts, and the separator cannot be forged
    parts = ("billing", "orders", "", "order-1")
    keys = {
        claims.claim_key(*parts),
        claims.claim_key("billing2", "orders", "", "order-1"),
        claims.claim_key("billing", "orders", "t", "order-1"),
        claims.claim_key("billing", "ordersorder-1", "", ""),
    }
    assert len(keys) == 4 and all(len(k) == 16 for k in keys)


def test_claim_key__an_id_without_a_time_leads_with_zeros_before_every_timed_key():
    key = claims.claim_key("billing", "orders", "", "order-1")
    assert key[:6] == bytes(6)
    assert key < claims.claim_key("billing", "orders", "", uuid7(1))


def delivery(sha: str, scheme: str = "faststream-json.v2", rehash=None) -> Delivery:
    return Delivery(
        "billing", MessageIdentity("orders", "m-1"), PayloadHash(scheme, sha), rehash=rehash
    )


def compact(sha: str, scheme: str) -> StoredClaim:
    tag = claims.scheme_tag(claims.scheme_code(scheme))
    return StoredClaim(claims.payload_digest(sha), tag, "", None)


def test_compare__a_compact_claim_of_the_same_payload_is_a_duplicate():
    sha = "ab" * 32
    assert compare(compact(sha, "faststream-json.v2"), delivery(sha)) == (Decision.DUPLICATE, True)


def test_compare__a_compact_claim_of_another_payload_is_a_conflict():
    stored = compact("ab" * 32, "faststream-json.v2")
    assert compare(stored, delivery("ab" * 16 + "cd" * 16)) == (Decision.DUPLICATE, True)
    assert compare(stored, delivery("cd" * 32)) == (Decision.CONFLICT, True)


def test_compare__a_compact_claim_of_a_known_older_scheme_is_recomputed():
    old = "11" * 32
    current = delivery("22" * 32, rehash={"faststream-json.v1": old}.get)
    assert compare(compact(old, "faststream-json.v1"), current) == (Decision.DUPLICATE, True)
    assert compare(compact("33" * 32, "faststream-json.v1"), current) == (Decision.CONFLICT, True)


def test_compare__a_compact_claim_of_an_unknown_scheme_is_an_unverified_duplicate():
    stored = compact("11" * 32, "someone-else.v9")
    assert compare(stored, delivery("22" * 32)) == (Decision.DUPLICATE, False)


def test_stored_scheme__names_pass_through_and_codes_are_read_back():
    assert claims.stored_scheme("json.v1", "x") == "json.v1"
    assert claims.stored_scheme(claims.scheme_tag(claims.scheme_code("mine")), "mine") == "mine"
    code = claims.scheme_code("dramatiq.v1")
    assert claims.stored_scheme(claims.scheme_tag(code), "other") == "dramatiq.v1"
    assert claims.stored_scheme("code:nonsense", "x") is None
    assert -32768 <= code <= 32767


@pytest.mark.parametrize(
    ("configured", "switched", "library_rows", "phase"),
    [
        (ClaimsTable.LIBRARY, False, True, ClaimsPhase.LIBRARY),
        (ClaimsTable.LIBRARY, True, False, ClaimsPhase.LIBRARY),
        (ClaimsTable.COMPACT, False, True, ClaimsPhase.BOTH),
        (ClaimsTable.COMPACT, False, False, ClaimsPhase.BOTH),
        (ClaimsTable.COMPACT, True, True, ClaimsPhase.COMPACT_CHECKING),
        (ClaimsTable.COMPACT, True, False, ClaimsPhase.COMPACT),
    ],
)
def test_claims_phase__from_the_setting_and_the_record(configured, switched, library_rows, phase):
    assert claims_phase(configured, switched=switched, library_rows=library_rows) is phase
