"""The inbox tables in a schema of their own, with a prefix (the migrations guide)."""

from __future__ import annotations

import dramatiq
from sqlalchemy import Engine

from inbox_middleware import InboxSchema
from inbox_middleware.dramatiq import InboxMiddleware

# --8<-- [start:naming]
# inbox.billing_consumer_inbox, inbox.billing_inbox_quarantine, ...
NAMING = InboxSchema(schema="inbox", prefix="billing_")


def add_inbox(broker: dramatiq.Broker, engine: Engine) -> None:
    # Give every part the same naming: the middleware, `migrate`, the command line.
    broker.add_middleware(InboxMiddleware(engine, naming=NAMING))


# --8<-- [end:naming]
