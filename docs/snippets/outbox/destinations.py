"""The destinations of `inbox-middleware outbox run --destinations <module>:destinations`."""

import asyncio
import json
import os
import urllib.error
import urllib.request

from inbox_middleware.outbox import (
    DeliveryError,
    Destinations,
    Effect,
    PermanentDeliveryError,
)
from inbox_middleware.outbox.destinations.http import HttpDestination


class AuditWebhook:
    """A destination of your own: one async method, given the effect and a timeout.

    This one uses a blocking client, so it runs in a thread, and honours the timeout.
    """

    def __init__(self, url: str) -> None:
        self.url = url

    async def deliver(self, effect: Effect, timeout: float) -> dict[str, int]:
        return await asyncio.to_thread(self._post, effect, timeout)

    def _post(self, effect: Effect, timeout: float) -> dict[str, int]:
        request = urllib.request.Request(
            self.url,
            data=json.dumps(effect.payload).encode(),
            headers={"content-type": "application/json", "Idempotency-Key": effect.effect_id},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return {"status": response.status}  # recorded as the remote result
        except urllib.error.HTTPError as exc:
            if exc.code < 500 and exc.code not in (408, 409, 429):
                raise PermanentDeliveryError(f"HTTP {exc.code}") from exc  # fails at once
            raise DeliveryError(f"HTTP {exc.code}") from exc  # retried with backoff


def destinations() -> Destinations:
    return Destinations(
        {
            "receipts": HttpDestination(os.environ["RECEIPTS_URL"]),
            "audit": AuditWebhook(os.environ["AUDIT_URL"]),
        }
    )
