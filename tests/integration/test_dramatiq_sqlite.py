"""The sequential Dramatiq cases on the embedded variant: SQLite and the stub broker.

SQLite has one writer, so concurrent claims are PostgreSQL's cases; everything a single
worker thread does must behave the same here.
"""

from __future__ import annotations

import dramatiq
import pytest

from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity

from ..apps.domain import apply_credit, balance, effects
from ..support.dramatiq_worker import drain, running_worker


@pytest.fixture
def app(stub_broker, sqlite_engine, queue):
    inbox = InboxMiddleware(sqlite_engine)
    stub_broker.add_middleware(inbox)
    attempts: list[int] = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None:
        attempts.append(account_id)
        apply_credit(current_session(), "billing", account_id, delta)
        if account_id == 13 and attempts.count(13) == 1:
            raise RuntimeError("fails once after its writes")

    return inbox, add_credit, attempts


def send(actor, *args, message_id="ord-1"):
    actor.send_with_options(args=args, **identity(producer="orders", message_id=message_id))


def test_sqlite__duplicate_conflict_retry_and_dead_letter(app, stub_broker, sqlite_engine, queue):
    inbox, add_credit, attempts = app
    with running_worker(stub_broker, threads=1) as worker:
        send(add_credit, 7, 10)
        send(add_credit, 7, 10)  # duplicate
        send(add_credit, 7, 99)  # conflict
        send(add_credit, 13, 5, message_id="ord-2")  # fails once, then applies
        add_credit.send(7, 1000)  # no identity
        drain(stub_broker, queue, worker)

    with sqlite_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
        assert (effects(conn, 13), balance(conn, 13)) == (1, 5)
    assert attempts == [7, 13, 13]
    assert [m.args for m in inbox.quarantine_publisher.messages[f"{queue}.quarantine"]] == [(7, 99)]
    assert len(stub_broker.dead_letters) == 1
