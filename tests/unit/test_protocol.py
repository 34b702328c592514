from datetime import UTC, datetime

import pytest

from inbox_middleware._core.exceptions import TransactionConflict
from inbox_middleware._core.identity import MessageIdentity, PayloadHash
from inbox_middleware._core.protocol import (
    Claim,
    Decision,
    Delivery,
    LookUp,
    QuarantineRecord,
    RecordConflict,
    StoredClaim,
    claim_steps,
)


def delivery(sha="a" * 64, scheme="json.v1", rehash=None):
    return Delivery(
        "billing", MessageIdentity("orders", "m-1"), PayloadHash(scheme, sha), rehash=rehash
    )


def stored(sha="a" * 64, scheme="json.v1"):
    return StoredClaim(sha, scheme, "1", datetime.now(UTC))


def run(steps, answers):
    """Drive the step machine with canned storage answers; return (steps, verdict)."""
    seen = [next(steps)]
    try:
        for answer in answers:
            seen.append(steps.send(answer))
    except StopIteration as done:
        return seen, done.value
    raise AssertionError(f"machine wants more after {seen}")


def test_claim__inserted_row_means_first():
    seen, verdict = run(claim_steps(delivery()), [True])
    assert [type(s) for s in seen] == [Claim]
    assert verdict.decision is Decision.FIRST


def test_claim__same_hash_is_a_duplicate():
    seen, verdict = run(claim_steps(delivery()), [False, stored()])
    assert [type(s) for s in seen] == [Claim, LookUp]
    assert (verdict.decision, verdict.verified) == (Decision.DUPLICATE, True)


def test_claim__different_hash_is_a_conflict_and_is_recorded():
    seen, verdict = run(
        claim_steps(delivery(sha="b" * 64)), [False, stored(), QuarantineRecord(7, 2)]
    )
    assert [type(s) for s in seen] == [Claim, LookUp, RecordConflict]
    assert verdict.decision is Decision.CONFLICT
    assert verdict.quarantine == QuarantineRecord(7, 2)


def test_claim__older_scheme_is_recomputed_not_called_a_conflict():
    current = delivery(sha="b" * 64, scheme="v2", rehash={"v1": "a" * 64}.get)
    _, verdict = run(claim_steps(current), [False, stored(scheme="v1")])
    assert (verdict.decision, verdict.verified) == (Decision.DUPLICATE, True)


def test_claim__unknown_scheme_is_an_unverified_duplicate():
    _, verdict = run(claim_steps(delivery(scheme="v2")), [False, stored(scheme="v0")])
    assert (verdict.decision, verdict.verified) == (Decision.DUPLICATE, False)


def test_claim__row_purged_between_insert_and_lookup_is_claimed_again():
    seen, verdict = run(claim_steps(delivery()), [False, None, True])
    assert [type(s) for s in seen] == [Claim, LookUp, Claim]
    assert verdict.decision is Decision.FIRST


def test_claim__gives_up_when_the_row_keeps_vanishing():
    steps = claim_steps(delivery())
    next(steps)

    def answer_forever() -> None:
        for answer in [False, None] * 10:
            steps.send(answer)

    with pytest.raises(TransactionConflict):
        answer_forever()
