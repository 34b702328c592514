"""A worker's start: the checks that must pass before it consumes, and how a worker
that must not start says so under the ``dramatiq`` command.

Raising `MiddlewareError` from ``before_worker_boot`` is what makes Dramatiq treat the
failure as fatal; under the ``dramatiq`` command the worker process then dies with the
exception's whole chain of tracebacks printed by multiprocessing, before the main process
reports "exited unexpectedly". There, the reason is logged instead as one CRITICAL line,
through the command's logging, and the worker process exits with status 3 (the status
Dramatiq gives a worker whose broker is unreachable at start-up), which the command
returns. Outside the command (a `dramatiq.Worker` started in code, a test), the
`MiddlewareError` is raised as usual.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING

from dramatiq.broker import MessageProxy
from dramatiq.middleware import MiddlewareError
from sqlalchemy import Engine

from .._core.exceptions import ConfigurationError
from .._core.logs import EXIT_STATUS, refuse_start
from .._storage.startup import DEFAULT_STARTUP_PATIENCE, StartupPatience

if TYPE_CHECKING:
    from .._storage import Inbox
    from .._storage.aio import AsyncInbox
    from .._storage.routed import RoutedInbox

__all__ = [
    "EXIT_STATUS",
    "QuietSkips",
    "WorkerBootError",
    "check_database",
    "check_routed",
    "refuse_boot",
]

logger = logging.getLogger("inbox_middleware.dramatiq")


def refuse_boot(reason: str) -> None:
    """Under the ``dramatiq`` command: log ``reason`` and exit; else return."""
    refuse_start(reason)


class WorkerBootError(ConfigurationError, MiddlewareError):
    """The worker must not start: the database is unreachable, or the inbox's schema or
    database settings are wrong."""


def check_routed(inbox: RoutedInbox) -> None:
    """The start-up check over many databases: every database the map names is checked;
    one that does not answer is left to its first delivery (it must not keep the fleet
    from starting), one that refuses (schema, settings) refuses the start."""
    try:
        inbox.check()
    except Exception as exc:
        refuse_boot(_boot_error(exc))
        raise WorkerBootError(_boot_error(exc)) from exc


def check_database(
    inbox: Inbox | None,
    async_inbox: AsyncInbox | None,
    threads: int,
    patience: float = DEFAULT_STARTUP_PATIENCE,
) -> None:
    """Refuse to start a worker whose database would break the guarantee: tables missing
    or out of date, ``synchronous_commit`` off, unreachable. A transient outage and a
    missing or older schema are waited out first, for ``patience`` seconds (see
    `inbox_middleware._storage.startup`); the worker consumes nothing meanwhile."""

    def check() -> None:
        if inbox is not None:
            inbox.check()
        if async_inbox is not None:
            asyncio.run(_check_async(async_inbox))

    try:
        StartupPatience(patience, log=logger).run(check)
        if inbox is not None:
            _check_pool(inbox.engine, threads)
        if async_inbox is not None:
            _check_pool(async_inbox.engine.sync_engine, threads)
    except Exception as exc:
        refuse_boot(_boot_error(exc))  # the dramatiq command: one line, exit status 3
        # A MiddlewareError, or Dramatiq would log this and start the worker anyway.
        raise WorkerBootError(_boot_error(exc)) from exc


async def _check_async(inbox: AsyncInbox) -> None:
    # Runs on a private event loop before Dramatiq's starts: its connections must not
    # outlive this loop, so the pool is emptied before returning.
    try:
        await inbox.check()
    finally:
        await inbox.engine.dispose()


def _boot_error(exc: Exception) -> str:
    if isinstance(exc, ConfigurationError) or exc.__class__.__module__.startswith(
        "inbox_middleware"
    ):
        return str(exc)
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return (
        "the inbox cannot reach its database, so the worker does not start: "
        f"{text[0] if text else type(exc).__name__}"
    )


def _check_pool(engine: Engine, threads: int) -> None:
    pool = engine.pool
    size = getattr(pool, "size", None)
    overflow = getattr(pool, "_max_overflow", 0)
    if callable(size) and overflow >= 0 and size() + overflow < threads:
        logger.warning(
            "the connection pool holds at most %d connections for %d worker threads: threads "
            "will wait for connections; set pool_size (plus max_overflow) to at least %d",
            size() + overflow,
            threads,
            threads,
        )


class QuietSkips(logging.Filter):
    """Drops Dramatiq's "Message ... was skipped." warning for messages the inbox settled
    (a duplicate is normal traffic, and the inbox logged it already)."""

    _LOGGER = "dramatiq.worker.WorkerThread"

    def __init__(self) -> None:
        super().__init__()
        self._settled = threading.local()

    def install(self) -> None:
        target = logging.getLogger(self._LOGGER)
        if self not in target.filters:
            target.addFilter(self)

    def mark(self, message: MessageProxy) -> None:
        self._settled.message_id = message.message_id

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "Message %s was skipped." or not record.args:
            return True
        args = record.args if isinstance(record.args, tuple) else (record.args,)
        settled = getattr(self._settled, "message_id", None)
        return getattr(args[0], "message_id", None) != settled or settled is None
