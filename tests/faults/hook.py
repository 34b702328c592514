"""The hook a fault-injection worker installs in `inbox_middleware._core.faults`.

A worker process of the suite imports one of the apps next to this module, which calls
`install()`. The hook reads the run's plan (a JSON file the harness wrote before starting
the worker) and, at each named point, logs the call and fires the planned fault when this
call matches: the point, the delivery's message id (``null`` in the plan matches a call
without one) and the occurrence (the n-th time this point is reached for this id, counted
across every worker process of the run; or any later one, if the n-th did not fire).
Each fault fires once: a marker file, created with O_EXCL before the fault is done, keeps
a replacement worker from firing it again.

Faults:

raise     raise `InjectedFault` at the point
cut       end every database session of this worker (``pg_terminate_backend`` from a
          connection of its own), then carry on: the next statement finds its connection gone
restart   ask the harness to restart PostgreSQL and block until it has
kill      SIGKILL this process

Environment: FAULTS_PLAN (the plan file), FAULTS_DIR (the run's folder: markers, logs,
restart requests), FAULTS_APPLICATION (the application_name of the worker's sessions),
FAULTS_ADMIN_URL (a libpq URL of the run's database, for the cut).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Fault", "InjectedFault", "install", "read_fired", "read_reached", "write_plan"]

RESTART_PATIENCE = 120.0  # seconds the hook waits for the harness to restart PostgreSQL
UNTIL_AT_MOST = 5  # a fault "until" another stops after this many occurrences anyway


class InjectedFault(RuntimeError):
    """Raised by the fault-injection hook at a named point."""


@dataclass(frozen=True, slots=True)
class Fault:
    point: str
    message_id: str | None
    kind: str  # raise, cut, restart, kill
    occurrence: int = 1
    until: str | None = None
    """Fire at every occurrence (a ``raise`` only) until the fault with this key fired:
    a handler that keeps failing until its failure's record point was met, even when a
    worker killed in between kept an attempt from getting there."""

    @property
    def key(self) -> str:
        return _key(self.point, self.message_id, self.occurrence)


def _key(point: str, message_id: str | None, occurrence: int) -> str:
    return f"{point}~{message_id or '-'}~{occurrence}"


def write_plan(path: Path, faults: list[Fault]) -> None:
    path.write_text(
        json.dumps([[f.point, f.message_id, f.kind, f.occurrence, f.until] for f in faults])
    )


def _exclusive(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text``; False if it existed already."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    return True


class Hook:
    def __init__(self, plan: Path, folder: Path, application: str, admin_url: str) -> None:
        self.folder = folder
        self.application = application
        self.admin_url = admin_url
        entries = json.loads(plan.read_text())
        self.faults = {
            (point, message_id): (occurrence, kind)
            for point, message_id, kind, occurrence, until in entries
            if until is None
        }
        self.until = {
            (point, message_id): until
            for point, message_id, kind, _, until in entries
            if until is not None
        }
        for sub in ("reached", "fired", "restart"):
            (folder / sub).mkdir(exist_ok=True)
        self.log = folder / f"calls.{os.getpid()}.log"

    def __call__(self, point: str, message_id: str | None) -> None:
        occurrence = self._occurrence(point, message_id)
        with open(self.log, "a") as log:
            log.write(f"{time.time():.3f} {point} {message_id} {occurrence}\n")
        until = self.until.get((point, message_id))
        if (
            until is not None
            and occurrence <= UNTIL_AT_MOST
            and not (self.folder / "fired" / until).exists()
        ):
            _exclusive(self.folder / "fired" / _key(point, message_id, 0), "raise until\n")
            raise InjectedFault(f"injected failure at {point} for {message_id}, until {until}")
        planned, kind = self.faults.get((point, message_id), (0, ""))
        if not planned or occurrence < planned:
            return
        # Not fired yet at a later occurrence: the planned one was cut short (another
        # thread's kill took the process down between counting it and firing).
        key = _key(point, message_id, planned)
        if not _exclusive(self.folder / "fired" / key, f"{kind} {os.getpid()} {time.time()}\n"):
            return
        if kind == "raise":
            raise InjectedFault(f"injected fault at {point} for {message_id}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # never reached
        if kind == "cut":
            self._cut()
        elif kind == "restart":
            self._restart(key)

    def _occurrence(self, point: str, message_id: str | None) -> int:
        """How many times this point has been reached for this id, this call included."""
        n = 1
        while not _exclusive(self.folder / "reached" / _key(point, message_id, n), ""):
            n += 1
        return n

    def _cut(self) -> None:
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
                "WHERE application_name = %s AND datname = current_database() "
                "AND pid <> pg_backend_pid()",
                (self.application,),
            )

    def _restart(self, key: str) -> None:
        request = self.folder / "restart" / f"{key}.request"
        done = self.folder / "restart" / f"{key}.done"
        request.write_text(str(os.getpid()))
        deadline = time.monotonic() + RESTART_PATIENCE
        while not done.exists():
            if time.monotonic() > deadline:
                raise InjectedFault(f"the harness did not restart PostgreSQL for {key}")
            time.sleep(0.05)


def install() -> None:
    """Set `faults.hook` for this worker process, from the environment."""
    from inbox_middleware._core import faults

    env = os.environ
    faults.hook = Hook(
        Path(env["FAULTS_PLAN"]),
        Path(env["FAULTS_DIR"]),
        env["FAULTS_APPLICATION"],
        env["FAULTS_ADMIN_URL"],
    )
    if env.get("FAULTS_SELF_CHECK") == "1":
        _self_check()


def _self_check() -> None:
    """Checking the harness itself: the handler (the test's own code) calls the
    ``handler`` point, so that faults fire whatever the library calls already."""
    from inbox_middleware import current_delivery
    from inbox_middleware._core import faults
    from tests.apps import chaos_domain

    credit = chaos_domain.credit

    def credit_at_point(session: Any, account_id: int, delta: int) -> None:
        delivery = current_delivery(session)
        faults.at("handler", delivery.identity.message_id if delivery else None)
        credit(session, account_id, delta)

    chaos_domain.credit = credit_at_point  # type: ignore[assignment]


def read_fired(folder: Path) -> dict[str, str]:
    """Key -> "kind pid time" of every fault that fired in the run."""
    fired = folder / "fired"
    if not fired.exists():
        return {}
    return {path.name: path.read_text() for path in fired.iterdir()}


def read_reached(folder: Path) -> set[tuple[str, str | None]]:
    """(point, message id) of every call the hook saw, in any worker of the run."""
    reached: set[tuple[str, str | None]] = set()
    for path in folder.glob("calls.*.log"):
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                _, point, message_id, _ = line.split(" ")
                reached.add((point, None if message_id == "None" else message_id))
    return reached
