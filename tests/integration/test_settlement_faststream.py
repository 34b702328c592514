"""Every FastStream delivery ends in a settlement the inbox chose: the paths that lost
messages before the consumption core, each on the real brokers and PostgreSQL.

1. a handler that swallows a database error leaves its transaction aborted: COMMIT
   silently rolls back, so the attempt must fail instead of being acked;
2. without ``inbox.guard``, the start-up check runs at the first message: a database that
   is down, tables that are missing or a setting that breaks the guarantee must hold the
   message back, not reject it;
3. a handler that raises ``AckMessage`` means "done": its work commits, then the ack;
4. a handler that calls ``msg.ack()`` itself is refused, so nothing is acked behind the
   inbox's back;
5. hand-backs the inbox makes (the database down) are not crashes: a low redelivery
   limit does not poison a valid message;
7. a redriven poison message starts its attempts again.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from faststream import Context
from faststream.exceptions import AckMessage
from sqlalchemy import create_engine, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import create_async_engine

from inbox_middleware._storage import InboxSchema, migrate
from inbox_middleware.faststream import FastStreamInbox, InboxSession

from ..apps import domain
from ..apps.domain import apply_credit_async, balance, effects
from ..support import services
from ..support.database import drop_database
from ..support.faststream_brokers import KINDS, Harness, Seen, eventually, recorder
from ..support.proxy import Proxy
from .test_faststream import ORDER, applied, ident
from .test_faststream_failures import URLS, cli

# These tests break the database under a running consumer (a proxy taken down during
# connection attempts, settings changed under open pools): an asyncpg connection whose
# handshake was cancelled with its consumer is left to the garbage collector. Collected
# here, after each test, so that it is not reported against whichever test runs next.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(autouse=True)
def _collect_cut_connections() -> Iterator[None]:
    yield
    gc.collect()


TABLES = InboxSchema().tables
MESSAGE = Context("message")


def poison_rows(engine: Any) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(select(TABLES.poison)).mappings()]


def claims(engine: Any) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(text("SELECT count(*) FROM consumer_inbox")) or 0)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def seen() -> Seen:
    return Seen()


@contextlib.asynccontextmanager
async def harness(kind: str, inbox: FastStreamInbox, seen: Seen, *, guard: bool = True) -> Any:
    h = Harness(kind, [recorder(seen), inbox.middleware])
    if guard:
        inbox.guard(h.broker)
    try:
        yield h
    finally:
        await h.cleanup()


def credit(h: Harness, inbox: FastStreamInbox, **options: Any) -> Any:
    @h.subscribe(inbox.consumer("billing"), **options)
    async def handle(body: dict[str, Any], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    return handle


# -- 1. an aborted transaction is a failed attempt, never an ack -----------------------------


async def test_settlement__swallowed_database_error_fails_the_attempt_then_poisons(
    kind, pg_async_engine, pg_engine, seen
):
    # Given a handler that writes its effect, then catches a failing INSERT without a
    # savepoint (the transaction is now aborted: PostgreSQL would roll back the COMMIT)
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.2), max_attempts=2)
    async with harness(kind, inbox, seen) as h:

        @h.subscribe(inbox.consumer("billing"))
        async def handle(body: dict[str, Any], session: InboxSession) -> None:
            await apply_credit_async(session, "billing", body["account"], body["delta"])
            try:  # noqa: SIM105 - the mistake under test
                await session.execute(text("INSERT INTO accounts (id) VALUES (7), (7)"))
            except IntegrityError:
                pass  # the mistake: no session.begin_nested() around it

        async with h.broker:
            await h.broker.start()
            await h.publish(ORDER, ident())
            # When it is delivered, then retried
            await eventually(lambda: poison_rows(pg_engine), timeout=20, what="the poison row")
    # Then no attempt was acked as if it had committed: nothing applied, no claim, and
    # the message is kept as poison with the reason
    (row,) = poison_rows(pg_engine)
    assert row["reason_code"] == "inbox_error"
    assert "TransactionAborted" in row["error"]
    assert "begin_nested" in row["error"]
    assert applied(pg_engine) == 0
    assert claims(pg_engine) == 0
    assert "processed" not in seen.outcomes


# -- 2. without guard, the first message's check never drops it ------------------------------


async def test_settlement__no_guard_database_down_at_first_message_holds_it(
    kind, pg_async_url, pg_engine, seen
):
    # Given an app written without inbox.guard, whose database is down when it starts
    proxy = Proxy(("127.0.0.1", 5432))
    engine = create_async_engine(
        pg_async_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"), pool_pre_ping=True
    )
    inbox = FastStreamInbox(engine, retry_backoff=(0.1, 0.5))
    try:
        async with harness(kind, inbox, seen, guard=False) as h:
            credit(h, inbox)
            proxy.down()
            async with h.broker:
                await h.broker.start()
                await h.publish(ORDER, ident())
                # When the first message meets the failing start-up check, repeatedly
                await eventually(
                    lambda: seen.count("NackForRedelivery") >= 2, what="two hold-backs"
                )
                assert applied(pg_engine) == 0
                # Then, once the database is back, it is applied exactly once
                proxy.up()
                await eventually(lambda: applied(pg_engine) == 1, timeout=20, what="the effect")
    finally:
        await engine.dispose()
        proxy.close()
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)


@contextlib.contextmanager
def empty_database() -> Iterator[str]:
    """A database of its own, with no inbox tables yet."""
    name = f"inbox_empty_{uuid.uuid4().hex[:8]}"
    admin = create_engine(services.POSTGRES, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    try:
        yield name
    finally:
        drop_database(name)


async def test_settlement__no_guard_missing_tables_and_bad_setting_hold_the_message(kind, seen):
    # Given an app without inbox.guard on a database whose tables are not migrated yet
    with empty_database() as name:
        url = services.with_database(services.POSTGRES, name)
        sync = create_engine(url)
        engine = create_async_engine(services.with_database(services.POSTGRES, name, "asyncpg"))
        inbox = FastStreamInbox(engine, retry_backoff=(0.1, 0.3))
        try:
            async with harness(kind, inbox, seen, guard=False) as h:
                credit(h, inbox)
                async with h.broker:
                    await h.broker.start()
                    await h.publish(ORDER, ident())
                    # When the check fails on the missing tables: held back, not rejected
                    await eventually(
                        lambda: seen.count("NackForRedelivery") >= 2, what="hold-backs"
                    )
                    # ... and then on synchronous_commit=off (a setting that breaks the
                    # guarantee) once the tables exist
                    with sync.begin() as conn:
                        conn.execute(text(f'ALTER DATABASE "{name}" SET synchronous_commit = off'))
                    migrate(sync)
                    with sync.begin() as conn:
                        domain.create(conn)
                    await engine.dispose()  # new connections read the database's setting
                    held = seen.count("NackForRedelivery")
                    await eventually(
                        lambda: seen.count("NackForRedelivery") >= held + 2, what="held"
                    )
                    with sync.connect() as conn:
                        assert effects(conn, 7) == 0
                    # Then, once the setting is fixed, it is applied exactly once
                    with sync.begin() as conn:
                        conn.execute(text(f'ALTER DATABASE "{name}" RESET synchronous_commit'))
                    await engine.dispose()
                    await eventually(
                        lambda: _effects(sync) == 1, timeout=20, what="the effect after the fix"
                    )
        finally:
            await engine.dispose()
            sync.dispose()
    assert "processed" in seen.outcomes


def _effects(engine: Any) -> int:
    with engine.connect() as conn:
        return effects(conn, 7)


# -- 3 and 4. the handler cannot settle the message behind the inbox's back ------------------


async def test_settlement__handler_ack_message_commits_then_acks(
    kind, pg_async_engine, pg_engine, seen
):
    # Given a handler that does its work, then raises AckMessage ("done")
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.2))
    async with harness(kind, inbox, seen) as h:

        @h.subscribe(inbox.consumer("billing"))
        async def handle(body: dict[str, Any], session: InboxSession) -> None:
            await apply_credit_async(session, "billing", body["account"], body["delta"])
            raise AckMessage()

        async with h.broker:
            await h.broker.start()
            await h.publish(ORDER, ident())
            await eventually(lambda: applied(pg_engine) == 1, what="the committed effect")
            await h.publish(ORDER, ident())  # and its duplicate
            await eventually(lambda: seen.count("Skipped") == 2, what="both settled")
            assert await h.leftover() == 0
    # Then its work committed (once), and the message was acked after the commit
    assert claims(pg_engine) == 1
    assert applied(pg_engine) == 1


async def test_settlement__handler_calling_msg_ack_is_refused_and_nothing_is_lost(
    kind, pg_async_engine, pg_engine, seen
):
    # Given a handler that acknowledges the message itself, as if it were MANUAL
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.2), max_attempts=2)
    async with harness(kind, inbox, seen) as h:

        @h.subscribe(inbox.consumer("billing"))
        async def handle(
            body: dict[str, Any], session: InboxSession, message: Any = MESSAGE
        ) -> None:
            await apply_credit_async(session, "billing", body["account"], body["delta"])
            await message.ack()

        async with h.broker:
            await h.broker.start()
            await h.publish(ORDER, ident())
            await eventually(lambda: poison_rows(pg_engine), timeout=20, what="the poison row")
    # Then the manual ack was refused with a clear error, nothing was committed, and the
    # message is kept as poison at once (the mistake repeats at every attempt): never
    # acked and lost
    (row,) = poison_rows(pg_engine)
    assert (row["reason_code"], row["attempts"]) == ("handler_transaction", 1)
    assert "inbox settles this message itself" in row["error"]
    assert "AckMessage" in row["error"]
    assert applied(pg_engine) == 0


# -- 5. hand-backs are not crashes -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["rabbit", "nats"])
async def test_settlement__hand_backs_do_not_count_against_the_redelivery_limit(
    kind, pg_async_url, pg_engine, seen
):
    # Given a redelivery limit of 1 and a database that is down for several hand-backs
    proxy = Proxy(("127.0.0.1", 5432))
    engine = create_async_engine(
        pg_async_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"), pool_pre_ping=True
    )
    inbox = FastStreamInbox(engine, retry_backoff=(0.05, 0.1), redelivery_limit=1)
    try:
        async with harness(kind, inbox, seen) as h:
            credit(h, inbox)
            async with h.broker:
                await h.broker.start()
                proxy.down()
                await h.publish(ORDER, ident())
                # When the message is handed back many more times than the limit
                await eventually(
                    lambda: seen.count("NackForRedelivery") >= 5, what="five hand-backs"
                )
                # Then, once the database is back, it is applied, not poisoned
                proxy.up()
                await eventually(lambda: applied(pg_engine) == 1, timeout=20, what="the effect")
    finally:
        await engine.dispose()
        proxy.close()
    assert poison_rows(pg_engine) == []


# -- 7. a redrive starts the attempts again ---------------------------------------------------


async def test_settlement__redriven_poison_is_not_poisoned_on_its_first_failure(
    kind, pg_async_engine, pg_engine, pg_url, seen
):
    # Given a message poisoned after max_attempts=2 failures
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.2), max_attempts=2)
    failures = {"left": 100}
    async with harness(kind, inbox, seen) as h:

        @h.subscribe(inbox.consumer("billing"))
        async def handle(body: dict[str, Any], session: InboxSession) -> None:
            if failures["left"] > 0:
                failures["left"] -= 1
                raise RuntimeError("flaky downstream")
            await apply_credit_async(session, "billing", body["account"], body["delta"])

        async with h.broker:
            await h.broker.start()
            await h.publish(ORDER, ident())
            await eventually(lambda: poison_rows(pg_engine), timeout=20, what="the poison row")
            (row,) = poison_rows(pg_engine)
            # When it is redriven and its first attempt after the repair fails once more
            failures["left"] = 1
            result = cli(pg_url, "poison", "redrive", str(row["id"]), "--broker-url", URLS[h.kind])
            assert result.returncode == 0, result.stderr
            # Then the failure is retried (attempts started again), and it is applied
            await eventually(lambda: applied(pg_engine) == 1, timeout=20, what="the effect")
    assert poison_rows(pg_engine)[0]["decision"] == "recovered"


@pytest.mark.parametrize("kind", ["rabbit", "nats"])
async def test_settlement__claim_in_progress_hand_backs_are_not_crashes(
    kind, pg_async_engine, pg_engine, seen
):
    # Given a redelivery limit of 2, a short lock_timeout, and a handler that holds its
    # claim for 3 s
    inbox = FastStreamInbox(
        pg_async_engine, lock_timeout=0.2, retry_backoff=(0.05, 0.1), redelivery_limit=2
    )
    async with harness(kind, inbox, seen) as h:

        @h.subscribe(inbox.consumer("billing"), max_workers=2)
        async def handle(body: dict[str, Any], session: InboxSession) -> None:
            await apply_credit_async(session, "billing", body["account"], body["delta"])
            await asyncio.sleep(3)

        async with h.broker:
            await h.broker.start()
            await h.publish(ORDER, ident())
            await asyncio.sleep(0.5)
            # When its duplicate is handed back again and again while the claim is held
            await h.publish(ORDER, ident())
            await eventually(lambda: seen.count("NackForRedelivery") >= 4, what="four hand-backs")
            # Then the duplicate is skipped once the first commits, and nothing is poisoned
            await eventually(lambda: seen.count("Skipped") >= 1, timeout=20, what="the skip")
    assert poison_rows(pg_engine) == []
    assert applied(pg_engine) == 1


async def test_settlement__hand_backs_spend_no_quorum_delivery_limit(pg_async_url, pg_engine, seen):
    # Given a RabbitMQ quorum queue whose delivery limit is 2, and a database that is down
    # for many more hand-backs than that
    from faststream.rabbit import QueueType, RabbitQueue

    proxy = Proxy(("127.0.0.1", 5432))
    engine = create_async_engine(
        pg_async_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"), pool_pre_ping=True
    )
    inbox = FastStreamInbox(engine, retry_backoff=(0.05, 0.1))
    try:
        async with harness("rabbit", inbox, seen) as h:
            queue = RabbitQueue(
                h.name,
                durable=True,
                queue_type=QueueType.QUORUM,
                arguments={"x-delivery-limit": 2},
            )

            @h.broker.subscriber(queue, dependencies=[inbox.consumer("billing")])
            async def handle(body: dict[str, Any], session: InboxSession) -> None:
                await apply_credit_async(session, "billing", body["account"], body["delta"])

            async with h.broker:
                await h.broker.start()
                proxy.down()
                await h.publish(ORDER, ident())
                # When it is handed back six times
                await eventually(
                    lambda: seen.count("NackForRedelivery") >= 6, what="six hand-backs"
                )
                # Then the queue still holds it, and once the database is back it is applied
                proxy.up()
                await eventually(lambda: applied(pg_engine) == 1, timeout=20, what="the effect")
                assert await h.leftover() == 0
    finally:
        await engine.dispose()
        proxy.close()
    assert poison_rows(pg_engine) == []
