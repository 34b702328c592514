"""`inbox_middleware.testing`, the users' pytest plugin: what it reports and refuses.

The examples' tests (``examples/*/test_*.py``) show it passing on a protected handler;
here it must fail, with an explanation, on a handler the inbox does not protect (shadow
mode runs every duplicate), on deliveries that never raced, on a reused intent, and refuse
the concurrent scenario on SQLite.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import dramatiq
import pytest
from faststream.rabbit import RabbitBroker, TestRabbitBroker
from sqlalchemy import text
from sqlalchemy.orm import Session

from inbox_middleware._core.exceptions import ConfigurationError
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity
from inbox_middleware.faststream import FastStreamInbox, InboxSession
from inbox_middleware.testing import ScenarioResult

from ..apps.domain import apply_credit, apply_credit_async, effects
from ..support.snippets import SNIPPETS, load_snippet

SNIPPET = SNIPPETS / "testing_plugin.py"


def snippet() -> Any:
    return load_snippet("testing_plugin")


def counter(engine: Any):
    def count() -> int:
        with engine.connect() as conn:
            return effects(conn)

    return count


@pytest.fixture
def credit_actor(stub_broker, queue):
    def declare(engine: Any, **options: Any) -> Any:
        stub_broker.add_middleware(InboxMiddleware(engine, **options))

        @dramatiq.actor(queue_name=queue, inbox_consumer="billing", min_backoff=10)
        def add_credit(account_id: int, delta: int) -> None:
            apply_credit(current_session(), "billing", account_id, delta)

        return add_credit

    return declare


def test_plugin__protected_actor_passes_every_scenario_and_says_what_happened(
    inbox_check, credit_actor, pg_engine
):
    check = inbox_check.dramatiq(credit_actor(pg_engine), effect=counter(pg_engine))
    first = check.redelivered(check.message(7, 10, producer="p", message_id="m-1"), times=4)
    assert first.assert_one_effect() is first
    assert (first.deliveries, first.processed, first.duplicates, first.claims) == (4, 1, 3, 1)
    racing = check.concurrent_duplicates(check.message(7, 10, producer="p", message_id="m-2"))
    assert racing.assert_one_effect().overlapped >= 2
    assert racing.summary().startswith("concurrent duplicates (8 deliveries of p/m-2): effect +1")


def test_plugin__shadow_mode_runs_duplicates_and_the_check_fails_saying_why(
    inbox_check, credit_actor, pg_engine
):
    check = inbox_check.dramatiq(credit_actor(pg_engine, shadow=True), effect=counter(pg_engine))
    result = check.crash_between_commit_and_ack(check.message(7, 10, producer="p", message_id="m"))
    assert (result.processed, result.effect) == (2, 2)
    with pytest.raises(AssertionError, match="committed 2 times: is the actor or subscriber"):
        result.assert_one_effect()


def test_plugin__deliveries_that_never_overlapped_are_no_race(inbox_check, credit_actor, pg_engine):
    check = inbox_check.dramatiq(credit_actor(pg_engine), effect=counter(pg_engine), threads=1)
    result = check.concurrent_duplicates(check.message(7, 10, producer="p", message_id="m"))
    with pytest.raises(AssertionError, match="as many threads as copies"):
        result.assert_one_effect()


def test_plugin__an_intent_processed_before_the_scenario_is_refused(
    inbox_check, credit_actor, pg_engine
):
    check = inbox_check.dramatiq(credit_actor(pg_engine), effect=counter(pg_engine))
    message = check.message(7, 10, producer="p", message_id="m")
    check.redelivered(message).assert_one_effect()
    with pytest.raises(AssertionError, match="give each scenario a message id of its own"):
        check.crash_between_commit_and_ack(message)


def test_plugin__sqlite_runs_the_sequential_scenarios_and_refuses_the_race(
    inbox_check, credit_actor, sqlite_engine
):
    check = inbox_check.dramatiq(credit_actor(sqlite_engine), effect=counter(sqlite_engine))
    check.redelivered(check.message(7, 10, producer="p", message_id="m-1")).assert_one_effect()
    check.crash_between_commit_and_ack(
        check.message(7, 10, producer="p", message_id="m-2")
    ).assert_one_effect()
    check.rolled_back(check.message(7, 10, producer="p", message_id="m-4")).assert_one_effect()
    with pytest.raises(ConfigurationError, match="concurrent duplicates need PostgreSQL"):
        check.concurrent_duplicates(check.message(7, 10, producer="p", message_id="m-3"))


def test_plugin__an_actor_without_the_inbox_is_refused(inbox_check, stub_broker, queue):
    @dramatiq.actor(queue_name=queue)
    def add_credit(account_id: int, delta: int) -> None: ...

    with pytest.raises(ConfigurationError, match="has no InboxMiddleware"):
        inbox_check.dramatiq(add_credit, effect=lambda: 0)


def test_plugin__failed_attempts_are_reported_with_the_effect(
    inbox_check, stub_broker, queue, pg_engine
):
    stub_broker.add_middleware(InboxMiddleware(pg_engine))
    attempts: list[int] = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", min_backoff=10, max_backoff=20)
    def flaky(account_id: int, delta: int) -> None:
        attempts.append(1)
        apply_credit(current_session(), "billing", account_id, delta)
        if len(attempts) == 1:
            raise ConnectionError("the ledger service timed out")

    check = inbox_check.dramatiq(flaky, effect=counter(pg_engine))
    result = check.redelivered(check.message(7, 10, producer="p", message_id="m"), times=2)
    assert result.failures == ("ConnectionError",)
    assert result.assert_one_effect().processed == 1


async def test_plugin__faststream_shadow_subscriber_fails_the_check(
    inbox_check, pg_async_engine, pg_engine
):
    inbox = FastStreamInbox(pg_async_engine, shadow=True)
    broker = RabbitBroker(middlewares=[inbox.middleware])

    @broker.subscriber("orders", dependencies=[inbox.consumer("billing")])
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    async with TestRabbitBroker(broker):
        check = inbox_check.faststream(broker, effect=counter(pg_engine))
        order = check.message(
            {"account": 7, "delta": 10}, producer="p", message_id="m", queue="orders"
        )
        result = await check.concurrent_duplicates(order, copies=4)
    assert (result.processed, result.effect, result.overlapped) == (4, 4, 4)
    with pytest.raises(AssertionError, match="the effect grew by 4, not 1"):
        result.assert_one_effect()
    with pg_engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM consumer_inbox")) == 1


def test_result__explains_every_problem_at_once():
    result = ScenarioResult(
        scenario="concurrent duplicates",
        intent="p/m",
        deliveries=4,
        processed=0,
        duplicates=1,
        conflicts=2,
        poison=0,
        failures=("DatabaseUnavailable",),
        claims=0,
        effect=0,
        overlapped=1,
        unsettled=1,
    )
    with pytest.raises(AssertionError) as raised:
        result.assert_one_effect()
    message = str(raised.value)
    for part in (
        "failed attempts: DatabaseUnavailable",
        "the effect grew by 0, not 1",
        "it never committed",
        "1 of the 3 later deliveries were skipped as duplicates",
        "the payload's canonical form changes between sends",
        "no race to check",
        "1 deliveries were never settled",
    ):
        assert part in message


def test_plugin__actor_parameters_named_like_the_identity_need_message_with(
    inbox_check, stub_broker, queue, pg_engine
):
    # Given an actor with parameters named producer and tenant
    stub_broker.add_middleware(InboxMiddleware(pg_engine))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", min_backoff=10)
    def add_credit(account_id: int, delta: int, producer: str, tenant: str = "") -> None:
        assert (producer, tenant) == ("the-shop", "eu")
        apply_credit(current_session(), "billing", account_id, delta)

    check = inbox_check.dramatiq(add_credit, effect=counter(pg_engine))
    # Then check.message(...) refuses to guess, and message_with keeps them apart
    with pytest.raises(TypeError, match="use check.message_with"):
        check.message(7, 10, producer="p", message_id="m", tenant="eu")
    order = check.message_with(
        args=(7, 10), kwargs={"producer": "the-shop", "tenant": "eu"}, producer="p", message_id="m"
    )
    assert (order.args, order.kwargs) == ((7, 10), {"producer": "the-shop", "tenant": "eu"})
    assert order.options["inbox_producer"] == "p"
    check.redelivered(order).assert_one_effect()
    # And the documented form builds the same kind of message
    documented = snippet().order_for_an_actor_with_a_producer_parameter(check)
    assert (documented.args, documented.kwargs) == ((7, 10), {"producer": "the-shop"})
    assert documented.options["inbox_message_id"] == "o-1"


def test_inbox_database__a_migrated_database_of_the_tests_own_dropped_after(
    pytester: pytest.Pytester,
):
    # Given a user's test suite using the fixture twice, in sync and async code
    pytester.makeini(
        "[pytest]\nasyncio_mode = auto\nfilterwarnings = error\n"
        "asyncio_default_fixture_loop_scope = function\n"
    )
    pytester.makepyfile(
        """
        import pytest
        from sqlalchemy import create_engine, text
        from sqlalchemy.ext.asyncio import create_async_engine

        NAMES = []

        @pytest.mark.parametrize("n", [1, 2])
        def test_sync(inbox_database, n):
            engine = create_engine(inbox_database.url)
            with engine.begin() as conn:
                assert conn.scalar(text("SELECT count(*) FROM consumer_inbox")) == 0
                conn.execute(text("CREATE TABLE mine (id int)"))  # no other test sees it
            engine.dispose()
            NAMES.append(inbox_database.name)
            print("DATABASE", inbox_database.name)

        async def test_async(inbox_database):
            engine = create_async_engine(inbox_database.async_url)
            async with engine.connect() as conn:
                assert await conn.scalar(text("SELECT count(*) FROM inbox_quarantine")) == 0
            await engine.dispose()
            assert len(set(NAMES)) == 2
        """
    )
    # When it runs
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s")
    # Then each test had its own migrated database, and none is left behind
    result.assert_outcomes(passed=3)
    names = re.findall(r"DATABASE (\w+)", result.stdout.str())
    assert len(names) == 2
    with pg_admin() as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_database WHERE datname = ANY(%s)", (names,)
        ).fetchone()
    assert left == (0,)


def test_inbox_database__an_unreachable_server_is_one_line_naming_the_setting(
    pytester: pytest.Pytester,
):
    pytester.makepyfile("def test_it(inbox_database):\n    pass\n")
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--inbox-database-url", "postgresql://postgres@127.0.0.1:1/x"
    )
    result.assert_outcomes(errors=1)
    assert "Traceback" not in result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "cannot create or drop a throwaway database on postgresql://postgres@127.0.0.1:1/x:"
            " connection failed: * (set INBOX_PYTEST_DATABASE_URL or the inbox_database_url ini"
            " option to a server whose role may create databases)",
        ]
    )


def pg_admin() -> Any:
    import psycopg

    return psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True)


def test_inbox_database__the_documented_setup_adds_the_users_tables(pytester: pytest.Pytester):
    # Given the documented conftest override and fixture use
    pytester.makeini(
        "[pytest]\nfilterwarnings = error\nasyncio_default_fixture_loop_scope = function\n"
    )
    pytester.makeconftest(
        f"import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('snippet', {str(SNIPPET)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "inbox_database_setup = module.inbox_database_setup\n"
        "engines = module.engines\n"
    )
    pytester.makepyfile(
        """
        from sqlalchemy import text
        from conftest import engines

        def test_it(inbox_database):
            engine, async_engine = engines(inbox_database)
            assert async_engine.url.drivername == "postgresql+asyncpg"
            with engine.connect() as conn:
                assert conn.scalar(text("SELECT count(*) FROM credits")) == 0
                assert conn.scalar(text("SELECT count(*) FROM consumer_inbox")) == 0
            engine.dispose()
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


# -- the check never hangs: its timeout bounds it whole ------------------------------------


@pytest.mark.timeout(30)
def test_plugin__an_actor_failing_every_time_fails_the_check_within_its_timeout(
    inbox_check, stub_broker, queue, pg_engine
):
    # Given an actor that fails every time, retried with a backoff far longer than the
    # check's timeout
    stub_broker.add_middleware(InboxMiddleware(pg_engine))

    @dramatiq.actor(
        queue_name=queue, inbox_consumer="billing", min_backoff=5_000, max_backoff=3_600_000
    )
    def always_down(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)
        raise ConnectionError("the ledger service is down")

    check = inbox_check.dramatiq(always_down, effect=counter(pg_engine), timeout=2)
    started = time.monotonic()
    # When a scenario runs, then it fails once its timeout is spent, naming each message
    # still pending: where it waits, how often it was retried, when it is due
    with pytest.raises(AssertionError) as raised:
        check.redelivered(check.message(7, 10, producer="p", message_id="m"), times=1)
    assert time.monotonic() - started < 8
    message = str(raised.value)
    assert message.startswith("redelivered (1 deliveries of p/m): not finished within 2s")
    assert re.search(rf"queue {queue}\.DQ, retries 1, eta 20\d\d-\S+ \(in \d+(\.\d)?s\)", message)
    assert "failed attempts: ConnectionError" in message
    # And the worker was stopped: nothing runs the actor after the check gave up
    assert not any(t.is_alive() for t in threading.enumerate() if "WorkerThread" in t.name)


@pytest.mark.timeout(30)
def test_plugin__a_leftover_delayed_message_on_a_real_broker_fails_the_check_naming_it(
    inbox_check, redis_broker, queue, pg_engine
):
    # Given a message left in the actor's delay queue, due in an hour
    redis_broker.add_middleware(InboxMiddleware(pg_engine))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", min_backoff=10)
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    leftover = add_credit.send_with_options(
        args=(1, 1), delay=3_600_000, **identity(producer="p", message_id="old")
    )
    check = inbox_check.dramatiq(add_credit, effect=counter(pg_engine), timeout=2)
    # When a scenario runs, then it fails within its timeout, naming the leftover message
    with pytest.raises(AssertionError, match="not finished within 2s") as raised:
        check.redelivered(check.message(7, 10, producer="p", message_id="m"), times=1)
    assert f"message {leftover.message_id} (actor add_credit, not this scenario's)" in str(
        raised.value
    )
    assert re.search(
        rf"queue {queue}\.DQ, retries 0, eta \S+ \(in 3\d\d\d(\.\d)?s\)", str(raised.value)
    )


# -- the rolled-back scenario: a write outside the inbox's transaction ---------------------


def test_plugin__a_rolled_back_attempt_leaves_nothing_of_a_protected_actor(
    inbox_check, credit_actor, pg_engine
):
    check = inbox_check.dramatiq(credit_actor(pg_engine), effect=counter(pg_engine))
    result = check.rolled_back(check.message(7, 10, producer="p", message_id="m"))
    assert result.assert_one_effect() is result
    assert (result.deliveries, result.rolled_back, result.survived, result.processed) == (
        2,
        1,
        0,
        1,
    )
    assert result.failures == ()


def test_plugin__an_actor_writing_through_its_own_session_fails_the_rolled_back_scenario(
    inbox_check, stub_broker, queue, pg_engine
):
    # Given an actor that writes through a session of its own, not bound to the inbox's
    # connection (the mistake the own-session guide warns about): it passes the others
    stub_broker.add_middleware(InboxMiddleware(pg_engine))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", min_backoff=10)
    def add_credit(account_id: int, delta: int) -> None:
        with Session(pg_engine) as own:
            apply_credit(own, "billing", account_id, delta)
            own.commit()

    check = inbox_check.dramatiq(add_credit, effect=counter(pg_engine))
    check.redelivered(check.message(7, 10, producer="p", message_id="m-1")).assert_one_effect()
    check.crash_between_commit_and_ack(
        check.message(7, 10, producer="p", message_id="m-2")
    ).assert_one_effect()
    check.concurrent_duplicates(
        check.message(7, 10, producer="p", message_id="m-3")
    ).assert_one_effect()
    # When its transaction is rolled back after it ran, then its write survived and the
    # redelivery wrote again: the check fails, saying why
    result = check.rolled_back(check.message(7, 10, producer="p", message_id="m-4"))
    assert (result.survived, result.effect, result.processed) == (1, 2, 1)
    with pytest.raises(AssertionError, match="the effect grew by 1 although the inbox's"):
        result.assert_one_effect()
