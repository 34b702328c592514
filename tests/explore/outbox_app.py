"""The explorer's outbox remote, for ``inbox-middleware outbox run --destinations
tests.explore.outbox_app:destinations``.

The remote honours the idempotency key as the outbox asks of one (docs/how-to/outbox.md):
it applies each effect id once, in ``explore_outbox_received`` on the run's database
(EXPLORE_DATABASE_URL, libpq), and counts every delivery of it.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg

__all__ = ["destinations"]

_RECEIVE = (
    "INSERT INTO explore_outbox_received (effect_id, key, n, deliveries) "
    "VALUES (%s, %s, %s, 1) ON CONFLICT (effect_id) "
    "DO UPDATE SET deliveries = explore_outbox_received.deliveries + 1 RETURNING deliveries"
)


class Remote:
    async def deliver(self, effect: Any, timeout: float) -> Any:
        url = os.environ["EXPLORE_OUTBOX_URL"]
        payload = effect.payload
        async with await psycopg.AsyncConnection.connect(
            url, autocommit=True, connect_timeout=max(1, int(timeout))
        ) as conn:
            cursor = await conn.execute(_RECEIVE, (effect.effect_id, payload["key"], payload["n"]))
            row = await cursor.fetchone()
        return {"deliveries": row[0] if row else None}


destinations = {"explore": Remote()}
