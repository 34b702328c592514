"""Send each effect to a Dramatiq actor (``pip install inbox-middleware[dramatiq]``).

The message carries the effect id as its inbox identity (``identity(producer=...,
message_id=effect_id)``), so an inbox actor downstream processes a re-sent effect once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..._core.optional import require

require("dramatiq", "dramatiq")

import dramatiq  # noqa: E402

from ..._core.exceptions import ConfigurationError  # noqa: E402
from ..._core.headers import message_options  # noqa: E402
from ..._core.identity import MessageIdentity  # noqa: E402
from .._destination import Effect  # noqa: E402
from .._errors import PermanentDeliveryError  # noqa: E402

__all__ = ["DramatiqDestination"]


class DramatiqDestination:
    """Enqueue a message for ``actor`` per effect.

    A JSON object payload becomes the actor's keyword arguments, an array its positional
    arguments. The actor object only names the actor, its queue and its broker: a
    producer may declare a stub with the consumer's ``actor_name`` and ``queue_name``.

    Parameters:
      actor: the actor to send to (its broker is used).
      producer: the producer name recorded in the message's inbox identity.
      tenant: the tenant of that identity, if any.
      options: more message options (``max_retries``, ...).

    Brokers' clients block, so sends run on a thread of the destination's own. On
    RabbitMQ the broker must be ``RabbitmqBroker(confirm_delivery=True)``: only then does
    an enqueue wait for RabbitMQ to confirm the message (and declare the queue again if
    it was deleted) before the effect is counted ``dispatched``.
    """

    def __init__(
        self,
        actor: dramatiq.Actor[Any, Any],
        *,
        producer: str,
        tenant: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        MessageIdentity.parse(producer=producer, message_id="check", tenant=tenant)
        broker = actor.broker
        if type(broker).__module__.startswith("dramatiq.brokers.rabbitmq") and not getattr(
            broker, "confirm_delivery", False
        ):
            raise ConfigurationError(
                "DramatiqDestination needs RabbitmqBroker(confirm_delivery=True): without "
                "it an enqueue returns before RabbitMQ has the message, and an effect it "
                "lost would be recorded dispatched"
            )
        self.actor = actor
        self.producer = producer
        self.tenant = tenant
        self.options = dict(options or {})
        self._executor: ThreadPoolExecutor | None = None

    async def deliver(self, effect: Effect, timeout: float) -> dict[str, Any]:
        payload = effect.payload
        if isinstance(payload, Mapping):
            args: tuple[Any, ...] = ()
            kwargs = dict(payload)
        elif isinstance(payload, list):
            args, kwargs = tuple(payload), {}
        else:
            raise PermanentDeliveryError(
                f"a Dramatiq effect's payload is an object (keyword arguments) or an array "
                f"(positional arguments), not {type(payload).__name__}"
            )
        message = self.actor.message_with_options(
            args=args,
            kwargs=kwargs,
            **self.options,
            **_options(self.producer, effect.effect_id, self.tenant),
        )
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="outbox-dramatiq")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.actor.broker.enqueue, message)
        return {"queue": message.queue_name, "message_id": message.message_id}

    async def aclose(self) -> None:
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)


def _options(producer: str, message_id: str, tenant: str | None) -> dict[str, Any]:
    parsed = MessageIdentity.parse(producer=producer, message_id=message_id, tenant=tenant)
    return message_options(parsed.producer, parsed.message_id, parsed.tenant, None)
