"""The SQL of the claim protocol: one statement per protocol step, built once.

Each method turns a `protocol` step into a statement and its parameters, and turns the
result back into what the protocol expects, so the two executors share every query.
A batch claim is one statement too; it is built per batch size (one row of parameters
per delivery), and SQLAlchemy caches each size's compiled form.
"""

from __future__ import annotations

import functools
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
    Text,
    bindparam,
    case,
    cast,
    func,
    literal_column,
    select,
    text,
    true,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

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
    "TRANSACTION_PROBE",
    "ClaimStatements",
    "DriverStatement",
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
class DriverStatement:
    """A step's statement compiled for one driver: its SQL, the values of its constant
    parameters and, for a positional paramstyle (asyncpg's ``$1``), the parameters'
    order."""

    sql: str
    constants: dict[str, Any]
    order: tuple[str, ...] | None

    sql_bytes: bytes = field(init=False, repr=False)
    """The SQL encoded once, for `driver.claim_with_begin` to fill with literals."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sql_bytes", self.sql.encode())

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
        """An UPDATE, run as a CTE of the claim: a pending poison row of the same identity
        and payload is marked recovered. A poisoned copy leaves no claim (its attempt
        rolled back), so a later copy is a first delivery of its own; when it commits, the
        intent is applied and the earlier copy's row must not wait for a redrive that would
        only publish it again. The claim's transaction holds the mark: a copy that rolls
        back leaves the row pending. A copy with another payload is not the poisoned
        message: its row stays for the operator (PostgreSQL only: SQLite has no
        data-modifying CTE)."""
        poison = self._poison
        columns = [poison.c[name] for name in self._key_names]
        columns.append(poison.c.payload_sha256)
        return (
            update(poison)
            .where(tuple_(*columns).in_([tuple_(*key) for key in keys]))
            .where(poison.c.decision == "pending")
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
        branches = []
        for index in range(size):
            row: list[Any] = [
                cast(bindparam(f"c{index}_{name}", type_=Text), Text).label(name)
                for name in self._columns[: self._texts]
            ]
            row += [
                self._timestamp(f"c{index}_{name}").label(name)
                for name in self._columns[self._texts :]
            ]
            branches.append(select(*row))
        rows = union_all(*branches).subquery("inbox_rows")
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
        probe = conn.begin_nested()
        try:
            if self._lock_timeout is not None:
                conn.execute(_SET_LOCK_TIMEOUT, {"lock_timeout": self._lock_timeout})
            owned = conn.execute(self.probe, self._claim_row(delivery)).first() is not None
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
