"""The tutorial, followed as a reader follows it: its commands, in the page's order and as
the page writes them, run by bash in a fresh virtual environment into which the page's
own `pip install` put the project; real worker processes started the way it says, the
snippets it runs; then what the page says the reader sees (one credit, a duplicate
skipped, a conflict quarantined, the quarantine listing).

Where the run differs from a reader's, and why:

- the clone is this checkout (a test does not clone), and the virtual environment is
  made in a temporary folder rather than in the clone's `.venv`, the suite's own;
- `pip install` runs offline: `--no-index --find-links` a wheelhouse filled through
  constraints.txt (tests/support/wheelhouse.py), with none of the machine's pip settings;
- the two databases get names of their own (created as `createdb` would), and the
  services' addresses come from the variables the page says the examples read.

A first test checks that these are all the page's commands, so a command added to the
page without being run here fails the suite.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import create_engine, text

from ..support import database, services
from ..support.wheelhouse import offline_env, wheelhouse

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = (ROOT / "docs" / "tutorial.md").read_text()
pytestmark = pytest.mark.slow

CLONE = [
    "git clone https://github.com/inbox-middleware/inbox-middleware.git",
    "cd inbox-middleware",
]
VENV = "python3 -m venv .venv"
ACTIVATE = ". .venv/bin/activate"
INSTALL = "pip install '.[dramatiq,faststream-rabbit]'"
CREATEDB = "createdb -h 127.0.0.1 -U postgres {}"
DRAMATIQ = [
    "cd examples/dramatiq",
    "inbox-middleware migrate --database-url postgresql://postgres@127.0.0.1/inbox_demo",
    'python -c "import accounts; accounts.reset_database(accounts.engine_from_env(), 5)"',
    "dramatiq service --processes 1 --threads 1",
    "python ../../docs/snippets/tutorial/dramatiq_one_order.py",
    "inbox-middleware quarantine list --database-url postgresql://postgres@127.0.0.1/inbox_demo",
]
FASTSTREAM = [
    "cd ../faststream",
    "inbox-middleware migrate --database-url postgresql://postgres@127.0.0.1/inbox_demo_faststream",
    'python -c "import asyncio, accounts; '
    'asyncio.run(accounts.reset_database(accounts.engine_from_env(), 5))"',
    "faststream run service:app",
    "python ../../docs/snippets/tutorial/faststream_one_order.py",
]
PAGE_URL = "postgresql://postgres@127.0.0.1/{}"


def page_commands() -> list[str]:
    """Every command line of the page's ``bash`` blocks, in order."""
    blocks = re.findall(r"^```bash\n(.*?)^```", TUTORIAL, flags=re.DOTALL | re.MULTILINE)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_tutorial__every_command_of_the_page_is_one_this_test_runs():
    createdb = [CREATEDB.format(name) for name in ("inbox_demo", "inbox_demo_faststream")]
    run_here = [*CLONE, VENV, ACTIVATE, INSTALL, *createdb, *DRAMATIQ, *FASTSTREAM]
    assert page_commands() == run_here


@dataclass
class Reader:
    """A shell with the tutorial's virtual environment activated."""

    venv: Path
    env: dict[str, str]
    cwd: Path = ROOT

    def argv(self, command: str) -> list[str]:
        activate = f". {shlex.quote(str(self.venv / 'bin' / 'activate'))}"
        return ["bash", "-c", f"{activate} && exec {command}"]

    def cd(self, command: str) -> None:
        assert command.startswith("cd ")
        self.cwd = (self.cwd / command.removeprefix("cd ")).resolve()

    def run(self, command: str, *, env: dict[str, str] | None = None, timeout: float = 120) -> str:
        ran = subprocess.run(
            self.argv(command),
            cwd=self.cwd,
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert ran.returncode == 0, f"{command}\n{ran.stdout}\n{ran.stderr}"
        return ran.stdout

    @contextlib.contextmanager
    def start(self, command: str, log: Path) -> Iterator[None]:
        with log.open("wb") as out:
            process = subprocess.Popen(
                self.argv(command), cwd=self.cwd, env=self.env, stdout=out, stderr=out
            )
        try:
            yield
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page's virtual environment, made and filled by its own commands."""
    wheels = wheelhouse()
    home = tmp_path_factory.mktemp("reader")
    env = offline_env()
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    # `python3` is the Python this suite runs on (3.11 or newer), not the suite's venv.
    env["PATH"] = f"{Path(sys.base_prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    made = subprocess.run(
        ["bash", "-c", VENV], cwd=home, env=env, capture_output=True, text=True, check=False
    )
    assert made.returncode == 0, made.stderr
    venv = home / ".venv"
    offline = f"pip install --no-index --find-links {shlex.quote(str(wheels))} "
    install = INSTALL.replace("pip install ", offline)
    Reader(venv, env).run(install, timeout=600)  # from the clone: `.` is this checkout
    return venv


@pytest.fixture
def databases() -> Iterator[dict[str, str]]:
    """The page's two databases, under names of their own: page name -> this run's."""
    services.require(services.POSTGRES, "PostgreSQL")
    names = {
        page: f"tutorial_{uuid.uuid4().hex[:8]}" for page in ("inbox_demo", "inbox_demo_faststream")
    }
    admin = services.with_database(services.POSTGRES, "postgres").replace("+psycopg", "")
    with psycopg.connect(admin, autocommit=True) as conn:
        for name in names.values():
            conn.execute(f'CREATE DATABASE "{name}"')
    yield names
    for name in names.values():
        database.drop_database(name)


def plain_url(name: str) -> str:
    return services.with_database(services.POSTGRES, name).replace("+psycopg", "")


def as_run(command: str, databases: dict[str, str]) -> str:
    """``command`` with the page's database URLs pointed at this run's databases."""
    for page in sorted(databases, key=len, reverse=True):
        command = command.replace(PAGE_URL.format(page), plain_url(databases[page]))
    return command


def reader_env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return env | variables


def wait_until(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def settled(url: str) -> Callable[[], bool]:
    """True once the credit and the quarantine row are both there."""

    def check() -> bool:
        engine = create_engine(url)
        try:
            with engine.connect() as conn:
                credits = conn.scalar(text("SELECT count(*) FROM credits"))
                quarantined = conn.scalar(text("SELECT count(*) FROM inbox_quarantine"))
        finally:
            engine.dispose()
        return credits == 1 and quarantined == 1

    return check


def assert_one_credit_and_one_conflict(url: str, listing: str) -> None:
    time.sleep(1)  # anything still arriving would show now
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            credits = conn.execute(text("SELECT account_id, amount FROM credits")).all()
            balance = conn.scalar(text("SELECT balance FROM accounts WHERE id = 1"))
            claims = conn.scalar(text("SELECT count(*) FROM consumer_inbox"))
    finally:
        engine.dispose()
    assert [tuple(row) for row in credits] == [(1, 25)]
    assert (balance, claims) == (25, 1)
    # (the row up to its timestamp, which differs from the tutorial's)
    line = "│ 1 │ pending  │ billing  │ orders   │ order-1000 │ identity_conflict │        1 │"
    assert line in listing
    assert line in TUTORIAL


def test_tutorial_dramatiq__one_credit_a_duplicate_skipped_a_conflict_quarantined(
    installed: Path, databases: dict[str, str], tmp_path: Path
):
    services.require(services.REDIS, "Redis")
    namespace = f"inbox-tutorial-{uuid.uuid4().hex[:8]}"
    url = services.with_database(services.POSTGRES, databases["inbox_demo"])
    reader = Reader(
        installed,
        reader_env(DATABASE_URL=url, BROKER_URL=services.REDIS, REDIS_NAMESPACE=namespace),
    )
    cd, migrate, reset, worker, send, listing = DRAMATIQ
    reader.cd(cd)
    assert "applied 0001_inbox" in reader.run(as_run(migrate, databases))
    reader.run(reset)

    log = tmp_path / "worker.log"
    try:
        with reader.start(worker, log):
            reader.run(send)
            wait_until(settled(url), "the order and the conflict")
            listed = reader.run(as_run(listing, databases))
            assert_one_credit_and_one_conflict(url, listed)
    finally:
        _delete_redis_keys(namespace)

    output = log.read_text()
    assert _logged("duplicate delivery skipped: consumer=billing producer=orders", output)
    assert _logged("identity conflict: same message id, different payload", output)


def test_tutorial_faststream__one_credit_a_duplicate_skipped_a_conflict_quarantined(
    installed: Path, databases: dict[str, str], tmp_path: Path
):
    services.require(services.RABBITMQ, "RabbitMQ")
    queue = f"accounts-tutorial-{uuid.uuid4().hex[:8]}"
    name = databases["inbox_demo_faststream"]
    env = reader_env(
        DATABASE_URL=services.with_database(services.POSTGRES, name, "asyncpg"),
        BROKER_URL=services.RABBITMQ,
        ACCOUNTS_QUEUE=queue,
    )
    reader = Reader(installed, env, cwd=ROOT / "examples" / "dramatiq")  # where Part 1 ended
    cd, migrate, reset, app, publish = FASTSTREAM
    reader.cd(cd)
    assert "applied 0001_inbox" in reader.run(as_run(migrate, databases))
    reader.run(reset)

    log = tmp_path / "app.log"
    read_url = services.with_database(services.POSTGRES, name)
    try:
        with reader.start(app, log):
            wait_until(lambda: "started successfully" in log.read_text(), "the app")
            reader.run(publish)
            wait_until(settled(read_url), "the order and the conflict")
            # The page shows this one in its text: the same listing for the second database
            listing = f"inbox-middleware quarantine list --database-url {PAGE_URL}"
            shown = listing.format("inbox_demo_faststream")
            assert f"`{shown}`" in TUTORIAL
            listed = reader.run(as_run(shown, databases))
            assert_one_credit_and_one_conflict(read_url, listed)
    finally:
        _delete_queues(queue)

    output = log.read_text()
    assert _logged(
        "duplicate delivery skipped: consumer=billing producer=orders message_id=order-1000",
        output,
    )
    assert _logged(
        "identity conflict: same message id, different payload: consumer=billing "
        "producer=orders message_id=order-1000",
        output,
    )


def _logged(line: str, output: str) -> bool:
    """``line`` is in the worker's log and in the tutorial's log excerpt."""
    return line in re.sub(r"\x1b\[[0-9;]*m", "", output) and line in TUTORIAL


def _delete_redis_keys(namespace: str) -> None:
    from redis import Redis

    client = Redis.from_url(services.REDIS)
    try:
        for key in client.scan_iter(f"{namespace}*"):
            client.delete(key)
    finally:
        client.close()


def _delete_queues(queue: str) -> None:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(services.RABBITMQ))
    try:
        channel = connection.channel()
        for name in (queue, f"{queue}.quarantine", f"{queue}.dead-letter"):
            channel.queue_delete(name)
    finally:
        connection.close()
