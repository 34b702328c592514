"""How a worker that must not start says so under the ``dramatiq`` command.

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

import logging
import multiprocessing
import sys

__all__ = ["EXIT_STATUS", "refuse_boot"]

EXIT_STATUS = 3

logger = logging.getLogger("inbox_middleware.dramatiq")


def _under_dramatiq_command() -> bool:
    return "dramatiq.cli" in sys.modules and multiprocessing.parent_process() is not None


def refuse_boot(reason: str) -> None:
    """Under the ``dramatiq`` command: log ``reason`` and exit; else return."""
    if not _under_dramatiq_command():
        return
    logger.critical(reason)
    for handler in logging.getLogger().handlers:  # the process ends without atexit
        handler.flush()
    raise SystemExit(EXIT_STATUS)
