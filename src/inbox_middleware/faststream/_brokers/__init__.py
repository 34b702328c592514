"""One `BrokerAdapter` per FastStream broker; each imported only when its broker is used."""

from __future__ import annotations

import importlib
from typing import Any

from ..._core.exceptions import ConfigurationError
from .base import BrokerAdapter, Item, Peer

__all__ = ["BrokerAdapter", "Item", "Peer", "adapter_for"]

_ADAPTERS = {
    "faststream.rabbit": ("rabbit", "RabbitAdapter"),
    "faststream.redis": ("redis", "RedisAdapter"),
    "faststream.nats": ("nats", "NatsAdapter"),
    "faststream.kafka": ("kafka", "KafkaAdapter"),
}


def adapter_for(broker: Any, subscriber: Any) -> BrokerAdapter:
    """The adapter for ``subscriber``, chosen by the FastStream package that made it."""
    module = type(subscriber).__module__
    for package, (name, cls) in _ADAPTERS.items():
        if module == package or module.startswith(package + "."):
            adapter: type[BrokerAdapter] = getattr(
                importlib.import_module(f"{__name__}.{name}"), cls
            )
            return adapter(broker, subscriber)
    raise ConfigurationError(
        f"the inbox supports RabbitMQ, Redis streams, NATS JetStream and Kafka subscribers, "
        f"not {type(subscriber).__name__} ({module})"
    )
