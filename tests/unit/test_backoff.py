"""One backoff formula, with the delays each of its users had before it."""

from __future__ import annotations

import tenacity

from inbox_middleware._core.consumption import HandBackDelays, backoff_delay
from inbox_middleware.outbox._dispatcher import Backoff


def test_backoff__hand_back_delays_double_per_message_up_to_the_limit() -> None:
    delays = HandBackDelays(0.5, 30.0)
    assert [delays.next("m") for _ in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert delays.next("other") == 0.5  # the count is per message
    delays.forget("m")
    assert delays.next("m") == 0.5


def test_backoff__the_outbox_keeps_its_delays_by_stored_attempt_count() -> None:
    backoff = Backoff(base=1.0, factor=3.0, cap=300.0, jitter=0.0)
    assert [backoff.delay(n) for n in (0, 1, 2, 3, 6, 7, 100)] == [1, 1, 3, 9, 243, 300, 300]


def test_backoff__re_enqueue_waits_as_tenacitys_exponential_did() -> None:
    before = tenacity.wait_exponential(multiplier=0.1, max=5)
    for attempt in range(1, 12):
        state = tenacity.RetryCallState(None, None, (), {})
        state.attempt_number = attempt
        assert backoff_delay(0.1, 5.0, attempt) == before(state)
