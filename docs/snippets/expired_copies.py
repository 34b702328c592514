"""Catching copies that arrive after their claim may have been purged (the retention
guide): the window the purge uses, given to the inbox of either framework."""

from __future__ import annotations

from datetime import timedelta

import dramatiq
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from inbox_middleware.dramatiq import InboxMiddleware
from inbox_middleware.faststream import FastStreamInbox

# --8<-- [start:window]
# The window of `inbox-middleware purge --older-than 30d`: a first-seen message that a
# producer stamped longer ago than this may have been processed, and its claim purged.
RETENTION = timedelta(days=30)


def add_inbox(broker: dramatiq.Broker, engine: Engine) -> None:
    broker.add_middleware(
        InboxMiddleware(engine, retention_window=RETENTION, expired_redelivery="reject")
    )


def faststream_inbox(engine: AsyncEngine) -> FastStreamInbox:
    return FastStreamInbox(engine, retention_window=RETENTION, expired_redelivery="reject")


# --8<-- [end:window]
