"""A local wheelhouse for the tests that install the project into a fresh virtual
environment, as a user would, with no network.

Filled once (``pip wheel``, through constraints.txt, so it holds the versions the suite
runs on) and reused while constraints.txt, the dependency lists in pyproject.toml and the
Python version stay the same: each such state has its own folder, so an install from it
can only find the pinned versions. The installs themselves use ``--no-index`` and no pip
configuration of the machine.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
CACHE = Path(
    os.environ.get(
        "INBOX_TEST_WHEELHOUSE", Path.home() / ".cache" / "inbox-middleware-test" / "wheelhouse"
    )
)
# Every broker's extra: the install tests' environments take one or two of them.
EXTRAS = (
    "dramatiq",
    "faststream-rabbit",
    "faststream-redis",
    "faststream-nats",
    "faststream-kafka",
)


def pip(*args: str, python: str = sys.executable, env: dict[str, str] | None = None) -> str:
    ran = subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        check=False,
    )
    assert ran.returncode == 0, f"pip {' '.join(args)}:\n{ran.stdout}\n{ran.stderr}"
    return ran.stdout


def offline_env() -> dict[str, str]:
    """The environment of an offline install: the machine's pip settings left out."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def _digest() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {
        "dependencies": project["dependencies"],
        **{extra: project["optional-dependencies"][extra] for extra in EXTRAS},
        "constraints": CONSTRAINTS.read_text(),
        "python": sys.version_info[:2],
    }
    return hashlib.sha256(repr(wanted).encode()).hexdigest()[:16]


def wheelhouse() -> Path:
    """The folder of wheels: every broker extra's dependencies and the build backend, at
    the versions constraints.txt pins (the project's own wheel is not among them)."""
    folder = CACHE / _digest()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once fill it once
        stamp = folder / ".filled"
        if not stamp.exists():
            constrained = ["-c", str(CONSTRAINTS), "--build-constraint", str(CONSTRAINTS)]
            target = f"{ROOT}[{','.join(EXTRAS)}]"
            pip("wheel", *constrained, "--wheel-dir", str(folder), target, "hatchling")
            for own in folder.glob("inbox_middleware-*.whl"):
                own.unlink()
            stamp.touch()
    return folder
