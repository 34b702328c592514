"""The claim protocol on the real databases, through the executors adapters use."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from inbox_middleware._core.consumption import LookUpClaim
from inbox_middleware._core.exceptions import (
    ClaimInProgress,
    DatabaseUnavailable,
    HandlerTransactionError,
    PrerequisiteError,
)
from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Claim, Decision, Delivery, StoredClaim
from inbox_middleware._storage import AsyncInbox, Inbox, InboxSchema, driver

from ..apps.domain import apply_credit, apply_credit_async, balance, effects
from ..support import database, services
from ..support.engines import async_engine, sync_engine
from ..support.proxy import Proxy


def delivery(message_id="m-1", payload=None, consumer="billing", scheme="json.v1"):
    payload = {"account": 1, "delta": 10} if payload is None else payload
    return Delivery(
        consumer,
        MessageIdentity("orders", message_id),
        hash_json(payload, scheme),
        handler_version="1",
        source="accounts",
        payload=repr(payload).encode(),
        headers={"x-trace": "t-1"},
    )


def credit(account=1, delta=10):
    def handler(session: Session) -> str:
        apply_credit(session, "billing", account, delta)
        return "applied"

    return handler


def inbox_rows(engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(text("SELECT count(*) FROM consumer_inbox")))


# -- sequential cases: PostgreSQL and SQLite ----------------------------------------------


def test_claim__sequential_duplicate_has_one_effect(engine):
    inbox = Inbox(engine)

    first = inbox.process(delivery(), credit())
    second = inbox.process(delivery(), credit())

    assert (first.decision, first.result) == (Decision.FIRST, "applied")
    assert (second.decision, second.result) == (Decision.DUPLICATE, None)
    with engine.connect() as conn:
        assert (effects(conn), balance(conn, 1)) == (1, 10)
    assert inbox_rows(engine) == 1


def test_claim__same_id_other_payload_is_quarantined_and_not_run(engine):
    inbox = Inbox(engine)
    inbox.process(delivery(), credit())

    conflict = inbox.process(delivery(payload={"account": 1, "delta": 99}), credit(delta=99))
    again = inbox.process(delivery(payload={"account": 1, "delta": 99}), credit(delta=99))

    assert conflict.decision is Decision.CONFLICT
    assert conflict.verdict.quarantine.attempts == 1
    assert again.verdict.quarantine.attempts == 2
    assert again.verdict.quarantine.id == conflict.verdict.quarantine.id
    with engine.connect() as conn:
        assert (effects(conn), balance(conn, 1)) == (1, 10)
        row = conn.execute(select(InboxSchema().tables.quarantine)).mappings().one()
    assert row["stored_sha256"] == hash_json({"account": 1, "delta": 10}, "json.v1").sha256
    assert row["conflicting_sha256"] == hash_json({"account": 1, "delta": 99}, "json.v1").sha256
    assert bytes(row["payload"]) == repr({"account": 1, "delta": 99}).encode()
    assert (row["decision"], row["attempts"], row["source"]) == ("pending", 2, "accounts")
    assert row["headers"] == {"x-trace": "t-1"}


def test_claim__exception_after_claim_rolls_the_claim_back(engine):
    # Given a handler that fails after its first write
    inbox = Inbox(engine)

    def fail_after_write(session: Session) -> None:
        apply_credit(session, "billing", 1, 10)
        raise RuntimeError("downstream validation failed")

    # When it raises, then nothing it did and no claim survive
    with pytest.raises(RuntimeError, match="downstream"):
        inbox.process(delivery(), fail_after_write)
    assert inbox_rows(engine) == 0
    # and the retry owns the message and applies it once
    assert inbox.process(delivery(), credit()).decision is Decision.FIRST
    with engine.connect() as conn:
        assert effects(conn) == 1


def test_claim__handler_commit_is_refused_and_nothing_is_half_applied(engine):
    inbox = Inbox(engine)

    def commits(session: Session) -> None:
        apply_credit(session, "billing", 1, 10)
        session.commit()

    with pytest.raises(HandlerTransactionError, match="inbox commits when the handler returns"):
        inbox.process(delivery(), commits)
    for refused in ("rollback", "close"):
        with pytest.raises(HandlerTransactionError):
            inbox.process(delivery(), lambda session, r=refused: getattr(session, r)())
    assert inbox_rows(engine) == 0
    with engine.connect() as conn:
        assert effects(conn) == 0


def test_claim__savepoints_inside_the_handler_are_allowed(engine):
    inbox = Inbox(engine)

    def partial(session: Session) -> None:
        apply_credit(session, "billing", 1, 10)
        try:
            with session.begin_nested():
                apply_credit(session, "billing", 2, 5)
                raise ValueError("undo only this block")
        except ValueError:
            pass

    inbox.process(delivery(), partial)
    with engine.connect() as conn:
        assert (balance(conn, 1), balance(conn, 2)) == (10, 0)


def test_claim__users_own_session_bound_to_the_connection_joins_the_transaction(engine):
    # The documented pattern: a repository with its own Session, bound to the claim's
    # connection; its commit() releases a savepoint, never the inbox's transaction.
    inbox = Inbox(engine)

    def with_repository(session: Session) -> None:
        repository = Session(bind=session.connection(), join_transaction_mode="create_savepoint")
        apply_credit(repository, "billing", 1, 10)
        repository.commit()
        raise RuntimeError("fails after the repository committed")

    with pytest.raises(RuntimeError):
        inbox.process(delivery(), with_repository)
    with engine.connect() as conn:
        assert effects(conn) == 0
    assert inbox_rows(engine) == 0


def test_claim__older_hash_scheme_is_recognised_on_redelivery(engine):
    # Given a claim hashed by scheme v1, when the library now hashes with v2 but can
    # recompute v1, the redelivery is a verified duplicate, not a conflict.
    inbox = Inbox(engine)
    inbox.process(delivery(scheme="v1"), credit())
    upgraded = replace(
        delivery(scheme="v2"),
        rehash=lambda scheme: hash_json({"account": 1, "delta": 10}, scheme).sha256,
    )

    outcome = inbox.process(upgraded, credit())

    assert (outcome.decision, outcome.verdict.verified) == (Decision.DUPLICATE, True)


def test_claim__timestamps_read_back_as_the_times_written(engine):
    # SQLite once stored only the year of received_at: its CAST to DATETIME is numeric.
    inbox = Inbox(engine)
    produced = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    one = replace(delivery("m-1"), identity=MessageIdentity("orders", "m-1", produced_at=produced))

    inbox.process(one, credit())
    inbox.process_batch([delivery("m-2"), delivery("m-3")], lambda session, verdicts: None)

    table = InboxSchema().tables.inbox
    with engine.connect() as conn:
        rows = conn.execute(
            select(table.c.message_id, table.c.produced_at, table.c.received_at).order_by(
                table.c.message_id
            )
        ).all()
    assert [row.message_id for row in rows] == ["m-1", "m-2", "m-3"]
    assert utc(rows[0].produced_at) == produced
    now = datetime.now(UTC)
    for row in rows:
        assert abs(now - utc(row.received_at)) < timedelta(minutes=1)


def utc(value: datetime) -> datetime:
    """SQLite hands back naive UTC; PostgreSQL an aware time in the session's zone."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# -- PostgreSQL: concurrency, isolation, failures -----------------------------------------


def _blocked_on_lock(engine) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.scalar(
                text(
                    # the claim as text, or as its prepared statement's EXECUTE
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND (query LIKE '%consumer_inbox%' OR query LIKE '%EXECUTE inbox_claim_%') "
                    "AND datname = current_database()"
                )
            )
        )


def holder(holding: threading.Event, release: threading.Event, outcome: str):
    """A handler that applies, says so, then holds its transaction open until released,
    and ends it with ``outcome`` (commit or rollback)."""

    def held(session: Session) -> None:
        apply_credit(session, "billing", 1, 10)
        holding.set()
        release.wait(30)
        if outcome == "rollback":
            raise RuntimeError("A fails")

    return held


@pytest.mark.parametrize("first_outcome", ["commit", "rollback"])
def test_claim__concurrent_duplicate_waits_for_first_transaction(pg_engine, first_outcome):
    # Given delivery A holding an uncommitted claim
    inbox = Inbox(pg_engine, lock_timeout=30)
    holding, release = threading.Event(), threading.Event()
    held = holder(holding, release, first_outcome)

    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(inbox.process, delivery(), held)
        assert holding.wait(10)
        # When delivery B of the same message arrives, its INSERT blocks on A's row
        b = pool.submit(inbox.process, delivery(), credit())
        deadline = time.monotonic() + 10
        while not _blocked_on_lock(pg_engine) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _blocked_on_lock(pg_engine), "B should be waiting on A's claim"
        assert not b.done()
        release.set()
        # Then B sees A's outcome: a duplicate after a commit, the claim after a rollback
        if first_outcome == "commit":
            assert a.result().decision is Decision.FIRST
            assert b.result().decision is Decision.DUPLICATE
        else:
            with pytest.raises(RuntimeError, match="A fails"):
                a.result()
            assert b.result().decision is Decision.FIRST
    with pg_engine.connect() as conn:
        assert effects(conn) == 1


@pytest.mark.parametrize("first_outcome", ["commit", "rollback", "none"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_claim__the_settled_look_up_waits_for_a_transaction_holding_the_key(
    pg_engine, pg_async_url, first_outcome, kind
):
    # Given delivery A holding an uncommitted claim (or none at all)
    inbox = Inbox(pg_engine, lock_timeout=30)
    holding, release = threading.Event(), threading.Event()
    held = holder(holding, release, first_outcome)

    op = LookUpClaim(delivery(), settled=True)

    async def look_up_async() -> StoredClaim | None:
        engine = async_engine(pg_async_url)
        try:
            return await AsyncInbox(engine).bookkeep(op)
        finally:
            await engine.dispose()

    def look_up() -> StoredClaim | None:
        if kind == "async":
            return asyncio.run(look_up_async())
        return Inbox(pg_engine).bookkeep(op)

    with ThreadPoolExecutor(2) as pool:
        a = None
        if first_outcome != "none":
            a = pool.submit(inbox.process, delivery(), held)
            assert holding.wait(10)
        # When the claim is read settled: it waits for A (a plain read would see nothing)
        read = pool.submit(look_up)
        time.sleep(0.5)
        assert read.done() == (first_outcome == "none")
        release.set()
        stored = read.result(timeout=20)
        if a is not None and first_outcome == "commit":
            a.result()
    # Then it reads A's outcome: its claim after a commit, none after a rollback; and the
    # read itself claims nothing
    assert (stored is not None) == (first_outcome == "commit")
    assert inbox_rows(pg_engine) == (1 if first_outcome == "commit" else 0)


def test_claim__sixteen_concurrent_deliveries_have_one_effect(pg_engine):
    inbox = Inbox(pg_engine, lock_timeout=30)
    start = threading.Barrier(16)

    def deliver(_: int) -> Decision:
        start.wait()
        return inbox.process(delivery(), credit()).decision

    with ThreadPoolExecutor(16) as pool:
        decisions = list(pool.map(deliver, range(16)))

    assert sorted(decisions).count(Decision.FIRST) == 1
    assert decisions.count(Decision.DUPLICATE) == 15
    with pg_engine.connect() as conn:
        assert (effects(conn), balance(conn, 1)) == (1, 10)


def test_claim__lock_timeout_hands_the_message_back_then_it_is_a_duplicate(pg_engine):
    # Given a long handler holding the claim for 2 s
    inbox = Inbox(pg_engine, lock_timeout=0.3)
    holding = threading.Event()

    def long_handler(session: Session) -> None:
        apply_credit(session, "billing", 1, 10)
        holding.set()
        time.sleep(2)

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(inbox.process, delivery(), long_handler)
        assert holding.wait(10)
        # When its duplicate arrives, it waits at most lock_timeout, then gives up
        started = time.monotonic()
        with pytest.raises(ClaimInProgress) as info:
            inbox.process(delivery(), credit())
        waited = time.monotonic() - started
        assert 0.25 <= waited < 1.5
        assert (info.value.consumer, info.value.message_id) == ("billing", "m-1")
        first.result()
    # And retried later, it is skipped
    assert inbox.process(delivery(), credit()).decision is Decision.DUPLICATE
    with pg_engine.connect() as conn:
        assert effects(conn) == 1


def test_claim__deadlock_between_handlers_is_retried_in_process(pg_engine):
    # Two messages update accounts 1 and 2 in opposite orders; PostgreSQL aborts one
    # with a deadlock (40P01) and the executor reruns that transaction.
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (1, 0), (2, 0)"))
    inbox = Inbox(pg_engine, lock_timeout=None)
    both_hold_one = threading.Barrier(2, timeout=10)
    attempts = {"m-a": 0, "m-b": 0}

    def opposite(first: int, second: int, message: str):
        def handler(session: Session) -> None:
            attempts[message] += 1
            apply_credit(session, "billing", first, 1)
            if attempts[message] == 1:
                both_hold_one.wait()
            apply_credit(session, "billing", second, 1)

        return handler

    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(inbox.process, delivery("m-a"), opposite(1, 2, "m-a"))
        b = pool.submit(inbox.process, delivery("m-b"), opposite(2, 1, "m-b"))
        outcomes = [a.result(), b.result()]

    assert sorted(o.attempts for o in outcomes) == [1, 2]
    with pg_engine.connect() as conn:
        assert (balance(conn, 1), balance(conn, 2), effects(conn)) == (2, 2, 4)


def test_claim__runs_at_read_committed_even_on_a_repeatable_read_engine(pg_url, pg_engine):
    engine = sync_engine(pg_url, isolation_level="REPEATABLE READ")
    try:
        inbox = Inbox(engine)
        levels = []
        inbox.process(
            delivery(),
            lambda s: levels.append(s.execute(text("SHOW transaction_isolation")).scalar()),
        )
        assert levels == ["read committed"]
    finally:
        engine.dispose()


def test_check__refuses_synchronous_commit_off(pg_engine):
    # Set on the database, as it must be behind PgBouncer (which refuses a connection's
    # "options"), and as the sessions of any pooler pick it up
    with database.scratch_database(synchronous_commit="off") as name:
        engine = sync_engine(services.with_database(services.POSTGRES, name))
        try:
            with pytest.raises(PrerequisiteError, match="synchronous_commit is off"):
                Inbox(engine).check()
        finally:
            engine.dispose()


def test_claim__database_down_at_claim_time_is_transient_and_loses_nothing(pg_engine, pg_url):
    # Given an engine that reaches PostgreSQL through a proxy we can break
    proxy = Proxy(services.postgres_address())
    engine = sync_engine(services.via_port(pg_url, proxy.port), pool_pre_ping=True)
    inbox = Inbox(engine)
    try:
        inbox.process(delivery("warm-up"), credit(account=9))
        # When the database becomes unreachable
        proxy.down()
        with pytest.raises(DatabaseUnavailable) as info:
            inbox.process(delivery(), credit())
        assert info.value.message_id == "m-1"
        # Then nothing was recorded, and once it is back the message is processed once
        proxy.up()
        assert inbox.process(delivery(), credit()).decision is Decision.FIRST
        assert inbox.process(delivery(), credit()).decision is Decision.DUPLICATE
    finally:
        engine.dispose()
        proxy.close()
    with pg_engine.connect() as conn:
        assert effects(conn, 1) == 1


def test_claim__connection_cut_mid_transaction_commits_nothing(pg_engine, pg_url):
    proxy = Proxy(services.postgres_address())
    engine = sync_engine(services.via_port(pg_url, proxy.port))
    inbox = Inbox(engine)

    def cut_after_writes(session: Session) -> None:
        apply_credit(session, "billing", 1, 10)
        proxy.cut()
        session.execute(text("SELECT 1"))

    try:
        with pytest.raises(DatabaseUnavailable):
            inbox.process(delivery(), cut_after_writes)
        assert inbox.process(delivery(), credit()).decision is Decision.FIRST
    finally:
        engine.dispose()
        proxy.close()
    with pg_engine.connect() as conn:
        assert effects(conn) == 1


# -- the claim and its BEGIN in one round trip (psycopg) ----------------------------------


CLAIMED = (b"1",)


def _marked(row: tuple[bytes, ...]) -> bool:
    """The claim's RETURNING: ``xid:`` and the transaction id it was given."""
    return len(row) == 1 and re.fullmatch(rb"xid:[0-9]+", row[0]) is not None


@pytest.fixture
def begins(monkeypatch):
    """What each `claim_with_begin` answered (None: it left the claim to the cursor), a
    claimed row written ``CLAIMED``: its value is the transaction's id, marked."""
    answers = []
    real = driver.claim_with_begin

    def recording(*args):
        answer = real(*args)
        answers.append(CLAIMED if answer and _marked(answer) else answer)
        return answer

    monkeypatch.setattr(driver, "claim_with_begin", recording)
    return answers


def test_claim__sent_with_its_begin_it_is_in_the_handlers_transaction(pg_engine, begins):
    # Given a handler that looks for its own claim from another connection, then fails
    inbox = Inbox(pg_engine)
    seen = []

    def look_then_fail(session: Session) -> None:
        apply_credit(session, "billing", 1, 10)
        status = session.connection().connection.dbapi_connection.info.transaction_status
        with pg_engine.connect() as other:
            seen.append((status.name, inbox_rows(pg_engine), effects(other)))
        raise RuntimeError("after the claim")

    # When the claim goes with its BEGIN and the handler fails
    with pytest.raises(RuntimeError, match="after the claim"):
        inbox.process(delivery(), look_then_fail)

    # Then the claim was one uncommitted transaction with the effect, rolled back with it
    assert begins == [(b"1",)]
    assert seen == [("INTRANS", 0, 0)]
    assert inbox_rows(pg_engine) == 0
    # And the next delivery claims, applies and commits once; a duplicate does nothing
    assert inbox.process(delivery(), credit()).decision is Decision.FIRST
    assert inbox.process(delivery(), credit()).decision is Decision.DUPLICATE
    assert begins[1:] == [(b"1",), ()]
    with pg_engine.connect() as conn:
        assert (effects(conn), balance(conn, 1)) == (1, 10)


@pytest.mark.parametrize(
    "message_id",
    ["it's", "back\\slash", "100%", "%(message_id)s", "a'; DROP TABLE consumer_inbox; --", "é€𝄞"],
)
def test_claim__values_written_as_literals_are_stored_as_sent(pg_engine, begins, message_id):
    inbox = Inbox(pg_engine)

    first = inbox.process(delivery(message_id), credit())
    second = inbox.process(delivery(message_id), credit())

    assert (first.decision, second.decision) == (Decision.FIRST, Decision.DUPLICATE)
    assert begins[0] == (b"1",)
    with pg_engine.connect() as conn:
        stored = conn.execute(text("SELECT message_id, received_at FROM consumer_inbox")).all()
    assert [row.message_id for row in stored] == [message_id]
    assert abs(utc(stored[0].received_at) - datetime.now(UTC)) < timedelta(minutes=1)


@pytest.mark.parametrize("message_id", ["it's", "back\\slash", "é"])
def test_claim__on_another_client_encoding_libpq_escapes_the_literals(
    pg_url, pg_engine, begins, message_id
):
    # Given a connection whose client encoding is not UTF-8 (the plain literals are
    # written for UTF-8 only)
    engine = sync_engine(pg_url, connect_args={"client_encoding": "LATIN1"})
    inbox = Inbox(engine)
    try:
        # When a message is claimed twice
        first = inbox.process(delivery(message_id), credit())
        again = inbox.process(delivery(message_id), credit())
    finally:
        engine.dispose()

    # Then both went with their BEGIN, escaped by libpq, and the id is stored as sent
    assert begins == [CLAIMED, ()]
    assert (first.decision, again.decision) == (Decision.FIRST, Decision.DUPLICATE)
    with pg_engine.connect() as conn:
        assert conn.scalar(text("SELECT message_id FROM consumer_inbox")) == message_id


def test_claim__an_open_transaction_or_autocommit_leaves_the_claim_to_the_cursor(pg_engine):
    statement = Inbox(pg_engine).statements.driver_sql(pg_engine.dialect)[Claim]
    args = statement.parameters(Inbox(pg_engine).statements.statement(claim_step())[1])
    raw = pg_engine.raw_connection()
    try:
        dbapi = raw.driver_connection
        dbapi.execute("SELECT 1")  # psycopg opened a transaction for it
        assert driver.claim_with_begin(dbapi, statement, args) is None
        dbapi.rollback()
        dbapi.autocommit = True
        assert driver.claim_with_begin(dbapi, statement, args) is None
        dbapi.autocommit = False
        assert _marked(driver.claim_with_begin(dbapi, statement, args))
        dbapi.rollback()
    finally:
        raw.close()
    assert inbox_rows(pg_engine) == 0


def test_claim__connection_cut_before_the_claim_is_transient_and_loses_nothing(
    pg_engine, pg_url, begins
):
    # Given a pooled connection the proxy then cuts, and no pre-ping to notice it
    proxy = Proxy(services.postgres_address())
    engine = sync_engine(services.via_port(pg_url, proxy.port))
    inbox = Inbox(engine, serialization_retries=0)
    try:
        inbox.process(delivery("warm-up"), credit(account=9))
        proxy.cut()
        # When the claim goes with its BEGIN on the dead connection
        with pytest.raises(DatabaseUnavailable):
            inbox.process(delivery(), credit())
        # Then the connection was dropped, and the next delivery is first seen, once
        assert inbox.process(delivery(), credit()).decision is Decision.FIRST
    finally:
        engine.dispose()
        proxy.close()
    with pg_engine.connect() as conn:
        assert effects(conn, 1) == 1


def _prepared_claims(session: Session) -> list[str]:
    """The claim statements prepared on the session's server session."""
    rows = session.execute(
        text("SELECT name FROM pg_prepared_statements WHERE name LIKE 'inbox_claim_%'")
    )
    return [row.name for row in rows]


def test_claim__runs_as_the_statement_prepared_once_on_the_servers_session(
    pg_url, pg_engine, begins
):
    # Given one connection, so that every delivery claims on the same server session
    engine = sync_engine(pg_url, pool_size=1, max_overflow=0)
    inbox = Inbox(engine)
    seen = []

    def look(session: Session) -> None:
        apply_credit(session, "billing", 1, 10)
        seen.append(_prepared_claims(session))

    try:
        # When three messages are claimed there, and one of them again
        decisions = [
            inbox.process(delivery(message_id), look).decision
            for message_id in ("m-1", "m-2", "m-3", "m-1")
        ]
        with engine.connect() as conn:
            state = conn.info[driver.PREPARED]
    finally:
        engine.dispose()
    assert decisions == [Decision.FIRST] * 3 + [Decision.DUPLICATE]
    assert begins == [CLAIMED] * 3 + [()]
    if not services.THROUGH_POOLER:  # a pooler hands each transaction any server session
        # Then the claim was prepared once, and each claim ran as that statement
        assert len(seen[0]) == 1 and seen == [seen[0]] * 3
        assert state == frozenset(seen[0])


@pytest.mark.parametrize("message_id", ["it's", "back\\slash", "%(message_id)s", "é€𝄞"])
def test_claim__a_prepared_claim_the_session_lost_is_sent_as_text_then_prepared_again(
    pg_url, pg_engine, begins, message_id
):
    # Given a connection whose prepared claim a handler deallocates after it ran
    engine = sync_engine(pg_url, pool_size=1, max_overflow=0)
    inbox = Inbox(engine)
    seen = []

    def deallocate(session: Session) -> None:
        apply_credit(session, "billing", 1, 10)
        for name in _prepared_claims(session):
            session.execute(text(f"DEALLOCATE {name}"))

    def look(session: Session) -> None:
        apply_credit(session, "billing", 1, 10)
        seen.append(_prepared_claims(session))

    try:
        assert inbox.process(delivery("first"), deallocate).decision is Decision.FIRST
        # When the next messages are claimed on it, one of them twice
        decisions = [
            inbox.process(delivery(message_id), look).decision,
            inbox.process(delivery(message_id), look).decision,
            inbox.process(delivery("last"), look).decision,
        ]
        with engine.connect() as conn:
            state = conn.info[driver.PREPARED]
    finally:
        engine.dispose()
    # Then each claim went with its BEGIN and was applied once
    assert decisions == [Decision.FIRST, Decision.DUPLICATE, Decision.FIRST]
    assert begins == [CLAIMED, CLAIMED, (), CLAIMED]
    with pg_engine.connect() as conn:
        assert effects(conn) == 3
        stored = conn.scalars(text("SELECT message_id FROM consumer_inbox")).all()
    assert sorted(stored) == sorted(["first", message_id, "last"])
    if not services.THROUGH_POOLER:  # a pooler hands each transaction any server session
        # the EXECUTE that found no statement was rolled back and the claim sent as text;
        # the next claim prepared it again, and the one after ran it
        assert seen[0] == [] and len(seen[1]) == 1
        assert state == frozenset(seen[1])


def test_claim__psycopgs_deallocate_all_after_a_rollback_costs_one_claim_as_text(pg_url, pg_engine):
    # Given a connection where psycopg prepared a statement of its own (the handler's, run
    # past its threshold of five), then a handler that fails: psycopg's rollback sends
    # DEALLOCATE ALL, which takes the inbox's prepared claim too
    engine = sync_engine(pg_url, pool_size=1, max_overflow=0)
    inbox = Inbox(engine)
    seen = []

    def look(session: Session) -> None:
        apply_credit(session, "billing", 1, 10)
        seen.append(
            session.scalars(
                text("SELECT name FROM pg_prepared_statements WHERE name LIKE '_pg3_%'")
            ).all()
        )
        seen.append(_prepared_claims(session))

    def fail(session: Session) -> None:
        apply_credit(session, "billing", 1, 10)
        raise RuntimeError("the handler failed")

    try:
        for n in range(6):
            inbox.process(delivery(f"m-{n}"), look)
        psycopgs, claims = seen[-2], seen[-1]
        with pytest.raises(RuntimeError):
            inbox.process(delivery("failing"), fail)
        # When the next messages are claimed, the failed one again among them
        decisions = [
            inbox.process(delivery(message_id), look).decision
            for message_id in ("failing", "m-6", "m-7")
        ]
        with engine.connect() as conn:
            state = conn.info[driver.PREPARED]
    finally:
        engine.dispose()

    # Then each was applied once; the first claim after the rollback went as text, the
    # next prepared the claim again
    assert decisions == [Decision.FIRST] * 3
    with pg_engine.connect() as conn:
        assert effects(conn) == 9
    if not services.THROUGH_POOLER:  # through the pooler's guide, psycopg prepares nothing
        assert psycopgs and len(claims) == 1
        assert seen[-5] == [] and seen[-3] == seen[-1] == claims
        assert state == frozenset(claims)


def test_claim__a_prepared_claim_gone_right_after_its_prepare_means_a_pooler_text_from_then_on(
    pg_url, pg_engine, begins, monkeypatch
):
    # Given a connection whose PREPARE lands on another server session than the EXECUTE
    # after it (as through a transaction pooler: here, deallocated at once)
    prepares = []
    real = driver._prepare

    def elsewhere(pgconn, command):
        prepares.append(command)
        done = real(pgconn, command)
        pgconn.exec_(b"DEALLOCATE " + command.split()[1].encode())
        return done

    monkeypatch.setattr(driver, "_prepare", elsewhere)
    engine = sync_engine(pg_url, pool_size=1, max_overflow=0)
    inbox = Inbox(engine)
    try:
        # When three messages are claimed, one of them twice
        decisions = [
            inbox.process(delivery(message_id), credit()).decision
            for message_id in ("m-1", "m-2", "m-1", "m-3")
        ]
        with engine.connect() as conn:
            state = conn.info[driver.PREPARED]
    finally:
        engine.dispose()

    # Then the first claim was rolled back and sent as text, and the connection never
    # prepared again: it claims as text
    assert decisions == [Decision.FIRST, Decision.FIRST, Decision.DUPLICATE, Decision.FIRST]
    assert begins == [CLAIMED, CLAIMED, (), CLAIMED]
    assert len(prepares) == 1 and state is False
    with pg_engine.connect() as conn:
        assert effects(conn) == 3


def claim_step():
    return Claim(delivery())


# -- the async executor (asyncpg) ---------------------------------------------------------


async def test_async_claim__first_duplicate_conflict(pg_async_engine, pg_engine):
    inbox = AsyncInbox(pg_async_engine)
    await inbox.check()

    async def handler(session) -> str:
        await apply_credit_async(session, "billing", 1, 10)
        return "applied"

    first = await inbox.process(delivery(), handler)
    duplicate = await inbox.process(delivery(), handler)
    conflict = await inbox.process(delivery(payload={"other": True}), handler)

    assert [first.decision, duplicate.decision, conflict.decision] == [
        Decision.FIRST,
        Decision.DUPLICATE,
        Decision.CONFLICT,
    ]
    with pg_engine.connect() as conn:
        assert effects(conn) == 1


@pytest.mark.parametrize("message_id", ["m-1", "it's", "back\\slash", "100%", "é€𝄞"])
async def test_async_claim__sent_with_its_begin_in_one_message(
    pg_async_engine, pg_engine, monkeypatch, message_id
):
    # Given a record of what each claim sent with its BEGIN answered (None: the BEGIN
    # went alone and the claim with parameters after it, a round trip more)
    answers = []
    real = driver.claim_with_begin_asyncpg

    def recording(*args):
        answers.append(real(*args))
        return answers[-1]

    monkeypatch.setattr(driver, "claim_with_begin_asyncpg", recording)
    inbox = AsyncInbox(pg_async_engine)

    async def handler(session) -> None:
        await apply_credit_async(session, "billing", 1, 10)

    # When a message is claimed, then claimed again
    first = await inbox.process(delivery(message_id), handler)
    again = await inbox.process(delivery(message_id), handler)

    # Then both claims went in one message with their BEGIN, and said what they found
    assert answers == [True, False]
    assert (first.decision, again.decision) == (Decision.FIRST, Decision.DUPLICATE)
    with pg_engine.connect() as conn:
        assert effects(conn) == 1
        stored = conn.scalar(text("SELECT message_id FROM consumer_inbox"))
    assert stored == message_id


async def test_async_claim__runs_as_the_prepared_statement_as_text_once_lost_then_again(
    pg_async_url, pg_engine
):
    # Given one asyncpg connection, so that every delivery claims on one server session
    engine = async_engine(pg_async_url, pool_size=1, max_overflow=0)
    inbox = AsyncInbox(engine)
    seen = []

    async def look(session) -> None:
        await apply_credit_async(session, "billing", 1, 10)
        seen.append(await session.run_sync(_prepared_claims))

    async def deallocate(session) -> None:
        await apply_credit_async(session, "billing", 1, 10)
        for name in await session.run_sync(_prepared_claims):
            await session.execute(text(f"DEALLOCATE {name}"))

    try:
        # When two messages are claimed, then the prepared claim is lost, then two more
        # (one of them twice) are claimed
        decisions = [(await inbox.process(delivery(m), look)).decision for m in ("m-1", "m-2")]
        decisions.append((await inbox.process(delivery("m-3"), deallocate)).decision)
        for message_id in ("it's", "it's", "m-4"):
            decisions.append((await inbox.process(delivery(message_id), look)).decision)
        async with engine.connect() as conn:
            state = (await conn.get_raw_connection()).info[driver.PREPARED]
    finally:
        await engine.dispose()

    # Then the first claims ran as the prepared statement, the one after the loss was
    # rolled back and sent as text, and the next prepared it again
    assert decisions == [Decision.FIRST] * 3 + [Decision.FIRST, Decision.DUPLICATE] + [
        Decision.FIRST
    ]
    if not services.THROUGH_POOLER:  # a pooler hands each transaction any server session
        assert len(seen[0]) == 1 and seen == [seen[0], seen[0], [], seen[0]]
        assert state == frozenset(seen[0])
    with pg_engine.connect() as conn:
        assert effects(conn) == 5


async def test_async_claim__commit_refused_and_rolled_back(pg_async_engine, pg_engine):
    inbox = AsyncInbox(pg_async_engine)

    async def commits(session) -> None:
        await apply_credit_async(session, "billing", 1, 10)
        await session.commit()

    with pytest.raises(HandlerTransactionError):
        await inbox.process(delivery(), commits)
    with pg_engine.connect() as conn:
        assert effects(conn) == 0
    assert inbox_rows(pg_engine) == 0


async def test_async_claim__cancellation_mid_transaction_invalidates_connection(
    pg_async_engine, pg_engine
):
    # Given a handler cancelled while a statement runs on the server
    inbox = AsyncInbox(pg_async_engine)
    started = asyncio.Event()

    async def slow(session) -> None:
        await apply_credit_async(session, "billing", 1, 10)
        started.set()
        await session.execute(text("SELECT pg_sleep(30)"))

    task = asyncio.create_task(inbox.process(delivery(), slow))
    await started.wait()
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    # Then the server statement is cancelled, not left holding the claim's row lock
    def sleeping() -> int:
        with pg_engine.connect() as conn:
            return int(
                conn.scalar(
                    text(
                        "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)' "
                        "AND state = 'active'"
                    )
                )
            )

    deadline = time.monotonic() + 5
    while sleeping() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert sleeping() == 0
    # and nothing was kept: the next delivery owns the message, on a working connection
    outcome = await inbox.process(delivery(), lambda session: asyncio.sleep(0))
    assert outcome.decision is Decision.FIRST
    with pg_engine.connect() as conn:
        assert effects(conn) == 0


async def test_async_claim__lock_timeout_hands_the_message_back(pg_async_engine, pg_engine):
    # Given a handler holding the claim for 2 s, on asyncpg (whose claim goes straight to
    # the driver's cursor, and must be mapped as SQLAlchemy's path would map it)
    inbox = AsyncInbox(pg_async_engine, lock_timeout=0.3)
    holding = asyncio.Event()

    async def long_handler(session) -> None:
        await apply_credit_async(session, "billing", 1, 10)
        holding.set()
        await asyncio.sleep(2)

    first = asyncio.create_task(inbox.process(delivery(), long_handler))
    await asyncio.wait_for(holding.wait(), 10)
    # When its duplicate arrives, it waits at most lock_timeout, then gives up
    started = time.monotonic()
    with pytest.raises(ClaimInProgress) as info:
        await inbox.process(delivery(), long_handler)
    assert 0.25 <= time.monotonic() - started < 1.5
    assert (info.value.consumer, info.value.message_id) == ("billing", "m-1")
    assert (await first).decision is Decision.FIRST
    # And retried later, it is skipped
    assert (await inbox.process(delivery(), long_handler)).decision is Decision.DUPLICATE
    with pg_engine.connect() as conn:
        assert effects(conn) == 1


async def test_async_claim__database_down_at_claim_time_is_transient(pg_async_url, pg_engine):
    proxy = Proxy(services.postgres_address())
    engine = async_engine(services.via_port(pg_async_url, proxy.port))
    inbox = AsyncInbox(engine)

    async def handler(session) -> None:
        await apply_credit_async(session, "billing", 1, 10)

    try:
        await inbox.process(delivery("warm-up"), handler)
        # When the connection is cut before the claim's statement
        proxy.cut()
        with pytest.raises(DatabaseUnavailable) as info:
            await inbox.process(delivery(), handler)
        assert info.value.message_id == "m-1"
        # Then nothing was recorded, and the next attempt takes a fresh connection
        assert (await inbox.process(delivery(), handler)).decision is Decision.FIRST
        assert (await inbox.process(delivery(), handler)).decision is Decision.DUPLICATE
    finally:
        await engine.dispose()
        proxy.close()
    with pg_engine.connect() as conn:
        assert effects(conn) == 2


def test_claim__handler_os_error_stays_the_handlers_error(engine):
    # A TimeoutError is an OSError, which outside the handler means "the driver could not
    # connect"; raised by the handler it is the handler's own and must pass through as is.
    inbox = Inbox(engine)

    def times_out(session: Session) -> None:
        raise TimeoutError("the payment gateway timed out")

    with pytest.raises(TimeoutError, match="payment gateway"):
        inbox.process(delivery(), times_out)
