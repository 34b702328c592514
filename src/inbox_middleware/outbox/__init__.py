"""The transactional outbox: external effects recorded in the handler's transaction and
delivered afterwards, with the effect id as the idempotency key.

```python
from inbox_middleware import outbox

outbox.add(session, destination="email", payload={"to": "a@example.com"})  # in a handler

dispatcher = outbox.Dispatcher(engine, outbox.Destinations({"email": EmailDestination()}))
await dispatcher.run()              # or: inbox-middleware outbox run --destinations app:dests
```

Shipped destinations live in `inbox_middleware.outbox.destinations` (HTTP, Dramatiq,
FastStream), each importing its own optional library only when imported.
"""

from ._destination import Destination, Destinations, Effect
from ._dispatcher import Backoff, Dispatcher, DispatcherStats
from ._errors import (
    DeliveryError,
    EffectIdRequired,
    EffectNotFound,
    InvalidEffect,
    OutboxError,
    PermanentDeliveryError,
)
from ._recording import add, effect_id_for

__all__ = [
    "Backoff",
    "DeliveryError",
    "Destination",
    "Destinations",
    "Dispatcher",
    "DispatcherStats",
    "Effect",
    "EffectIdRequired",
    "EffectNotFound",
    "InvalidEffect",
    "OutboxError",
    "PermanentDeliveryError",
    "add",
    "effect_id_for",
]
