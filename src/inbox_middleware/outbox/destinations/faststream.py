"""Publish each effect through a FastStream broker (``pip install inbox-middleware[faststream]``).

The message carries the effect id as its inbox identity in the ``x-inbox-*`` headers, so
a subscriber using this library downstream processes a re-published effect once.
"""

from __future__ import annotations

from typing import Any

from ..._optional import require

require(
    "faststream", "faststream-rabbit", "faststream-redis", "faststream-nats", "faststream-kafka"
)

from ...headers import MESSAGE_ID, PRODUCER, TENANT  # noqa: E402
from ...identity import MessageIdentity  # noqa: E402
from ..destination import Effect  # noqa: E402

__all__ = ["FastStreamDestination"]


class FastStreamDestination:
    """``await broker.publish(payload, **publish_options, headers=...)`` per effect.

    Parameters:
      broker: a FastStream broker (``RabbitBroker``, ``RedisBroker``, ``NatsBroker``, ...).
        If it is not connected yet, the destination connects it and stops it again when
        the dispatcher stops; a broker your app already runs is left running.
      producer: the producer name recorded in the message's inbox identity.
      tenant: the tenant of that identity, if any.
      publish_options: where and how to publish, as for the broker's ``publish``
        (``queue="emails"``, ``subject="..."``, ``persist=True``, ...).

    The effect's headers are sent along; the effect id is also the correlation id.
    """

    def __init__(
        self, broker: Any, *, producer: str, tenant: str | None = None, **publish_options: Any
    ) -> None:
        MessageIdentity.parse(producer=producer, message_id="check", tenant=tenant)
        self.broker = broker
        self.producer = producer
        self.tenant = tenant
        self.publish_options = publish_options
        self._connected_here = False

    async def deliver(self, effect: Effect, timeout: float) -> dict[str, Any]:
        if not self._connected_here and not _is_connected(self.broker):
            await self.broker.connect()
            self._connected_here = True
        headers = {**effect.headers, PRODUCER: self.producer, MESSAGE_ID: effect.effect_id}
        if self.tenant:
            headers[TENANT] = self.tenant
        options = {"correlation_id": effect.effect_id, **self.publish_options}
        await self.broker.publish(effect.payload, headers=headers, **options)
        return {"published": True}

    async def aclose(self) -> None:
        if self._connected_here:
            self._connected_here = False
            await self.broker.stop()


def _is_connected(broker: Any) -> bool:
    return bool(getattr(broker, "running", False) or getattr(broker, "_connection", None))
