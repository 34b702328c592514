"""What the synchronous and the asynchronous executor share: the base of both
(`Executor`), the attempts that decide retries (`SingleAttempts`, `BatchAttempts`), the
drive of the protocol's steps on a connection, and the log lines of the claim.

`executors.Inbox` and `aio.AsyncInbox` build on these; they differ only in whether a call
is awaited (see `executors` for one attempt's shape).
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from time import monotonic, perf_counter
from typing import Any, Generic, TypeVar

from sqlalchemy import Connection, Dialect, Engine, event, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from .._core import faults
from .._core.claims import ClaimsPhase, ClaimsTable, claims_phase
from .._core.consumption import (
    REMEMBERED_MESSAGES,
    CountFailure,
    CountHandBack,
    CountRedelivery,
    LoadOutputs,
    LookUpClaim,
    MarkSent,
    Observer,
    Op,
    QuarantineConflict,
    RecordPoison,
    RedeliveryCount,
    TransactionState,
    commit_refusal,
    drive,
)
from .._core.exceptions import (
    ClaimInProgress,
    CommitUnanswered,
    ConfigurationError,
    HandlerTransactionError,
    InboxInterrupted,
    PrerequisiteError,
)
from .._core.outputs import OUTPUTS_UNDELIVERABLE, Output
from .._core.protocol import (
    ClaimBatch,
    Decision,
    Delivery,
    RecordConflict,
    Step,
    Verdict,
    claim_batch_steps,
    claim_steps,
    compare,
)
from .._observe import tracing
from .._observe.instruments import metrics
from .driver import InboxTransaction, begin_owned, commit_checked, driver_path, on_driver
from .errors import Failure, classify, sqlstate, transient_error
from .failures import FailureRecorder, mark_recovered
from .outputs import OutputStatements
from .statements import TRANSACTION_PROBE, ClaimStatements, CompactClaimStatements, phase_record
from .tables import InboxSchema

__all__ = [
    "ABORTED",
    "BATCH_KEY",
    "DEFAULT_LOCK_TIMEOUT",
    "DEFAULT_SERIALIZATION_RETRIES",
    "DELIVERY_KEY",
    "SHADOW_KEY",
    "Attempts",
    "BatchAttempts",
    "BatchCommitted",
    "BatchOutcome",
    "Committed",
    "DatabaseSettings",
    "Executor",
    "Outcome",
    "SingleAttempts",
    "any_first_seen",
    "current_delivery",
    "database_settings",
    "enter_handler",
    "guard_transaction",
    "interrupted",
    "leave_handler",
    "log_event",
    "shadow_verdict",
    "track_aborts",
]

R = TypeVar("R")
V = TypeVar("V")
logger = logging.getLogger("inbox_middleware")

DEFAULT_LOCK_TIMEOUT = 5.0
DEFAULT_SERIALIZATION_RETRIES = 3
_READ_COMMITTED = {"isolation_level": "READ COMMITTED"}
DELIVERY_KEY = "inbox_middleware.delivery"
BATCH_KEY = "inbox_middleware.batch"
SHADOW_KEY = "inbox_middleware.shadow_verdict"
OUTPUT_KEY = "inbox_middleware.output"
MARKED_KEY = "inbox_middleware.marked"
"""Set in a session's info when its claim marked the transaction (`CHECKED_COMMIT`)."""
CLAIMED_ON = "inbox_middleware.claimed_on"
"""The `Connection` the claim ran on, in its session's info: what the commit checks and
commits (each ``session.connection()`` is SQLAlchemy's look-up of the bind, several µs)."""


def current_delivery(session: Session) -> Delivery | None:
    """The delivery whose claim ``session``'s transaction holds, or None outside the inbox.

    For an `AsyncSession`, pass its ``sync_session``.
    """
    delivery = session.info.get(DELIVERY_KEY)
    return delivery if isinstance(delivery, Delivery) else None


def shadow_verdict(session: Session) -> Verdict | None:
    """In shadow mode, the would-be duplicate or conflict verdict of the delivery whose
    handler runs in ``session``'s transaction; None when the delivery was first seen (or
    outside shadow mode). For an `AsyncSession`, pass its ``sync_session``.
    """
    verdict = session.info.get(SHADOW_KEY)
    return verdict if isinstance(verdict, Verdict) else None


@dataclass(frozen=True, slots=True)
class Committed(Generic[R]):
    """What a delivery's transaction committed: the claim's verdict, the handler's result,
    the transaction attempts it took. Only after `process` returns it may the caller ack."""

    verdict: Verdict
    result: R | None = None
    attempts: int = 1
    recovered: str | None = None
    """The kind of repair row (poison, quarantine) this delivery marked recovered."""

    @property
    def decision(self) -> Decision:
        return self.verdict.decision


@dataclass(frozen=True, slots=True)
class BatchCommitted(Generic[R]):
    """What a batch's transaction committed: one verdict per delivery, in the batch's
    order. Only after `process_batch` returns it may the caller ack."""

    verdicts: tuple[Verdict, ...]
    result: R | None = None
    attempts: int = 1
    recovered: tuple[str | None, ...] = ()
    """Per delivery, in the batch's order: the kind of repair row (poison, quarantine) it
    marked recovered, or None; empty when no delivery carried a repair marker."""

    @property
    def decisions(self) -> tuple[Decision, ...]:
        return tuple(verdict.decision for verdict in self.verdicts)


Outcome = Committed
"""The older name of `Committed`."""
BatchOutcome = BatchCommitted
"""The older name of `BatchCommitted`."""


class Executor:
    def __init__(
        self,
        dialect: str,
        naming: InboxSchema | None,
        lock_timeout: float | None,
        serialization_retries: int,
        claims: str = "library",
    ) -> None:
        if dialect not in ("postgresql", "sqlite"):
            raise ConfigurationError(
                f"inbox-middleware supports PostgreSQL and SQLite, not {dialect}"
            )
        if lock_timeout is not None and lock_timeout <= 0:
            raise ConfigurationError("lock_timeout must be positive seconds, or None for no limit")
        if serialization_retries < 0:
            raise ConfigurationError("serialization_retries must be zero or more")
        self.naming = naming or InboxSchema()
        self.dialect = dialect
        self.lock_timeout = lock_timeout
        self.serialization_retries = serialization_retries
        self.claims = _claims_table(claims, dialect)
        self.statements = ClaimStatements(self.naming, dialect, lock_timeout)
        self._phase_statements: dict[ClaimsPhase, ClaimStatements] = {
            ClaimsPhase.LIBRARY: self.statements
        }
        self._phase_due = 0.0 if self.claims is ClaimsTable.COMPACT else float("inf")
        # READ COMMITTED: a claim must see rows committed after its snapshot. Forced on
        # PostgreSQL until the engine is known to default to it (forcing it costs a
        # set-and-reset of the connection on every checkout); SQLite has one writer.
        self._connection_options = _READ_COMMITTED if dialect == "postgresql" else {}
        self._isolation_known = dialect != "postgresql"
        self.recorder = FailureRecorder(self.naming, dialect)
        self.outputs = OutputStatements(self.naming, dialect)
        # Hand-backs that could not be counted in the database (it was down): remembered
        # here while this process lives, so a broker's delivery count does not take them
        # for crashes. A worker that dies after a hand-back forgets them (a crash, then).
        self._unrecorded: OrderedDict[tuple[str, str, str, str], int] = OrderedDict()

    def _bookkeep(self, conn: Connection, op: Op) -> Any:
        """Perform one of the core's bookkeeping operations on ``conn``, in a transaction
        of its own (never the failed attempt's)."""
        faults.at("record", _message_id(op))
        match op:
            case CountRedelivery(delivery=delivery):
                claimed = self.statements.stored_claim(conn, delivery) is not None
                count = self.recorder.count_redelivery(conn, delivery, claimed=claimed)
                extra = self._unrecorded.get(delivery.key, 0)
                if not extra:
                    return count
                return RedeliveryCount(
                    count.redeliveries, count.failures, count.hand_backs + extra, count.claimed
                )
            case CountFailure(delivery=delivery, error=error):
                return self.recorder.count_failure(conn, delivery, error)
            case CountHandBack(delivery=delivery):
                self.recorder.count_hand_back(conn, delivery, "handed back")
                return None
            case LookUpClaim(delivery=delivery, settled=True):
                return self.statements.settled_claim(conn, delivery)
            case LookUpClaim(delivery=delivery):
                return self.statements.stored_claim(conn, delivery)
            case LoadOutputs(delivery=delivery):
                return self.outputs.load(conn, delivery)
            case MarkSent(delivery=delivery, marker=marker):
                return mark_recovered(conn, self.naming, marker, delivery.key, through="send")
            case RecordPoison(delivery=delivery, reason=reason, error=error, attempts=attempts):
                # Outputs that could not be sent: that message's own claim committed, and
                # its row waits for the redrive that sends them.
                applied = reason != OUTPUTS_UNDELIVERABLE and self._applied(conn, delivery)
                return self.recorder.record_poison(
                    conn,
                    delivery,
                    reason_code=reason,
                    error=error,
                    attempts=attempts,
                    applied=applied,
                )
            case QuarantineConflict(delivery=delivery, stored=stored):
                step = RecordConflict(delivery, stored)
                statement, params = self.statements.statement(step)
                return self.statements.result(step, conn.execute(statement, params))
        raise TypeError(f"not a bookkeeping operation: {op!r}")

    def _applied(self, conn: Connection, delivery: Delivery) -> bool:
        """Whether a copy of ``delivery`` with the same payload committed, read where this
        inbox claims (the library's table, the compact one, or both)."""
        stored = self.statements.stored_claim(conn, delivery)
        return stored is not None and compare(stored, delivery) == (Decision.DUPLICATE, True)

    def _unrecorded_hand_back(self, op: Op) -> None:
        if isinstance(op, CountHandBack):
            key = op.delivery.key
            self._unrecorded[key] = self._unrecorded.pop(key, 0) + 1
            while len(self._unrecorded) > _UNRECORDED_MEMORY:
                self._unrecorded.popitem(last=False)

    def _before_commit(self, session: Session, delivery: Delivery | None) -> None:
        """Report the transaction's state to the core, which refuses to commit one ended
        behind the inbox or aborted (`consumption.commit_refusal`): PostgreSQL would
        answer the COMMIT with ROLLBACK and no error, and the message would be acked with
        nothing done."""
        leave_handler(session)
        if delivery is not None:
            faults.at("commit", delivery.identity.message_id)
        refusal = commit_refusal(self._transaction_state(session), delivery)
        if refusal is not None:
            raise refusal
        kept = session.info.pop(OUTPUT_KEY, None)
        if kept is not None:  # the handler's result, written just before the COMMIT
            claim, output = kept
            first_seen = SHADOW_KEY not in session.info  # the handler ran: first seen
            self.outputs.store(session.connection(), claim, output, first_seen=first_seen)

    def _transaction_state(self, session: Session) -> TransactionState:
        """What the claim's transaction is in, right before its COMMIT (on PostgreSQL;
        SQLite's is taken as open): reported, not judged."""
        if self.dialect != "postgresql":
            return TransactionState.OPEN
        # The claim's connection: once the handler ended the transaction, SQLAlchemy has
        # closed it (no transaction: ended); without a claim, the session's own.
        conn = session.info.get(CLAIMED_ON) or session.connection()
        if _ended(conn):
            return TransactionState.ENDED
        # In a transaction the inbox began on asyncpg, the checked COMMIT finds an aborted
        # transaction itself (25P02), with no probe of its own.
        checked = session.info.get(MARKED_KEY) and _owned(conn)
        if not checked and _aborted(conn):
            return TransactionState.ABORTED
        return TransactionState.OPEN

    def _commit(self, session: Session) -> None:
        """COMMIT. The claim's transaction is committed with its check (`commit_checked`),
        in the same round trip: before any ack, the inbox knows that the transaction that
        committed holds the claim, and that it did commit."""
        claimed_on = session.info.pop(CLAIMED_ON, None)
        if session.info.pop(MARKED_KEY, None) and self.dialect == "postgresql":
            # The claim's connection: the state check found its transaction still open.
            connection = claimed_on or session.connection()
            # The session's own commit work first (its last flush, its before_commit hooks,
            # the outbox's refusal of an add that was not awaited): what refuses the commit
            # must refuse it before the COMMIT is sent, not after.
            transaction = session.get_transaction()
            if transaction is not None:
                transaction._prepare_impl()
            commit_checked(connection)
        Session.commit(session)

    def keep_output(self, session: Session, delivery: Delivery, output: Output) -> None:
        """Store ``output`` with ``delivery``'s claim: written in its transaction, right
        before the COMMIT (no round trip of its own from the handler's side)."""
        session.info[OUTPUT_KEY] = (delivery, output)

    def _learn_isolation(self, dialect: Dialect, engine_options: Mapping[str, Any]) -> None:
        """After the first connection: stop forcing READ COMMITTED if it is the default."""
        self._isolation_known = True
        levels = {
            engine_options.get("isolation_level"),
            getattr(dialect, "isolation_level", None),  # create_engine(isolation_level=...)
            getattr(dialect, "_on_connect_isolation_level", None),  # the same, SQLAlchemy 2.1
            dialect.default_isolation_level,
        }
        if levels <= {None, "READ COMMITTED"} and dialect.default_isolation_level:
            self._connection_options = {}

    def _claim(self, session: Session, attempts: Attempts[V]) -> V:
        """Claim in ``session``'s transaction (the same for both executors)."""
        conn = session.connection(execution_options=self._connection_options)
        if not self._isolation_known:
            self._learn_isolation(conn.dialect, conn.engine.get_execution_options())
        if monotonic() >= self._phase_due:
            self._read_phase(conn)
        conn.info.pop(ABORTED, None)
        attempts.clock = perf_counter()
        with tracing.claim(attempts.number) as traced:
            verdict = _drive(attempts.steps(), conn, self.statements, traced.observer)
        attempts.claim_took()
        attempts.bind(session, verdict)
        enter_handler(session, conn)
        faults.at("claim", attempts.delivery.identity.message_id)
        return verdict

    def _read_phase(self, conn: Connection) -> None:
        """Where a worker configured for the compact claim claims now (`claims_phase`),
        from the database's record, read in the claim's transaction at most every
        `PHASE_REFRESH` seconds. A worker that reads it late claims in both tables,
        which every phase accepts."""
        switched, library_rows = conn.execute(phase_record(self.naming)).one()
        phase = claims_phase(self.claims, switched=bool(switched), library_rows=bool(library_rows))
        if phase not in self._phase_statements:
            self._phase_statements[phase] = CompactClaimStatements(
                self.naming, self.lock_timeout, phase
            )
        self.statements = self._phase_statements[phase]
        self._phase_due = monotonic() + PHASE_REFRESH

    @property
    def phase(self) -> ClaimsPhase:
        """Where this inbox claimed last (the library's table until its first claim)."""
        return getattr(self.statements, "phase", ClaimsPhase.LIBRARY)

    def _check_settings(self, settings: DatabaseSettings | None) -> None:
        if settings is None:
            return
        if settings.synchronous_commit == "off":
            raise PrerequisiteError(
                "synchronous_commit is off for this database: a message could be acked and "
                "its effect then lost in a database crash. Set it to on (or local) for the "
                "role or database the inbox uses."
            )
        for warning in settings.replication_warnings():
            logger.warning(warning)


class Attempts(Generic[V]):
    """Counts one delivery's attempts and decides what a failed one leads to."""

    def __init__(self, delivery: Delivery, retries: int) -> None:
        self.delivery = delivery
        self.retries = retries
        self.number = 0
        self.claimed = False
        self.in_handler = False
        self.clock = 0.0  # perf_counter() when the claim, then the commit, started

    def start(self) -> None:
        self.number += 1
        self.claimed = False
        self.in_handler = False

    def retry_now(self, exc: BaseException) -> bool:
        """True to run the transaction again at once; else raise the library's error.

        Returns False for an error that is the handler's own, which the caller re-raises.
        """
        failure = classify(exc, from_handler=self.in_handler)
        consumer = self.delivery.consumer
        if failure is Failure.SERIALIZATION and self.number <= self.retries:
            metrics.transaction_retry(consumer)
            log_event(
                logging.INFO,
                "retrying",
                self.delivery,
                "retrying after a serialization failure",
                attempt=self.number,
            )
            return True
        mapped = transient_error(exc, failure, self.delivery, claimed=self.claimed)
        if isinstance(mapped, ClaimInProgress):
            # The claim waited lock_timeout on a concurrent delivery: the longest lock
            # waits are these, so they belong in the claim histogram too.
            metrics.claim_seconds(consumer, perf_counter() - self.clock)
            metrics.claim_in_progress(consumer)
        if mapped is not None:
            raise mapped from exc
        return False

    def steps(self) -> Generator[Step, Any, V]:
        raise NotImplementedError

    def bind(self, session: Session, verdict: V) -> None:
        """Make the claim visible to the handler's session (`current_delivery`)."""

    def claim_took(self) -> None:
        """Record the claim's duration, from ``clock``; ``clock`` then times the commit."""
        now = perf_counter()
        metrics.claim_seconds(self.delivery.consumer, now - self.clock)
        self.clock = now

    def committed(self, verdict: V) -> None:
        """Record and log the commit (``clock`` was set just before it)."""


class SingleAttempts(Attempts[Verdict]):
    def steps(self) -> Generator[Step, Any, Verdict]:
        verdict = yield from claim_steps(self.delivery)
        self.claimed = True
        _log_verdict(self.delivery, verdict)
        return verdict

    def bind(self, session: Session, verdict: Verdict) -> None:
        session.info[DELIVERY_KEY] = self.delivery
        session.info[MARKED_KEY] = True
        if verdict.shadow:
            session.info[SHADOW_KEY] = verdict

    def committed(self, verdict: Verdict) -> None:
        delivery = self.delivery
        metrics.commit_seconds(delivery.consumer, perf_counter() - self.clock)
        metrics.decision(
            delivery.consumer, delivery.identity.producer, verdict.decision, verdict.shadow
        )
        log_event(logging.DEBUG, "committed", delivery, decision=verdict.decision)


class BatchAttempts(Attempts[tuple[Verdict, ...]]):
    """A batch's attempts; errors and retries are reported under its first delivery."""

    def __init__(self, deliveries: Sequence[Delivery], retries: int) -> None:
        if not deliveries:
            raise ValueError("a batch needs at least one delivery")
        super().__init__(deliveries[0], retries)
        self.deliveries = tuple(deliveries)

    def steps(self) -> Generator[Step, Any, tuple[Verdict, ...]]:
        verdicts = yield from claim_batch_steps(self.deliveries)
        self.claimed = True
        for delivery, verdict in zip(self.deliveries, verdicts, strict=True):
            _log_verdict(delivery, verdict)
        return verdicts

    def bind(self, session: Session, verdict: tuple[Verdict, ...]) -> None:
        session.info[BATCH_KEY] = self.deliveries
        session.info[MARKED_KEY] = True

    def committed(self, verdict: tuple[Verdict, ...]) -> None:
        metrics.commit_seconds(self.delivery.consumer, perf_counter() - self.clock)
        for delivery, decided in zip(self.deliveries, verdict, strict=True):
            metrics.decision(
                delivery.consumer, delivery.identity.producer, decided.decision, decided.shadow
            )
        log_event(logging.DEBUG, "committed", self.delivery, batch=len(self.deliveries))


def any_first_seen(verdicts: Sequence[Verdict]) -> bool:
    """Whether the batch's handler runs: a delivery first seen, or any in shadow mode."""
    return any(verdict.runs_handler for verdict in verdicts)


def _drive(
    steps: Generator[Step, Any, V],
    conn: Connection,
    statements: ClaimStatements,
    observer: Observer | None,
) -> V:
    """Perform the claim protocol's steps on ``conn``, through the one trampoline."""
    dbapi, direct = driver_path(conn, statements)

    def perform(step: Step) -> Any:
        statement, params = statements.statement(step)
        compiled = direct.get(type(step))
        if compiled is not None:
            return on_driver(conn, dbapi, compiled, step, params)
        if isinstance(step, ClaimBatch):
            begin_owned(conn, dbapi)  # asyncpg: the inbox begins it, to commit it checked
        return statements.result(step, conn.execute(statement, params))

    return drive(steps, perform, observer)


ABORTED = "inbox_middleware.aborted"
"""Set in a connection's info when a statement failed in its transaction."""
IN_HANDLER = "inbox_middleware.in_handler"
"""Set in a connection's info while a handler runs in its claim's transaction."""
# A statement that ends the transaction, after any comments: not ROLLBACK TO (a savepoint).
_TRANSACTION_CONTROL = re.compile(
    r"(?:\s|--[^\n]*(?:\n|$)|/\*.*?\*/)*"
    r"(?:COMMIT|END|ABORT|PREPARE\s+TRANSACTION"
    r"|ROLLBACK(?!\s+(?:(?:WORK|TRANSACTION)\s+)?TO\b))\b",
    re.IGNORECASE | re.DOTALL,
)
_IN_FAILED_TRANSACTION = "25P02"
# libpq's PQtransactionStatus: psycopg.pq.TransactionStatus.IDLE and INERROR.
_PQ_IDLE = 0
_PQ_INERROR = 3
_UNRECORDED_MEMORY = REMEMBERED_MESSAGES


PHASE_REFRESH = 5.0
"""Seconds a worker configured for the compact claim goes on claiming where it last read
it should (`Executor._read_phase`)."""


def _claims_table(claims: str, dialect: str) -> ClaimsTable:
    try:
        table = ClaimsTable(claims)
    except ValueError:
        raise ConfigurationError(f"claims must be 'library' or 'compact', not {claims!r}") from None
    if table is ClaimsTable.COMPACT and dialect != "postgresql":
        raise ConfigurationError(
            "the compact claim is for PostgreSQL; an embedded SQLite inbox claims in the "
            "library's table (claims='library')"
        )
    return table


def _message_id(op: Op) -> str | None:
    delivery = getattr(op, "delivery", None)
    return delivery.identity.message_id if isinstance(delivery, Delivery) else None


def _aborted(conn: Connection) -> bool:
    """Whether the session's transaction is in the failed state (25P02 on any statement).

    psycopg reads libpq's own state, with no round trip. asyncpg keeps its state private,
    so `track_aborts` records, from the statement errors SQLAlchemy sees, that the
    transaction may be aborted; a savepoint the handler rolled back to in plain SQL
    (``ROLLBACK TO SAVEPOINT x``, which SQLAlchemy does not see) may have healed it since.
    Only then is the server asked, with one statement that fails in an aborted
    transaction (25P02) and does nothing in a healthy one.
    """
    if conn.dialect.driver == "psycopg":
        pgconn = conn.connection.dbapi_connection.pgconn  # type: ignore[union-attr]
        return bool(pgconn.transaction_status == _PQ_INERROR)
    if not conn.info.get(ABORTED):
        return False
    try:
        conn.exec_driver_sql(TRANSACTION_PROBE)
    except DBAPIError as exc:
        if sqlstate(exc) != _IN_FAILED_TRANSACTION:
            raise  # the connection's own trouble (lost, cancelled): the attempt fails with it
        return True
    conn.info.pop(ABORTED, None)
    return False


def _owned(conn: Connection) -> bool:
    """Whether the inbox began the connection's transaction on asyncpg (and commits it)."""
    adapter = conn.connection.dbapi_connection
    return isinstance(getattr(adapter, "_transaction", None), InboxTransaction)


def _ended(conn: Connection) -> bool:
    """Whether the transaction ended behind the inbox: the connection's ``rollback()``
    (SQLAlchemy's transaction is inactive), or a ``ROLLBACK`` or ``COMMIT`` sent on the
    driver's own connection or among several statements in one, with nothing after it
    (psycopg reads libpq's state, idle: no transaction, with no round trip; on asyncpg,
    which runs one statement a string, the checked COMMIT finds the first). The other
    ways are refused as they happen (`guard_transaction`)."""
    transaction = conn.get_transaction()
    if transaction is None or not transaction.is_active:
        return True
    if conn.dialect.driver != "psycopg":
        return False
    pgconn = conn.connection.dbapi_connection.pgconn  # type: ignore[union-attr]
    return bool(pgconn.transaction_status == _PQ_IDLE)


def enter_handler(session: Session, conn: Connection) -> None:
    """From now until `leave_handler`, ending ``conn``'s transaction is refused."""
    info = conn.info
    info[IN_HANDLER] = True
    session.info[IN_HANDLER] = info
    session.info[CLAIMED_ON] = conn


def interrupted(delivery: Delivery, *, committing: bool) -> InboxInterrupted:
    """The error of an attempt interrupted outside its handler (its ``cause`` is the
    interruption), reported to the core as what it is: once the COMMIT was on its way,
    `CommitUnanswered` (whether the claim committed is unknown); before, `InboxInterrupted`
    (rolled back: the connection is invalidated)."""
    identity = delivery.identity
    where = "the COMMIT of the claim" if committing else "the inbox's work on the claim"
    error = CommitUnanswered if committing else InboxInterrupted
    return error(
        f"interrupted during {where} of {identity.message_id!r}"
        + (": whether it committed is unknown" if committing else ""),
        consumer=delivery.consumer,
        producer=identity.producer,
        message_id=identity.message_id,
    )


def leave_handler(session: Session) -> None:
    """The inbox itself ends the transaction now (its commit or its rollback)."""
    info = session.info.pop(IN_HANDLER, None)
    if isinstance(info, dict):
        info.pop(IN_HANDLER, None)


def guard_transaction(engine: Engine) -> None:
    """While a handler runs, refuse whatever would end the claim's transaction behind
    the inbox: the connection's own ``commit()``, and a statement that ends the
    transaction (``COMMIT``, ``ROLLBACK``, ``END``, ``ABORT``, ``PREPARE TRANSACTION``;
    ``ROLLBACK TO SAVEPOINT`` is fine), refused before it is sent. Nothing of it reaches
    the server, so the attempt rolls back whole. A transaction found closed before a
    statement (ended on the driver's own connection, or by one of several statements in
    one string) is refused there too, before the driver would begin a new one for it; one
    found closed at the commit is refused then (`_ended`).

    The connection's ``rollback()`` (also that of a session bound to it with
    ``join_transaction_mode="rollback_only"``) is not refused as it happens, because
    SQLAlchemy rolls back the same way itself when a statement is interrupted: it leaves
    the transaction inactive, which the commit refuses (`_ended`).

    The guard is on the engine's dialect, not on its connections: a connection event makes
    SQLAlchemy build a dispatcher for each connection it checks out and consult it at each
    of its steps, which every use of the engine would pay, the inbox's or not (about 30 µs
    a transaction). Dialect events see each statement; SQLAlchemy has none for the commit,
    so the dialect's ``do_commit`` is wrapped.
    """
    dialect = engine.dialect
    if isinstance(dialect.do_commit, _RefusingCommit):
        return
    for name in ("do_execute", "do_execute_no_params", "do_executemany"):
        event.listen(engine, name, _refuse_control, insert=True)
    dialect.do_commit = _RefusingCommit(dialect.do_commit)  # type: ignore[method-assign]


def _refuse_control(cursor: Any, statement: str, *rest: Any) -> bool:
    """Before a statement runs in a handler (as a dialect event, whose last argument is
    the execution context): raise if it would end the transaction, or if the transaction
    already ended. Returns False: SQLAlchemy then runs the statement as usual."""
    try:
        info = rest[-1].root_connection.info
    except NotImplementedError:  # the dialect's first look at the server: no pool record
        return False
    if not info.get(IN_HANDLER):
        return False
    if _TRANSACTION_CONTROL.match(statement):
        raise HandlerTransactionError(
            f"the handler ran {statement.strip()[:40]!r}, which would end the inbox's "
            "transaction; the inbox commits when the handler returns (raise an exception to "
            "abandon the message, use SAVEPOINT or session.begin_nested() for part of it)"
        )
    if _idle(cursor):  # the driver would begin a new transaction for this statement
        raise HandlerTransactionError(_ENDED_BEHIND)
    return False


def _idle(cursor: Any) -> bool:
    """No transaction open on the cursor's connection, as the driver reports it with no
    round trip: psycopg (libpq's status), and asyncpg in a transaction the inbox began (its
    protocol's status; in SQLAlchemy's own, the adapter would begin one for the statement).
    Other drivers: False (they do not say)."""
    # psycopg: libpq's status as a number (its ConnectionInfo builds an enum member).
    pgconn = getattr(getattr(cursor, "connection", None), "pgconn", None)
    if pgconn is not None:
        return bool(pgconn.transaction_status == _PQ_IDLE)
    adapter = getattr(cursor, "_adapt_connection", None)
    if isinstance(getattr(adapter, "_transaction", None), InboxTransaction):
        return not adapter._connection.is_in_transaction()  # type: ignore[union-attr]
    return False


_ENDED_BEHIND = (
    "the inbox's transaction was ended behind it (a COMMIT or ROLLBACK on the driver's own "
    "connection, or among several statements in one): what ran before it was committed or "
    "rolled back apart from the claim's outcome. Raise an exception to abandon the message"
)


class _RefusingCommit:
    """The dialect's ``do_commit``, refusing the connection's own ``commit()`` while a
    handler runs on it (SQLAlchemy passes the pooled connection, whose ``info`` is the
    `Connection`'s)."""

    __slots__ = ("_commit",)

    def __init__(self, commit: Any) -> None:
        self._commit = commit

    def __call__(self, dbapi_connection: Any) -> None:
        info = getattr(dbapi_connection, "info", None)
        if info is not None and info.get(IN_HANDLER):
            raise HandlerTransactionError(
                "the handler called commit() on the inbox's connection; the inbox commits "
                "when the handler returns"
            )
        self._commit(dbapi_connection)


def track_aborts(engine: Engine) -> None:
    """Record, per connection, that a statement failed on the server (which aborts the
    transaction) until a savepoint is rolled back to (which heals it). On the dialect, as
    `guard_transaction` says why: its error event, and its ``do_rollback_to_savepoint``
    wrapped."""
    dialect = engine.dialect
    if isinstance(dialect.do_rollback_to_savepoint, _HealingRollback):
        return
    event.listen(engine, "handle_error", _statement_failed)
    dialect.do_rollback_to_savepoint = _HealingRollback(  # type: ignore[method-assign]
        dialect.do_rollback_to_savepoint
    )


def _statement_failed(context: Any) -> None:
    conn = context.connection
    if conn is not None and sqlstate(context.sqlalchemy_exception) is not None:
        conn.info[ABORTED] = True


class _HealingRollback:
    """The dialect's ``do_rollback_to_savepoint``: the transaction is healthy again."""

    __slots__ = ("_rollback",)

    def __init__(self, rollback: Any) -> None:
        self._rollback = rollback

    def __call__(self, connection: Connection, name: str) -> None:
        self._rollback(connection, name)
        connection.info.pop(ABORTED, None)


@dataclass(frozen=True)
class DatabaseSettings:
    """What the start-up check reads of the server: the durability of a commit."""

    synchronous_commit: str
    synchronous_standby_names: str
    standbys: int
    """Standbys streaming from this server now (``pg_stat_replication``)."""

    def replication_warnings(self) -> list[str]:
        """What a failover to a standby could lose, in words (none: nothing)."""
        warnings = []
        if self.standbys and not self.synchronous_standby_names.strip():
            warnings.append(
                f"this server streams its WAL to {self.standbys} standby(s) asynchronously "
                "(synchronous_standby_names is empty): a failover to one of them loses the "
                "effects committed here and not yet replicated, whose messages were already "
                "acknowledged. Name the standbys in synchronous_standby_names to make a "
                "commit wait for them (docs: Run several workers and dispatchers)."
            )
        replicated = self.standbys or self.synchronous_standby_names.strip()
        if self.synchronous_commit == "local" and replicated:
            warnings.append(
                "synchronous_commit is local for this database: a commit does not wait for "
                "the standbys, so a failover loses the effects committed here and not yet "
                "replicated, whose messages were already acknowledged. Set it to on for the "
                "role or database the inbox uses."
            )
        return warnings


def database_settings(conn: Connection) -> DatabaseSettings | None:
    """The server's commit durability settings; None on another database than PostgreSQL."""
    if conn.dialect.name != "postgresql":
        return None
    row = conn.execute(
        text(
            "SELECT current_setting('synchronous_commit'), "
            "current_setting('synchronous_standby_names'), "
            "(SELECT count(*) FROM pg_stat_replication)"
        )
    ).one()
    return DatabaseSettings(str(row[0]), str(row[1]), int(row[2]))


def _log_verdict(delivery: Delivery, verdict: Verdict) -> None:
    decision = verdict.decision
    if decision is Decision.FIRST:
        log_event(logging.DEBUG, "claimed", delivery, decision=decision)
        return
    if not logger.isEnabledFor(logging.INFO if decision is Decision.DUPLICATE else logging.WARNING):
        return
    stored = verdict.stored
    fields: dict[str, object] = {
        "decision": decision,
        "shadow": verdict.shadow,
        "payload_sha256": delivery.payload_hash.sha256,
        "stored_sha256": stored.payload_sha256 if stored else None,
        "claimed_at": stored.processed_at.isoformat() if stored and stored.processed_at else None,
    }
    # Shadow mode: the same record as when enforcing, saying the handler runs anyway.
    shadow = " (shadow mode: processed anyway)" if verdict.shadow else ""
    if decision is Decision.DUPLICATE:
        note = "" if verdict.verified else " (stored hash scheme unknown, payload not compared)"
        text = ("duplicate delivery" if shadow else "duplicate delivery skipped") + note + shadow
        log_event(logging.INFO, "duplicate", delivery, text, verified=verdict.verified, **fields)
    else:
        if verdict.quarantine is not None:
            fields["quarantine_id"] = verdict.quarantine.id
        text = "identity conflict: same message id, different payload" + shadow
        log_event(logging.WARNING, "conflict", delivery, text, **fields)


def log_event(
    level: int, event: str, delivery: Delivery, text: str | None = None, **fields: object
) -> None:
    """One structured line: ``inbox_event`` (a stable code), the identity, ``fields``.

    Every field is in the record's ``extra`` under an ``inbox_`` name, so a JSON formatter
    (or any handler reading record attributes) gets them as values, not only as text.
    """
    if not logger.isEnabledFor(level):
        return
    extra: dict[str, object] = {
        "inbox_event": event,
        "inbox_consumer": delivery.consumer,
        "inbox_producer": delivery.identity.producer,
        "inbox_tenant": delivery.identity.tenant,
        "inbox_message_id": delivery.identity.message_id,
    }
    extra |= {f"inbox_{name}": value for name, value in fields.items()}
    logger.log(
        level,
        "%s: consumer=%s producer=%s message_id=%s",
        text or event,
        delivery.consumer,
        delivery.identity.producer,
        delivery.identity.message_id,
        extra=extra,
    )
