"""The harness's verdict on one message, on hand-made end states: it must see a message
dropped, applied twice, applied with another payload, or a conflicting copy lost."""

from __future__ import annotations

import pytest

from .harness import Message, State, _verdict
from .matrix import ROWS

ROW = {row.name: row for row in ROWS}


def _state(journal=None, poison=None, quarantine=None) -> State:
    return State(journal or {}, poison or {}, quarantine or {})


def _first(message_id: str = "m1") -> Message:
    return Message(ROW["commit"], message_id, 7, 10)


def test_verdict__applied_once_with_its_payload_passes() -> None:
    assert _verdict(_first(), _state({"m1": [(7, 10)]}), [], [], {}) == ([], [])


def test_verdict__acked_without_effect_or_record_is_dropped() -> None:
    problems, _ = _verdict(_first(), _state(), [], [], {"q": 0})
    assert problems == [
        "dropped: acked with neither its effect nor a record (no journal, poison, "
        "quarantine row or copy)"
    ]


def test_verdict__still_in_the_broker_is_not_settled() -> None:
    problems, _ = _verdict(_first(), _state(), [], [], {"q": 1})
    assert problems == ["not settled: 1 message(s) still in the broker"]


def test_verdict__applied_twice_or_with_another_payload_fails() -> None:
    problems, _ = _verdict(_first(), _state({"m1": [(7, 11), (7, 10)]}), [], [], {})
    assert problems == ["applied 2 times", "applied with another payload (7, 11) than the first"]


def test_verdict__poisoned_intent_passes_with_a_note() -> None:
    problems, notes = _verdict(_first(), _state(poison={"m1": "inbox_error"}), [], [], {})
    assert problems == []
    assert notes == [
        "poisoned (inbox_error), not applied",
        "no copy at the dead-letter destination",
    ]


def test_verdict__refused_intent_needs_a_poison_row_or_a_dead_letter_copy() -> None:
    refused = Message(ROW["record (poison)"], "m2", 1001, 10)
    assert _verdict(refused, _state(poison={"m2": "unknown_account"}), [], [("m2", {})], {}) == (
        [],
        [],
    )
    problems, _ = _verdict(refused, _state(), [], [], {})
    assert problems and problems[0].startswith("dropped")


def test_verdict__conflicting_copy_needs_a_quarantine_record() -> None:
    conflict = Message(ROW["quarantine_publish"], "m3", 7, 10, conflicting_delta=11)
    applied = {"m3": [(7, 10)]}
    quarantined = _state(applied, quarantine={"m3": ("pending", "identity_conflict")})
    assert _verdict(conflict, quarantined, [("m3", {})], [], {}) == ([], [])
    problems, _ = _verdict(conflict, _state(applied), [], [], {})
    assert problems == ["conflicting copy lost: no quarantine row, no quarantined message"]
    problems, _ = _verdict(conflict, _state({"m3": [(7, 11)]}), [], [], {})
    assert "applied with another payload (7, 11) than the first" in problems


@pytest.mark.parametrize(
    ("found", "lost"), [([(None, {"account": 7, "delta": 10})], False), ([], True)]
)
def test_verdict__message_without_identity_must_reach_the_dead_letter_destination(
    found, lost: bool
) -> None:
    noid = Message(ROW["dead_letter_publish (no id)"], None, 7, 10)
    problems, _ = _verdict(noid, _state(), [], found, {})
    assert bool(problems) is lost
