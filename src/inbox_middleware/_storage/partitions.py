"""The hourly partitions of the compact claims table: made ahead, emptied past the window.

``inbox_claims`` is partitioned by range of its key, whose first 6 bytes are the time the
message id carries (`_core.claims`): an hour of ids a partition, made ahead of time
(`prepare`, run by ``inbox-middleware claims prepare`` and by the purge), beside the
partition of the ids without a time and the default partition, which holds any key whose
hour has no partition. Where a claim lands never decides whether it is a duplicate: the
key is the partition key, so the primary key is unique across all of them.

Each step takes only locks that leave claims running, as measured on PostgreSQL 15:

- a partition is made as a table of its own, then attached (``ATTACH PARTITION`` takes
  SHARE UPDATE EXCLUSIVE on the table: claims go on). It first takes the default
  partition in ACCESS EXCLUSIVE, moves the rows of its hour out of it (ids sent ahead of
  their time), and attaches, which scans the default partition for rows of the hour: the
  claims that land in the default partition wait for those few milliseconds, no other;
- an hour past the retention window is emptied by ``TRUNCATE``, which locks that
  partition alone, once its youngest claim is older than the window too (a late first
  delivery of an old id keeps its hour);
- dropping a partition, even an empty one, takes the whole table in ACCESS EXCLUSIVE: it
  waits for every open claim transaction, and every new claim waits behind it (about
  6 ms for one partition, 16 ms for 24 in one statement, with 400 partitions); and its
  commit makes each connection rebuild what it caches of the partitioned table (about
  2 ms) at its next claim. So the emptied partitions are left empty until a day's worth
  has gathered (`DROP_GATHER`), then dropped together, `DROPS_A_STATEMENT` a statement,
  each only when the table is free within `DROP_WAIT` (else at a later purge): an hourly
  purge holds the table once a day, not every hour.

An hour is emptied in a transaction of its own, which reads the whole partition first
(the check of its youngest claim): the hours of a purge that catches up are paced, so that
this reading takes at most `EMPTY_SHARE` of the time (each hour's commit also frees its
files at once; see the performance page on the freed files' stall).

Every statement runs under a short ``lock_timeout``: a step that cannot take its lock at
once gives up, and the next `prepare` or purge takes it up again. Nothing depends on it
for the guarantee; a missing partition only leaves its hour's claims in the default
partition, purged row by row with it.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import OperationalError

from .tables import CLAIMS_PARTITIONS, InboxSchema

__all__ = [
    "PREPARE_HOURS",
    "Partition",
    "empty_expired",
    "expired_claims",
    "hourly",
    "prepare",
    "purge_hours",
]

logger = logging.getLogger("inbox_middleware")

PREPARE_HOURS = 72
"""Hours of partitions `prepare` keeps ahead of the current one."""
LOCK_WAIT = "200ms"
"""How long a step of `prepare` or `empty_expired` waits for its lock before giving up."""
DROP_WAIT = "20ms"
"""How long dropping an emptied partition waits for the table (claims wait behind it)."""
DROP_GATHER = 24
"""Emptied partitions a purge leaves empty until this many have gathered: then it drops
them all (a day's worth at an hourly purge; each drop holds the whole table)."""
DROPS_A_STATEMENT = 24
"""Emptied partitions dropped in one statement at most (claims wait while it runs)."""
EMPTY_SHARE = 0.02
"""The share of a paced purge's time spent emptying hours: after an hour that took ``t``
seconds, the purge waits ``t * (1 / EMPTY_SHARE - 1)``."""
HOUR = timedelta(hours=1)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Partition:
    """An hourly partition: its name and the first instant of its hour."""

    name: str
    hour: datetime


def _quoted(naming: InboxSchema, name: str) -> str:
    # validated identifiers (InboxSchema): quoting them is enough, and keeps their case
    return f'"{naming.schema}"."{name}"' if naming.schema else f'"{name}"'


def _wait_for_locks(conn: Connection, wait: str) -> None:
    """This transaction's statements give up on a lock not free within ``wait``."""
    conn.execute(text("SELECT pg_catalog.set_config('lock_timeout', :wait, true)"), {"wait": wait})


def _bounds(hour: datetime) -> tuple[str, str]:
    """The keys of an hour's ids, as uuid text: from its first millisecond's to the next
    hour's (6 bytes of milliseconds since the epoch, then zeros)."""

    def key(at: datetime) -> str:
        hexed = f"{int((at - _EPOCH).total_seconds() * 1000):012x}"
        return f"{hexed[:8]}-{hexed[8:]}-0000-0000-000000000000"

    return key(hour), key(hour + HOUR)


def hourly(conn: Connection, naming: InboxSchema) -> list[Partition]:
    """The hourly partitions attached to ``inbox_claims``, oldest first."""
    pattern = re.compile(re.escape(naming.hourly_partition("")) + r"(\d{10})")
    rows = conn.execute(
        text(
            "SELECT c.relname FROM pg_catalog.pg_inherits i "
            "JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = CAST(:parent AS regclass)"
        ),
        {"parent": _quoted(naming, naming.name("inbox_claims"))},
    ).scalars()
    found = []
    for name in rows:
        if match := pattern.fullmatch(name):
            hour = datetime.strptime(match[1], "%Y%m%d%H").replace(tzinfo=UTC)
            found.append(Partition(name, hour))
    return sorted(found, key=lambda partition: partition.hour)


def prepare(engine: Engine, naming: InboxSchema, *, hours: int = PREPARE_HOURS) -> list[str]:
    """Make the hourly partitions of the next ``hours`` hours that do not exist yet (the
    current hour's ids keep landing where they do); answer the names made. A partition
    that could not take its locks at once is left to the next call."""
    with engine.connect() as conn:
        now = conn.scalar(text("SELECT now()"))
        existing = {partition.hour for partition in hourly(conn, naming)}
    assert isinstance(now, datetime)
    current = now.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    made = []
    for ahead in range(1, hours + 1):
        hour = current + ahead * HOUR
        if hour not in existing and add(engine, naming, hour):
            made.append(naming.hourly_partition(f"{hour:%Y%m%d%H}"))
    return made


def add(engine: Engine, naming: InboxSchema, hour: datetime) -> bool:
    """Make and attach the partition of ``hour``'s ids, moving them out of the default
    partition, in one transaction; False when a lock was not free at once (nothing done)
    or another call made it meanwhile."""
    name = naming.hourly_partition(f"{hour:%Y%m%d%H}")
    parent = _quoted(naming, naming.name("inbox_claims"))
    other = _quoted(naming, naming.name(CLAIMS_PARTITIONS[1]))
    table = _quoted(naming, name)
    low, high = _bounds(hour)
    try:
        with engine.begin() as conn:
            _wait_for_locks(conn, LOCK_WAIT)
            conn.exec_driver_sql(f"LOCK TABLE {other} IN ACCESS EXCLUSIVE MODE")
            if any(partition.hour == hour for partition in hourly(conn, naming)):
                return False
            conn.exec_driver_sql(f"CREATE TABLE {table} (LIKE {parent} INCLUDING DEFAULTS)")
            conn.exec_driver_sql(
                f"WITH moved AS (DELETE FROM {other} "
                f"WHERE identity >= '{low}' AND identity < '{high}' "
                "RETURNING identity, payload_digest, processed_at, hash_scheme) "
                f"INSERT INTO {table} (identity, payload_digest, processed_at, hash_scheme) "
                "SELECT * FROM moved"
            )
            conn.exec_driver_sql(
                f"ALTER TABLE {parent} ATTACH PARTITION {table} "
                f"FOR VALUES FROM ('{low}') TO ('{high}')"
            )
    except OperationalError as exc:  # 55P03: a lock not free within LOCK_WAIT
        logger.info("the claims partition %s was not made now: %s", name, exc.orig)
        return False
    return True


def purge_hours(
    engine: Engine,
    naming: InboxSchema,
    older_than: timedelta,
    *,
    paced: bool = True,
    on_hour: Callable[[int], None] | None = None,
) -> int:
    """The purge's part of the hourly partitions: the coming hours made (`prepare`), the
    hours past the window emptied (`empty_expired`); answers the claims removed."""
    prepare(engine, naming)
    with engine.connect() as conn:
        now = conn.scalar(text("SELECT now()"))
    assert isinstance(now, datetime)
    share = EMPTY_SHARE if paced else None
    return empty_expired(engine, naming, now - older_than, share=share, on_hour=on_hour)


def empty_expired(
    engine: Engine,
    naming: InboxSchema,
    cutoff: datetime,
    *,
    gather: int | None = None,
    share: float | None = None,
    on_hour: Callable[[int], None] | None = None,
) -> int:
    """Empty the hourly partitions whose hour and youngest claim are older than
    ``cutoff``, an hour a transaction, and, once ``gather`` (`DROP_GATHER`) emptied ones
    are there, drop them, `DROPS_A_STATEMENT` a statement, while the table is free;
    answer the claims removed.

    With ``share``, the steps are paced: each hour's reading and ``TRUNCATE``, and each
    drop, take at most that share of the time. A busy hour (its lock not free at once)
    is left to a later purge, and so are the drops once one finds the table busy.
    ``on_hour`` hears the claims each emptied hour removed."""
    with engine.connect() as conn:
        expired = [p for p in hourly(conn, naming) if p.hour + HOUR <= cutoff]
    removed, emptied = 0, []
    for partition in expired:
        began = time.monotonic()
        try:
            one, done = _empty(engine, naming, partition, cutoff)
        except OperationalError as exc:  # 55P03: a lock not free within LOCK_WAIT
            logger.info("the claims partition %s was not emptied now: %s", partition.name, exc.orig)
            continue
        removed += one
        emptied += done
        if one and on_hour is not None:
            on_hour(one)
        if one:
            _pace(began, share)
    if len(emptied) < (DROP_GATHER if gather is None else gather):
        return removed
    for start in range(0, len(emptied), DROPS_A_STATEMENT):
        began = time.monotonic()
        if not _drop(engine, emptied[start : start + DROPS_A_STATEMENT]):
            break
        _pace(began, share)
    return removed


def _pace(began: float, share: float | None) -> None:
    """After a step that began at ``began`` (monotonic), wait so that the steps take
    ``share`` of the time (None: no wait)."""
    if share is not None:
        time.sleep((time.monotonic() - began) * (1 / share - 1))


def _drop(engine: Engine, tables: list[str]) -> bool:
    """Drop these emptied partitions in one statement (one wait for the table, one
    rebuild of each connection's cache of it), if the table is free within `DROP_WAIT`;
    whether it was."""
    try:
        with engine.begin() as conn:
            _wait_for_locks(conn, DROP_WAIT)
            conn.exec_driver_sql(f"DROP TABLE {', '.join(tables)}")
    except OperationalError as exc:  # claims are running: try at a later purge
        logger.info("the emptied claims partitions were not dropped now: %s", exc.orig)
        return False
    return True


def _empty(
    engine: Engine, naming: InboxSchema, partition: Partition, cutoff: datetime
) -> tuple[int, list[str]]:
    """Empty this partition if its youngest claim is older than ``cutoff``: the claims
    removed and the table emptied (none when a claim keeps it)."""
    table = _quoted(naming, partition.name)
    with engine.begin() as conn:
        _wait_for_locks(conn, LOCK_WAIT)
        # Locked first: a claim landing between the look and the TRUNCATE would be
        # removed younger than the window.
        conn.exec_driver_sql(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        count, youngest = conn.execute(
            text(f"SELECT count(*), max(processed_at) FROM {table}")
        ).one()
        if youngest is not None and youngest >= cutoff:
            return 0, []  # a late first delivery of an old id: its hour stays
        if count:
            conn.exec_driver_sql(f"TRUNCATE {table}")
    return int(count), [table]


def expired_claims(conn: Connection, naming: InboxSchema, older_than: timedelta) -> int:
    """The claims `empty_expired` would remove now, with a window of ``older_than``."""
    now = conn.scalar(text("SELECT now()"))
    assert isinstance(now, datetime)
    cutoff = now - older_than
    total = 0
    for partition in hourly(conn, naming):
        if partition.hour + HOUR > cutoff:
            break
        table = _quoted(naming, partition.name)
        count = conn.scalar(
            text(
                f"SELECT CASE WHEN max(processed_at) < :cutoff THEN count(*) ELSE 0 END "
                f"FROM {table}"
            ),
            {"cutoff": cutoff},
        )
        total += int(count or 0)
    return total
