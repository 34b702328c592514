"""Shadow mode, per consumer: claims are recorded and decided, nothing is skipped."""

from __future__ import annotations

from typing import Any

import dramatiq
from sqlalchemy import Engine, text

from inbox_middleware.dramatiq import InboxMiddleware, current_session
from inbox_middleware.faststream import FastStreamInbox, InboxSession


def dramatiq_consumer(broker: dramatiq.Broker, engine: Engine) -> Any:
    # --8<-- [start:dramatiq]
    broker.add_middleware(InboxMiddleware(engine))

    @dramatiq.actor(broker=broker, inbox_consumer="billing", inbox_shadow=True)
    def add_credit(account_id: int, delta: int) -> None:
        current_session().execute(
            text("UPDATE accounts SET balance = balance + :d WHERE id = :a"),
            {"a": account_id, "d": delta},
        )

    # --8<-- [end:dramatiq]
    return add_credit


def faststream_consumer(broker: Any, inbox: FastStreamInbox, queue: str = "orders") -> Any:
    # --8<-- [start:faststream]
    @broker.subscriber(queue, dependencies=[inbox.consumer("billing", shadow=True)])
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await session.execute(
            text("UPDATE accounts SET balance = balance + :d WHERE id = :a"),
            {"a": body["account"], "d": body["delta"]},
        )

    # --8<-- [end:faststream]
    return handle
