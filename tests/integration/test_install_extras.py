"""Each extra, installed alone in a fresh virtual environment, gives a command line that
works against the real PostgreSQL with the driver that extra brings (``faststream-*``:
asyncpg only, no psycopg), and none of the other brokers' clients.

The dependencies come from a local wheelhouse, filled once (``pip wheel``) and reused
while the dependency lists in pyproject.toml stay the same; the environments install
from it with ``--no-index``, so a run is fast and needs no network after the first.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..support.database import _admin
from ..support.services import POSTGRES

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = Path(
    os.environ.get(
        "INBOX_TEST_WHEELHOUSE", Path.home() / ".cache" / "inbox-middleware-test" / "wheelhouse"
    )
)

# extra -> (URL scheme the user would write, the driver module it must bring, modules
# that must not come with it)
EXTRAS = {
    "dramatiq": ("postgresql", "psycopg", ["asyncpg", "faststream"]),
    "faststream-rabbit": ("postgresql+asyncpg", "asyncpg", ["psycopg", "aiokafka", "nats"]),
    "faststream-redis": ("postgres", "asyncpg", ["psycopg", "aio_pika", "aiokafka"]),
    "faststream-nats": ("postgresql+asyncpg", "asyncpg", ["psycopg", "aio_pika", "redis"]),
    "faststream-kafka": ("postgresql+asyncpg", "asyncpg", ["psycopg", "aio_pika", "nats"]),
}

CHECK_IMPORTS = """
import importlib.util, sys
driver, absent = sys.argv[1], sys.argv[2].split(",")
assert importlib.util.find_spec(driver), driver
found = [name for name in absent if importlib.util.find_spec(name)]
assert not found, f"installed, though this extra should not bring them: {found}"
if importlib.util.find_spec("faststream"):
    import inbox_middleware.faststream
if importlib.util.find_spec("dramatiq"):
    import inbox_middleware.dramatiq
"""


def pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _digest() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {
        "dependencies": project["dependencies"],
        **{extra: project["optional-dependencies"][extra] for extra in EXTRAS},
        "python": sys.version_info[:2],
    }
    return hashlib.sha256(repr(wanted).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the dependencies' wheels, this tree's own wheel)."""
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    stamp = WHEELHOUSE / f"filled-{_digest()}"
    with open(WHEELHOUSE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once fill it once
        if not stamp.exists():
            extras = ",".join(EXTRAS)
            pip("wheel", "--wheel-dir", str(WHEELHOUSE), f"{ROOT}[{extras}]", "hatchling")
            for own in WHEELHOUSE.glob("inbox_middleware-*.whl"):
                own.unlink()
            stamp.touch()
    own = tmp_path_factory.mktemp("own-wheel")
    # Built without the network too: hatchling comes from the wheelhouse.
    pip(
        "wheel",
        "--no-deps",
        "--no-index",
        "--find-links",
        str(WHEELHOUSE),
        "-w",
        str(own),
        str(ROOT),
    )
    return WHEELHOUSE, own


@pytest.fixture
def database() -> Iterator[str]:
    name = f"inbox_install_{uuid.uuid4().hex[:8]}"
    with _admin() as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield name
    with _admin() as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.slow
@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_extra__alone_in_a_fresh_environment_runs_migrate_check_and_status(
    extra, wheelhouse, database, tmp_path
):
    wheels, own = wheelhouse
    scheme, driver, absent = EXTRAS[extra]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip(
        "--python",
        python,
        "install",
        "--no-index",
        "--find-links",
        str(wheels),
        "--find-links",
        str(own),
        f"inbox-middleware[{extra}]",
    )
    subprocess.run([python, "-c", CHECK_IMPORTS, driver, ",".join(absent)], check=True)

    url = POSTGRES.split("://", 1)[1].rsplit("/", 1)[0]
    env = {**os.environ, "INBOX_DATABASE_URL": f"{scheme}://{url}/{database}"}

    def cli(*args: str) -> str:
        ran = subprocess.run(
            [str(venv / "bin" / "inbox-middleware"), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert ran.returncode == 0, (args, ran.stderr)
        assert "Traceback" not in ran.stderr
        return ran.stdout

    assert "applied 0001_inbox" in cli("migrate")
    assert "the inbox schema is at version" in cli("check")
    assert "claims by consumer and producer" in cli("status")
