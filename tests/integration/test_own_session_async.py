"""The own-session guide's async snippet, run in a FastStream handler on RabbitMQ: the
repository's commit() only releases a savepoint, so the inbox's transaction still decides."""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path
from typing import Any

from faststream.rabbit import RabbitBroker
from sqlalchemy import Engine, select, text

from inbox_middleware._storage import InboxSchema
from inbox_middleware.faststream import FastStreamInbox, InboxSession, identity_headers

from ..apps.domain import balance
from ..support import services
from ..support.faststream_brokers import eventually

SNIPPET = Path(__file__).resolve().parents[2] / "docs" / "snippets" / "own_session_async.py"


def load() -> Any:
    spec = importlib.util.spec_from_file_location("docs_snippet_own_session_async", SNIPPET)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def test_own_session_async_snippet__repository_commit_joins_the_inbox_transaction(
    pg_async_engine: Any, pg_engine: Engine
):
    services.require(services.RABBITMQ, "RabbitMQ")
    own_session = load()
    queue = f"t{uuid.uuid4().hex[:12]}"
    inbox = FastStreamInbox(pg_async_engine, max_attempts=1)
    broker = inbox.guard(RabbitBroker(services.RABBITMQ, middlewares=[inbox.middleware]))
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (7, 0), (8, 0)"))

    @broker.subscriber(queue, dependencies=[inbox.consumer("billing")])
    async def add_credit(order: dict[str, Any], session: InboxSession) -> None:
        await own_session.add_credit(session, order["account_id"], order["amount"])
        if order["account_id"] == 8:
            raise RuntimeError("fails after the repository's commit()")

    try:
        async with broker:
            await broker.start()
            for account, message_id in ((7, "o-7"), (7, "o-7"), (8, "o-8")):
                await broker.publish(
                    {"account_id": account, "amount": 10},
                    queue,
                    headers=identity_headers(producer="orders", message_id=message_id),
                )
            await eventually(lambda: _poisoned(pg_engine) == ["o-8"], what="o-8 kept as poison")
    finally:
        async with broker:
            channel = await broker._connection.channel()
            for name in (queue, f"{queue}.quarantine", f"{queue}.dead-letter"):
                await channel.queue_delete(name)

    with pg_engine.connect() as conn:
        assert (balance(conn, 7), balance(conn, 8)) == (10, 0)


def _poisoned(engine: Engine) -> list[str]:
    poison = InboxSchema().tables.poison
    with engine.connect() as conn:
        return list(conn.scalars(select(poison.c.message_id)))
