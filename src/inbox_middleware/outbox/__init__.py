"""The transactional outbox: external effects recorded in the handler's transaction and
delivered afterwards, with the effect id as the idempotency key.

```python
from inbox_middleware import outbox

outbox.add(session, destination="email", payload={"to": "a@example.com"})  # in a handler

dispatcher = outbox.Dispatcher(engine, outbox.Destinations({"email": EmailDestination()}))
await dispatcher.run()              # or: inbox-middleware outbox run --destinations app:dests

# a fleet over many databases: every database of the map, in a bounded round robin
dispatcher = outbox.RoutedDispatcher(database_map, destinations)  # or: outbox run --map FILE
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
from ._routed import RoutedDispatcher

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
    "RoutedDispatcher",
    "add",
    "effect_id_for",
]
