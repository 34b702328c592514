"""Real Dramatiq worker processes, started with the ``dramatiq`` command and killed with
SIGKILL (the whole process group: the command forks its worker processes)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class WorkerProcess:
    def __init__(
        self,
        app: str,
        env: dict[str, str],
        log: Path,
        *,
        processes: int = 1,
        threads: int = 4,
        options: tuple[str, ...] = (),
    ) -> None:
        self.log = log
        command = [
            sys.executable,
            "-m",
            "dramatiq",
            app,
            "--processes",
            str(processes),
            "--threads",
            str(threads),
            *options,
        ]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        """SIGKILL the command and every worker process it forked."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Stop gracefully, falling back to SIGKILL.

        SIGTERM goes to the main process only: it forwards one to each worker process, and
        a worker that receives a second one exits at once, skipping its shutdown.
        """
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def wait_for(predicate, *, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
