"""A time-partitioned claims table: the layout proven here before the library offers it.

The claims table partitioned by day of arrival (``processed_at``, the claim
transaction's start) keeps the index a claim writes to one day's rows however long the
retention window, and makes the purge a `DETACH PARTITION ... CONCURRENTLY` and a `DROP
TABLE` of the oldest day instead of a DELETE and the VACUUM after it. Its danger is the
one the design names: a unique key on a partitioned table must contain the partition
column, so each day's partition is unique on the identity only within that day, and a
redelivery that arrives on the next day (or races the first delivery across midnight)
lands in another partition.

The claim here closes that gap for every kind of message id, time-ordered or not: one
statement, a call of a function the layout installs (`claim_function`), which

1. takes a transaction-scoped advisory lock on the identity (every claim of the
   identity waits here for the one before it to commit or roll back);
2. looks for the identity in every partition, with a snapshot taken *after* the lock
   (a VOLATILE PL/pgSQL function takes a fresh snapshot for each statement in READ
   COMMITTED), so a claim that committed while this one waited is seen;
3. inserts into the partition of the day (its own unique index catches what the lock
   could not: an insert made without the function).

The function runs with ``enable_seqscan`` off: its look-up's plan is cached for the
connection's life, and a plan made while the day's partition was new and empty would scan
that partition, row by row, all day long; every partition has its index on the identity.

`claim_in_one_statement` is the same lock and look-up written as a single INSERT: its
snapshot is taken before the lock is granted, so it misses a claim that committed while
it waited. It is kept to show that the boundary test can fail (and does, for it and for
the plain insert, `claim_without_lock`).

The compact row (`CREATE_COMPACT_TABLE`, `COMPACT_CLAIM_FUNCTION`) is the same layout
with the fewest bytes a row: a 16-byte digest of the identity for a key, computed by the
worker (`compact_params`).

Used by ``python -m bench.growth --layouts plain,partitioned,compact`` and by
``tests/integration/test_partition_boundary.py``; the SQL a configured schema would need
(quoted names, the library's migrations, the rolling change from today's table) is the
work that remains before the library offers the layout.
"""

from __future__ import annotations

import hashlib
import uuid
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

import psycopg
from sqlalchemy.dialects import postgresql

from inbox_middleware._storage import InboxSchema

TABLE = "consumer_inbox"
_LIBRARY = InboxSchema().tables.inbox
KEY = tuple(column.name for column in _LIBRARY.primary_key.columns)
COLUMNS = (
    *KEY,
    "payload_sha256",
    "hash_scheme",
    "handler_version",
    "trace_id",
    "produced_at",
    "received_at",
)
"""The columns a claim writes, in the order of the claim function's arguments."""

# processed_at's, the claim transaction's start, chooses the partition.
_DEFAULTS = {
    "tenant": "''",
    "handler_version": "''",
    "received_at": "now()",
    "processed_at": "now()",
}


def _definition(column: Any) -> str:
    """A column of the library's claims table, with the default its migrations give it."""
    kind = column.type.compile(dialect=postgresql.dialect())
    null = "" if column.nullable else " NOT NULL"
    default = f" DEFAULT {_DEFAULTS[column.name]}" if column.name in _DEFAULTS else ""
    return f"{column.name} {kind}{null}{default}"


CREATE_TABLE = (
    f"CREATE TABLE {TABLE} ({', '.join(_definition(column) for column in _LIBRARY.c)})"
    " PARTITION BY RANGE (processed_at)"
)
"""The library's claims table (its columns, without its primary key) partitioned by day."""

# The advisory lock's two keys: the table's (so that the lock space is the layout's own,
# apart from a user's one-key advisory locks) and the identity's 32-bit hash. Two
# identities that share a hash only wait for each other.
_LOCK = f"""pg_catalog.pg_advisory_xact_lock(
        pg_catalog.hashtext('{TABLE}'),
        pg_catalog.hashtext(c || chr(31) || p || chr(31) || t || chr(31) || m))"""
_SEEN = f"""EXISTS (SELECT 1 FROM {TABLE}
        WHERE consumer_name = c AND producer_name = p AND tenant = t AND message_id = m)"""
_VALUES = "c, p, t, m, sha, scheme, version, trace, produced, received"


def _body(lock: str, seen: str, insert: str) -> str:
    """The claim function's body: the lock, the look-up in every partition, the insert."""
    return f"""LANGUAGE plpgsql VOLATILE SET enable_seqscan = off AS $$
BEGIN
    PERFORM pg_catalog.set_config('lock_timeout', timeout, true);
    PERFORM {lock};
    IF {seen} THEN
        RETURN NULL;
    END IF;
    {insert}
        ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN pg_catalog.pg_current_xact_id();
END $$"""


CLAIM_FUNCTION = f"""CREATE OR REPLACE FUNCTION {TABLE}_claim(
    c text, p text, t text, m text, sha text, scheme text, version text, trace text,
    produced timestamptz, received timestamptz, timeout text) RETURNS xid8
{_body(_LOCK, _SEEN, f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) VALUES ({_VALUES})")}"""

_ARGUMENTS = ", ".join(f"%({name})s" for name in (*COLUMNS, "lock_timeout"))
CLAIM = f"SELECT {TABLE}_claim({_ARGUMENTS})"
"""The claim: one round trip; answers the transaction id when claimed, NULL when the
identity is stored already."""

_PARAMETERS = """SELECT %(consumer_name)s::text AS c, %(producer_name)s::text AS p,
        %(tenant)s::text AS t, %(message_id)s::text AS m, %(payload_sha256)s::text AS sha,
        %(hash_scheme)s::text AS scheme, %(handler_version)s::text AS version,
        %(trace_id)s::text AS trace, %(produced_at)s::timestamptz AS produced,
        %(received_at)s::timestamptz AS received"""
CLAIM_IN_ONE_STATEMENT = f"""WITH given AS MATERIALIZED ({_PARAMETERS}),
    locked AS MATERIALIZED (SELECT given.*, {_LOCK} FROM given)
INSERT INTO {TABLE} ({", ".join(COLUMNS)})
SELECT {_VALUES} FROM locked WHERE NOT {_SEEN}
ON CONFLICT DO NOTHING RETURNING pg_catalog.pg_current_xact_id()"""
"""Wrong on purpose: the lock and the look-up in one statement, whose snapshot predates
the lock."""

CLAIM_WITHOUT_LOCK = f"""INSERT INTO {TABLE} ({", ".join(COLUMNS)})
SELECT {_VALUES} FROM ({_PARAMETERS}) AS given
ON CONFLICT DO NOTHING RETURNING pg_catalog.pg_current_xact_id()"""
"""Wrong on purpose: each day's unique index alone."""

CLAIMS = {
    "function": CLAIM,
    "one_statement": CLAIM_IN_ONE_STATEMENT,
    "without_lock": CLAIM_WITHOUT_LOCK,
}

# -- the compact row ---------------------------------------------------------------------------

IDENTITY_SHA256 = """pg_catalog.sha256(pg_catalog.convert_to(
        {c} || chr(31) || {p} || chr(31) || {t} || chr(31) || {m}, 'UTF8'))"""
DIGEST_SQL = f"""pg_catalog.encode(pg_catalog.substr({IDENTITY_SHA256}, 1, 16), 'hex')::uuid"""
"""The identity's digest: the first 16 bytes of SHA-256 over its four parts (the unit
separator between them), as a ``uuid`` (16 bytes, no length header)."""

CREATE_COMPACT_TABLE = f"""CREATE TABLE {TABLE} (
    processed_at    timestamptz NOT NULL DEFAULT now(),
    identity        uuid        NOT NULL,
    payload_digest  uuid        NOT NULL,
    hash_scheme     smallint    NOT NULL
) PARTITION BY RANGE (processed_at)"""
"""The same partitions with the fewest bytes a row: the identity's digest instead of its
four texts, the payload's SHA-256 cut to 16 bytes instead of 64 hex characters, the hash
scheme as a small number, the claim's time; no handler version, producer time, receipt
time or trace. Columns in order of alignment: a row is 24 bytes of header and 42 of
data."""

COMPACT_CLAIM_FUNCTION = f"""CREATE OR REPLACE FUNCTION {TABLE}_claim(
    key uuid, payload uuid, scheme smallint, lock_key integer, timeout text) RETURNS xid8
{
    _body(
        f"pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext('{TABLE}'), lock_key)",
        f"EXISTS (SELECT 1 FROM {TABLE} WHERE identity = key)",
        f"INSERT INTO {TABLE} (identity, payload_digest, hash_scheme)"
        " VALUES (key, payload, scheme)",
    )
}"""
"""The same claim over the compact row; the worker sends the digests (as the library
would compute them, in Python) and the lock's key, the digest's first four bytes."""

COMPACT_CLAIM = (
    f"SELECT {TABLE}_claim(%(identity)s, %(payload_digest)s, %(scheme_code)s, "
    "%(lock_key)s, %(lock_timeout)s)"
)
COMPACT_LOOK_UP = f"""SELECT payload_digest, hash_scheme, processed_at FROM {TABLE}
    WHERE identity = %(identity)s"""
"""The stored claim of an identity, for a duplicate, in the compact row."""


def compact_params(params: dict[str, Any]) -> dict[str, Any]:
    """The compact claim's parameters from the library's: the identity's digest (the same
    as `DIGEST_SQL`), the payload's SHA-256 cut to 16 bytes, the scheme's code."""
    parts = (params[name] for name in KEY)
    digest = hashlib.sha256("\x1f".join(parts).encode()).digest()[:16]
    return params | {
        "identity": uuid.UUID(bytes=digest),
        "payload_digest": uuid.UUID(params["payload_sha256"][:32]),
        "scheme_code": 1,
        "lock_key": int.from_bytes(digest[:4], "big", signed=True),
    }


# -- partitioned by the time in the identity ----------------------------------------------------

CREATE_ID_TIME_TABLE = f"""CREATE TABLE {TABLE} (
    id_time         timestamptz NOT NULL,
    identity        uuid        NOT NULL,
    payload_digest  uuid        NOT NULL,
    hash_scheme     smallint    NOT NULL
) PARTITION BY RANGE (id_time)"""
"""The compact row partitioned by the time the message id carries (a UUIDv7's first 48
bits, milliseconds since the epoch) instead of the claim's: every copy of a message has
the same id, so the same partition, and that partition's unique index alone decides. No
lock, no look-up in other partitions, no function: the claim is the plain insert. It
holds only for ids with a time in them; a copy whose id is older than the retention
window is an expired copy (`docs/how-to/retention.md`), and the claim time is not kept."""

ID_TIME_DIGEST_SQL = f"""(pg_catalog.left(pg_catalog.replace({{m}}, '-', ''), 12)
        || pg_catalog.encode(pg_catalog.substr({IDENTITY_SHA256}, 1, 10), 'hex'))::uuid"""
"""The id-time layout's key: the 6 bytes of milliseconds the UUIDv7 id begins with, then
the first 10 bytes of the identity's SHA-256 (`DIGEST_SQL`'s). Still 16 bytes, and still
one value an identity (its id names the time): but the keys a partition's index receives
rise with time, so a claim writes near the index's right edge, the few pages every recent
claim shares, instead of a random leaf of the partition's. With the digest alone, the WAL
of a claim grew with a partition's rows (361 bytes a claim empty, 1,413 at 10^8 rows, a
day a partition): each checkpoint made every leaf a claim touched a full-page image.
Two identities collide only with the same millisecond and the same 80 bits of digest."""

ID_TIME_CLAIM = f"""INSERT INTO {TABLE} (id_time, identity, payload_digest, hash_scheme)
SELECT %(id_time)s, %(identity)s, %(payload_digest)s, %(scheme_code)s
FROM (SELECT pg_catalog.set_config('lock_timeout', %(lock_timeout)s, true)) AS settings
ON CONFLICT DO NOTHING RETURNING pg_catalog.pg_current_xact_id()"""
ID_TIME_LOOK_UP = f"""SELECT payload_digest, hash_scheme FROM {TABLE}
    WHERE id_time = %(id_time)s AND identity = %(identity)s"""
"""The stored claim, looked for in the one partition its id's time names."""


def _milliseconds(message_id: str) -> bytes:
    """The 6 bytes of milliseconds since the epoch a UUIDv7 message id begins with."""
    return bytes.fromhex(message_id.replace("-", "")[:12])


def id_time(message_id: str) -> datetime:
    """The time a UUIDv7 message id carries."""
    return datetime.fromtimestamp(int.from_bytes(_milliseconds(message_id)) / 1000, UTC)


def id_time_params(params: dict[str, Any]) -> dict[str, Any]:
    """The id-time claim's parameters: the compact row's, its key led by the id's time
    (`ID_TIME_DIGEST_SQL`)."""
    compact = compact_params(params)
    milliseconds = _milliseconds(params["message_id"])
    return compact | {
        "id_time": id_time(params["message_id"]),
        "identity": uuid.UUID(bytes=milliseconds + compact["identity"].bytes[:10]),
    }


ROWS = {
    "partitioned": (CREATE_TABLE, CLAIM_FUNCTION, ", ".join(KEY)),
    "compact": (CREATE_COMPACT_TABLE, COMPACT_CLAIM_FUNCTION, "identity"),
    "idtime": (CREATE_ID_TIME_TABLE, None, "identity"),
}
"""Each layout's table, claim function (None: none) and unique key."""

HOURS = {"partitioned": 24, "compact": 24, "idtime": 1}
"""Each layout's partition, in hours. The claim of the first two looks in every
partition, so they have few: a day each. The id-time claim goes to the one partition its
id names, whatever their number, so it has small ones: dropping a partition unlinks its
files at once, and on a file system that discards freed blocks as it frees them (ext4's
``discard``) a day's gigabyte held every commit about 20 to 70 ms, where an hour's tens of
megabytes go unnoticed (``docs/performance.md``, "The dropped partition's stall")."""


def create(
    conn: psycopg.Connection[Any],
    first: date | datetime,
    days: int,
    *,
    layout: str = "partitioned",
) -> None:
    """Replace the claims table by the partitioned one of ``layout`` (one of `ROWS`),
    partitions of the layout's `HOURS` from ``first`` (a day's midnight, or the start of
    the partition that holds that time) to ``days`` days after it, and install its claim
    function."""
    table, function, _ = ROWS[layout]
    conn.execute(f"DROP TABLE IF EXISTS {TABLE} CASCADE")
    conn.execute(table)
    span = timedelta(hours=HOURS[layout])
    if isinstance(first, datetime):
        midnight = _midnight(first.astimezone(UTC).date())
        lower = midnight + (first - midnight) // span * span
    else:
        lower = _midnight(first)
    end = lower + timedelta(days=days)
    while lower < end:
        add_partition(conn, lower, lower + span, layout=layout)
        lower += span
    if function is not None:
        conn.execute(function)


def add_partition(
    conn: psycopg.Connection[Any], lower: datetime, upper: datetime, *, layout: str = "partitioned"
) -> str:
    """A partition for claims whose transaction started in [lower, upper), with its own
    unique index on the identity."""
    name = f"{TABLE}_{lower.astimezone(UTC):%Y%m%d_%H%M%S_%f}"
    bounds = f"FROM ({_literal(lower)}) TO ({_literal(upper)})"
    conn.execute(f"CREATE TABLE {name} PARTITION OF {TABLE} FOR VALUES {bounds}")
    key = ROWS[layout][2]
    conn.execute(f"CREATE UNIQUE INDEX {name}_key ON {name} ({key})")
    return name


def partitions(conn: psycopg.Connection[Any]) -> list[str]:
    """The partitions, oldest first."""
    rows = conn.execute(
        """SELECT c.relname FROM pg_catalog.pg_inherits i
           JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
           WHERE i.inhparent = %s::regclass ORDER BY c.relname""",
        (TABLE,),
    ).fetchall()
    return [str(row[0]) for row in rows]


def rows_of(conn: psycopg.Connection[Any], partition: str) -> int:
    counted = conn.execute(f"SELECT count(*) FROM {partition}").fetchone()
    return int(counted[0]) if counted else 0


def drop(conn: psycopg.Connection[Any], partition: str) -> None:
    """The purge of this layout: a partition detached without blocking the claims
    (``CONCURRENTLY``; ``conn`` must be in autocommit) and dropped."""
    conn.execute(f"ALTER TABLE {TABLE} DETACH PARTITION {partition} CONCURRENTLY")
    conn.execute(f"DROP TABLE {partition}")


def drop_oldest(conn: psycopg.Connection[Any]) -> tuple[str, int]:
    """The oldest partition dropped (`drop`); answers its name and the rows it held."""
    oldest = partitions(conn)[0]
    rows = rows_of(conn, oldest)
    drop(conn, oldest)
    return oldest, rows


def _midnight(day: date) -> datetime:
    return datetime.combine(day, time(), tzinfo=UTC)


def _literal(at: datetime) -> str:
    return f"'{at.astimezone(UTC).isoformat()}'"
