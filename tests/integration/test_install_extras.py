"""Each extra, installed alone in a fresh virtual environment, gives a command line that
works against the real PostgreSQL with the driver that extra brings (``faststream-*``:
asyncpg only, no psycopg), and none of the other brokers' clients.

The dependencies come from a local wheelhouse (tests/support/wheelhouse.py), filled once
through constraints.txt and reused; the environments install from it with ``--no-index``,
so a run is fast and needs no network after the first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..support.database import _admin
from ..support.services import POSTGRES
from ..support.wheelhouse import EXTRAS as WHEELHOUSE_EXTRAS
from ..support.wheelhouse import offline_env, pip
from ..support.wheelhouse import wheelhouse as fill_wheelhouse

ROOT = Path(__file__).resolve().parents[2]

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


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the dependencies' wheels, this tree's own wheel)."""
    assert set(EXTRAS) <= set(WHEELHOUSE_EXTRAS)
    wheels = fill_wheelhouse()
    own = tmp_path_factory.mktemp("own-wheel")
    # Built without the network too: hatchling comes from the wheelhouse.
    pip(
        "wheel",
        "--no-deps",
        "--no-index",
        "--find-links",
        str(wheels),
        "-w",
        str(own),
        str(ROOT),
        env=offline_env(),
    )
    return wheels, own


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
        env=offline_env(),
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
