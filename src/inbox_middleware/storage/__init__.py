"""Storage: the inbox tables, their SQL and migrations, and the executors that run the
claim protocol inside the caller's transaction."""

from .executors import AsyncInbox, Inbox, Outcome
from .migrate import LATEST_VERSION, check_schema, exclude_inbox_tables, migrate, render_sql
from .session import InboxSession
from .tables import InboxSchema

__all__ = [
    "LATEST_VERSION",
    "AsyncInbox",
    "Inbox",
    "InboxSchema",
    "InboxSession",
    "Outcome",
    "check_schema",
    "exclude_inbox_tables",
    "migrate",
    "render_sql",
]
