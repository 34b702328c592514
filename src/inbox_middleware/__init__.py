"""inbox-middleware: exactly-once effects for at-least-once delivery.

The message's identity is claimed in the same database transaction as the business
change, so a redelivered message cannot repeat its effect and an uncommitted attempt
stays retryable. Framework adapters live in `inbox_middleware.dramatiq` and
`inbox_middleware.faststream`, the outbox in `inbox_middleware.outbox`, monitoring in
`inbox_middleware.metrics` and the test tools in `inbox_middleware.testing`; this package
exports the framework-free core, the storage and the errors. Every other module is
private (a leading underscore): import from these facades.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._core.canonical import canonical_json
from ._core.canonical import loads as canonical_loads
from ._core.consumption import Settlement, settle_steps
from ._core.exceptions import (
    ClaimInProgress,
    ClaimNotCommitted,
    CommitUnanswered,
    ConfigurationError,
    DatabaseUnavailable,
    DirectPublishRefused,
    DirectPublishWarning,
    HandlerTransactionError,
    IdentityError,
    InboxError,
    InboxInterrupted,
    InvalidIdentity,
    MissingIdentity,
    PayloadNotHashable,
    PermanentError,
    PrerequisiteError,
    RouteUnavailable,
    SchemaError,
    TransactionAborted,
    TransactionConflict,
    TransientError,
    UnknownTenant,
)
from ._core.identity import MessageIdentity, PayloadHash
from ._core.policy import ConsumerPolicy
from ._core.protocol import Decision, Delivery, ReasonCode
from ._core.tenancy import DatabaseMap, DatabasePatience, MapFile, Router, TenantRange, load_map
from ._storage import (
    LATEST_VERSION,
    ClaimSession,
    Committed,
    Inbox,
    InboxSchema,
    Outcome,
    check_schema,
    current_delivery,
    drop_inbox,
    exclude_inbox_tables,
    migrate,
    render_sql,
)
from ._storage.engines import engine_from_url
from ._storage.routed import AsyncRoutedInbox, RoutedInbox
from ._storage.tenants import copy_tenant, delete_tenant

if TYPE_CHECKING:
    from ._storage.aio import AsyncInbox

__all__ = [
    "LATEST_VERSION",
    "AsyncInbox",
    "AsyncRoutedInbox",
    "ClaimInProgress",
    "ClaimNotCommitted",
    "ClaimSession",
    "CommitUnanswered",
    "Committed",
    "ConfigurationError",
    "ConsumerPolicy",
    "DatabaseMap",
    "DatabasePatience",
    "DatabaseUnavailable",
    "Decision",
    "Delivery",
    "DirectPublishRefused",
    "DirectPublishWarning",
    "HandlerTransactionError",
    "IdentityError",
    "Inbox",
    "InboxError",
    "InboxInterrupted",
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
    "ReasonCode",
    "RouteUnavailable",
    "RoutedInbox",
    "Router",
    "SchemaError",
    "Settlement",
    "TenantRange",
    "TransactionAborted",
    "TransactionConflict",
    "TransientError",
    "UnknownTenant",
    "canonical_json",
    "canonical_loads",
    "check_schema",
    "copy_tenant",
    "current_delivery",
    "delete_tenant",
    "drop_inbox",
    "engine_from_url",
    "exclude_inbox_tables",
    "load_map",
    "migrate",
    "render_sql",
    "settle_steps",
]


def __getattr__(name: str) -> Any:
    # AsyncInbox needs SQLAlchemy's asyncio extra (greenlet): import it only when asked.
    if name == "AsyncInbox":
        from ._storage.aio import AsyncInbox

        return AsyncInbox
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
