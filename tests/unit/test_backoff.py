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


def test_backoff__a_database_found_down_holds_its_hand_backs_for_its_pause() -> None:
    from inbox_middleware._core.consumption import HandBackRequested, HandedBack
    from inbox_middleware._core.exceptions import DatabaseUnavailable, RouteUnavailable

    down = DatabaseUnavailable("db2 did not answer")
    down.retry_after = 4.0
    waits = {key: HandedBack(down, counted=False).wait(key, lambda: 0.2) for key in range(50)}
    # never sooner than the pause, spread over one more pause by the message's key
    assert all(4.0 <= wait < 8.0 for wait in waits.values())
    assert max(waits.values()) - min(waits.values()) > 2.0
    assert HandedBack(down, counted=False).wait(7, lambda: 0.2) == waits[7]
    # a backoff longer than the pause wins; without a pause the backoff alone decides
    assert HandedBack(down, counted=False).wait(7, lambda: 30.0) == 30.0
    assert HandedBack(DatabaseUnavailable("x"), counted=False).wait(7, lambda: 0.2) == 0.2
    # a database whose pool is taken by hung deliveries holds its hand-backs as well
    busy = RouteUnavailable("db2 holds 4 deliveries already")
    busy.retry_after = 1.0
    assert 1.0 <= HandedBack(busy, counted=False).wait(7, lambda: 0.2) < 2.0
    # refused late in a long pause: spread over the whole pause after it, not over what
    # is left of it (all of them just after the pause: a wave through the shared queue)
    late = DatabaseUnavailable("db2 did not answer")
    late.retry_after, late.retry_spread = 0.5, 10.0
    waits = {key: HandedBack(late, counted=False).wait(key, lambda: 0.2) for key in range(50)}
    assert all(0.5 <= wait < 10.5 for wait in waits.values())
    assert max(waits.values()) - min(waits.values()) > 5.0
    # a delay the handler asked for is kept as it is
    requested = HandBackRequested(delay=1.5)
    assert HandedBack(requested, counted=True, delay=1.5).wait(7, lambda: 0.2) == 1.5


def test_backoff__rabbitmqs_wait_queues_round_a_delay_up_to_a_few_steps() -> None:
    from inbox_middleware.faststream._brokers.rabbit import _wait_step

    delays = [0.2, 0.4, 0.8, 1.0, 1.001, 4.3, 7.9, 12.4, 19.9, 3600]
    assert [_wait_step(d) for d in delays] == [
        200,
        400,
        800,
        1000,
        1200,
        5000,
        8000,
        15000,
        20000,
        4_000_000,
    ]
    spread = {_wait_step(5 + n / 100) for n in range(500)}  # a pause of 5 s, spread
    assert spread == {5000, 6000, 7000, 8000, 10000}
    assert all(_wait_step(ms / 1000) >= ms for ms in range(1, 100_000, 7))


def test_backoff__a_claim_in_progress_comes_back_after_the_consumer_s_in_progress_delay():
    from inbox_middleware._core.consumption import HandedBack
    from inbox_middleware._core.exceptions import ClaimInProgress, DatabaseUnavailable

    held = HandedBack(ClaimInProgress("another delivery holds it"), counted=False)
    assert held.wait(7, lambda: 0.2, in_progress=0.3) == 0.3
    assert held.wait(7, lambda: 0.2) == 0.2  # none set: the hand-back backoff
    # other hand-backs keep the backoff whatever in_progress says
    down = HandedBack(DatabaseUnavailable("x"), counted=False)
    assert down.wait(7, lambda: 0.2, in_progress=0.3) == 0.2
