"""Claims in the compact row (the compact claim guide)."""

from __future__ import annotations

import dramatiq
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from inbox_middleware.dramatiq import InboxMiddleware
from inbox_middleware.faststream import FastStreamInbox


# --8<-- [start:compact]
def add_inbox(broker: dramatiq.Broker, engine: Engine) -> None:
    broker.add_middleware(InboxMiddleware(engine, claims="compact"))


def faststream_inbox(async_engine: AsyncEngine) -> FastStreamInbox:
    return FastStreamInbox(async_engine, claims="compact")


# --8<-- [end:compact]
