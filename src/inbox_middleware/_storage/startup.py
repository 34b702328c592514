"""A worker's start, decided once for every framework: which trouble with the database is
waited out before anything is consumed, and which ends the start at once.

- A configuration error (a wrong URL or database name, a failed authentication, an engine
  or a setting the inbox cannot work with, a subscriber it refuses) cannot heal by
  waiting: the start ends at once.
- A missing or older schema (a migration not run yet, or running) and a transient outage
  (connection refused, a lost connection, SQLSTATE class 08, 57P03 "the database system
  is starting up") are waited out for ``startup_patience`` seconds, trying again with
  growing delays, one log line per attempt naming the fix; past it, the start ends.

The check runs before the worker consumes: nothing is held or consumed while it waits.
``startup_patience`` plays the part of Celery's ``broker_connection_retry_on_startup``
and ``broker_connection_max_retries``, counted in seconds rather than attempts (0: no
waiting, the first failure ends the start).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable

from .._core.exceptions import ConfigurationError, InboxError, SchemaError, TransientError
from .errors import Failure, classify, sqlstate

__all__ = [
    "DEFAULT_STARTUP_PATIENCE",
    "DatabaseNotReady",
    "StartupPatience",
    "validate_patience",
    "worth_waiting",
]

DEFAULT_STARTUP_PATIENCE = 60.0
"""Seconds a worker waits at start-up for its database (a restart, a migration)."""

FIRST_DELAY = 0.5
LONGEST_DELAY = 5.0

logger = logging.getLogger("inbox_middleware")

# Connection errors that no wait heals: wrong credentials, a role or database that does
# not exist (psycopg reports them without an SQLSTATE while connecting).
_REFUSED_CLASSES = ("28", "3D")  # invalid authorization, invalid catalog name
_REFUSED_TEXT = ("authentication failed", "does not exist", "no pg_hba.conf entry")


class DatabaseNotReady(InboxError):
    """The database stayed unreachable, or its schema missing or old, for the whole
    start-up patience."""


def validate_patience(patience: float) -> float:
    if not isinstance(patience, int | float) or patience < 0:
        raise ConfigurationError("startup_patience must be zero or more seconds")
    return float(patience)


def worth_waiting(exc: BaseException) -> str | None:
    """What to do about ``exc`` while waiting for it to pass (the fix a log line names),
    or None when waiting cannot help: the start ends at once."""
    if isinstance(exc, SchemaError):
        return "run `inbox-middleware migrate` (or wait for the migration to finish)"
    if isinstance(exc, ConfigurationError):
        return None
    if isinstance(exc, socket.gaierror):  # the host name does not resolve: a wrong URL
        return None
    code = sqlstate(exc)
    if code is not None and code.startswith(_REFUSED_CLASSES):
        return None
    text = str(getattr(exc, "orig", None) or exc).lower()
    if any(mark in text for mark in _REFUSED_TEXT):
        return None
    if isinstance(exc, TransientError) or classify(exc) is Failure.DISCONNECTED:
        return "start PostgreSQL, or check the host and port of the engine's URL"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class StartupPatience:
    """Runs a start-up check until it passes, waiting out the trouble `worth_waiting`
    names for ``patience`` seconds; raises at once otherwise, and `DatabaseNotReady`
    (from the last error) once the patience is spent."""

    def __init__(
        self,
        patience: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        log: logging.Logger = logger,
    ) -> None:
        self.patience = validate_patience(patience)
        self.clock = clock
        self.log = log

    def _next(self, exc: Exception, attempt: int, started: float) -> float:
        """Seconds to wait before the next attempt; raises when there is none."""
        fix = worth_waiting(exc)
        if fix is None or self.patience == 0:
            raise exc  # the start ends at once, with the error itself
        elapsed = self.clock() - started
        left = self.patience - elapsed
        if left <= 0:
            raise DatabaseNotReady(
                f"the inbox's database was not ready after {attempt} attempts in "
                f"{elapsed:.0f}s (startup_patience={self.patience:g}): {_first_line(exc)}; "
                f"{fix}"
            ) from exc
        delay = float(min(LONGEST_DELAY, FIRST_DELAY * 2 ** min(attempt - 1, 16), left))
        self.log.warning(
            "the inbox's database is not ready (attempt %d, %.0fs of startup_patience=%g "
            "left; nothing is consumed meanwhile): %s; %s",
            attempt,
            left,
            self.patience,
            _first_line(exc),
            fix,
        )
        return delay

    def run(
        self, check: Callable[[], None], *, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        started = self.clock()
        attempt = 0
        while True:
            attempt += 1
            try:
                check()
            except Exception as exc:
                sleep(self._next(exc, attempt, started))
                continue
            self._ready(attempt)
            return

    async def run_async(self, check: Callable[[], Awaitable[None]]) -> None:
        started = self.clock()
        attempt = 0
        while True:
            attempt += 1
            try:
                await check()
            except Exception as exc:
                await asyncio.sleep(self._next(exc, attempt, started))
                continue
            self._ready(attempt)
            return

    def _ready(self, attempt: int) -> None:
        if attempt > 1:
            self.log.info("the inbox's database is ready (attempt %d)", attempt)
