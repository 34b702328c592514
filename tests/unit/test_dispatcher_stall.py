"""A dispatcher whose database call does not come back says so, without a database: the
engine is never connected, the storage call stands in for one that gets no answer (a
connection lost without a reset, a pooler holding the statement while the server is
down)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from sqlalchemy import create_engine

from inbox_middleware.outbox import Dispatcher, Effect


class Nowhere:
    async def deliver(self, effect: Effect, timeout: float) -> None:
        raise AssertionError("never delivered")


def stalling_dispatcher(answer: threading.Event, calls: list[float]) -> Dispatcher:
    engine = create_engine("postgresql+psycopg://u@127.0.0.1:1/nowhere")
    dispatcher = Dispatcher(
        engine, {"remote": Nowhere()}, lease=1.0, delivery_timeout=0.5, poll_interval=0.05
    )

    def lease(token: str) -> list[Effect]:
        calls.append(time.monotonic())
        answer.wait(timeout=30)  # the first call hangs until answered; later ones return at once
        return []

    dispatcher._lease = lease  # type: ignore[method-assign]
    return dispatcher


def test_dispatcher__a_lease_without_an_answer_is_logged_while_it_waits_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answer, calls = threading.Event(), []
    dispatcher = stalling_dispatcher(answer, calls)
    with caplog.at_level(logging.WARNING, "inbox_middleware.outbox"):
        thread = dispatcher.start()
        try:
            # When its lease gets no answer for longer than the lease itself
            deadline = time.monotonic() + 10
            while "no answer" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
            # Then it says so (once a lease's length has passed, not before), still waiting
            stalled = [r for r in caplog.records if "no answer" in r.getMessage()]
            assert stalled, caplog.text
            assert "leasing" in stalled[0].getMessage()
            assert stalled[0].created - calls[0] >= 0.9
            assert len(calls) == 1
            # And once the database answers, it goes on polling
            answer.set()
            deadline = time.monotonic() + 10
            while len(calls) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(calls) >= 3
        finally:
            answer.set()
            dispatcher.stop()
            thread.join(timeout=10)
    assert not thread.is_alive()


class Stubborn:
    """A destination that does not end when cancelled, until released."""

    def __init__(self) -> None:
        self.released = threading.Event()

    async def deliver(self, effect: Effect, timeout: float) -> str:
        import asyncio

        while not self.released.is_set():
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                continue
        return "done"


def test_dispatcher__a_delivery_still_running_after_its_lease_is_logged_while_the_batch_waits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stubborn = Stubborn()
    engine = create_engine("postgresql+psycopg://u@127.0.0.1:1/nowhere")
    dispatcher = Dispatcher(
        engine, {"remote": stubborn}, lease=1.0, delivery_timeout=0.5, poll_interval=0.05
    )
    leased: list[float] = []
    settled: list[list[dict[str, object]]] = []

    def lease(token: str) -> list[Effect]:
        leased.append(time.monotonic())
        return [Effect("fx-1", "remote", {})] if len(leased) == 1 else []

    dispatcher._lease = lease  # type: ignore[method-assign]
    dispatcher._settle = lambda token, outcomes: settled.append(outcomes)  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, "inbox_middleware.outbox"):
        thread = dispatcher.start()
        try:
            # When its delivery does not end when cancelled, past the lease
            deadline = time.monotonic() + 10
            while "still running" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
            # Then it says so, once the lease has run out, and leases nothing meanwhile
            stalled = [r for r in caplog.records if "still running" in r.getMessage()]
            assert stalled, caplog.text
            assert "fx-1" in stalled[0].getMessage()
            assert stalled[0].created - leased[0] >= 0.9
            assert (len(leased), settled) == (1, [])
            # And once the delivery ends, its outcome is settled and it polls again
            stubborn.released.set()
            deadline = time.monotonic() + 10
            while len(leased) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(settled) == 1
            assert len(leased) >= 3
        finally:
            stubborn.released.set()
            dispatcher.stop()
            thread.join(timeout=10)
    assert not thread.is_alive()
