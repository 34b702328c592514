"""inbox-middleware: exactly-once effects for at-least-once delivery.

The message's identity is claimed in the same database transaction as the business
change, so a redelivered message cannot repeat its effect and an uncommitted attempt
stays retryable. Framework adapters live in `inbox_middleware.dramatiq` and
`inbox_middleware.faststream`; this package holds the framework-free core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._core.canonical import canonical_json
from ._core.exceptions import (
    ClaimInProgress,
    ConfigurationError,
    DatabaseUnavailable,
    HandlerTransactionError,
    IdentityError,
    InboxError,
    InvalidIdentity,
    MissingIdentity,
    PayloadNotHashable,
    PermanentError,
    PrerequisiteError,
    RouteUnavailable,
    SchemaError,
    TransactionConflict,
    TransientError,
    UnknownTenant,
)
from ._core.identity import MessageIdentity, PayloadHash
from ._core.protocol import Decision, Delivery
from ._core.tenancy import DatabaseMap, MapFile, TenantRange, load_map
from ._storage import Committed, Inbox, InboxSchema, Outcome, current_delivery, migrate
from ._storage.engines import engine_from_url

if TYPE_CHECKING:
    from ._storage.aio import AsyncInbox

__all__ = [
    "AsyncInbox",
    "ClaimInProgress",
    "Committed",
    "ConfigurationError",
    "DatabaseMap",
    "DatabaseUnavailable",
    "Decision",
    "Delivery",
    "HandlerTransactionError",
    "IdentityError",
    "Inbox",
    "InboxError",
    "InboxSchema",
    "InvalidIdentity",
    "MapFile",
    "MessageIdentity",
    "MissingIdentity",
    "Outcome",
    "PayloadHash",
    "PayloadNotHashable",
    "PermanentError",
    "PrerequisiteError",
    "RouteUnavailable",
    "SchemaError",
    "TenantRange",
    "TransactionConflict",
    "TransientError",
    "UnknownTenant",
    "canonical_json",
    "current_delivery",
    "engine_from_url",
    "load_map",
    "migrate",
]


def __getattr__(name: str) -> Any:
    # AsyncInbox needs SQLAlchemy's asyncio extra (greenlet): import it only when asked.
    if name == "AsyncInbox":
        from ._storage.aio import AsyncInbox

        return AsyncInbox
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
