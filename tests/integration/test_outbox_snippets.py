"""Every code file the outbox guide includes is run here, so the guide cannot drift."""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from pathlib import Path

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from inbox_middleware import outbox
from inbox_middleware._core.identity import MessageIdentity, PayloadHash
from inbox_middleware._core.protocol import Delivery
from inbox_middleware._storage import InboxSchema
from inbox_middleware.dramatiq import InboxMiddleware, identity
from inbox_middleware.outbox import Destinations, Dispatcher
from inbox_middleware.outbox.destinations.http import HttpDestination

from ..apps.domain import balance
from ..support.dramatiq_worker import drain, running_worker
from ..support.http_remote import Behaviour, Remote
from ..support.workers import wait_for

SNIPPETS = Path(__file__).resolve().parents[2] / "docs" / "snippets" / "outbox"
OUTBOX = InboxSchema().tables.outbox


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"outbox_snippet_{name}", SNIPPETS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def remotes():
    servers = Remote(), Remote()
    yield servers
    for server in servers:
        server.close()


def test_handler_snippet__records_the_receipt_with_the_credit(stub_broker, pg_engine):
    stub_broker.add_middleware(InboxMiddleware(pg_engine))
    handler = load("handler")
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (7, 0)"))

    with running_worker(stub_broker, threads=1) as worker:
        for _ in range(2):  # the same intent delivered twice
            handler.add_credit.send_with_options(
                args=(7, 10), **identity(producer="orders", message_id="o-1")
            )
        drain(stub_broker, "default", worker)

    with pg_engine.connect() as conn:
        recorded = conn.execute(select(OUTBOX.c.effect_id, OUTBOX.c.payload)).all()
        assert balance(conn, 7) == 10
    message = Delivery("billing", MessageIdentity("orders", "o-1"), PayloadHash("any", ""))
    expected = outbox.effect_id_for(message, 0)  # the payload hash is not part of the id
    assert [tuple(r) for r in recorded] == [(expected, {"account_id": 7, "amount": 10})]


def test_destinations_snippet__http_and_own_destination_deliver_with_the_key(
    pg_engine, remotes, monkeypatch
):
    receipts, audit = remotes
    audit.behaviour = Behaviour(status=404)
    monkeypatch.setenv("RECEIPTS_URL", receipts.url)
    monkeypatch.setenv("AUDIT_URL", audit.url)
    destinations = load("destinations").destinations()
    with Session(pg_engine) as session, session.begin():
        outbox.add(session, destination="receipts", payload={"n": 1}, effect_id="r-1")
        outbox.add(session, destination="audit", payload={"n": 2}, effect_id="a-1")

    asyncio.run(Dispatcher(pg_engine, destinations).run(burst=True))

    assert list(receipts.applied) == ["r-1"]
    assert audit.requests_for("a-1") == 1  # refused with 404: failed at once, not retried
    with pg_engine.connect() as conn:
        statuses = dict(conn.execute(select(OUTBOX.c.effect_id, OUTBOX.c.status)).all())
    assert statuses == {"r-1": "dispatched", "a-1": "failed"}


def test_in_process_snippet__asyncio_task_and_thread_dispatch_and_stop(pg_engine, remotes):
    in_process = load("in_process")
    receipts, _ = remotes

    def record(effect_id: str) -> None:
        with Session(pg_engine) as session, session.begin():
            outbox.add(session, destination="receipts", payload={}, effect_id=effect_id)

    async def in_asyncio() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(
            in_process.serve(
                pg_engine, Destinations({"receipts": HttpDestination(receipts.url)}), stop
            )
        )
        record("async-1")
        while receipts.requests_for("async-1") == 0:
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 10)

    asyncio.run(in_asyncio())

    dispatcher, thread = in_process.start_in_a_thread(
        pg_engine, Destinations({"receipts": HttpDestination(receipts.url)})
    )
    record("thread-1")
    wait_for(lambda: receipts.requests_for("thread-1") == 1, timeout=10, what="the delivery")
    in_process.stop_the_thread(dispatcher, thread)
    assert not thread.is_alive()
    assert isinstance(thread, threading.Thread)
    assert sorted(receipts.applied) == ["async-1", "thread-1"]


@pytest.mark.parametrize("path", sorted(SNIPPETS.glob("*.py")), ids=lambda p: p.name)
def test_every_outbox_snippet_is_covered_here(path: Path):
    assert f'load("{path.stem}")' in Path(__file__).read_text(), f"{path.name} is not exercised"
