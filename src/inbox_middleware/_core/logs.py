"""Where the library's log records go when the process configured no logging.

The library logs to ``inbox_middleware`` and its children, and adds no handler of its
own while anything is configured: under ``dramatiq`` (whose command configures the root
logger) or an application's ``logging.basicConfig`` / ``dictConfig``, records propagate
to those handlers, once. Under ``faststream run``, FastStream configures only its own
``faststream`` logger, so with nothing else configured the library's records would reach
Python's last-resort handler (WARNING and above, no timestamp, no level). At a worker's
start-up `follow` then gives the library's logger a fallback that hands each record to
the framework's handler (FastStream's format and stream), at the framework's level; it
stands aside, record by record, as soon as the root logger or the library's gets a
handler, so
configuring logging later never doubles a line. The library's own command
(``inbox-middleware outbox run``) configures logging as ``dramatiq`` does (`configure`).

Inside one message's processing (`scope`), the fallback hands the records to the logger
FastStream writes that subscriber's lines with instead, through its filters, so the
library's line about a message carries the queue and message id as FastStream's do.
"""

from __future__ import annotations

import logging
import sys
from contextvars import ContextVar, Token

__all__ = ["EXIT_STATUS", "FORMAT", "configure", "follow", "leave", "refuse_start", "scope"]

LIBRARY = "inbox_middleware"
EXIT_STATUS = 3
"""The status a Dramatiq worker process exits with when the inbox refuses its start (the
status Dramatiq gives a worker whose broker is unreachable at start-up)."""
FORMAT = "%(asctime)s %(levelname)8s - %(name)s: %(message)s"
"""The format of the fallback when no framework handler exists, and of ``outbox run``."""


_scope: ContextVar[logging.Logger | None] = ContextVar("inbox_middleware_log_scope", default=None)


def scope(framework: logging.Logger | None) -> Token[logging.Logger | None]:
    """While a message is processed: hand the fallback's records to ``framework`` (the
    logger of FastStream's lines for that subscriber), whose filters add its context."""
    return _scope.set(framework)


def leave(token: Token[logging.Logger | None]) -> None:
    try:
        _scope.reset(token)
    except ValueError:  # set in another context: nothing of this one to restore
        _scope.set(None)


class _Fallback(logging.Handler):
    """Hands records to the framework's handlers while nothing else would take them."""

    def __init__(self, framework: str | None) -> None:
        super().__init__()
        self.framework = framework
        self.stderr = logging.StreamHandler(sys.stderr)
        self.stderr.setFormatter(logging.Formatter(FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if _configured(logging.getLogger(LIBRARY)):  # since: the record goes there
            return
        framework = _scope.get()
        if framework is not None and framework.handlers:
            if record.levelno >= framework.getEffectiveLevel() and framework.filter(record):
                for handler in framework.handlers:
                    if record.levelno >= handler.level:
                        handler.handle(record)
            return
        targets = logging.getLogger(self.framework).handlers if self.framework else []
        for handler in targets or [self.stderr]:
            if record.levelno >= handler.level:
                handler.handle(record)


def _configured(library: logging.Logger) -> bool:
    own = [h for h in library.handlers if not isinstance(h, _Fallback)]
    return bool(own or logging.getLogger().handlers)


def follow(framework: str | None) -> None:
    """At a worker's start-up: unless logging is configured (a handler on the root logger
    or the library's), send the library's records to the handlers of the ``framework``
    logger (``"faststream"``), else to stderr with a timestamp and level, at the
    framework logger's level (INFO when it has none). Safe to call again."""
    library = logging.getLogger(LIBRARY)
    if _configured(library):
        return
    if not any(isinstance(h, _Fallback) for h in library.handlers):
        library.addHandler(_Fallback(framework))
    if library.level == logging.NOTSET:
        level = logging.getLogger(framework).getEffectiveLevel() if framework else logging.INFO
        library.setLevel(min(level, logging.INFO) if framework is None else level)


def configure(level: int | str = logging.INFO) -> None:
    """For the library's commands: configure the root logger as ``dramatiq`` does (stderr,
    timestamp, level, logger name), unless the process configured logging already."""
    if logging.getLogger().handlers:
        return
    logging.basicConfig(level=level, format=FORMAT, stream=sys.stderr)


def _under_dramatiq_command() -> bool:
    import multiprocessing

    return "dramatiq.cli" in sys.modules and multiprocessing.parent_process() is not None


def refuse_start(reason: str) -> None:
    """In a worker process of the ``dramatiq`` command: log ``reason`` as one CRITICAL
    line, through the command's logging, and exit with `EXIT_STATUS` (no traceback from
    multiprocessing); anywhere else, return (the caller raises)."""
    if not _under_dramatiq_command():
        return
    logging.getLogger(f"{LIBRARY}.dramatiq").critical(reason)
    for handler in logging.getLogger().handlers:  # the process ends without atexit
        handler.flush()
    raise SystemExit(EXIT_STATUS)
