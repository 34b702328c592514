"""Every code file the documentation includes is run here, so the docs cannot drift."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import dramatiq
import pytest
from sqlalchemy import text

from inbox_middleware.dramatiq import InboxMiddleware, identity

from ..apps.domain import balance
from ..support.dramatiq_worker import drain, running_worker

ROOT = Path(__file__).resolve().parents[2]
SNIPPETS = ROOT / "docs" / "snippets"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"snippet_{name}", SNIPPETS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_own_session_snippet__joins_the_inbox_transaction(stub_broker, pg_engine, queue):
    own_session = load("own_session")
    stub_broker.add_middleware(InboxMiddleware(pg_engine))
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (7, 0), (8, 0)"))
    failures = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=0)
    def add_credit(account_id: int, amount: int) -> None:
        own_session.add_credit(account_id, amount)  # the repository commits inside
        if account_id == 8:
            failures.append(account_id)
            raise RuntimeError("fails after the repository's commit()")

    with running_worker(stub_broker, threads=1) as worker:
        for account in (7, 7, 8):
            add_credit.send_with_options(
                args=(account, 10), **identity(producer="p", message_id=f"m-{account}")
            )
        drain(stub_broker, queue, worker)

    with pg_engine.connect() as conn:
        assert (balance(conn, 7), balance(conn, 8)) == (10, 0)
    assert failures == [8]


@pytest.mark.parametrize("path", sorted(SNIPPETS.rglob("*.py")), ids=lambda p: p.name)
def test_every_snippet_is_exercised_by_a_test(path: Path):
    tests = Path(__file__).resolve().parents[1]
    users = [t for t in tests.rglob("test_*.py") if path.stem in t.read_text()]
    assert users, f"{path.relative_to(ROOT)} is not exercised by any test"
