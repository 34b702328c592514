"""The SQL of the claim protocol: one statement per protocol step, built once.

Each method turns a `protocol` step into a statement and its parameters, and turns the
result back into what the protocol expects, so the two executors share every query.
A batch claim is one statement too; it is built per batch size (one row of parameters
per delivery), and SQLAlchemy caches each size's compiled form.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from sqlalchemy import (
    Connection,
    CursorResult,
    DateTime,
    Dialect,
    Executable,
    Select,
    Table,
    Text,
    bindparam,
    case,
    cast,
    func,
    literal_column,
    or_,
    select,
    text,
    true,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from .._core import claims
from .._core.outputs import OUTPUTS_UNDELIVERABLE
from .._core.protocol import (
    Claim,
    ClaimBatch,
    Delivery,
    LookUp,
    LookUpBatch,
    QuarantineRecord,
    ReasonCode,
    RecordConflict,
    Step,
    StoredClaim,
)
from .._observe import tracing
from .tables import InboxSchema

__all__ = [
    "CHECKED_COMMIT",
    "CLAIM_ENDED",
    "LOCK_TIMEOUT_SECONDS",
    "STILL_RUNNING",
    "TRANSACTION_PROBE",
    "ClaimStatements",
    "CompactClaimStatements",
    "DriverStatement",
    "phase_record",
    "writers_in_flight",
]

_TIMESTAMP = DateTime(timezone=True)

TRANSACTION_PROBE = "SELECT 1"
"""Does nothing in a healthy transaction; fails with 25P02 in an aborted one."""

# The claim's transaction, marked in the transaction itself: the claim's RETURNING (only a
# row it inserted) records the transaction id it was given, ``pg_current_xact_id()``; the
# look-up of a duplicate records ``pg_current_xact_id_if_assigned()`` (None when the
# transaction has written nothing yet: it must not assign one). The setting is local to
# the transaction: once that transaction ends, by a COMMIT or a ROLLBACK wherever it was
# sent, it is gone, and any transaction begun since has none.
_MARK = "inbox_middleware.claim_xid"
_SET_LOCK_TIMEOUT = text("SELECT pg_catalog.set_config('lock_timeout', :lock_timeout, true)")
_MARKED = f"pg_catalog.set_config('{_MARK}', 'xid:' || coalesce({{xid}}::text, ''), true)"
CLAIM_ENDED = "inbox_middleware.claim_transaction_ended"
"""The name in the error the checked COMMIT raises when the transaction is not the claim's."""
CHECKED_COMMIT = (
    # The transaction committing is the claim's: its mark is there, and names the
    # transaction's own id (or none, when the look-up ran before the transaction had
    # one). Otherwise the SELECT fails (an unknown setting, named for what happened), the
    # COMMIT after it in the same message is never run, and the attempt fails. In an
    # aborted transaction the SELECT fails with 25P02. Both go in one simple-protocol
    # message, so that the check costs no round trip of its own; COMMIT's reply (COMMIT,
    # or ROLLBACK) is read by the caller.
    f"SELECT CASE WHEN pg_catalog.current_setting('{_MARK}', true) IN "
    f"('xid:', 'xid:' || coalesce(pg_catalog.pg_current_xact_id_if_assigned()::text, '')) "
    f"THEN 0 ELSE pg_catalog.current_setting('{CLAIM_ENDED}')::int END; COMMIT"
)


@dataclass(frozen=True, slots=True)
class PreparedForm:
    """A driver statement as a prepared statement of the server session: ``PREPARE name
    AS ...`` once on a connection, then ``EXECUTE name(...)`` with the values as literals,
    which the server runs with the plan it kept instead of parsing and planning the whole
    claim again (`driver.claim_with_begin`).

    The name is taken from the statement's text, so that every worker names the same
    statement alike and never names another one so: behind a pooler that hands server
    sessions around, a name found prepared is this statement."""

    name: str
    prepare: str
    """The PREPARE command: the statement's placeholders numbered ``$1``, ``$2``..."""
    names: tuple[str, ...] | None
    """For a mapping's placeholders (psycopg's ``%(name)s``), the name each ``$n`` takes
    its value from; None when the arguments are positional already (asyncpg's)."""

    @staticmethod
    def of(sql: str, order: tuple[str, ...] | None) -> PreparedForm:
        if order is not None:
            text, names = sql, None
        else:
            found: list[str] = []

            def numbered(match: re.Match[str]) -> str:
                name = match.group(1)
                if name is None:
                    return "%"  # an escaped percent sign
                if name not in found:
                    found.append(name)
                return f"${found.index(name) + 1}"

            text, names = _PYFORMAT.sub(numbered, sql), tuple(found)
        name = "inbox_claim_" + hashlib.sha256(text.encode()).hexdigest()[:24]
        return PreparedForm(name, f"PREPARE {name} AS {text}", names)


_PYFORMAT = re.compile(r"%\((\w+)\)s|%%")


@dataclass(frozen=True, slots=True)
class DriverStatement:
    """A step's statement compiled for one driver: its SQL, the values of its constant
    parameters and, for a positional paramstyle (asyncpg's ``$1``), the parameters'
    order."""

    sql: str
    constants: dict[str, Any]
    order: tuple[str, ...] | None

    sql_bytes: bytes = field(init=False, repr=False)
    """The SQL encoded once, for `driver.claim_with_begin` to fill with literals."""
    prepared: PreparedForm = field(init=False, repr=False)
    """The same statement as the server keeps it prepared (`PreparedForm`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sql_bytes", self.sql.encode())
        object.__setattr__(self, "prepared", PreparedForm.of(self.sql, self.order))

    def parameters(self, params: dict[str, Any]) -> Any:
        """The step's parameters as the driver takes them: a mapping, or a sequence."""
        merged = self.constants | params
        return merged if self.order is None else [merged[name] for name in self.order]


@functools.cache
def begin_command(isolation_level: Any, read_only: bool | None, deferrable: bool | None) -> bytes:
    """The BEGIN psycopg sends for a connection with these characteristics (its
    ``isolation_level``, ``read_only`` and ``deferrable``), for `driver.claim_with_begin`
    to send in its stead."""
    parts = ["BEGIN"]
    if isolation_level is not None:
        parts.append(f"ISOLATION LEVEL {isolation_level.name.replace('_', ' ')}")
    if read_only is not None:
        parts.append("READ ONLY" if read_only else "READ WRITE")
    if deferrable is not None:
        parts.append("DEFERRABLE" if deferrable else "NOT DEFERRABLE")
    return " ".join(parts).encode()


class ClaimStatements:
    """Statements for one naming and dialect; ``lock_timeout`` in seconds or None."""

    def __init__(self, naming: InboxSchema, dialect: str, lock_timeout: float | None) -> None:
        tables = naming.tables
        inbox, quarantine = tables.inbox, tables.quarantine
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        key = [inbox.c.consumer_name, inbox.c.producer_name, inbox.c.tenant, inbox.c.message_id]
        self._key_names = [column.name for column in key]
        self._inbox, self._insert, self._key_columns = inbox, insert, key
        self._dialect = dialect

        # trace_id: the delivery's trace when it is traced (NULL otherwise), written in the
        # claim itself so that `explain` finds the trace of the first delivery for free.
        columns = [*key, inbox.c.payload_sha256, inbox.c.hash_scheme, inbox.c.handler_version]
        columns.append(inbox.c.trace_id)
        values: list[Any] = [bindparam(column.name, type_=Text) for column in columns]
        self._texts = len(columns)
        columns += [inbox.c.produced_at, inbox.c.received_at]
        values += [self._timestamp("produced_at"), self._timestamp("received_at")]
        rows = select(*values)
        self._columns = [column.name for column in columns]
        # A claim attempt that only waits: rolled back (`settled_claim`), marks nothing.
        self.probe: Executable = (
            insert(inbox)
            .from_select(self._columns, rows)
            .on_conflict_do_nothing()
            .returning(literal_column("1"))
        )
        self._lock_timeout: str | None = None
        if dialect == "postgresql" and lock_timeout is not None:
            # Set lock_timeout for this transaction inside the claim statement itself: the
            # sub-select runs before the INSERT waits on a conflicting uncommitted row, so
            # the wait is bounded without a separate SET round trip per message.
            rows = rows.select_from(self._setting())
            self._lock_timeout = f"{max(1, round(lock_timeout * 1000))}ms"
        claim: Any = (
            insert(inbox)
            .from_select([column.name for column in columns], rows)
            .on_conflict_do_nothing()
            .returning(self._mark("pg_catalog.pg_current_xact_id()"))
        )
        self._poison = tables.poison
        if dialect == "postgresql":
            claim = claim.add_cte(
                self._recover([bindparam(name) for name in [*self._key_names, "payload_sha256"]])
            )
        self.claim: Executable = claim

        self.look_up: Executable = select(
            inbox.c.payload_sha256,
            inbox.c.hash_scheme,
            inbox.c.handler_version,
            inbox.c.processed_at,
            self._mark("pg_catalog.pg_current_xact_id_if_assigned()"),
        ).where(*(column == bindparam(column.name) for column in key))

        record = insert(quarantine).values(
            consumer_name=bindparam("consumer_name"),
            producer_name=bindparam("producer_name"),
            tenant=bindparam("tenant"),
            message_id=bindparam("message_id"),
            stored_sha256=bindparam("stored_sha256"),
            conflicting_sha256=bindparam("payload_sha256"),
            hash_scheme=bindparam("hash_scheme"),
            source=bindparam("source"),
            payload=bindparam("payload"),
            payload_format=bindparam("payload_format"),
            headers=bindparam("headers", type_=quarantine.c.headers.type),
            reason_code=ReasonCode.IDENTITY_CONFLICT.value,
            attempts=1,
            handler_version=bindparam("handler_version"),
            first_seen_at=func.now(),
            last_seen_at=func.now(),
            decision="pending",
        )
        # A redriven row whose copy conflicts again is pending once more (as a poison row
        # whose redrive fails again): the operator must look again. Accepted and discarded
        # rows keep their decision: a copy of the same conflicting payload changes nothing.
        again = quarantine.c.decision == "redriven"

        def unless_again(column: str, pending: Any) -> Any:
            return case((again, pending), else_=quarantine.c[column])

        self.record_conflict: Executable = record.on_conflict_do_update(
            index_elements=[*self._key_names, "conflicting_sha256"],
            set_={
                "attempts": quarantine.c.attempts + 1,
                "last_seen_at": func.now(),
                "headers": record.excluded.headers,
                "decision": unless_again("decision", "pending"),
                **{
                    name: unless_again(name, None)
                    for name in (
                        "decided_by",
                        "decided_at",
                        "decision_note",
                        "operation_id",
                        "published_at",
                    )
                },
            },
        ).returning(quarantine.c.id, quarantine.c.attempts)

    def _recover(self, *keys: list[Any]) -> Any:
        """An UPDATE, run as a CTE of the claim: a pending or redriven poison row of the
        same identity and payload is marked recovered. A poisoned copy leaves no claim (its
        attempt rolled back), so a later copy is a first delivery of its own; when it
        commits, the intent is applied and the earlier copy's row must not wait for a
        redrive that would only publish it again. A redriven row too: the copy that commits
        may not be the redriven one (the poisoned copy itself, reclaimed or redelivered
        after the operator's redrive), and the redriven copy is then a duplicate that marks
        nothing. The claim's transaction holds the mark: a copy that rolls back leaves the
        row as it was. A copy with another payload is not the poisoned message: its row
        stays for the operator (PostgreSQL only: SQLite has no data-modifying CTE)."""
        poison = self._poison
        columns = [poison.c[name] for name in self._key_names]
        columns.append(poison.c.payload_sha256)
        return (
            update(poison)
            .where(tuple_(*columns).in_([tuple_(*key) for key in keys]))
            # (two comparisons: the claim's literal writer has no form for an IN list)
            .where(or_(poison.c.decision == "pending", poison.c.decision == "redriven"))
            # outputs that could not be sent: that message's own claim committed, and its
            # row waits for the redrive that sends them
            .where(poison.c.reason_code != OUTPUTS_UNDELIVERABLE)
            .values(decision="recovered", recovered_at=func.now())
            .returning(poison.c.id)
            .cte("inbox_recovered")
        )

    def _timestamp(self, name: str) -> Any:
        """A timestamp parameter. PostgreSQL needs the CAST to type a parameter in a
        SELECT list; SQLite must not have one: its CAST(... AS DATETIME) is numeric and
        would store the year alone, where the bound value is already ISO text."""
        parameter = bindparam(name, type_=_TIMESTAMP)
        return cast(parameter, _TIMESTAMP) if self._dialect == "postgresql" else parameter

    def _mark(self, xid: str) -> Any:
        """Mark the transaction as the claim's (PostgreSQL; `CHECKED_COMMIT`), or a
        constant column (SQLite)."""
        if self._dialect != "postgresql":
            return literal_column("1")
        return literal_column(_MARKED.format(xid=xid))

    @staticmethod
    def _setting() -> Any:
        return select(
            func.set_config("lock_timeout", bindparam("lock_timeout", type_=Text), true())
        ).subquery("inbox_settings")

    @functools.lru_cache(maxsize=64)  # noqa: B019 (one instance per inbox, kept for its life)
    def claim_batch(self, size: int) -> Executable:
        """INSERT ``size`` rows in one statement, in key order; RETURNING the claimed keys.

        The rows are a UNION ALL of one SELECT of parameters per delivery (``c0_*``,
        ``c1_*``, ...), which PostgreSQL and SQLite both accept. ORDER BY the key makes
        every batch take its row locks in the same order.
        """
        rows = self._batch_rows(size)
        ordered: Select[Any] = select(*(rows.c[name] for name in self._columns))
        if self._lock_timeout is not None:
            # Sorting consumes every row, settings included, before the first INSERT can
            # wait on a lock: lock_timeout is in force by then, as for one delivery.
            ordered = ordered.select_from(rows.join(self._setting(), true()))
        # WHERE true: SQLite cannot otherwise tell the upsert's ON CONFLICT from a join's ON.
        ordered = ordered.where(true()).order_by(*(rows.c[name] for name in self._key_names))
        statement: Any = (
            self._insert(self._inbox)
            .from_select(self._columns, ordered)
            .on_conflict_do_nothing()
            .returning(*self._key_columns, self._mark("pg_catalog.pg_current_xact_id()"))
        )
        if self._dialect == "postgresql":
            names = [*self._key_names, "payload_sha256"]
            keys = [
                [cast(bindparam(f"c{index}_{name}", type_=Text), Text) for name in names]
                for index in range(size)
            ]
            statement = statement.add_cte(self._recover(*keys))
        built: Executable = statement
        return built

    @functools.lru_cache(maxsize=64)  # noqa: B019
    def look_up_batch(self, size: int) -> Executable:
        keys: list[list[Any]] = [
            [bindparam(f"k{i}_{name}") for name in self._key_names] for i in range(size)
        ]
        return select(
            *self._key_columns,
            self._inbox.c.payload_sha256,
            self._inbox.c.hash_scheme,
            self._inbox.c.handler_version,
            self._inbox.c.processed_at,
            self._mark("pg_catalog.pg_current_xact_id_if_assigned()"),
        ).where(tuple_(*self._key_columns).in_([tuple_(*key) for key in keys]))

    def _batch_rows(self, size: int, extra: tuple[str, ...] = ()) -> Any:
        """The rows of a batch's claim: a UNION ALL of one SELECT of parameters per
        delivery (``c0_*``, ``c1_*``, ...), the claim's columns then ``extra`` texts."""
        texts = [*self._columns[: self._texts], *extra]
        branches = []
        for index in range(size):
            row: list[Any] = [
                cast(bindparam(f"c{index}_{name}", type_=Text), Text).label(name) for name in texts
            ]
            row += [
                self._timestamp(f"c{index}_{name}").label(name)
                for name in self._columns[self._texts :]
            ]
            branches.append(select(*row))
        return union_all(*branches).subquery("inbox_rows")

    def statement(self, step: Step) -> tuple[Executable, dict[str, Any]]:
        if isinstance(step, ClaimBatch):
            params: dict[str, Any] = {}
            for index, delivery in enumerate(step.deliveries):
                params |= {f"c{index}_{k}": v for k, v in self._claim_row(delivery).items()}
            if self._lock_timeout is not None:
                params["lock_timeout"] = self._lock_timeout
            return self.claim_batch(len(step.deliveries)), params
        if isinstance(step, LookUpBatch):
            params = {}
            for index, delivery in enumerate(step.deliveries):
                params |= {f"k{index}_{k}": v for k, v in self._key(delivery).items()}
            return self.look_up_batch(len(step.deliveries)), params
        delivery = step.delivery
        if isinstance(step, Claim):
            params = self._claim_row(delivery)
            if self._lock_timeout is not None:
                params["lock_timeout"] = self._lock_timeout
            return self.claim, params
        if isinstance(step, LookUp):
            return self.look_up, self._key(delivery)
        return self.record_conflict, self._key(delivery) | {
            "stored_sha256": step.stored.payload_sha256,
            "payload_sha256": delivery.payload_hash.sha256,
            "hash_scheme": delivery.payload_hash.scheme,
            "source": delivery.source,
            "payload": delivery.stored_payload(),
            "payload_format": delivery.payload_format,
            "headers": delivery.stored_headers(),
            "handler_version": delivery.handler_version,
        }

    @staticmethod
    def result(step: Step, result: CursorResult[Any]) -> object:
        if isinstance(step, ClaimBatch):
            return {tuple(row)[:4] for row in result}
        if isinstance(step, LookUpBatch):
            rows: list[tuple[Any, ...]] = [tuple(row) for row in result]
            return {row[:4]: StoredClaim(row[4], row[5], row[6], row[7]) for row in rows}
        first = result.first()
        return ClaimStatements.answer(step, None if first is None else tuple(first))

    @staticmethod
    def answer(step: Step, row: tuple[Any, ...] | None) -> object:
        """What a one-row step's first row (or None) means to the protocol."""
        if isinstance(step, Claim):
            return row is not None
        if isinstance(step, LookUp):
            return None if row is None else StoredClaim(*row[:4])
        assert isinstance(step, RecordConflict)
        assert row is not None
        return QuarantineRecord(*row)

    @functools.cache  # noqa: B019  (one entry per dialect; statements live as long as inboxes)
    def driver_sql(self, dialect: Dialect) -> dict[type[Any], DriverStatement]:
        """The claim and look-up compiled once for ``dialect``, to run on its driver.

        The hot path sends these two statements straight to the driver connection: the
        same SQL SQLAlchemy would send, without its per-execution work (see `executors`).
        """
        compiled = {
            Claim: self._compile(self.claim, dialect),
            LookUp: self._compile(self.look_up, dialect),
        }
        # A constant that is an enum member (a reason code) goes as its plain value: the
        # claim's literals are written for plain text only (`driver.claim_with_begin`).
        return {
            step: DriverStatement(
                str(c),
                {
                    k: v.value if isinstance(v, Enum) else v
                    for k, v in c.params.items()
                    if v is not None
                },
                tuple(c.positiontup) if dialect.positional and c.positiontup else None,
            )
            for step, c in compiled.items()
        }

    @staticmethod
    def _compile(statement: Any, dialect: Dialect) -> Any:
        return statement.compile(dialect=dialect)

    def _claim_row(self, delivery: Delivery) -> dict[str, Any]:
        return self._key(delivery) | {
            "payload_sha256": delivery.payload_hash.sha256,
            "hash_scheme": delivery.payload_hash.scheme,
            "handler_version": delivery.handler_version,
            "trace_id": tracing.trace_id(),
            "produced_at": delivery.identity.produced_at,
            "received_at": delivery.received_at,
        }

    def settled_claim(self, conn: Connection, delivery: Delivery) -> StoredClaim | None:
        """The claim held for ``delivery``'s key once any transaction still holding the key
        has ended (a COMMIT still running on the server): a claim attempt, rolled back to
        a savepoint, waits for that transaction as a claim does, within the lock_timeout
        (`LockNotAvailable` after it); then the claim is read, or None when there is none."""
        row = self._claim_row(delivery)
        probe = conn.begin_nested()
        try:
            if self._lock_timeout is not None:
                conn.execute(_SET_LOCK_TIMEOUT, {"lock_timeout": self._lock_timeout})
                row["lock_timeout"] = self._lock_timeout  # the compact probe sets it again
            owned = conn.execute(self.probe, row).first() is not None
        finally:
            probe.rollback()
        return None if owned else self.stored_claim(conn, delivery)

    def stored_claim(self, conn: Connection, delivery: Delivery) -> StoredClaim | None:
        """The claim held for ``delivery``'s key, read without claiming, or None."""
        row = conn.execute(self.look_up, self._key(delivery)).first()
        if row is None:
            return None
        return StoredClaim(row[0], row[1], row[2], row[3])

    def _key(self, delivery: Delivery) -> dict[str, Any]:
        return dict(zip(self._key_names, delivery.key, strict=True))


class CompactClaimStatements(ClaimStatements):
    """The claim protocol's statements in one phase of the compact claim
    (`_core.claims.ClaimsPhase`, PostgreSQL only): the compact row alone, checking the
    library's table or not, or both tables in one statement.

    Every claim keeps the identity's texts among its parameters: the poison row a first
    delivery recovers is found by them, and so is a claim in the library's table. A
    stored compact claim reaches the core with the payload's 32 hex characters and its
    scheme's number (`claims.scheme_tag`), which the core reads back (`protocol.compare`).
    """

    def __init__(
        self, naming: InboxSchema, lock_timeout: float | None, phase: claims.ClaimsPhase
    ) -> None:
        super().__init__(naming, "postgresql", lock_timeout)
        if phase is claims.ClaimsPhase.LIBRARY:
            raise ValueError("the library's phase has the library's statements")
        self.phase = phase
        compact = self._compact = naming.tables.claims
        inbox = self._inbox
        self._compact_columns = ["identity", "payload_digest", "hash_scheme"]
        compact_values = [
            cast(bindparam("identity", type_=Text), compact.c.identity.type),
            cast(bindparam("payload_digest", type_=Text), compact.c.payload_digest.type),
            cast(bindparam("scheme_code", type_=Text), compact.c.hash_scheme.type),
        ]
        key_params = [bindparam(name, type_=Text) for name in self._key_names]
        recover = self._recover([bindparam(name) for name in [*self._key_names, "payload_sha256"]])

        def compact_rows(unclaimed_in_library: bool) -> Any:
            rows = select(*compact_values)
            if self._lock_timeout is not None:
                rows = rows.select_from(self._setting())
            if unclaimed_in_library:
                rows = rows.where(~self._in_library(key_params))
            return rows

        def claim(returning: Any, *, with_recover: bool) -> Any:
            if phase is claims.ClaimsPhase.BOTH:
                # The compact row first (it sets lock_timeout): the library's row is
                # inserted only when the compact one was, so a message claimed by either
                # kind of worker is never claimed again.
                first = (
                    postgresql.insert(compact)
                    .from_select(self._compact_columns, compact_rows(False))
                    .on_conflict_do_nothing()
                    .returning(literal_column("1"))
                    .cte("inbox_compact")
                )
                library_rows = select(*self._library_values()).where(
                    select(literal_column("1")).select_from(first).exists()
                )
                statement: Any = (
                    postgresql.insert(inbox)
                    .from_select(self._columns, library_rows)
                    .on_conflict_do_nothing()
                    .returning(returning)
                    .add_cte(first)
                )
            else:
                checking = phase is claims.ClaimsPhase.COMPACT_CHECKING
                statement = (
                    postgresql.insert(compact)
                    .from_select(self._compact_columns, compact_rows(checking))
                    .on_conflict_do_nothing()
                    .returning(returning)
                )
            return statement.add_cte(recover) if with_recover else statement

        self.claim = claim(self._mark("pg_catalog.pg_current_xact_id()"), with_recover=True)
        self.probe = claim(literal_column("1"), with_recover=False)
        stored = self._stored_columns()
        self.look_up = union_all(
            select(*self._library_stored()).where(
                *(column == bindparam(column.name) for column in self._key_columns)
            ),
            select(*stored).where(compact.c.identity == compact_values[0]),
        ).limit(literal_column("1"))

    def _in_library(self, key: list[Any]) -> Any:
        return (
            select(literal_column("1"))
            .select_from(self._inbox)
            .where(*(column == value for column, value in zip(self._key_columns, key, strict=True)))
            .exists()
        )

    def _library_values(self) -> list[Any]:
        values: list[Any] = [bindparam(name, type_=Text) for name in self._columns[: self._texts]]
        values += [self._timestamp(name) for name in self._columns[self._texts :]]
        return values

    def _library_stored(self) -> list[Any]:
        inbox = self._inbox
        return [
            inbox.c.payload_sha256,
            inbox.c.hash_scheme,
            inbox.c.handler_version,
            inbox.c.processed_at,
            self._mark("pg_catalog.pg_current_xact_id_if_assigned()"),
        ]

    def _stored_columns(self) -> list[Any]:
        """A compact row as the library's stored claim: the payload digest's 32 hex
        characters, the scheme's number as `claims.scheme_tag` writes it, no handler
        version."""
        compact = self._compact
        return [
            func.replace(cast(compact.c.payload_digest, Text), _DASH, _EMPTY).label(
                "payload_sha256"
            ),
            (literal_column("'code:'") + cast(compact.c.hash_scheme, Text)).label("hash_scheme"),
            literal_column("''").label("handler_version"),
            compact.c.processed_at,
            self._mark("pg_catalog.pg_current_xact_id_if_assigned()"),
        ]

    @functools.lru_cache(maxsize=64)  # noqa: B019 (one instance per phase, kept for its life)
    def claim_batch(self, size: int) -> Executable:
        """The batch's claim in this phase: one statement, RETURNING the compact key of
        each message claimed (`result` maps it back to its delivery)."""
        compact, inbox = self._compact, self._inbox
        rows = self._batch_rows(size, ("identity", "payload_digest", "scheme_code"))
        compact_values = [
            cast(rows.c.identity, compact.c.identity.type),
            cast(rows.c.payload_digest, compact.c.payload_digest.type),
            cast(rows.c.scheme_code, compact.c.hash_scheme.type),
        ]
        source: Any = rows
        if self._lock_timeout is not None:
            source = rows.join(self._setting(), true())
        ordered = select(*compact_values).select_from(source).order_by(compact_values[0])
        if self.phase is claims.ClaimsPhase.COMPACT_CHECKING:
            key = [rows.c[name] for name in self._key_names]
            ordered = ordered.where(~self._in_library(key))
        first = (
            postgresql.insert(compact)
            .from_select(self._compact_columns, ordered)
            .on_conflict_do_nothing()
        )
        mark = self._mark("pg_catalog.pg_current_xact_id()")
        if self.phase is claims.ClaimsPhase.BOTH:
            inserted = first.returning(compact.c.identity).cte("inbox_compact")
            library = (
                select(*(rows.c[name] for name in self._columns))
                .where(
                    cast(rows.c.identity, compact.c.identity.type).in_(select(inserted.c.identity))
                )
                .order_by(*(rows.c[name] for name in self._key_names))
            )
            statement: Any = (
                postgresql.insert(inbox)
                .from_select(self._columns, library)
                .on_conflict_do_nothing()
                .returning(*self._key_columns, mark)
                .add_cte(inserted)
            )
        else:
            statement = first.returning(
                func.replace(cast(compact.c.identity, Text), _DASH, _EMPTY).label("identity"),
                mark,
            )
        keys = [
            [
                cast(bindparam(f"c{index}_{name}", type_=Text), Text)
                for name in [*self._key_names, "payload_sha256"]
            ]
            for index in range(size)
        ]
        built: Executable = statement.add_cte(self._recover(*keys))
        return built

    @functools.lru_cache(maxsize=64)  # noqa: B019
    def look_up_batch(self, size: int) -> Executable:
        """The stored claims of a batch: the library's rows by key, the compact rows by
        their key; each row names its delivery one way or the other."""
        compact = self._compact
        keys: list[list[Any]] = [
            [bindparam(f"k{i}_{name}") for name in self._key_names] for i in range(size)
        ]
        identities = [
            cast(bindparam(f"k{i}_identity", type_=Text), compact.c.identity.type)
            for i in range(size)
        ]
        nothing = [cast(literal_column("NULL"), Text).label(name) for name in self._key_names]
        return union_all(
            select(
                *self._key_columns,
                cast(literal_column("NULL"), Text).label("identity"),
                *self._library_stored(),
            ).where(tuple_(*self._key_columns).in_([tuple_(*key) for key in keys])),
            select(
                *nothing,
                func.replace(cast(compact.c.identity, Text), _DASH, _EMPTY),
                *self._stored_columns(),
            ).where(compact.c.identity.in_(identities)),
        )

    def statement(self, step: Step) -> tuple[Executable, dict[str, Any]]:
        executable, params = super().statement(step)
        if isinstance(step, LookUpBatch):
            for index, delivery in enumerate(step.deliveries):
                params[f"k{index}_identity"] = _identity(delivery)
        return executable, params

    def result(self, step: Step, result: CursorResult[Any]) -> object:  # type: ignore[override]
        if isinstance(step, ClaimBatch):
            if self.phase is claims.ClaimsPhase.BOTH:
                return {tuple(row)[:4] for row in result}
            by_identity = {_identity(delivery): delivery.key for delivery in step.deliveries}
            return {by_identity[row[0]] for row in result}
        if isinstance(step, LookUpBatch):
            by_identity = {_identity(delivery): delivery.key for delivery in step.deliveries}
            found: dict[tuple[str, ...], StoredClaim] = {}
            for row in result:
                values: tuple[Any, ...] = tuple(row)
                key = values[:4] if values[0] is not None else by_identity[values[4]]
                found.setdefault(key, StoredClaim(*values[5:9]))
            return found
        return ClaimStatements.result(step, result)

    def _claim_row(self, delivery: Delivery) -> dict[str, Any]:
        row = super()._claim_row(delivery)  # its key (`_key`) holds the identity
        row["payload_digest"] = claims.payload_digest(delivery.payload_hash.sha256)
        row["scheme_code"] = _scheme_code(delivery.payload_hash.scheme)
        return row

    def _key(self, delivery: Delivery) -> dict[str, Any]:
        return super()._key(delivery) | {"identity": _identity(delivery)}


_DASH: Any = literal_column("'-'")
_EMPTY: Any = literal_column("''")
"""A uuid's text without its dashes, written inline (no bound constants to name)."""


@functools.lru_cache(maxsize=64)
def _scheme_code(scheme: str) -> str:
    return str(claims.scheme_code(scheme))


def _identity(delivery: Delivery) -> str:
    """The compact key of ``delivery``'s claim, as the 32 hex characters of its uuid."""
    return claims.claim_key(*delivery.key).hex()


@functools.cache
def phase_record(naming: InboxSchema) -> Executable:
    """Whether the operator recorded the switch to the compact claim, and whether the
    library's claims table still has a row: one row of two booleans."""
    tables = naming.tables
    layout, inbox = tables.layout, tables.inbox
    switched = (
        select(literal_column("1"))
        .select_from(layout)
        .where(layout.c.name == "claims", layout.c.value == "compact")
        .exists()
    )
    remaining = select(literal_column("1")).select_from(inbox).exists()
    built: Executable = select(switched.label("switched"), remaining.label("library_rows"))
    return built


_WRITE_LOCKS = ("RowExclusiveLock", "ShareRowExclusiveLock", "ExclusiveLock", "AccessExclusiveLock")
"""The table locks a transaction holds once it wrote a table's rows (or altered it): not
``ShareUpdateExclusiveLock``, which (auto)vacuum holds and which writes nothing."""


def writers_in_flight(dialect: Dialect, tables: Sequence[Table]) -> Executable:
    """The transactions, other than this one, that hold a write lock on one of ``tables``
    (PostgreSQL, from ``pg_locks``): their virtual transaction ids, each held as a lock of
    its own until it ends (`STILL_RUNNING`). Read without taking a lock, so no one waits
    for it. The names are quoted by the dialect."""
    names = ", ".join(
        f"CAST('{dialect.identifier_preparer.format_table(table)}' AS regclass)" for table in tables
    )
    modes = ", ".join(f"'{mode}'" for mode in _WRITE_LOCKS)
    return text(
        "SELECT DISTINCT virtualtransaction FROM pg_catalog.pg_locks"
        " WHERE locktype = 'relation'"
        " AND database = (SELECT oid FROM pg_catalog.pg_database"
        " WHERE datname = pg_catalog.current_database())"
        f" AND relation IN ({names}) AND mode IN ({modes})"
        " AND pid <> pg_catalog.pg_backend_pid()"
    )


STILL_RUNNING = text(
    "SELECT virtualxid, pg_catalog.pg_backend_pid() = ANY(pg_catalog.pg_blocking_pids(pid))"
    " FROM pg_catalog.pg_locks"
    " WHERE locktype = 'virtualxid' AND virtualxid = ANY(CAST(:transactions AS text[]))"
)
"""Which of ``transactions`` (virtual transaction ids) have not ended yet, and whether each
waits for a lock this transaction holds."""

LOCK_TIMEOUT_SECONDS = text(
    "SELECT EXTRACT(EPOCH FROM CAST(pg_catalog.current_setting('lock_timeout') AS interval))"
)
"""The session's ``lock_timeout``, in seconds (0: none)."""
