"""The compact claim (``claims="compact"``) on PostgreSQL, in each phase of a deployment's
move to it: claimed in both tables while older workers may run, in the compact table
checking the library's after the switch, in the compact table alone once the library's
is empty; with workers of each kind claiming the same messages at once."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from inbox_middleware._core.claims import ClaimsPhase, claim_key
from inbox_middleware._core.consumption import CountRedelivery, LookUpClaim, RecordPoison
from inbox_middleware._core.exceptions import ClaimInProgress, ConfigurationError, PrerequisiteError
from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Decision, Delivery, compare
from inbox_middleware._operate.explain import explain
from inbox_middleware._operate.retention import purge, purgeable
from inbox_middleware._storage import AsyncInbox, Inbox, InboxSchema
from inbox_middleware._storage.layout import check_claims, claims_record, switch_claims

from ..apps.domain import apply_credit, apply_credit_async, balance, effects
from ..support.handing_back import process_until_settled

PHASES = [ClaimsPhase.BOTH, ClaimsPhase.COMPACT_CHECKING, ClaimsPhase.COMPACT]


def delivery(message_id: str, payload=None, consumer="billing") -> Delivery:
    payload = {"account": 1, "delta": 10} if payload is None else payload
    return Delivery(
        consumer,
        MessageIdentity("orders", message_id),
        hash_json(payload, "faststream-json.v2"),
        handler_version="1",
        source="accounts",
        payload=repr(payload).encode(),
    )


def credit(account=1, delta=10):
    def handler(session: Session) -> str:
        apply_credit(session, "billing", account, delta)
        return "applied"

    return handler


def rows(engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(text(f"SELECT count(*) FROM {table}")))


def enter(engine, phase: ClaimsPhase) -> None:
    """Put the database in ``phase``: the switch recorded or not, a library row or not."""
    with engine.begin() as conn:
        if phase is not ClaimsPhase.BOTH:
            switch_claims(conn, InboxSchema(), by="test")
        if phase is ClaimsPhase.COMPACT_CHECKING:
            conn.execute(
                text(
                    "INSERT INTO consumer_inbox (consumer_name, producer_name, tenant, "
                    "message_id, payload_sha256, hash_scheme, handler_version, received_at) "
                    "VALUES ('other', 'orders', '', 'kept', repeat('0', 64), 'x', '', now())"
                )
            )


@pytest.mark.parametrize("phase", PHASES, ids=lambda p: p.name.lower())
def test_compact__first_duplicate_conflict_in_each_phase(pg_engine, phase):
    enter(pg_engine, phase)
    inbox = Inbox(pg_engine, claims="compact")
    mid = str(uuid.uuid4())

    first = inbox.process(delivery(mid), credit())
    again = inbox.process(delivery(mid), credit())
    other = inbox.process(delivery(mid, {"account": 1, "delta": 99}), credit(delta=99))

    assert inbox.phase is phase
    assert (first.decision, again.decision, other.decision) == (
        Decision.FIRST,
        Decision.DUPLICATE,
        Decision.CONFLICT,
    )
    assert again.verdict.verified
    with pg_engine.connect() as conn:
        assert (effects(conn), balance(conn, 1)) == (1, 10)
    assert rows(pg_engine, "inbox_claims") == 1
    assert rows(pg_engine, "inbox_quarantine") == 1
    library = 1 if phase is ClaimsPhase.BOTH else 0
    kept = 1 if phase is ClaimsPhase.COMPACT_CHECKING else 0
    assert rows(pg_engine, "consumer_inbox") == library + kept


@pytest.mark.parametrize("phase", PHASES, ids=lambda p: p.name.lower())
async def test_compact__asyncpg_claims_in_each_phase(pg_engine, pg_async_engine, phase):
    enter(pg_engine, phase)
    inbox = AsyncInbox(pg_async_engine, claims="compact")
    mid = str(uuid.uuid4())

    async def handler(session):
        await apply_credit_async(session, "billing", 1, 10)

    first = await inbox.process(delivery(mid), handler)
    again = await inbox.process(delivery(mid), handler)

    assert inbox.phase is phase
    assert (first.decision, again.decision) == (Decision.FIRST, Decision.DUPLICATE)
    with pg_engine.connect() as conn:
        assert (effects(conn), balance(conn, 1)) == (1, 10)


def test_compact__a_message_claimed_by_an_older_worker_is_a_duplicate_for_a_new_one(pg_engine):
    # Before the switch, a worker configured for the library's table (an older version)
    # claims; the new worker must find that claim whichever phase it reads.
    old, new = Inbox(pg_engine), Inbox(pg_engine, claims="compact")
    mid, unseen = str(uuid.uuid4()), str(uuid.uuid4())
    assert old.process(delivery(mid), credit()).decision is Decision.FIRST
    assert old.process(delivery(unseen), credit()).decision is Decision.FIRST
    assert new.process(delivery(mid), credit()).decision is Decision.DUPLICATE

    with pg_engine.begin() as conn:
        switch_claims(conn, InboxSchema(), by="test")
    switched = Inbox(pg_engine, claims="compact")
    assert switched.process(delivery(mid), credit()).decision is Decision.DUPLICATE
    # claimed by the older worker alone, in the library's table only
    assert switched.process(delivery(unseen), credit()).decision is Decision.DUPLICATE
    assert switched.phase is ClaimsPhase.COMPACT_CHECKING
    with pg_engine.connect() as conn:
        assert (effects(conn), balance(conn, 1)) == (2, 20)


def test_compact__a_batch_claims_and_looks_up_in_each_phase(pg_engine):
    for phase in PHASES:
        with pg_engine.begin() as conn:
            conn.execute(text("TRUNCATE inbox_layout, inbox_claims, consumer_inbox"))
        enter(pg_engine, phase)
        inbox = Inbox(pg_engine, claims="compact")
        ids = [str(uuid.uuid4()) for _ in range(4)]
        seen = [delivery(ids[0]), delivery(ids[1])]
        inbox.process_batch(seen, lambda session, verdicts: None)
        batch = [*(delivery(i) for i in ids), delivery(ids[0], {"other": 1})]

        decided = inbox.process_batch(batch, lambda session, verdicts: None)

        assert inbox.phase is phase
        assert decided.decisions == (
            Decision.DUPLICATE,
            Decision.DUPLICATE,
            Decision.FIRST,
            Decision.FIRST,
            Decision.CONFLICT,
        ), phase


def test_compact__the_key_carries_the_time_of_a_uuid7_id():
    # 2026-12-01T00:00:00Z in milliseconds, as a UUIDv7 begins with it
    millis = 1_796_083_200_000
    v7 = f"{millis:012x}"
    message_id = f"{v7[:8]}-{v7[8:]}-7abc-8def-0123456789ab"
    key = claim_key("billing", "orders", "", message_id)
    assert int.from_bytes(key[:6], "big") == millis
    assert claim_key("billing", "orders", "", message_id) == key
    assert claim_key("shipping", "orders", "", message_id) != key
    assert claim_key("billing", "orders", "", "order-1")[:6] == bytes(6)  # no time: zeros


def _concurrent(engine, inboxes, ids, copies=3, workers=8):
    """Each id delivered ``copies`` times, spread over ``inboxes`` in random order, on
    ``workers`` threads; a hand-back (ClaimInProgress) is delivered again."""
    jobs = [(message_id, copy) for message_id in ids for copy in range(copies)]
    random.shuffle(jobs)
    firsts: dict[str, int] = {}
    lock = threading.Lock()

    def deliver(job):
        message_id, copy = job
        inbox = inboxes[(hash(message_id) + copy) % len(inboxes)]
        decided = process_until_settled(inbox, delivery(message_id), credit(account=2, delta=1))
        if decided.decision is Decision.FIRST:
            with lock:
                firsts[message_id] = firsts.get(message_id, 0) + 1

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(deliver, jobs))
    return firsts


def test_compact__concurrent_copies_across_old_and_new_workers_apply_once(pg_engine):
    # Before the switch: workers of an earlier version (the library's table) and new ones
    # (both tables) take copies of the same messages at once.
    ids = [str(uuid.uuid4()) for _ in range(150)]
    inboxes = [Inbox(pg_engine), Inbox(pg_engine, claims="compact")]

    firsts = _concurrent(pg_engine, inboxes, ids)

    assert firsts == dict.fromkeys(ids, 1)
    with pg_engine.connect() as conn:
        assert (effects(conn), balance(conn, 2)) == (150, 150)


@pytest.mark.parametrize("library_rows", [True, False], ids=["checking", "compact"])
def test_compact__after_the_switch_a_late_worker_and_switched_ones_apply_once(
    pg_engine, library_rows
):
    # A worker that has not read the switch yet still claims in both tables; those that
    # have claim in the compact one: copies between them are still applied once.
    enter(pg_engine, ClaimsPhase.COMPACT_CHECKING if library_rows else ClaimsPhase.COMPACT)
    late = Inbox(pg_engine, claims="compact")
    late._phase_statements.clear()
    from inbox_middleware._storage.statements import CompactClaimStatements

    late.statements = CompactClaimStatements(InboxSchema(), late.lock_timeout, ClaimsPhase.BOTH)
    late._phase_due = float("inf")
    switched = Inbox(pg_engine, claims="compact")
    ids = [str(uuid.uuid4()) for _ in range(150)]

    firsts = _concurrent(pg_engine, [late, switched], ids)

    assert firsts == dict.fromkeys(ids, 1)
    assert switched.phase is not ClaimsPhase.BOTH
    with pg_engine.connect() as conn:
        assert (effects(conn), balance(conn, 2)) == (150, 150)


def test_compact__switch_refuses_a_library_worker_and_show_counts(pg_engine):
    with pg_engine.begin() as conn:
        check_claims(conn, InboxSchema(), Inbox(pg_engine).claims)  # nothing recorded: fine
        record = switch_claims(conn, InboxSchema(), by="ops")
        again = switch_claims(conn, InboxSchema(), by="someone else")
    assert record.switched and again.switched_by == "ops"
    with pytest.raises(PrerequisiteError, match="claims='compact'"):
        Inbox(pg_engine).check()
    Inbox(pg_engine, claims="compact").check()
    Inbox(pg_engine, claims="compact").process(delivery("order-1"), credit())
    with pg_engine.connect() as conn:
        assert claims_record(conn, InboxSchema()).compact_rows == 1


def test_compact__bad_settings_are_refused(pg_engine, sqlite_engine):
    with pytest.raises(ConfigurationError, match="'library' or 'compact'"):
        Inbox(pg_engine, claims="tiny")
    with pytest.raises(ConfigurationError, match="for PostgreSQL"):
        Inbox(sqlite_engine, claims="compact")


def test_compact__explain_reads_a_compact_claim_from_the_typed_identity(pg_engine):
    enter(pg_engine, ClaimsPhase.COMPACT)
    inbox = Inbox(pg_engine, claims="compact")
    inbox.process(delivery("order-7"), credit())
    sha = delivery("order-7").payload_hash.sha256

    with pg_engine.connect() as conn:
        story = explain(conn, InboxSchema(), "billing", "orders", "order-7", payload_sha256=sha)
        other = explain(conn, InboxSchema(), "billing", "orders", "order-8")

    assert story["verdict"] == "duplicate"
    assert story["claim"]["payload_sha256"] == sha[:32]
    assert story["claim"]["hash_scheme"] == "faststream-json.v2"
    assert other["verdict"] == "process"


def test_compact__a_purge_of_every_consumer_removes_old_compact_claims(pg_engine):
    enter(pg_engine, ClaimsPhase.COMPACT)
    inbox = Inbox(pg_engine, claims="compact")
    for index in range(30):
        inbox.process(delivery(f"order-{index}"), credit())
    with pg_engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE inbox_claims SET processed_at = now() - interval '10 days' "
                "WHERE identity IN (SELECT identity FROM inbox_claims LIMIT 20)"
            )
        )
    from datetime import timedelta

    with pg_engine.connect() as conn:
        assert purgeable(conn, InboxSchema(), timedelta(days=7)) == 20
        assert purgeable(conn, InboxSchema(), timedelta(days=7), consumer="billing") == 0

    assert purge(pg_engine, InboxSchema(), timedelta(days=7), consumer="billing") == 0
    assert purge(pg_engine, InboxSchema(), timedelta(days=7)) == 20
    assert rows(pg_engine, "inbox_claims") == 10


def test_compact__a_row_is_about_120_bytes(pg_engine):
    enter(pg_engine, ClaimsPhase.COMPACT)
    with pg_engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO inbox_claims (identity, payload_digest, hash_scheme) "
                "SELECT gen_random_uuid(), gen_random_uuid(), 1 FROM generate_series(1, 100000)"
            )
        )
    with pg_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE inbox_claims_other"))
    with pg_engine.connect() as conn:
        total = conn.scalar(
            text(
                "SELECT sum(pg_total_relation_size(relid)) "
                "FROM pg_partition_tree('inbox_claims') WHERE isleaf"
            )
        )
    assert 100 <= total / 100_000 <= 125


async def test_compact__asyncio_gather_of_copies_applies_once(pg_engine, pg_async_engine):
    inbox = AsyncInbox(pg_async_engine, claims="compact")

    async def handler(session):
        await apply_credit_async(session, "billing", 3, 1)

    async def one(message_id):
        while True:
            try:
                return (await inbox.process(delivery(message_id), handler)).decision
            except ClaimInProgress:
                continue

    ids = [str(uuid.uuid4()) for _ in range(40)]
    decided = await asyncio.gather(*(one(i) for i in ids * 3))

    assert decided.count(Decision.FIRST) == len(ids)
    with pg_engine.connect() as conn:
        assert balance(conn, 3) == len(ids)


def test_compact__migrated_under_load_from_the_schema_before_it(pg_engine):
    # Given the inbox tables at the version before the compact claim, in a schema of
    # their own, and workers of that time claiming on four threads
    from inbox_middleware._storage.migrate import migrate, migrations

    naming = InboxSchema(schema="before_compact")
    with pg_engine.begin() as conn:
        conn.exec_driver_sql('DROP SCHEMA IF EXISTS "before_compact" CASCADE')
        conn.exec_driver_sql('CREATE SCHEMA "before_compact"')
        naming.tables.version.create(conn)
        for migration in migrations("postgresql")[:9]:
            for statement in migration.statements(naming, "postgresql"):
                conn.exec_driver_sql(statement)
            conn.execute(
                naming.tables.version.insert().values(
                    version=migration.version, name=migration.name, applied_at=datetime.now(UTC)
                )
            )
    old = Inbox(pg_engine, naming=naming)
    ids = [str(uuid.uuid4()) for _ in range(120)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def claim_old() -> None:
        while not stop.is_set():
            try:
                old.process(delivery(random.choice(ids)), credit(account=4, delta=1))
            except ClaimInProgress:
                continue
            except BaseException as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=claim_old) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        # When migration 10 is applied while they claim, and new workers join them
        time.sleep(0.3)
        applied = migrate(pg_engine, naming)
        new = Inbox(pg_engine, naming=naming, claims="compact")
        new.check()
        for message_id in ids:
            new.process(delivery(message_id), credit(account=4, delta=1))
        time.sleep(0.3)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    # Then the migration applied without stopping them, and each message applied once
    assert [migration.version for migration in applied] == [10]
    assert errors == []
    with pg_engine.connect() as conn:
        assert (effects(conn, 4), balance(conn, 4)) == (120, 120)
    with pg_engine.begin() as conn:
        conn.exec_driver_sql('DROP SCHEMA "before_compact" CASCADE')


def test_compact__status_counts_the_compact_claims_apart(pg_engine, pg_url):
    import json
    import subprocess
    import sys

    enter(pg_engine, ClaimsPhase.COMPACT)
    inbox = Inbox(pg_engine, claims="compact")
    for index in range(3):
        inbox.process(delivery(f"order-{index}"), credit())
    command = [sys.executable, "-c", "from inbox_middleware.cli import run; run()", "status"]
    shown = subprocess.run(
        [*command, "--database-url", pg_url], capture_output=True, text=True, check=False
    )
    data = json.loads(
        subprocess.run(
            [*command, "--json", "--database-url", pg_url],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert (data["inbox"]["rows"], data["inbox"]["compact_rows"]) == (0, 3)
    assert "3 in the compact claims table (inbox_claims)" in shown.stdout, shown.stderr


@pytest.mark.parametrize("phase", PHASES, ids=lambda p: p.name.lower())
def test_compact__the_inbox_s_records_find_a_compact_claim(pg_engine, phase):
    # Given a message applied in each phase of the compact claim
    enter(pg_engine, phase)
    inbox = Inbox(pg_engine, claims="compact")
    mid = str(uuid.uuid4())
    assert inbox.process(delivery(mid), credit()).decision is Decision.FIRST
    # When the inbox counts a redelivery of it and records a copy of it as poison (a
    # requeued copy over the redelivery limit), and another payload's as well
    count = inbox.bookkeep(CountRedelivery(delivery(mid), 5))
    record = inbox.bookkeep(RecordPoison(delivery(mid), "redelivery_limit", "redelivered", 5))
    other = delivery(mid, {"account": 1, "delta": 99})
    conflict = inbox.bookkeep(RecordPoison(other, "redelivery_limit", "redelivered", 5))
    # Then the count says it committed, and the copy's row is written recovered, as with
    # the library's claims: no operator redrives an intent already applied; the other
    # payload's row waits for one
    assert count.claimed
    assert (record.recovered, conflict.recovered) == (True, False)
    with pg_engine.connect() as conn:
        decision = conn.scalar(
            text("SELECT decision FROM inbox_poison WHERE message_id = :m"), {"m": mid}
        )
    assert decision == "pending"  # the later record, the other payload's, took the row


@pytest.mark.parametrize("phase", PHASES, ids=lambda p: p.name.lower())
def test_compact__the_settled_look_up_reads_a_compact_claim(pg_engine, phase):
    # What the core reads after a COMMIT whose answer was lost (`CommitUnanswered`), or
    # once a poison row comes back recovered: the claim, once no transaction holds it
    enter(pg_engine, phase)
    inbox = Inbox(pg_engine, claims="compact")
    mid = str(uuid.uuid4())
    assert inbox.bookkeep(LookUpClaim(delivery(mid), settled=True)) is None
    inbox.process(delivery(mid), credit())
    stored = inbox.bookkeep(LookUpClaim(delivery(mid), settled=True))
    assert stored is not None
    assert compare(stored, delivery(mid)) == (Decision.DUPLICATE, True)
