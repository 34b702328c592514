"""The FastStream guide's smaller examples: stamping identities, a batch subscriber, and
a canonical form of one's own. Each is a function, so the guide's test can run it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from faststream.rabbit import RabbitBroker
from faststream.redis import RedisBroker, StreamSub
from sqlalchemy.ext.asyncio import AsyncEngine

from inbox_middleware.faststream import (
    CanonicalForm,
    FastStreamInbox,
    InboxBatch,
    InboxSession,
    StampIdentity,
)


def stamping_broker(url: str) -> RabbitBroker:
    # --8<-- [start:stamp]
    broker = RabbitBroker(
        url,
        middlewares=[
            StampIdentity("shop", lambda order: f"order-{order['id']}", destinations={"orders"})
        ],
    )
    # --8<-- [end:stamp]
    return broker


def batch_service(engine: AsyncEngine, url: str, worker: str) -> tuple[FastStreamInbox, Any]:
    inbox = FastStreamInbox(engine)
    broker = inbox.guard(RedisBroker(url, middlewares=[inbox.middleware]))
    billing = inbox.consumer("billing")
    seen: list[list[Any]] = []

    # --8<-- [start:batch]
    @broker.subscriber(
        stream=StreamSub("orders", group="billing", consumer=worker, batch=True),
        dependencies=[billing],
    )
    @broker.subscriber(
        stream=StreamSub(
            "orders", group="billing", consumer=f"{worker}-reclaim", min_idle_time=30_000
        ),
        dependencies=[billing],
    )
    async def add_credits(
        orders: list[dict[str, Any]], session: InboxSession, batch: InboxBatch
    ) -> None:
        # `orders` holds the first-seen messages; `batch` a decision for every message:
        # FIRST, DUPLICATE, CONFLICT, or None when it was rejected (see item.rejected)
        seen.append([orders, [item.decision for item in batch]])

    # --8<-- [end:batch]
    broker.seen = seen  # type: ignore[attr-defined]
    return inbox, broker


# --8<-- [start:canonical]
def without_sent_at(body: bytes, headers: Mapping[str, Any]) -> object:
    """The order as the producer meant it: without the time each send stamps on it."""
    return {k: v for k, v in json.loads(body).items() if k != "sent_at"}


def canonical_inbox(engine: AsyncEngine) -> FastStreamInbox:
    return FastStreamInbox(engine, canonical_form=CanonicalForm("orders.v1", without_sent_at))


# --8<-- [end:canonical]
