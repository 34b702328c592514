"""Storage: the inbox tables, their SQL and migrations, and the executors that run the
claim protocol inside the caller's transaction."""

from typing import TYPE_CHECKING, Any

from .executors import Committed, Inbox, Outcome, current_delivery
from .migrate import (
    LATEST_VERSION,
    check_schema,
    drop_inbox,
    exclude_inbox_tables,
    migrate,
    render_sql,
)
from .session import ClaimSession
from .tables import InboxSchema

__all__ = [
    "LATEST_VERSION",
    "AsyncInbox",
    "ClaimSession",
    "Committed",
    "Inbox",
    "InboxSchema",
    "Outcome",
    "check_schema",
    "current_delivery",
    "drop_inbox",
    "exclude_inbox_tables",
    "migrate",
    "render_sql",
]

if TYPE_CHECKING:
    from .aio import AsyncInbox


def __getattr__(name: str) -> Any:
    # AsyncInbox needs SQLAlchemy's asyncio extra (greenlet): import it only when asked.
    if name == "AsyncInbox":
        from .aio import AsyncInbox

        return AsyncInbox
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
