"""Real FastStream worker processes, started with ``faststream run`` in a process group of
their own and killed with SIGKILL (the whole group)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READY = "started successfully"


class FastStreamWorker:
    def __init__(
        self,
        app: str,
        env: dict[str, str],
        log: Path,
        *,
        cwd: Path = ROOT,
        options: tuple[str, ...] = (),
    ) -> None:
        """``options``: more of the command's options (``--workers 2``)."""
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "faststream", "run", app, *options],
                cwd=cwd,
                env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def ready(self) -> bool:
        """Whether the app started (raises if the process died first)."""
        if READY in self.output():
            return True
        if self.proc.poll() is not None:
            raise AssertionError(f"the worker exited ({self.proc.returncode}):\n{self.output()}")
        return False

    def kill(self) -> None:
        """SIGKILL the worker's whole process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Stop gracefully (SIGTERM), falling back to SIGKILL."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def children(self) -> list[int]:
        """The process ids of the command's live worker processes (``--workers``), as
        its supervisor logs them when it starts (or restarts) one."""
        pids = [
            int(pid) for pid in re.findall(r"Started child process[^\[]*\[(\d+)\]", self.output())
        ]
        return [pid for pid in pids if _alive(pid)]

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not reaped yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
