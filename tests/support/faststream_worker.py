"""Real FastStream worker processes, started with ``faststream run`` in a process group of
their own and killed with SIGKILL (the whole group)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READY = "started successfully"


class FastStreamWorker:
    def __init__(self, app: str, env: dict[str, str], log: Path, *, cwd: Path = ROOT) -> None:
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "faststream", "run", app],
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

    def output(self) -> str:
        return self.log.read_text(errors="replace")
