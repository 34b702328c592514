"""The claim and its look-up sent straight to the driver, and on psycopg the claim with
the BEGIN of its transaction in one round trip.

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
rolls it back as usual. Nothing is prepared on the server, so the same path works through
PgBouncer in transaction mode. On the benchmark machine it saves a message about 60 µs
of worker CPU and 70 µs of latency (``python -m bench.hotpath``).

The single round trip is taken only where it is the same transaction psycopg would have
opened: a connection not in autocommit, with no transaction open yet, and values of the
types the claim has (text, timestamps, NULL). Anything else takes the cursor.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from ..protocol import Claim, Step
from .errors import from_driver
from .statements import ClaimStatements, DriverStatement, begin_command

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["driver_path", "on_driver"]

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
            found = claim_with_begin(dbapi, compiled, args)
            if found is not None:
                return ClaimStatements.answer(step, found or None)
        cursor = dbapi.cursor()
        try:
            cursor.execute(compiled.sql, args)
            row = cursor.fetchone()
        finally:
            cursor.close()
    except conn.dialect.loaded_dbapi.Error as exc:
        raise from_driver(exc, conn, dbapi, compiled.sql, args) from exc
    return ClaimStatements.answer(step, None if row is None else tuple(row))


def claim_with_begin(dbapi: Any, compiled: DriverStatement, args: dict[str, Any]) -> Any:
    """Open the transaction and claim in one round trip on a psycopg connection: the
    claim's row (``()`` when it returned none), or None when this connection or these
    values must take the ordinary path (nothing was sent then)."""
    from psycopg import errors, pq

    pgconn = dbapi.pgconn
    if dbapi.autocommit or pgconn.transaction_status != pq.TransactionStatus.IDLE:
        return None
    encoding = dbapi.info.encoding
    literals = _literals(pq.Escaping(pgconn), args, encoding)
    if literals is None:
        return None
    begin = begin_command(dbapi.isolation_level, dbapi.read_only, dbapi.deferrable)
    result = pgconn.exec_(begin + b"; " + compiled.sql_bytes % literals)
    if result.status != pq.ExecStatus.TUPLES_OK:
        raise errors.error_from_result(result, encoding=encoding)
    if not result.ntuples:
        return ()
    return tuple(result.get_value(0, column) for column in range(result.nfields))


def _literals(escaping: Any, args: dict[str, Any], encoding: str) -> dict[bytes, bytes] | None:
    """The values as SQL literals, or None for a value of another type, or text the
    connection's encoding cannot hold (the cursor then raises psycopg's own error)."""
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
