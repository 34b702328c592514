"""Check your own actor or subscriber in your test suite: one effect, however delivered.

A pytest plugin (installed with the library, no configuration): its ``inbox_check``
fixture runs your handler, through the real inbox and your real database, under the
deliveries that break handlers without one, and measures the effect with a function you
give::

    def test_add_credit_is_applied_once(inbox_check, engine):
        def credits() -> int:  # how often the effect happened
            with engine.connect() as conn:
                return conn.scalar(text("SELECT count(*) FROM credits"))

        check = inbox_check.dramatiq(add_credit, effect=credits)
        order = check.message(7, 10, producer="orders", message_id="o-1")
        check.redelivered(order, times=3).assert_one_effect()

Three scenarios, each on an intent not processed before (use a new message id for each):

``redelivered(message, times=3)``
    The same intent delivered again and again, one delivery after the other: a producer
    retrying after a lost confirmation, or a broker redelivering. Each is a new broker
    message with the same identity and payload.
``crash_between_commit_and_ack(message)``
    The worker commits, then dies before acknowledging; the broker delivers the very same
    message again. Emulated here by delivering it twice through the real inbox: what the
    second delivery finds is exactly what a redelivery after the crash finds (the commit
    is durable, the claim is there). The library's own test suite kills real workers
    with SIGKILL at that point.
``concurrent_duplicates(message, copies=8)``
    ``copies`` deliveries of the intent at once, in as many worker threads (Dramatiq) or
    tasks (FastStream). The first one to claim the intent holds its transaction open a
    moment before committing (``hold`` seconds), so that the others arrive while its claim
    is uncommitted and wait on it, as they do in a real race. Needs PostgreSQL: SQLite has
    a single writer, so there is no race to check.

Each returns a `ScenarioResult`: how often the handler committed, how many deliveries were
skipped as duplicates, which attempts failed, the growth of your effect. Its
`~ScenarioResult.assert_one_effect` fails with an explanation unless the effect grew by
exactly one, the handler committed once, and every other delivery was a duplicate.

Dramatiq: the actor's broker must have the `InboxMiddleware`; the check starts a worker
with ``threads`` threads on it for each scenario (or uses ``worker=``, one you run). A
stub broker is enough. FastStream: give the broker (inside ``TestRabbitBroker`` and the
like, or a real, started one); scenarios are coroutines.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import Engine, event, func, select

from .exceptions import ConfigurationError
from .identity import MessageIdentity
from .storage import InboxSchema
from .throwaway import Setup, Template, ThrowawayDatabase, migrate_inbox, server_from

if TYPE_CHECKING:
    from .dramatiq.testing import DramatiqCheck
    from .faststream.testing import FastStreamCheck, FastStreamMessage

__all__ = [
    "DramatiqCheck",
    "FastStreamCheck",
    "FastStreamMessage",
    "InboxCheck",
    "ScenarioResult",
    "ThrowawayDatabase",
    "inbox_check",
    "inbox_database",
    "inbox_database_setup",
]

_FRAMEWORK_NAMES = {
    "DramatiqCheck": "dramatiq",
    "FastStreamCheck": "faststream",
    "FastStreamMessage": "faststream",
}


def __getattr__(name: str) -> Any:
    # Each framework's half is imported when asked for: the plugin loads in every test
    # session of a project with the library installed, which may have only one of them.
    if name in _FRAMEWORK_NAMES:
        module = importlib.import_module(f".{_FRAMEWORK_NAMES[name]}.testing", __package__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


# -- shared ----------------------------------------------------------------------------------


@dataclass
class _Outcomes:
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
class _Tally:
    """The waves of one scenario, added up."""

    processed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    started: list[float] = field(default_factory=list)

    def add(self, wave: _Outcomes) -> None:
        self.processed += wave.processed
        self.skipped += wave.skipped
        self.failures += wave.failures
        self.started += wave.started

    def overlapped(self, first_done: float | None) -> int:
        if first_done is None:
            return 0
        return sum(1 for started in self.started if started < first_done)


class _Hold:
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
    def installed(self) -> Iterator[_Hold]:
        event.listen(self.engine, "commit", self)
        try:
            yield self
        finally:
            event.remove(self.engine, "commit", self)


def _refuse_sqlite(engine: Engine) -> None:
    if engine.dialect.name == "sqlite":
        raise ConfigurationError(
            "concurrent duplicates need PostgreSQL: SQLite has a single writer, so "
            "deliveries never race for a claim there; run this scenario on PostgreSQL"
        )


def _claim_queries(
    naming: InboxSchema, identity: MessageIdentity, consumer: str | None
) -> tuple[Any, Any, Any]:
    tables = naming.tables
    queries = []
    for table in (tables.inbox, tables.quarantine, tables.poison):
        where = [
            table.c.producer_name == identity.producer,
            table.c.tenant == identity.tenant,
            table.c.message_id == identity.message_id,
        ]
        if consumer is not None:
            where.append(table.c.consumer_name == consumer)
        if table is tables.quarantine:
            queries.append(select(func.coalesce(func.sum(table.c.attempts), 0)).where(*where))
        else:
            queries.append(select(func.count()).select_from(table).where(*where))
    return queries[0], queries[1], queries[2]


def _name(identity: MessageIdentity) -> str:
    tenant = f"{identity.tenant}/" if identity.tenant else ""
    return f"{identity.producer}/{tenant}{identity.message_id}"


def _fresh(claims: int, identity: MessageIdentity) -> None:
    if claims:
        raise AssertionError(
            f"intent {_name(identity)} was processed before this scenario began; give each "
            "scenario a message id of its own"
        )


# -- the pytest plugin ---------------------------------------------------------------------


class InboxCheck:
    """What the ``inbox_check`` fixture gives: a factory of checks for your handlers."""

    def dramatiq(
        self,
        actor: Any,
        effect: Effect,
        *,
        threads: int = 8,
        hold: float = 0.2,
        timeout: float = 30.0,
        worker: Any = None,
    ) -> DramatiqCheck:
        """Check a Dramatiq actor declared with ``inbox_consumer``. ``effect`` counts what
        the actor did (synchronously); ``worker``: your running worker, else one is
        started per scenario with ``threads`` threads."""
        from .dramatiq.testing import DramatiqCheck

        return DramatiqCheck(
            actor, effect, threads=threads, hold=hold, timeout=timeout, worker=worker
        )

    def faststream(
        self,
        broker: Any,
        effect: Effect,
        *,
        inbox: Any = None,
        hold: float = 0.2,
        timeout: float = 30.0,
    ) -> FastStreamCheck:
        """Check the inbox subscribers of a FastStream broker (give the `FastStreamInbox`
        when the broker has several). ``effect`` may be a coroutine function."""
        from .faststream.testing import FastStreamCheck

        return FastStreamCheck(broker, effect, inbox=inbox, hold=hold, timeout=timeout)


@pytest.fixture
def inbox_check() -> InboxCheck:
    """Run your own actor or subscriber under redelivery, a crash between commit and ack,
    and concurrent duplicates, and assert one effect (`inbox_middleware.testing`)."""
    return InboxCheck()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("inbox-middleware")
    group.addoption(
        "--inbox-database-url",
        default=None,
        help="PostgreSQL server for the inbox_database fixture's throwaway databases "
        "(a role that may create databases); else $INBOX_PYTEST_DATABASE_URL, the "
        "inbox_database_url ini option, or postgresql://postgres@127.0.0.1:5432/postgres",
    )
    parser.addini(
        "inbox_database_url",
        "PostgreSQL server for the inbox_database fixture's throwaway databases",
        default=None,
    )


@pytest.fixture(scope="session")
def inbox_database_setup() -> Setup:
    """What the template database holds: the inbox tables. Override it in your
    ``conftest.py`` to add your own schema (the callable gets a connection in a
    transaction)::

        @pytest.fixture(scope="session")
        def inbox_database_setup():
            def setup(conn):
                migrate(conn)                   # the inbox tables
                Base.metadata.create_all(conn)  # your tables
            return setup
    """
    return migrate_inbox


@pytest.fixture(scope="session")
def _inbox_database_template(
    request: pytest.FixtureRequest, inbox_database_setup: Setup
) -> Iterator[Template]:
    config = request.config
    server = server_from(
        config.getoption("--inbox-database-url"), config.getini("inbox_database_url")
    )
    template = Template(server, inbox_database_setup)
    yield template
    template.close()


@pytest.fixture
def inbox_database(_inbox_database_template: Template) -> Iterator[ThrowawayDatabase]:
    """A PostgreSQL database of this test's own, with the schema of
    ``inbox_database_setup`` (the inbox tables), dropped after the test: ``.url`` for a
    synchronous engine (psycopg), ``.async_url`` for an `AsyncEngine` (asyncpg)."""
    problem = None
    try:
        database = _inbox_database_template.clone()
    except ConfigurationError as exc:
        problem = str(exc)
    if problem is not None:  # one line naming the setting, not a chain of tracebacks
        pytest.fail(problem, pytrace=False)
    try:
        yield database
    finally:
        _inbox_database_template.drop(database)
