"""The harness the ``inbox_check`` scenarios share, whichever the framework: the result
of a scenario, the tally of its deliveries, the hold that keeps the first claim
uncommitted while duplicates arrive, and the counts of an intent's rows.

The pytest plugin (`inbox_middleware.testing`) and each framework's half
(`inbox_middleware.dramatiq.testing`, `inbox_middleware.faststream.testing`) build on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, event

from .exceptions import ConfigurationError
from .identity import MessageIdentity

__all__ = [
    "CONCURRENT",
    "CRASH",
    "REDELIVERED",
    "Effect",
    "Hold",
    "Outcomes",
    "ScenarioResult",
    "Tally",
    "fresh",
    "intent_name",
    "refuse_sqlite",
    "timed_out",
]

Effect = Callable[[], Any]
"""Returns a number that grows by one each time the handler's effect happens (a row count,
say); for FastStream it may be a coroutine function."""

REDELIVERED = "redelivered"
CRASH = "crash between commit and ack"
CONCURRENT = "concurrent duplicates"


@dataclass(frozen=True)
class ScenarioResult:
    """What one scenario did to one intent."""

    scenario: str
    intent: str
    deliveries: int
    processed: int
    """Deliveries whose handler ran and committed."""
    duplicates: int
    """Deliveries skipped because the intent was processed already."""
    conflicts: int
    """Deliveries quarantined as identity conflicts (the payload differed)."""
    poison: int
    """Deliveries kept as poison messages (a permanent failure)."""
    failures: tuple[str, ...]
    """The errors of attempts that rolled back (retried or not)."""
    claims: int
    """Inbox rows for the intent afterwards: one per consumer that processed it."""
    effect: float
    """How much your effect grew."""
    overlapped: int = 0
    """Concurrent scenario: deliveries that began while the first held its claim."""
    unsettled: int = 0
    """Deliveries with no outcome when the scenario gave up waiting."""

    def summary(self) -> str:
        clauses = [
            f"effect +{self.effect:g}",
            f"handler committed {self.processed}x",
            f"{self.duplicates} duplicates skipped",
        ]
        if self.conflicts:
            clauses.append(f"{self.conflicts} quarantined as conflicts")
        if self.poison:
            clauses.append(f"{self.poison} kept as poison")
        if self.failures:
            clauses.append(f"failed attempts: {', '.join(self.failures)}")
        if self.unsettled:
            clauses.append(f"{self.unsettled} never settled")
        if self.scenario == CONCURRENT:
            clauses.append(f"{self.overlapped} overlapped the first claim")
        head = f"{self.scenario} ({self.deliveries} deliveries of {self.intent})"
        return f"{head}: {', '.join(clauses)}"

    def assert_one_effect(self) -> ScenarioResult:
        """Fail unless the effect happened exactly once and every other delivery was
        recognised as a duplicate; returns the result, for chaining."""
        return self.assert_effect(1)

    def assert_effect(self, expected: float) -> ScenarioResult:
        """As `assert_one_effect`, for an effect that grows by ``expected`` per intent
        (a balance credited by the intent's amount, say)."""
        problems = []
        if self.effect != expected:
            problems.append(f"the effect grew by {self.effect:g}, not {expected:g}")
        if self.processed != 1:
            problems.append(
                f"the handler committed {self.processed} times: "
                + (
                    "is the actor or subscriber declared as an inbox consumer, and not in "
                    "shadow mode?"
                    if self.processed > 1
                    else "it never committed"
                )
            )
        if self.duplicates != self.deliveries - 1:
            problems.append(
                f"{self.duplicates} of the {self.deliveries - 1} later deliveries were "
                "skipped as duplicates"
            )
        if self.conflicts:
            problems.append(
                f"{self.conflicts} deliveries were identity conflicts: the payload's "
                "canonical form changes between sends (a timestamp? a random field?)"
            )
        if self.scenario == CONCURRENT and self.overlapped < 2:
            problems.append(
                f"only {self.overlapped} deliveries overlapped the first claim, so there "
                "was no race to check: give the worker as many threads as copies"
            )
        if self.unsettled:
            problems.append(f"{self.unsettled} deliveries were never settled")
        if problems:
            raise AssertionError(self.summary() + "\n  - " + "\n  - ".join(problems))
        return self


@dataclass
class Outcomes:
    """The outcomes of one wave of deliveries, as the framework reported them, and when
    each delivery began. Dramatiq's are told apart by message id; FastStream's by the
    intent's identity headers (``key`` None)."""

    expected: set[str] | None
    size: int
    processed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    started: list[float] = field(default_factory=list)
    settled: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ours(self, key: str | None) -> bool:
        return self.expected is None or key in self.expected

    def begin(self, key: str | None = None) -> None:
        with self.lock:
            self.started.append(time.monotonic())

    def end(self, outcome: str, key: str | None = None, final: bool = True) -> None:
        with self.lock:
            if outcome == "processed":
                self.processed += 1
            elif outcome == "skipped":
                self.skipped += 1
            else:
                self.failures.append(outcome)
            if final and key is not None:
                self.settled.add(key)

    @property
    def final(self) -> int:
        return self.processed + self.skipped


@dataclass
class Tally:
    """The waves of one scenario, added up."""

    processed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    started: list[float] = field(default_factory=list)

    def add(self, wave: Outcomes) -> None:
        self.processed += wave.processed
        self.skipped += wave.skipped
        self.failures += wave.failures
        self.started += wave.started

    def overlapped(self, first_done: float | None) -> int:
        if first_done is None:
            return 0
        return sum(1 for started in self.started if started < first_done)


class Hold:
    """Delays every commit on an engine by ``seconds`` while installed, so that the first
    claim of an intent stays uncommitted while the other deliveries arrive."""

    def __init__(self, engine: Engine, seconds: float, asynchronous: bool) -> None:
        self.engine, self.seconds, self.asynchronous = engine, seconds, asynchronous
        self.first_done: float | None = None

    def __call__(self, conn: Any) -> None:
        if self.asynchronous:  # inside SQLAlchemy's greenlet: yield to the event loop
            from sqlalchemy.util import await_only

            await_only(asyncio.sleep(self.seconds))
        else:
            time.sleep(self.seconds)
        if self.first_done is None:
            self.first_done = time.monotonic()

    @contextlib.contextmanager
    def installed(self) -> Iterator[Hold]:
        event.listen(self.engine, "commit", self)
        try:
            yield self
        finally:
            event.remove(self.engine, "commit", self)


def refuse_sqlite(engine: Engine) -> None:
    if engine.dialect.name == "sqlite":
        raise ConfigurationError(
            "concurrent duplicates need PostgreSQL: SQLite has a single writer, so "
            "deliveries never race for a claim there; run this scenario on PostgreSQL"
        )


def intent_name(identity: MessageIdentity) -> str:
    tenant = f"{identity.tenant}/" if identity.tenant else ""
    return f"{identity.producer}/{tenant}{identity.message_id}"


def timed_out(
    scenario: str,
    identity: MessageIdentity,
    waves: list[Any],
    tally: Tally,
    *,
    timeout: float,
    ending: str,
    pending: list[str],
) -> str:
    """The failure of a scenario that did not finish within its ``timeout``: what happened
    so far, and each delivery or message still pending."""
    deliveries = sum(wave if isinstance(wave, int) else len(wave) for wave in waves)
    done = [f"handler committed {tally.processed}x", f"{tally.skipped} skipped"]
    if tally.failures:
        done.append(f"failed attempts: {', '.join(tally.failures)}")
    head = (
        f"{scenario} ({deliveries} deliveries of {intent_name(identity)}): not finished "
        f"within {timeout:g}s (the check's timeout), so the worker was stopped; " + ", ".join(done)
    )
    if not pending:
        return head
    return head + "; still pending:\n  - " + "\n  - ".join(pending)


def fresh(claims: int, identity: MessageIdentity) -> None:
    if claims:
        raise AssertionError(
            f"intent {intent_name(identity)} was processed before this scenario began; give each "
            "scenario a message id of its own"
        )
