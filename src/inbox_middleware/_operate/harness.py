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

from .._core.exceptions import ConfigurationError
from .._core.identity import MessageIdentity

__all__ = [
    "CONCURRENT",
    "CRASH",
    "REDELIVERED",
    "ROLLED_BACK",
    "Effect",
    "Hold",
    "Outcomes",
    "Rollback",
    "RolledBackByCheck",
    "ScenarioResult",
    "Tally",
    "Wave",
    "fresh",
    "intent_name",
    "refuse_sqlite",
    "rollback_at_commit",
    "timed_out",
]

Effect = Callable[[], Any]
"""Returns a number that grows by one each time the handler's effect happens (a row count,
say); for FastStream it may be a coroutine function."""

REDELIVERED = "redelivered"
CRASH = "crash between commit and ack"
CONCURRENT = "concurrent duplicates"
ROLLED_BACK = "rolled back after the handler"


class RolledBackByCheck(Exception):
    """Raised by the ``rolled_back`` scenario where the inbox is about to commit, so that
    the inbox's transaction rolls back after the handler has written."""


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
    rolled_back: int = 0
    """Rolled-back scenario: deliveries whose transaction the check rolled back."""
    survived: float = 0
    """Rolled-back scenario: how much the effect grew although the inbox's transaction
    rolled back (a write outside it); must be nothing."""

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
        if self.scenario == ROLLED_BACK:
            clauses.append(f"{self.rolled_back} rolled back, the effect +{self.survived:g} then")
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
        if self.survived:
            problems.append(
                f"the effect grew by {self.survived:g} although the inbox's transaction rolled "
                "back: the handler writes outside it (a session or connection of its own, "
                "committed by itself?); bind it to the inbox's connection (the own-session "
                "guide)"
            )
        if self.scenario == ROLLED_BACK and self.rolled_back != 1:
            problems.append(
                f"{self.rolled_back} attempts were rolled back by the check, not 1: the first "
                "delivery never reached the inbox's commit"
            )
        later = self.deliveries - 1 - self.rolled_back
        if self.duplicates != later:
            problems.append(
                f"{self.duplicates} of the {later} later deliveries were skipped as duplicates"
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
class Wave:
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


Outcomes = Wave
"""The older name of `Wave`."""


@dataclass
class Tally:
    """The waves of one scenario, added up."""

    processed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    started: list[float] = field(default_factory=list)

    def add(self, wave: Wave) -> None:
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


@dataclass
class Rollback:
    """The ``rolled_back`` scenario's probe. The first attempt of the intent to reach its
    commit raises `RolledBackByCheck` there instead (so the inbox rolls its transaction
    back after the handler has written) and sets ``fired``; the framework's recorder then
    measures the effect once that attempt is over (``survived``) and sets ``measured``,
    and holds the redelivery until it has, so that what it writes is not mistaken for a
    survivor."""

    message_id: str
    fired: threading.Event = field(default_factory=threading.Event)
    measured: threading.Event = field(default_factory=threading.Event)
    survived: float = 0.0

    def owes_measure(self) -> bool:
        return self.fired.is_set() and not self.measured.is_set()

    def hook(self, point: str, message_id: str | None) -> None:
        if point == "commit" and message_id == self.message_id and not self.fired.is_set():
            self.fired.set()
            raise RolledBackByCheck("the check rolled the inbox's transaction back here")


@contextlib.contextmanager
def rollback_at_commit(message_id: str) -> Iterator[Rollback]:
    """Install a `Rollback` probe for the intent ``message_id`` on the inbox's named point
    ``commit`` (`inbox_middleware._core.faults`: the handler has returned, COMMIT is next);
    the previous hook, if any, still runs and is restored afterwards."""
    from .._core import faults

    previous, probe = faults.hook, Rollback(message_id)

    def hook(point: str, delivered: str | None) -> None:
        if previous is not None:
            previous(point, delivered)
        probe.hook(point, delivered)

    faults.hook = hook
    try:
        yield probe
    finally:
        faults.hook = previous


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
        f"within {timeout:g}s (the check's timeout), {ending}; " + ", ".join(done)
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
