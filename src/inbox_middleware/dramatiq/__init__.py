"""Dramatiq integration: `InboxMiddleware`, `current_session`, `identity`, and for
producers `StampIdentity` and
`StampTraceContext`.

```python
broker.add_middleware(InboxMiddleware(engine))

@dramatiq.actor(inbox_consumer="billing", inbox_handler_version="3")
def add_credit(account_id: int, delta: int) -> None:
    current_session().execute(...)

add_credit.send_with_options(args=(7, 10), **identity(producer="orders", message_id="o-42"))
```
"""

from typing import TYPE_CHECKING, Any

from .._core.optional import require

require("dramatiq", "dramatiq")

from ._middleware import (  # noqa: E402
    InboxMiddleware,
    MissingIdentityPolicy,
    current_async_session,
    current_session,
    identity,
)
from ._payload import CanonicalForm  # noqa: E402
from ._producer import IdentityRefused, StampIdentity  # noqa: E402
from ._routing import QuarantinePublisher  # noqa: E402
from ._trace_context import StampTraceContext  # noqa: E402

__all__ = [
    "CanonicalForm",
    "IdentityRefused",
    "InboxMiddleware",
    "MissingIdentityPolicy",
    "QuarantinePublisher",
    "QuorumRabbitmqBroker",
    "StampIdentity",
    "StampTraceContext",
    "current_async_session",
    "current_session",
    "identity",
]

if TYPE_CHECKING:
    from ._quorum import QuorumRabbitmqBroker


def __getattr__(name: str) -> Any:
    # The quorum-queue broker needs dramatiq's RabbitMQ extra (pika): imported when asked.
    if name == "QuorumRabbitmqBroker":
        from ._quorum import QuorumRabbitmqBroker

        return QuorumRabbitmqBroker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
