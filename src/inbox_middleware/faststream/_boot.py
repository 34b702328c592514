"""How a FastStream app the inbox refuses to start says so, under a server command.

`FastStreamInbox.guard` runs the start-up check inside ``broker.start``. Left to itself,
a refusal is an exception that ``faststream run`` prints as a rich traceback of some two
hundred lines with the reason at the bottom; under ``--workers N`` the supervising
process respawns the refused worker at once, for ever; under an ASGI server (uvicorn
running a FastAPI app or an `AsgiFastStream`) the lifespan's failure is printed as a
traceback too. So under a server command (``faststream``, ``uvicorn``, ``gunicorn``,
``hypercorn``, ``fastapi``) a refusal is instead:

- logged as one CRITICAL block, naming the cause and the fix (the traceback follows only
  when the library's logger is at DEBUG: ``faststream run ... --log-level debug``);
- told to a supervising process, which then stops every worker instead of respawning
  this one (SIGTERM, the supervisor's own "stop"; under ``--reload`` the reloader keeps
  watching for the fix);
- the end of the process, with exit status 3, as for a Dramatiq worker the inbox refuses
  (3 is also uvicorn's "startup failure" and gunicorn's "worker boot error": their
  supervisors stop every worker on it).

``faststream run --workers N``'s supervisor imports the app too, so `watch_supervisor`
runs there: the refused worker then signals it with SIGUSR2 instead, and the supervisor
stops its workers and exits with status 3 as well. Anywhere else (an app started in
code, a test) the exception is raised as usual.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from .._core.exceptions import InboxError

__all__ = ["EXIT_STATUS", "refuse_start", "watch_supervisor"]

EXIT_STATUS = 3

logger = logging.getLogger("inbox_middleware.faststream")

_SERVERS = frozenset({"faststream", "uvicorn", "gunicorn", "hypercorn", "fastapi"})
# Set by a supervisor that listens for SIGUSR2 (`watch_supervisor`); its workers inherit it.
_SUPERVISOR = "INBOX_MIDDLEWARE_SUPERVISOR"
_refused = threading.Event()


def _server_command() -> bool:
    """Whether this process runs under a server command (a spawned worker keeps its
    supervisor's ``sys.argv``)."""
    if not sys.argv or not sys.argv[0]:
        return False
    path = Path(sys.argv[0])
    name = path.parent.name if path.name == "__main__.py" else path.name
    return name.removesuffix(".exe") in _SERVERS


def refuse_start(error: Exception) -> None:
    """Under a server command: log why the app does not start, stop a supervisor from
    respawning this worker, and end the process with `EXIT_STATUS`. Else return."""
    if not _server_command():
        return
    logger.critical(
        "the inbox refuses to start this app (exit status %d):\n%s",
        EXIT_STATUS,
        _reason(error),
        exc_info=error if logger.isEnabledFor(logging.DEBUG) else None,
    )
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None and "--reload" not in sys.argv:
        told = os.environ.get(_SUPERVISOR) == str(parent.pid)
        with contextlib.suppress(OSError):  # gone already
            os.kill(parent.pid, signal.SIGUSR2 if told else signal.SIGTERM)
    _exit(EXIT_STATUS)


def watch_supervisor() -> None:
    """In the process ``faststream run --workers N`` supervises its workers from: when a
    worker is refused (SIGUSR2), stop the workers as on SIGTERM, and exit with
    `EXIT_STATUS` once they are stopped. Nothing elsewhere, or if SIGUSR2 has a handler."""
    if (
        not _server_command()
        or multiprocessing.parent_process() is not None
        or threading.current_thread() is not threading.main_thread()
        or os.environ.get(_SUPERVISOR)
        or signal.getsignal(signal.SIGUSR2) is not signal.SIG_DFL
    ):
        return
    signal.signal(signal.SIGUSR2, _worker_refused)
    os.environ[_SUPERVISOR] = str(os.getpid())
    atexit.register(_exit_if_refused)


def _worker_refused(signum: int, frame: FrameType | None) -> None:
    _refused.set()
    stop: Any = signal.getsignal(signal.SIGTERM)
    if callable(stop):  # the supervisor's own: stop every worker, do not respawn
        stop(signal.SIGTERM, frame)


def _exit_if_refused() -> None:
    if _refused.is_set():
        _exit(EXIT_STATUS)


def _exit(status: int) -> None:
    # os._exit: an ASGI server would print the lifespan's traceback on SystemExit, and
    # FastStream's task group would wrap it; nothing was consumed, nothing is pending.
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for each in loggers:
        for handler in getattr(each, "handlers", ()):
            handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _reason(error: Exception) -> str:
    if isinstance(error, InboxError):
        text = str(error)
    else:
        first = str(getattr(error, "orig", None) or error).strip().splitlines()
        text = (
            "the inbox cannot reach its database: "
            f"{first[0] if first else type(error).__name__}; check the engine's URL and "
            "that PostgreSQL is up"
        )
    return "\n".join(f"  {line}" for line in text.splitlines())
