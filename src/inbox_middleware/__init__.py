"""inbox-middleware: exactly-once effects for at-least-once delivery.

The message's identity is claimed in the same database transaction as the business
change, so a redelivered message cannot repeat its effect and an uncommitted attempt
stays retryable. Framework adapters live in `inbox_middleware.dramatiq` and
`inbox_middleware.faststream`; this package holds the framework-free core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .canonical import canonical_json
from .exceptions import (
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
from .identity import MessageIdentity, PayloadHash
from .protocol import Decision, Delivery
from .storage import Committed, Inbox, InboxSchema, Outcome, current_delivery, migrate
from .storage.engines import engine_from_url
from .tenancy import DatabaseMap, MapFile, TenantRange, load_map

if TYPE_CHECKING:
    from .storage.aio import AsyncInbox

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
        from .storage.aio import AsyncInbox

        return AsyncInbox
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
