"""What a user's installation needs: the sync path must not need SQLAlchemy's asyncio
extra (greenlet), and optional integrations must say which extra to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CODE = r"""
import sys
sys.modules["greenlet"] = None  # as if sqlalchemy[asyncio] were not installed
import dramatiq
from dramatiq.brokers.stub import StubBroker
from sqlalchemy import create_engine, text
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity
from inbox_middleware._storage import migrate

engine = create_engine("sqlite:///{db}")
migrate(engine)
with engine.begin() as conn:
    conn.execute(text("CREATE TABLE seen (n INTEGER)"))
broker = StubBroker()
broker.add_middleware(InboxMiddleware(engine))
dramatiq.set_broker(broker)

@dramatiq.actor(inbox_consumer="c")
def record(n: int) -> None:
    current_session().execute(text("INSERT INTO seen VALUES (:n)"), {{"n": n}})

for _ in range(3):
    record.send_with_options(args=(1,), **identity(producer="p", message_id="m"))
worker = dramatiq.Worker(broker, worker_threads=1)
worker.start(); broker.join("default"); worker.join(); worker.stop()
with engine.connect() as conn:
    print(conn.scalar(text("SELECT count(*) FROM seen")))
assert "sqlalchemy.ext.asyncio" not in sys.modules
"""


def test_sync_path_runs_without_greenlet(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-c", CODE.format(db=tmp_path / "x.db")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"


def test_missing_integration_names_the_extra():
    code = (
        "import sys; sys.modules['dramatiq'] = None\n"
        "try:\n    import inbox_middleware.dramatiq\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "run `pip install 'inbox-middleware[dramatiq]'`" in result.stdout


def test_package_description__is_for_pip_users_with_absolute_links():
    import re
    import tomllib

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    description = (root / project["readme"]).read_text()
    # The README opens with the developers' two commands; the index shows this instead.
    assert project["readme"] != "README.md" and "scripts/" not in description
    links = re.findall(r"\]\(([^)]+)\)", description)
    assert links and all(link.startswith("https://") for link in links), links
    assert "pip install 'inbox-middleware[faststream-rabbit]'" in description
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(project["urls"])
