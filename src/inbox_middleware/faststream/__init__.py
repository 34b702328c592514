"""FastStream integration: `FastStreamInbox`, `InboxSession` and the producer helpers.

```python
inbox = FastStreamInbox(async_engine)
broker = RabbitBroker(url, middlewares=[inbox.middleware])
app = FastStream(inbox.guard(broker))

@broker.subscriber("orders", dependencies=[inbox.consumer("billing", handler_version="3")])
async def handle(order: Order, session: InboxSession) -> None:
    await session.execute(...)

await broker.publish(order, "orders", persist=True,
                     headers=identity_headers(producer="shop", message_id="o-42"))
```
"""

from .._core.optional import require

require(
    "faststream", "faststream-rabbit", "faststream-redis", "faststream-nats", "faststream-kafka"
)

from ._consumer import MissingIdentityPolicy  # noqa: E402
from ._context import BatchItem, InboxBatch, InboxSession  # noqa: E402
from ._inbox import FastStreamInbox  # noqa: E402
from ._payload import CanonicalForm, StampIdentity, identity_headers  # noqa: E402

__all__ = [
    "BatchItem",
    "CanonicalForm",
    "FastStreamInbox",
    "InboxBatch",
    "InboxSession",
    "MissingIdentityPolicy",
    "StampIdentity",
    "identity_headers",
]
