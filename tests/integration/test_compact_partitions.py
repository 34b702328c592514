"""The compact claims table's hourly partitions: made ahead, rows of an hour moved out of
the default partition when its own is made, hours past the window emptied and dropped;
and claims, copies among them, running all the while."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

from sqlalchemy import event, text
from sqlalchemy.orm import Session

from inbox_middleware._core.claims import claim_key
from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Decision, Delivery
from inbox_middleware._operate.retention import purge, purgeable
from inbox_middleware._storage import Inbox, InboxSchema, partitions
from inbox_middleware._storage.layout import switch_claims

from ..apps.domain import apply_credit, balance, effects
from ..support.handing_back import process_until_settled

NAMING = InboxSchema()
HOUR = timedelta(hours=1)


def uuid7(at: datetime) -> str:
    """A UUIDv7 message id sent at ``at``."""
    milliseconds = int(at.timestamp() * 1000)
    value = (milliseconds << 80) | (0x7 << 76) | (0b10 << 62) | (uuid.uuid4().int & (1 << 62) - 1)
    return str(uuid.UUID(int=value))


def delivery(message_id: str) -> Delivery:
    return Delivery("billing", MessageIdentity("orders", message_id), hash_json({"a": 1}, "v1"))


def credit(session: Session) -> None:
    apply_credit(session, "billing", 5, 1)


def where(engine, message_id: str) -> str:
    """The partition holding the claim of ``message_id``."""
    key = str(uuid.UUID(bytes=claim_key("billing", "orders", "", message_id)))
    with engine.connect() as conn:
        return str(
            conn.scalar(
                text("SELECT tableoid::regclass::text FROM inbox_claims WHERE identity = :k"),
                {"k": key},
            )
        )


def hour_name(at: datetime) -> str:
    return NAMING.hourly_partition(f"{at.astimezone(UTC):%Y%m%d%H}")


def switched(engine) -> Inbox:
    with engine.begin() as conn:
        switch_claims(conn, NAMING, by="test")
    return Inbox(engine, claims="compact")


def test_partitions__claims_land_in_their_hour_and_a_late_partition_takes_its_rows(pg_engine):
    inbox = switched(pg_engine)
    now = datetime.now(UTC)
    assert len(partitions.prepare(pg_engine, NAMING, hours=3)) == 3
    next_hour, later = uuid7(now + HOUR), uuid7(now + 5 * HOUR)
    for message_id in (next_hour, later, "order-1"):
        assert inbox.process(delivery(message_id), credit).decision is Decision.FIRST

    assert where(pg_engine, next_hour) == hour_name(now + HOUR)
    assert where(pg_engine, later) == "inbox_claims_other"  # its hour has no partition yet
    assert where(pg_engine, "order-1") == "inbox_claims_untimed"
    # When the later hour's partition is made, its claim moves there, still a claim
    assert partitions.prepare(pg_engine, NAMING, hours=6) == [
        hour_name(now + k * HOUR) for k in (4, 5, 6)
    ]
    assert where(pg_engine, later) == hour_name(now + 5 * HOUR)
    for message_id in (next_hour, later, "order-1"):
        assert inbox.process(delivery(message_id), credit).decision is Decision.DUPLICATE
    with pg_engine.connect() as conn:
        assert (effects(conn, 5), balance(conn, 5)) == (3, 3)


def test_partitions__the_purge_empties_and_drops_the_hours_past_the_window(pg_engine):
    inbox = switched(pg_engine)
    now = datetime.now(UTC)
    old, late = now - 30 * HOUR, now - 29 * HOUR
    for hour in (old, late):
        assert partitions.add(pg_engine, NAMING, hour.replace(minute=0, second=0, microsecond=0))
    old_ids = [uuid7(old) for _ in range(5)]
    late_ids = [uuid7(late) for _ in range(3)]
    for message_id in [*old_ids, *late_ids, "order-1"]:
        inbox.process(delivery(message_id), credit)
    # claims processed 2 days ago, except one of the later hour's: a late first delivery
    with pg_engine.begin() as conn:
        conn.execute(text("UPDATE inbox_claims SET processed_at = now() - interval '2 days'"))
        key = str(uuid.UUID(bytes=claim_key("billing", "orders", "", late_ids[0])))
        conn.execute(
            text("UPDATE inbox_claims SET processed_at = now() WHERE identity = :k"), {"k": key}
        )
    with pg_engine.connect() as conn:
        assert purgeable(conn, NAMING, timedelta(days=1)) == 5 + 1  # the old hour, order-1

    removed = purge(pg_engine, NAMING, timedelta(days=1))

    assert removed == 6
    with pg_engine.connect() as conn:
        hours = [partition.name for partition in partitions.hourly(conn, NAMING)]
        # emptied, and kept until a day's worth of emptied hours has gathered
        assert conn.scalar(text(f"SELECT count(*) FROM {hour_name(old)}")) == 0
    assert hour_name(old) in hours
    assert hour_name(late) in hours  # its young claim keeps it
    assert partitions.prepare(pg_engine, NAMING, hours=2) == []  # the purge made them
    assert inbox.process(delivery(late_ids[0]), credit).decision is Decision.DUPLICATE
    assert inbox.process(delivery(old_ids[0]), credit).decision is Decision.FIRST  # purged


def test_partitions__copies_claimed_while_partitions_are_made_and_emptied_apply_once(pg_engine):
    # Given claims on eight threads, every message sent three times, with ids of the past
    # hour, this one, the next ones and none, while partitions are made (rows moved out of
    # the default one) and hours emptied, again and again
    inbox = switched(pg_engine)
    now = datetime.now(UTC)
    ids = [uuid7(now + random.choice([-HOUR, 0 * HOUR, HOUR, 2 * HOUR])) for _ in range(150)]
    ids += [f"order-{n}" for n in range(50)]
    jobs = [message_id for message_id in ids for _ in range(3)]
    random.shuffle(jobs)
    firsts: dict[str, int] = {}
    lock = threading.Lock()
    done = threading.Event()

    def deliver(message_id: str) -> None:
        decided = process_until_settled(inbox, delivery(message_id), credit)
        if decided.decision is Decision.FIRST:
            with lock:
                firsts[message_id] = firsts.get(message_id, 0) + 1

    def maintain() -> None:
        hour = (now - 3 * HOUR).replace(minute=0, second=0, microsecond=0)
        while not done.is_set():
            for ahead in range(7):
                partitions.add(pg_engine, NAMING, hour + ahead * HOUR)
            partitions.empty_expired(pg_engine, NAMING, now - 2 * HOUR)
            time.sleep(0.01)

    keeper = threading.Thread(target=maintain)
    keeper.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(deliver, jobs))
    finally:
        done.set()
        keeper.join()

    # Then each was applied once, and its claim is where its key says
    assert firsts == dict.fromkeys(ids, 1)
    with pg_engine.connect() as conn:
        assert (effects(conn, 5), balance(conn, 5)) == (200, 200)
        hours = {partition.name for partition in partitions.hourly(conn, NAMING)}
    assert {hour_name(now + k * HOUR) for k in (-1, 0, 1, 2)} <= hours
    assert all(where(pg_engine, message_id) != "inbox_claims_other" for message_id in ids[:150])


def test_partitions__the_command_prepares_ahead(pg_url, pg_engine):
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from inbox_middleware.cli import run; run()",
            *("claims", "prepare", "--hours", "4", "--database-url", pg_url),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("made 4 partitions; 4 hourly partitions in all")
    with pg_engine.connect() as conn:
        assert len(partitions.hourly(conn, NAMING)) == 4


def test_partitions__alembic_autogenerate_leaves_them_alone():
    from inbox_middleware._storage.migrate import exclude_inbox_tables

    keep = exclude_inbox_tables(InboxSchema(prefix="svc_"))
    for name in ("svc_inbox_claims", "svc_inbox_claims_other", "svc_inbox_claims_2026120515"):
        assert keep(None, name, "table", True, None) is False, name
    assert keep(None, "svc_inbox_claims_20261205", "table", True, None) is True
    assert keep(None, "orders", "table", True, None) is True


def test_partitions__a_busy_hour_is_left_and_the_others_emptied(pg_engine):
    inbox = switched(pg_engine)
    now = datetime.now(UTC)
    hours = [(now - k * HOUR).replace(minute=0, second=0, microsecond=0) for k in (40, 39, 38)]
    for hour in hours:
        assert partitions.add(pg_engine, NAMING, hour)
        inbox.process(delivery(uuid7(hour)), credit)
    with pg_engine.begin() as conn:
        conn.execute(text("UPDATE inbox_claims SET processed_at = now() - interval '3 days'"))
    busy = pg_engine.connect()
    try:
        # a transaction holding the middle hour (a claim of an old id, not yet committed)
        busy.execute(text(f"SELECT count(*) FROM {hour_name(hours[1])}"))
        removed = partitions.empty_expired(pg_engine, NAMING, now - timedelta(days=1))
    finally:
        busy.rollback()
        busy.close()
    assert removed == 2
    with pg_engine.connect() as conn:
        left = {
            name: conn.scalar(text(f"SELECT count(*) FROM {name}"))
            for name in map(hour_name, hours)
        }
    assert left == {hour_name(hours[0]): 0, hour_name(hours[1]): 1, hour_name(hours[2]): 0}


def test_partitions__a_purge_catching_up_empties_an_hour_a_transaction_paced(
    pg_engine, monkeypatch
):
    inbox = switched(pg_engine)
    now = datetime.now(UTC)
    hours = [(now - k * HOUR).replace(minute=0, second=0, microsecond=0) for k in range(40, 34, -1)]
    for n, hour in enumerate(hours):
        assert partitions.add(pg_engine, NAMING, hour)
        for _ in range(n + 1):
            inbox.process(delivery(uuid7(hour)), credit)
    with pg_engine.begin() as conn:
        conn.execute(text("UPDATE inbox_claims SET processed_at = now() - interval '3 days'"))
    waits: list[float] = []
    monkeypatch.setattr(partitions.time, "sleep", waits.append)
    heard: list[int] = []

    removed = partitions.empty_expired(
        pg_engine, NAMING, now - timedelta(days=1), gather=7, share=0.25, on_hour=heard.append
    )

    # Each hour in a transaction of its own, oldest first, each followed by its pause:
    # three times what it took (it takes a quarter of the time)
    assert (removed, heard) == (21, [1, 2, 3, 4, 5, 6])
    assert len(waits) == 6 and all(wait > 0 for wait in waits), waits
    # Fewer emptied partitions than gather: all left empty
    with pg_engine.connect() as conn:
        left = [partition.name for partition in partitions.hourly(conn, NAMING)]
        assert left == [hour_name(hour) for hour in hours]
        assert {conn.scalar(text(f"SELECT count(*) FROM {name}")) for name in left} == {0}
    # Once enough have gathered, a purge drops them all, at most four a statement here,
    # oldest first, each statement followed by its pause (nothing to empty: no other)
    monkeypatch.setattr(partitions, "DROPS_A_STATEMENT", 4)
    dropped: list[str] = []

    def seen(conn, cursor, statement, *rest):
        if statement.startswith("DROP TABLE"):
            dropped.append(statement)

    event.listen(pg_engine, "before_cursor_execute", seen)
    try:
        removed = partitions.empty_expired(
            pg_engine, NAMING, now - timedelta(days=1), gather=4, share=0.25
        )
    finally:
        event.remove(pg_engine, "before_cursor_execute", seen)
    assert removed == 0
    names = [f'"{hour_name(hour)}"' for hour in hours]
    assert dropped == [f"DROP TABLE {', '.join(names[:4])}", f"DROP TABLE {', '.join(names[4:])}"]
    assert len(waits) == 8
    with pg_engine.connect() as conn:
        assert partitions.hourly(conn, NAMING) == []


def test_partitions__the_unpaced_purge_empties_hours_back_to_back(pg_engine, monkeypatch):
    inbox = switched(pg_engine)
    now = datetime.now(UTC)
    hour = (now - 40 * HOUR).replace(minute=0, second=0, microsecond=0)
    assert partitions.add(pg_engine, NAMING, hour)
    inbox.process(delivery(uuid7(hour)), credit)
    with pg_engine.begin() as conn:
        conn.execute(text("UPDATE inbox_claims SET processed_at = now() - interval '3 days'"))
    waits: list[float] = []
    monkeypatch.setattr(partitions.time, "sleep", waits.append)

    monkeypatch.setattr(partitions, "DROP_GATHER", 1)
    assert purge(pg_engine, NAMING, timedelta(days=1), rows_per_second=None) == 1
    assert waits == []
    assert partitions.add(pg_engine, NAMING, hour)  # the purge dropped it, emptied
    inbox.process(delivery(uuid7(hour)), credit)
    with pg_engine.begin() as conn:
        conn.execute(text("UPDATE inbox_claims SET processed_at = now() - interval '3 days'"))
    assert purge(pg_engine, NAMING, timedelta(days=1)) == 1  # paced, the default
    assert len(waits) == 2  # after the hour, and after the drop
