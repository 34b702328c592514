"""The one place where driver errors become the library's own.

psycopg, asyncpg and sqlite3 report the same conditions differently; SQLAlchemy wraps
them in `DBAPIError` with the driver's exception as ``orig``. Everything that decides
"retry now", "retry later" or "give up" reads `classify`, never a driver type.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc

from .._core.exceptions import (
    ClaimInProgress,
    DatabaseUnavailable,
    InboxError,
    TransactionConflict,
)
from .._core.protocol import Delivery

__all__ = ["Failure", "as_transient", "classify", "from_driver", "sqlstate", "transient_error"]

_SERIALIZATION = {"40001", "40P01"}  # serialization_failure, deadlock_detected
_LOCK_TIMEOUT = "55P03"  # lock_not_available
# check_violation outside the handler: the inbox's tables have no CHECK constraint but the
# compact claims table's partition bounds, which a claim routed to the default partition
# meets when the partition of its hour was attached meanwhile (`partitions.add`): the
# same claim, run again, goes to that partition.
_PARTITION_MOVED = "23514"
_CONNECTION_CLASSES = ("08", "57P")  # connection exceptions, admin/crash shutdown


class Failure(Enum):
    SERIALIZATION = "serialization"
    """Retry the whole transaction at once: nothing about the message is wrong."""
    LOCK_TIMEOUT = "lock_timeout"
    """A lock wait exceeded lock_timeout (or SQLite stayed busy); retry later."""
    DISCONNECTED = "disconnected"
    """The connection is gone; the transaction's outcome on the server is a rollback."""
    OTHER = "other"
    """Not a database condition the inbox handles; the caller's own error."""


def from_driver(
    exc: Any, conn: Connection, dbapi_connection: Any, statement: str, params: Any
) -> sa_exc.StatementError:
    """A driver error raised outside SQLAlchemy's execution, as SQLAlchemy would raise it.

    Checks for a lost connection the way SQLAlchemy does, and invalidates the connection
    then, so `classify` sees the same error whichever path sent the statement.
    """
    dialect = conn.dialect
    disconnected = dialect.is_disconnect(exc, dbapi_connection, None)
    if disconnected:
        conn.invalidate(exc)
    error: sa_exc.StatementError = sa_exc.DBAPIError.instance(
        statement,
        params,
        exc,
        dialect.loaded_dbapi.Error,
        connection_invalidated=disconnected,
        dialect=dialect,
    )
    return error


def sqlstate(exc: BaseException) -> str | None:
    orig = getattr(exc, "orig", None)
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return code if isinstance(code, str) else None


def classify(exc: BaseException, *, from_handler: bool = False) -> Failure:
    """What a failed attempt's exception means for the inbox.

    ``from_handler``: the exception came out of the handler. A raw `OSError` there is the
    handler's own (a `TimeoutError` from an HTTP client, say), while outside it, it is a
    driver failing to connect; the driver's own errors are `DBAPIError` wherever they occur.
    """
    if isinstance(exc, sa_exc.TimeoutError):  # the pool had no connection to give
        return Failure.DISCONNECTED
    if isinstance(exc, OSError) and not from_handler:  # some drivers, while connecting
        return Failure.DISCONNECTED
    if not isinstance(exc, sa_exc.DBAPIError):
        return Failure.OTHER
    if exc.connection_invalidated:
        return Failure.DISCONNECTED
    code = sqlstate(exc)
    if code in _SERIALIZATION or (code == _PARTITION_MOVED and not from_handler):
        return Failure.SERIALIZATION
    if code == _LOCK_TIMEOUT:
        return Failure.LOCK_TIMEOUT
    if code is not None and code.startswith(_CONNECTION_CLASSES):
        return Failure.DISCONNECTED
    if code is None and isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError):
        if "locked" in str(exc.orig).lower():  # sqlite3: "database is locked"
            return Failure.LOCK_TIMEOUT
        return Failure.DISCONNECTED  # connect refused, server closed the connection, ...
    return Failure.OTHER


def transient_error(
    exc: BaseException, failure: Failure, delivery: Delivery, *, claimed: bool
) -> InboxError | None:
    """The library's error for a failed attempt, or None when the error is the caller's.

    ``claimed`` says whether the claim statement had completed: a lock timeout before it
    means another delivery holds the claim; after it, the handler waited on its own locks.
    """
    where = {
        "consumer": delivery.consumer,
        "producer": delivery.identity.producer,
        "message_id": delivery.identity.message_id,
    }
    if failure is Failure.LOCK_TIMEOUT and not claimed:
        return ClaimInProgress(
            "another delivery of this message holds its claim; it will be retried", **where
        )
    if failure is Failure.LOCK_TIMEOUT:
        return TransactionConflict(f"the handler waited too long for a lock: {exc}", **where)
    if failure is Failure.SERIALIZATION:
        return TransactionConflict(
            f"serialization failures or deadlocks persisted after retries: {exc}", **where
        )
    if failure is Failure.DISCONNECTED:
        return DatabaseUnavailable(f"the database is unavailable: {_first_line(exc)}", **where)
    return None


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def as_transient(exc: Exception, delivery: Delivery) -> Exception:
    """``exc`` from a statement the inbox ran outside the claim's transaction (failure
    bookkeeping), as the library's transient error when it is the database's trouble."""
    mapped = transient_error(exc, classify(exc), delivery, claimed=True)
    if mapped is not None:
        mapped.__cause__ = exc
        return mapped
    return exc
