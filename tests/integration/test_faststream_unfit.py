"""A message is unfit for its handler only when FastStream cannot decode its body into
the handler's parameters: dead-lettered at once. A validation error raised inside the
handler (a model it builds) or while checking its return value is the handler's own
failure: counted, retried, and kept as poison when the attempts run out. On RabbitMQ and
the real PostgreSQL."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from inbox_middleware._storage import InboxSchema
from inbox_middleware.faststream import FastStreamInbox, InboxSession

from ..apps.domain import apply_credit_async
from ..support.faststream_brokers import Harness, Seen, eventually, recorder
from .test_faststream import ORDER, applied, claims, ident

TABLES = InboxSchema().tables


class Credit(BaseModel):
    account: int
    delta: int


def poison_rows(engine: Any) -> list[dict[str, Any]]:
    from sqlalchemy import select

    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(select(TABLES.poison)).mappings()]


async def run(inbox: FastStreamInbox, handler: Any, body: Any, pg_engine: Any) -> Harness:
    seen = Seen()
    h = Harness("rabbit", [recorder(seen), inbox.middleware])
    inbox.guard(h.broker)
    h.subscribe(inbox.consumer("billing"))(handler)
    try:
        async with h.broker:
            await h.broker.start()
            await h.publish(body, ident())
            await eventually(lambda: poison_rows(pg_engine), timeout=20, what="the poison row")
            h.dead = await h.read(f"{h.source}.dead-letter")  # type: ignore[attr-defined]
    finally:
        await h.cleanup()
    return h


async def test_unfit__a_model_the_handler_builds_is_an_ordinary_failure(pg_async_engine, pg_engine):
    # Given a handler whose body fits, and which then builds a model that fails validation
    attempts: list[int] = []
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.2), max_attempts=3)

    async def handle(body: Credit, session: InboxSession) -> None:
        attempts.append(1)
        await apply_credit_async(session, "billing", body.account, body.delta)
        Credit(account="seven", delta=body.delta)  # type: ignore[arg-type]

    h = await run(inbox, handle, ORDER, pg_engine)
    # Then each attempt counted, and the message is kept as poison when they ran out,
    # with the handler's error: never taken for a body that does not fit
    (row,) = poison_rows(pg_engine)
    assert (row["reason_code"], row["attempts"]) == ("retries_exhausted", 3)
    assert "ValidationError" in row["error"]
    assert len(attempts) == 3
    (dead,) = h.dead  # type: ignore[attr-defined]
    assert json.loads(dead[1]["x-inbox-rejected"])["reason"] == "Poisoned"
    assert (applied(pg_engine), claims(pg_engine)) == (0, [])


async def test_unfit__a_return_value_that_does_not_fit_is_an_ordinary_failure(
    pg_async_engine, pg_engine
):
    # Given a handler that returns a value its annotation does not allow
    attempts: list[int] = []
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.2), max_attempts=2)

    async def handle(body: Credit, session: InboxSession) -> int:
        attempts.append(1)
        await apply_credit_async(session, "billing", body.account, body.delta)
        return "not a number"  # type: ignore[return-value]

    await run(inbox, handle, ORDER, pg_engine)
    (row,) = poison_rows(pg_engine)
    assert (row["reason_code"], row["attempts"]) == ("retries_exhausted", 2)
    assert len(attempts) == 2
    assert (applied(pg_engine), claims(pg_engine)) == (0, [])
