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

Four scenarios, each on an intent not processed before (use a new message id for each):

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
``rolled_back(message)``
    The handler runs and writes, then the inbox's transaction is rolled back where it
    would commit (a failed COMMIT, a worker dead before it), and the intent is delivered
    again. Nothing the rolled-back attempt wrote may survive: the one scenario that fails
    a handler writing through a session or connection of its own.
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

``timeout`` (30 seconds) bounds each scenario whole, retries and queued messages included:
past it the check stops the worker it started and fails, listing what is still pending.

Dramatiq: the actor's broker must have the `InboxMiddleware`; the check starts a worker
with ``threads`` threads on it for each scenario (or uses ``worker=``, one you run). A
stub broker is enough. FastStream: give the broker (inside ``TestRabbitBroker`` and the
like, or a real, started one); scenarios are coroutines.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from ._contract import ContractViolation, ProducerContract, PublishedMessage, producer_contract
from ._core.exceptions import ConfigurationError
from ._operate.harness import Effect, ScenarioResult
from ._operate.throwaway import Setup, Template, ThrowawayDatabase, migrate_inbox, server_from

if TYPE_CHECKING:
    from .dramatiq.testing import DramatiqCheck
    from .faststream.testing import FastStreamCheck, FastStreamMessage

__all__ = [
    "ContractViolation",
    "DramatiqCheck",
    "FastStreamCheck",
    "FastStreamMessage",
    "InboxCheck",
    "ProducerContract",
    "PublishedMessage",
    "ScenarioResult",
    "ThrowawayDatabase",
    "inbox_check",
    "inbox_database",
    "inbox_database_setup",
    "producer_contract",
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
        started per scenario with ``threads`` threads; ``timeout``: seconds a scenario may
        take in all, retries and queued messages included, before it fails."""
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
        when the broker has several). ``effect`` may be a coroutine function; ``timeout``:
        seconds a scenario may take in all, redeliveries included, before it fails."""
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
