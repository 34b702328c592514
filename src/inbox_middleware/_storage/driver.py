"""The claim and its look-up sent straight to the driver, the claim with the BEGIN of its
transaction in one round trip (psycopg and asyncpg), and the COMMIT checked in one round
trip (`commit_checked`).

SQLAlchemy's execution work costs more CPU than these statements themselves, so with
psycopg and asyncpg they go to the DBAPI connection, compiled once (`driver_path`); other
drivers, and every other statement, take SQLAlchemy's ordinary path.

psycopg opens a transaction lazily: before the first statement of a transaction it sends
a BEGIN, and waits for its answer, a round trip of its own. The claim is the first
statement of every inbox transaction, so `claim_with_begin` sends the two in one
simple-protocol message, ``BEGIN ISOLATION LEVEL ...; INSERT ...``, the claim's values
written as literals escaped by libpq (``PQescapeLiteral``, the escaping libpq documents for
values put into a command's text), and waits once. The server runs the two as it would
have run them apart, and the transaction they open is the one psycopg then uses: psycopg
reads libpq's transaction status, sees it open, sends no BEGIN of its own, and commits or
rolls it back as usual. On the benchmark machine it saves a message about 60 µs of worker
CPU and 70 µs of latency (``python -m bench.hotpath``).

The claim itself goes as ``EXECUTE`` of a statement prepared once on the connection's
server session (``BEGIN ...; EXECUTE inbox_claim_...('...', ...)``), so that the server
does not parse and plan the whole claim at every message; where the session does not have
it (a transaction pooler such as PgBouncer in transaction mode hands out another one),
the claim goes as text instead (see "the claim prepared on the server" below).

The single round trip is taken only where it is the same transaction psycopg would have
opened: a connection not in autocommit, with no transaction open yet, and values of the
types the claim has (text, timestamps, NULL). Anything else takes the cursor.
"""

from __future__ import annotations

import datetime
import functools
import re
from collections.abc import Iterable
from itertools import chain
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection
from sqlalchemy.util import await_

from .._core.exceptions import ClaimNotCommitted, TransactionAborted
from .._core.protocol import Claim, Step
from .errors import from_driver
from .statements import CHECKED_COMMIT, CLAIM_ENDED, ClaimStatements, DriverStatement, begin_command

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["InboxTransaction", "begin_owned", "commit_checked", "driver_path", "on_driver"]

_DIRECT_DRIVERS = frozenset({"psycopg", "asyncpg"})


def driver_path(
    conn: Connection, statements: ClaimStatements
) -> tuple[Any, Mapping[type[Any], DriverStatement]]:
    """The DBAPI connection and the steps it runs directly (the claim and the look-up,
    compiled), or none: a driver other than psycopg and asyncpg."""
    if conn.dialect.driver not in _DIRECT_DRIVERS:
        return None, {}
    return conn.connection.dbapi_connection, statements.driver_sql(conn.dialect)


def on_driver(
    conn: Connection, dbapi: Any, compiled: DriverStatement, step: Step, params: dict[str, Any]
) -> object:
    """Run one step's statement on the DBAPI connection: what its first row means."""
    args = compiled.parameters(params)
    try:
        if isinstance(step, Claim) and conn.dialect.driver == "psycopg":
            found = claim_with_begin(dbapi, compiled, args, conn.info)
            if found is not None:
                return ClaimStatements.answer(step, found or None)
        elif isinstance(step, Claim):
            inserted = claim_with_begin_asyncpg(dbapi, compiled, args, conn.info)
            if inserted is not None:
                return inserted
        cursor = dbapi.cursor()
        try:
            cursor.execute(compiled.sql, args)
            row = cursor.fetchone()
        finally:
            cursor.close()
    except conn.dialect.loaded_dbapi.Error as exc:
        raise from_driver(exc, conn, dbapi, compiled.sql, args) from exc
    return ClaimStatements.answer(step, None if row is None else tuple(row))


def claim_with_begin(
    dbapi: Any,
    compiled: DriverStatement,
    args: dict[str, Any],
    prepared: dict[str, Any] | None = None,
) -> Any:
    """Open the transaction and claim in one round trip on a psycopg connection: the
    claim's row (``()`` when it returned none), or None when this connection or these
    values must take the ordinary path (nothing was sent then). With ``prepared`` (the
    connection's info), the claim runs as the server's prepared statement (`_execute`)."""
    pgconn = dbapi.pgconn
    if dbapi.autocommit or pgconn.transaction_status != _IDLE:
        return None
    begin = begin_command(dbapi.isolation_level, dbapi.read_only, dbapi.deferrable)
    command = None if prepared is None else _execute(pgconn, compiled, args, prepared)
    if command is not None:
        assert prepared is not None
        result = pgconn.exec_(begin + b"; " + command)
        if result.status == _FATAL_ERROR and _not_prepared_here(result):
            pgconn.exec_(b"ROLLBACK")  # the BEGIN ran: end its failed transaction
            _missed(prepared, compiled.prepared.name)
            command = None
        elif FRESH in prepared:
            del prepared[FRESH]  # found where it was prepared: no pooler between
    if command is None:
        command = _claim_text(pgconn, compiled, args) or _escaped(dbapi, compiled, args)
        if command is None:
            return None
        result = pgconn.exec_(begin + b"; " + command)
    if result.status != _TUPLES_OK:
        raise _psycopg().errors.error_from_result(result, encoding=dbapi.info.encoding)
    if not result.ntuples:
        return ()
    return tuple(result.get_value(0, column) for column in range(result.nfields))


def _escaped(dbapi: Any, compiled: DriverStatement, args: dict[str, Any]) -> bytes | None:
    """The claim with its values escaped by libpq (another encoding, or text no plain
    literal holds), or None for a value of another type."""
    escaping = _psycopg().pq.Escaping(dbapi.pgconn)
    literals = _literals(escaping, args, dbapi.info.encoding)
    return None if literals is None else compiled.sql_bytes % literals


# -- the claim prepared on the server ---------------------------------------------------------
#
# Sent as text, the claim is parsed, analysed and planned by the server at every message:
# on the benchmark machine about 100 µs of the server's time, which a consumer that
# handles one message after another waits for. Prepared once on the connection's server
# session (`PreparedForm`), it is sent as ``BEGIN ...; EXECUTE name('...', ...)``, still
# one round trip, and runs with the plan the server kept.
#
# Where the server session lacks the statement, the EXECUTE fails (26000) before the
# claim ran: the transaction is rolled back and the claim sent again as text. Two causes:
# - the session lost it: a DEALLOCATE ALL, which psycopg sends itself after a rollback on
#   a connection where it prepared statements of its own. The next claim prepares it again.
# - a transaction pooler (PgBouncer in transaction mode) gives each transaction whichever
#   server session is free, so the EXECUTE right after this connection's PREPARE already
#   found none: the connection sends the claim as text from then on. A pooler that
#   prepares statements for its clients (PgBouncer's ``max_prepared_statements``) does so
#   for the protocol's own, not for PREPARE, so it ends the same way.

PREPARED = "inbox_middleware.prepared"
"""In a connection's info (kept as long as its DBAPI connection): the names of the claim
statements prepared on its server session, or False when a prepared claim was not found
right after its PREPARE (a pooler): the claim goes as text on it from then on."""
FRESH = "inbox_middleware.prepared_fresh"
"""In a connection's info: the claim statement it prepared last, until an EXECUTE of it
runs (and shows the session kept it)."""
_NOT_PREPARED = "26000"  # invalid_sql_statement_name: no prepared statement of that name
_ALREADY_PREPARED = "42P05"  # duplicate_prepared_statement


def _execute(
    pgconn: Any, compiled: DriverStatement, args: dict[str, Any], prepared: dict[str, Any]
) -> bytes | None:
    """The claim as an EXECUTE of its prepared statement, prepared first when this
    connection has not yet (a round trip, once); None when it goes as text."""
    names = prepared.get(PREPARED)
    form = compiled.prepared
    if names is False or form.names is None or not _plain_literals(pgconn):
        return None
    if (names is None or form.name not in names) and not _prepared_now(
        prepared, form.name, _prepare(pgconn, form.prepare)
    ):
        return None
    quoted = _quoted([args[name] for name in form.names])
    if quoted is None:
        return None
    try:
        return f"EXECUTE {form.name}({', '.join(quoted)})".encode()
    except UnicodeEncodeError:
        return None


def _prepare(pgconn: Any, command: str) -> bool:
    """PREPARE on the connection's server session, outside any transaction: whether the
    statement is prepared there now (by this call, or before it under the same name)."""
    result = pgconn.exec_(command.encode())
    if result.status != _FATAL_ERROR:
        return True
    return bool(result.error_field(_SQLSTATE) == _ALREADY_PREPARED.encode())


def _prepared_now(prepared: dict[str, Any], name: str, done: bool) -> bool:
    """Record a PREPARE of ``name`` on the connection: prepared (and fresh, until an
    EXECUTE runs it), or not (the claim goes as text on it from then on). Returns
    ``done``."""
    if done:
        prepared[PREPARED] = (prepared.get(PREPARED) or frozenset()) | {name}
        prepared[FRESH] = name
    else:
        prepared[PREPARED] = False
    return done


def _missed(prepared: dict[str, Any], name: str) -> None:
    """An EXECUTE of ``name`` found no such statement in the server session: prepare it
    again at the next claim, unless it was the first EXECUTE after this connection's own
    PREPARE (a pooler: text from then on)."""
    if prepared.pop(FRESH, None) == name:
        prepared[PREPARED] = False
    else:
        prepared[PREPARED] = prepared[PREPARED] - {name}


def _not_prepared_here(result: Any) -> bool:
    return bool(result.error_field(_SQLSTATE) == _NOT_PREPARED.encode())


def _plain_literals(pgconn: Any) -> bool:
    """Whether `_quote`'s literals are the ones libpq would write: a UTF-8 connection with
    standard_conforming_strings on (a backslash is then no escape)."""
    return bool(
        pgconn.parameter_status(b"client_encoding") == b"UTF8"
        and pgconn.parameter_status(b"standard_conforming_strings") == b"on"
    )


def _claim_text(pgconn: Any, compiled: DriverStatement, args: dict[str, Any]) -> bytes | None:
    """The claim with its values as plain literals (`_quote`), encoded, where they are
    the literals libpq would write (`_plain_literals`). None otherwise, or for a value of
    another type."""
    if not _plain_literals(pgconn):
        return None
    quoted = _quoted(args.values())
    if quoted is None:
        return None
    try:
        return (compiled.sql % dict(zip(args, quoted, strict=True))).encode()
    except UnicodeEncodeError:  # a lone surrogate: the cursor raises psycopg's own error
        return None


def _literals(escaping: Any, args: dict[str, Any], encoding: str) -> dict[bytes, bytes] | None:
    """The values as SQL literals escaped by libpq, or None for a value of another type,
    or text the connection's encoding cannot hold (the cursor then raises psycopg's own
    error)."""
    literals: dict[bytes, bytes] = {}
    try:
        for name, value in args.items():
            if value is None:
                literal = b"NULL"
            elif isinstance(value, str):
                literal = escaping.escape_literal(value.encode(encoding))
            elif isinstance(value, datetime.datetime):
                literal = escaping.escape_literal(value.isoformat().encode())
            else:
                return None
            literals[name.encode()] = literal
    except UnicodeEncodeError:
        return None
    return literals


@functools.cache
def _psycopg() -> Any:
    """psycopg's modules, imported at the first claim (not with this module: asyncpg
    installations need not have psycopg)."""
    import psycopg

    return psycopg


# libpq's codes (psycopg.pq.TransactionStatus.IDLE, ExecStatus.TUPLES_OK, FATAL_ERROR),
# compared as plain numbers on the hot path.
_IDLE = 0
_TUPLES_OK = 2
_FATAL_ERROR = 7
_SQLSTATE = ord("C")  # psycopg.pq.DiagnosticField.SQLSTATE


# -- asyncpg: the inbox owns BEGIN and COMMIT ------------------------------------------------
#
# SQLAlchemy's asyncpg adapter begins a transaction with asyncpg's ``transaction()``
# (its own round trip) before the first statement, and refuses one it did not start. The
# inbox takes its place: it sends ``BEGIN ...; INSERT ...`` as one simple-protocol message
# (the values as literals), whose status, ``INSERT 0 1`` or ``INSERT 0 0``, is the claim's
# answer, and hands the adapter an `InboxTransaction` where it keeps asyncpg's: the
# session's statements then run in that transaction, and its commit and rollback go
# through the inbox. The inbox commits with `CHECKED_COMMIT`, reading COMMIT's reply.


class InboxTransaction:
    """The claim's transaction on an asyncpg connection, as the adapter holds it."""

    __slots__ = ("connection", "done")

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.done = False

    async def commit(self) -> None:
        """SQLAlchemy's commit after the inbox's own (done); else a plain COMMIT."""
        if not self.done and self.connection.is_in_transaction():
            await self.connection.execute("COMMIT")
        self.done = True

    async def rollback(self) -> None:
        self.done = True
        if self.connection.is_in_transaction():  # not when it ended behind the inbox
            await self.connection.execute("ROLLBACK")


def claim_with_begin_asyncpg(
    adapter: Any,
    compiled: DriverStatement,
    args: list[Any],
    prepared: dict[str, Any] | None = None,
) -> Any:
    """Open the transaction and claim in one round trip on an asyncpg connection: whether
    the claim inserted its row. None when these values must take the parameters' path (a
    connection without standard_conforming_strings, a value no literal is written for):
    the inbox then sends its BEGIN alone, and the cursor the claim, in its transaction.
    None, with nothing sent, when a transaction is open already or in autocommit. With
    ``prepared`` (the connection's info), the claim runs as the server's prepared
    statement (see `_execute`)."""
    driver = adapter._connection
    if adapter._transaction is not None or adapter.autocommit or driver.is_in_transaction():
        return None
    begin = _begin_asyncpg(adapter.isolation_level, adapter.readonly, adapter.deferrable)
    sql = None if prepared is None else _execute_asyncpg(adapter, compiled, args, prepared)
    adapter._transaction = InboxTransaction(driver)
    try:
        if sql is not None:
            assert prepared is not None
            try:
                status = await_(driver.execute(begin + sql))
            except Exception as error:
                if _sqlstate(error) != _NOT_PREPARED:
                    raise
                await_(driver.execute("ROLLBACK"))  # the BEGIN ran: end its transaction
                _missed(prepared, compiled.prepared.name)
            else:
                if FRESH in prepared:
                    del prepared[FRESH]  # found where it was prepared: no pooler between
                return status == "INSERT 0 1"
        sql = _claim_sql(driver, compiled, args)
        status = await_(driver.execute(begin + sql if sql is not None else begin))
    except Exception as error:
        adapter._handle_exception(error)  # SQLAlchemy's DBAPI error, as from a cursor
    return None if sql is None else status == "INSERT 0 1"


def _execute_asyncpg(
    adapter: Any, compiled: DriverStatement, args: list[Any], prepared: dict[str, Any]
) -> str | None:
    """`_execute` on asyncpg: the claim as an EXECUTE of its prepared statement."""
    driver = adapter._connection
    names = prepared.get(PREPARED)
    form = compiled.prepared
    if names is False or driver.get_settings().standard_conforming_strings != "on":
        return None
    if (names is None or form.name not in names) and not _prepared_now(
        prepared, form.name, _prepare_asyncpg(adapter, form.prepare)
    ):
        return None
    quoted = _quoted(args)
    if quoted is None:
        return None
    return f"EXECUTE {form.name}({', '.join(quoted)})"


def _prepare_asyncpg(adapter: Any, command: str) -> bool:
    """`_prepare` on asyncpg: whether the statement is prepared on the session now."""
    try:
        await_(adapter._connection.execute(command))
    except Exception as error:
        if _sqlstate(error) is None:
            adapter._handle_exception(error)  # the connection's trouble, not PREPARE's
        return _sqlstate(error) == _ALREADY_PREPARED
    return True


def _sqlstate(error: BaseException) -> str | None:
    """The SQLSTATE of an error asyncpg raised for the server's answer, else None."""
    return getattr(error, "sqlstate", None)


def begin_owned(conn: Connection, adapter: Any) -> None:
    """On asyncpg, send the BEGIN of a transaction the inbox then commits (a batch claim,
    sent with parameters next): the round trip SQLAlchemy's adapter would have made."""
    if conn.dialect.driver != "asyncpg":
        return
    driver = adapter._connection
    if adapter._transaction is not None or adapter.autocommit or driver.is_in_transaction():
        return
    adapter._transaction = InboxTransaction(driver)
    try:
        await_(
            driver.execute(
                _begin_asyncpg(adapter.isolation_level, adapter.readonly, adapter.deferrable)
            )
        )
    except Exception as error:
        try:
            adapter._handle_exception(error)
        except conn.dialect.loaded_dbapi.Error as mapped:
            raise from_driver(mapped, conn, adapter, "BEGIN", ()) from error


def _claim_sql(driver: Any, compiled: DriverStatement, args: list[Any]) -> str | None:
    """The claim with its values as literals, or None when they cannot be written so."""
    if driver.get_settings().standard_conforming_strings != "on":
        return None  # a backslash in a literal would be an escape
    parts, positions = _template(compiled.sql)
    quoted = _quoted([args[position] for position in positions])
    if quoted is None:
        return None
    return "".join(chain.from_iterable(zip(parts, quoted, strict=False))) + parts[-1]


@functools.cache
def _begin_asyncpg(isolation_level: str | None, readonly: bool, deferrable: bool) -> str:
    """The BEGIN asyncpg's ``transaction()`` sends for the adapter's characteristics, and
    the separator before the claim."""
    begin = "BEGIN"
    if isolation_level is not None:
        begin += " ISOLATION LEVEL " + isolation_level.replace("_", " ").upper()
    if readonly:
        begin += " READ ONLY"
    if deferrable:
        begin += " DEFERRABLE"
    return begin + "; "


def _quoted(values: Iterable[Any]) -> list[str] | None:
    """Each value as a SQL literal (`_quote`), or None when one cannot be written so."""
    literals = [
        # most values are text: quoted inline, without a call
        "'" + value.replace("'", "''") + "'"
        if value.__class__ is str and "\x00" not in value
        else _quote(value)
        for value in values
    ]
    return None if None in literals else literals  # type: ignore[return-value]


def _quote(value: Any) -> str | None:
    """A SQL literal under standard_conforming_strings (a quote doubled, nothing else
    special), or None for a type the claim does not have or text PostgreSQL refuses."""
    if value.__class__ is not str:
        if value is None:
            return "NULL"
        if not isinstance(value, datetime.datetime):
            return None
        value = value.isoformat()
    if "\x00" in value:
        return None
    return "'" + str(value).replace("'", "''") + "'"


_PLACEHOLDER = re.compile(r"\$(\d+)")


@functools.cache
def _template(sql: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``sql`` cut at each ``$n`` (SQLAlchemy's compiled claim has no ``$`` anywhere
    else): the text around them, and each one's position in the arguments."""
    pieces = _PLACEHOLDER.split(sql)
    return tuple(pieces[0::2]), tuple(int(n) - 1 for n in pieces[1::2])


def commit_checked(conn: Connection) -> bool:
    """COMMIT the claim's transaction on ``conn`` with `CHECKED_COMMIT`, in one round
    trip, and read the reply; False when this connection must commit the ordinary way
    (asyncpg in a transaction the inbox did not begin; other drivers).

    Raises `TransactionAborted` when the transaction was failed (25P02), and
    `ClaimNotCommitted` when it was not the claim's or COMMIT answered ROLLBACK: nothing
    of the attempt committed with its claim, and the caller must not ack.
    """
    driver = conn.dialect.driver
    dbapi = conn.connection.dbapi_connection
    if driver == "psycopg":
        return _commit_checked_psycopg(conn, dbapi)
    if driver == "asyncpg" and isinstance(getattr(dbapi, "_transaction", None), InboxTransaction):
        return _commit_checked_asyncpg(conn, dbapi)
    return False


def _commit_checked_psycopg(conn: Connection, dbapi: Any) -> bool:
    try:
        result = dbapi.pgconn.exec_(_CHECKED_COMMIT_BYTES)
        if result.status == _FATAL_ERROR:
            psycopg = _psycopg()
            state = result.error_field(psycopg.pq.DiagnosticField.SQLSTATE)
            _refuse((state or b"").decode(), result.error_message.decode(errors="replace"))
            raise psycopg.errors.error_from_result(result, encoding=dbapi.info.encoding)
    except conn.dialect.loaded_dbapi.Error as exc:
        raise from_driver(exc, conn, dbapi, CHECKED_COMMIT, ()) from exc
    if result.command_status != b"COMMIT":
        _read_reply((result.command_status or b"").decode())
    return True


def _commit_checked_asyncpg(conn: Connection, adapter: Any) -> bool:
    import asyncpg  # type: ignore[import-untyped]

    transaction: InboxTransaction = adapter._transaction
    try:
        status = await_(transaction.connection.execute(CHECKED_COMMIT))
    except asyncpg.PostgresError as exc:
        _refuse(str(getattr(exc, "sqlstate", "")), str(exc))
        try:
            adapter._handle_exception(exc)
        except conn.dialect.loaded_dbapi.Error as mapped:
            raise from_driver(mapped, conn, adapter, CHECKED_COMMIT, ()) from exc
        raise
    except Exception as exc:  # the connection's own trouble (lost, closed)
        try:
            adapter._handle_exception(exc)
        except conn.dialect.loaded_dbapi.Error as mapped:
            raise from_driver(mapped, conn, adapter, CHECKED_COMMIT, ()) from exc
        raise
    transaction.done = True
    _read_reply(status)
    return True


_CHECKED_COMMIT_BYTES = CHECKED_COMMIT.encode()
_IN_FAILED_TRANSACTION = "25P02"
_UNDEFINED_OBJECT = "42704"


def _refuse(state: str, message: str) -> None:
    """Raise the inbox's error for a checked COMMIT that failed on its check."""
    if state == _IN_FAILED_TRANSACTION:
        raise TransactionAborted(
            "the transaction was aborted by an earlier error that the handler caught, so "
            "nothing it did (nor the claim) could commit. Run a statement that is expected "
            "to fail inside session.begin_nested(), so that only its savepoint is lost"
        )
    if state == _UNDEFINED_OBJECT and CLAIM_ENDED in message:
        raise ClaimNotCommitted(_NOT_THE_CLAIMS)


def _read_reply(status: str) -> None:
    if status != "COMMIT":  # ROLLBACK: the server rolled the transaction back
        raise ClaimNotCommitted(f"the COMMIT was answered {status!r}: " + _NOT_THE_CLAIMS)


_NOT_THE_CLAIMS = (
    "the transaction the inbox committed is not the one that holds the claim (the handler "
    "ended the claim's transaction behind the inbox, for example on the driver's own "
    "connection): nothing the handler did before is committed with the claim. The attempt "
    "failed and the message is retried; raise an exception to abandon a message"
)
