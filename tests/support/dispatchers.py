"""Real ``inbox-middleware outbox run`` processes, in their own process group, stopped
with SIGTERM or killed with SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.apps.outbox_app:destinations"


class DispatcherProcess:
    def __init__(
        self, database_url: str | Path, env: dict[str, str], log: Path, *args: str
    ) -> None:
        """``database_url`` a URL, or the `Path` of a database map (``--map``)."""
        self.log = log
        where = (
            ["--map", str(database_url)]
            if isinstance(database_url, Path)
            else [
                "--database-url",
                database_url,
            ]
        )
        command = [
            sys.executable,
            "-c",
            "from inbox_middleware.cli import run; run()",
            "outbox",
            "run",
            *where,
            "--destinations",
            APP,
            *args,
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
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM, then wait for the exit; its status."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")
