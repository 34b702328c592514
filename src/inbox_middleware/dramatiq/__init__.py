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
    "StampIdentity",
    "StampTraceContext",
    "current_async_session",
    "current_session",
    "identity",
]
