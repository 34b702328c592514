"""Handler versions and the three replay policies (docs/snippets/replay_policies.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import dramatiq
import pytest
from sqlalchemy import select, text

from inbox_middleware._storage import InboxSchema
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity

from ..apps.domain import apply_credit, balance, effects
from ..support.dramatiq_worker import drain, running_worker

INBOX = InboxSchema().tables.inbox
ORDERS = [("o-1", 7, 10), ("o-2", 7, 5), ("o-3", 8, 20)]


def snippets():
    path = Path(__file__).resolve().parents[2] / "docs" / "snippets" / "replay_policies.py"
    spec = importlib.util.spec_from_file_location("replay_policies", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def deploy(pg_engine) -> dramatiq.Broker:
    """A fresh worker process's broker: the way a new handler version arrives."""
    from dramatiq.brokers.stub import StubBroker

    broker = StubBroker()
    broker.add_middleware(InboxMiddleware(pg_engine))
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)
    return broker


@pytest.fixture
def worker(pg_engine, queue):
    brokers = []
    with pg_engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS balances_view (account_id integer "
                "PRIMARY KEY, balance bigint NOT NULL)"
            )
        )
        conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS projection (version integer, "
                "account_id integer, balance bigint, PRIMARY KEY (version, account_id))"
            )
        )
        conn.execute(text("DELETE FROM balances_view"))
        conn.execute(text("DELETE FROM projection"))

    def run(actor, messages, producer="orders"):
        with running_worker(actor.broker, threads=1) as running:
            for message_id, account, delta in messages:
                actor.send_with_options(
                    args=(account, delta), **identity(producer=producer, message_id=message_id)
                )
            drain(actor.broker, queue, running)

    run.deploy = lambda: brokers.append(deploy(pg_engine)) or brokers[-1]  # type: ignore[attr-defined]
    yield run
    for broker in brokers:
        broker.close()


def declare_credit(queue, version):
    @dramatiq.actor(
        queue_name=queue,
        actor_name=f"add_credit_v{version}",
        inbox_consumer="billing",
        inbox_handler_version=str(version),
    )
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    return add_credit


def test_replay__no_reapplication_skips_old_messages_and_rebuilds_the_view(
    pg_engine, queue, worker
):
    # Given three orders applied by handler version 1
    worker.deploy()
    worker(declare_credit(queue, 1), ORDERS)
    # When version 2 is deployed and the old messages are replayed to it
    worker.deploy()
    worker(declare_credit(queue, 2), ORDERS)
    # Then nothing is applied twice: every claim still names version 1
    with pg_engine.connect() as conn:
        assert effects(conn) == 3
        versions = conn.execute(select(INBOX.c.handler_version)).scalars().all()
    assert versions == ["1", "1", "1"]
    # and the derived view is rebuilt from the business tables instead
    with pg_engine.begin() as conn:
        snippets().rebuild_balances_view(conn)
        view = dict(conn.execute(text("SELECT account_id, balance FROM balances_view")).all())
    assert view == {7: 15, 8: 20}


def test_replay__versioned_projection_consumes_everything_once_more(pg_engine, queue, worker):
    module = snippets()
    worker.deploy()
    worker(module.declare_projection(1, queue), ORDERS)
    # When projection version 2 is deployed and everything is replayed to it, twice
    worker.deploy()
    v2 = module.declare_projection(2, queue)
    worker(v2, ORDERS)
    worker(v2, ORDERS)
    # Then version 2 saw each message once, and version 1's claims and rows are untouched
    with pg_engine.connect() as conn:
        found = conn.execute(text("SELECT version, account_id, balance FROM projection")).all()
        rows = {(version, account): value for version, account, value in found}
        consumers = conn.execute(select(INBOX.c.consumer_name)).scalars().all()
    assert rows == {(1, 7): 15, (1, 8): 20, (2, 7): 15, (2, 8): 20}
    assert sorted(consumers) == ["balances-projection-v1"] * 3 + ["balances-projection-v2"] * 3


def test_replay__compensated_migration_applies_each_correction_once(pg_engine, queue, worker):
    # Given orders applied by a version that credited half the amount
    worker.deploy()
    add_credit = declare_credit(queue, 1)
    worker(add_credit, [(m, a, d // 2) for m, a, d in ORDERS])
    # When a migration sends the missing halves as intents of its own, and is run twice
    corrections = [(m, a, d - d // 2) for m, a, d in ORDERS]
    for _ in range(2):
        with running_worker(add_credit.broker, threads=1) as running:
            snippets().compensate(add_credit, "fix-2026-11-half-credits", corrections)
            drain(add_credit.broker, queue, running)
    # Then every account holds the full amount, each correction applied once
    with pg_engine.connect() as conn:
        assert (balance(conn, 7), balance(conn, 8)) == (15, 20)
        assert effects(conn) == 6
        producers = conn.execute(select(INBOX.c.producer_name)).scalars().all()
    assert sorted(set(producers)) == ["migration:fix-2026-11-half-credits", "orders"]
