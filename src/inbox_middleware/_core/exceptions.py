"""Every error the library raises, under one root.

```
InboxError
├── ConfigurationError            a setting or a declaration cannot work
│   └── PrerequisiteError         the database would break the guarantee (synchronous_commit)
├── IdentityError                 a message's identity is unusable; never retried
│   ├── MissingIdentity           no producer or message id on the message
│   └── InvalidIdentity           a value is too long, empty, not text, ...
├── PayloadNotHashable            the payload has no canonical form
├── UnknownTenant                 no database serves the message's tenant; never retried
├── HandlerTransactionError       the handler tried to end the inbox's transaction itself
│   ├── TransactionAborted        the handler swallowed a database error: nothing can commit
│   ├── ClaimNotCommitted         the transaction at COMMIT was not the claim's, or rolled back
│   └── DirectPublishRefused      the handler published directly (direct_publish="refuse")
├── PermanentError                raised by a handler: retrying cannot help (poison message)
├── SchemaError                   tables missing or older than this version expects
└── TransientError                the attempt rolled back; the message must be retried later
    ├── ClaimInProgress           another delivery of the message holds the claim (lock_timeout)
    ├── TransactionConflict       serialization failure or deadlock, after the in-process retries
    ├── DatabaseUnavailable       the database could not be reached or dropped the connection
    ├── RouteUnavailable          the tenant's database cannot be chosen now (resolver, map)
    └── InboxInterrupted          a time limit or shutdown landed outside the handler
        └── CommitUnanswered      ... while the COMMIT ran: whether it committed is unknown
```

Driver errors become these types in exactly one place, `inbox_middleware._storage.errors`:
`classify` reads what a failure means, `transient_error` builds the library's error, and
`from_driver` wraps errors raised outside SQLAlchemy's execution the way it would.
"""

from __future__ import annotations

import re

__all__ = [
    "ClaimInProgress",
    "ClaimNotCommitted",
    "CommitUnanswered",
    "ConfigurationError",
    "DatabaseUnavailable",
    "DirectPublishRefused",
    "DirectPublishWarning",
    "HandlerTransactionError",
    "IdentityError",
    "InboxError",
    "InboxInterrupted",
    "InvalidIdentity",
    "MissingIdentity",
    "PayloadNotHashable",
    "PermanentError",
    "PrerequisiteError",
    "RouteUnavailable",
    "SchemaError",
    "TransactionAborted",
    "TransactionConflict",
    "TransientError",
    "UnknownTenant",
]


_REASON_CODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class InboxError(Exception):
    """The inbox could not process a message safely."""

    def __init__(
        self,
        message: str | None = None,
        *,
        consumer: str | None = None,
        producer: str | None = None,
        message_id: str | None = None,
    ) -> None:
        self.consumer = consumer
        self.producer = producer
        self.message_id = message_id
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(InboxError):
    """The inbox is configured in a way that cannot work."""


class PrerequisiteError(ConfigurationError):
    """The database is configured in a way that breaks the inbox's guarantee."""


class IdentityError(InboxError):
    """The message's identity cannot be used; retrying will not help."""

    def __init__(self, message: str | None = None, *, field: str | None = None, **kw: str | None):
        self.field = field
        super().__init__(message, **kw)


class MissingIdentity(IdentityError):
    """The message carries no producer-assigned identity."""


class InvalidIdentity(IdentityError):
    """A value of the message's identity is malformed."""


class PayloadNotHashable(InboxError):
    """The payload has no canonical form, so duplicates cannot be told from conflicts."""

    def __init__(self, message: str | None = None, *, path: str = "$", **kw: str | None) -> None:
        self.path = path
        super().__init__(message, **kw)


class UnknownTenant(InboxError):
    """No database of the map serves the message's tenant.

    A durable rejection: the message is dead-lettered with this reason (there is no
    database of that tenant to keep a record in), never claimed in another database.
    """

    def __init__(self, message: str | None = None, *, tenant: str = "", **kw: str | None):
        self.tenant = tenant
        super().__init__(message, **kw)


class HandlerTransactionError(InboxError):
    """The handler must not commit or roll back the inbox's transaction.

    The inbox commits after the handler returns, so that the claim and the handler's
    writes land together, and rolls back when it raises. Raise an exception to abort.
    """


class TransactionAborted(HandlerTransactionError):
    """A statement failed in the handler's transaction and the handler carried on.

    PostgreSQL then ignores every statement until the transaction ends, and answers its
    COMMIT with a rollback, without an error. The inbox checks first and fails the
    attempt instead of acknowledging a message whose effects were never committed. Run a
    statement that is expected to fail in ``session.begin_nested()``.
    """


class ClaimNotCommitted(HandlerTransactionError):
    """The transaction the inbox committed was not the one that holds the claim, or its
    COMMIT was answered with ROLLBACK.

    The handler ended the claim's transaction behind the inbox (most often on the
    driver's own connection, which SQLAlchemy never sees), or left it failed. The inbox
    checks, in the same round trip as its COMMIT, that the transaction committing is the
    claim's, and reads COMMIT's reply: the attempt failed and is retried, never acked.
    """


class DirectPublishRefused(HandlerTransactionError):
    """A handler published or sent a message directly while its inbox attempt was open,
    with ``direct_publish="refuse"``: it would leave before the commit (sent even if the
    attempt rolls back) and a duplicate would not send it again. Record it with
    ``outbox.add`` instead."""


class DirectPublishWarning(RuntimeWarning):
    """The warning for the same, with ``direct_publish="warn"`` (the default)."""


class PermanentError(InboxError):
    """The message can never be processed as it is; retrying will not help.

    Raise it from a handler with a stable ``reason_code`` (``"unknown_account"``, not a
    formatted message): the attempt rolls back, the message is recorded in the poison
    table with its payload and moved to the repair destination instead of being retried.
    """

    def __init__(self, reason_code: str, message: str | None = None, **kw: str | None) -> None:
        if not _REASON_CODE.fullmatch(reason_code):
            raise ValueError(
                f"reason_code must be a short identifier (letters, digits, '_', '-', '.'), "
                f"got {reason_code!r}"
            )
        self.reason_code = reason_code
        super().__init__(message or reason_code, **kw)


class SchemaError(InboxError):
    """The inbox tables are missing or out of date; run `inbox-middleware migrate`."""


class TransientError(InboxError):
    """The attempt was rolled back; the message stays unacknowledged and is retried later."""


class ClaimInProgress(TransientError):
    """Another delivery of this message holds its claim; retry once it has settled."""


class TransactionConflict(TransientError):
    """The transaction kept failing on serialization conflicts or deadlocks."""


class DatabaseUnavailable(TransientError):
    """The database could not be reached, or the connection broke mid-transaction.

    ``retry_after``: seconds before this process tries the database again (a routed
    inbox's database found down), or None; the hand-back waits at least that long.
    ``retry_spread``: seconds after that over which its hand-backs are spread (the whole
    pause, however much of it is left), or None: ``retry_after`` itself."""

    retry_after: float | None = None
    retry_spread: float | None = None


class RouteUnavailable(TransientError):
    """The database of the message's tenant cannot be chosen or reached now: the resolver
    raised, the map is being reloaded, or the connection budget is spent. Retried later."""

    retry_after: float | None = None
    """Seconds the hand-back waits at least (its database holds all the deliveries of this
    worker it may: they may hang), or None."""
    retry_spread: float | None = None
    """Seconds after ``retry_after`` over which the hand-backs are spread, or None (see
    `DatabaseUnavailable`)."""


class InboxInterrupted(TransientError):
    """An interruption (a time limit, a worker's shutdown) landed while the inbox, not the
    handler, was at work on the message: claiming it (waiting for the database, or for a
    concurrent delivery's claim) or writing what goes with the COMMIT. No fault of the
    message: the transaction is rolled back and the message handed back, never counted as
    a failed attempt. The interruption is its ``__cause__``."""


class CommitUnanswered(InboxInterrupted):
    """An interruption landed while the COMMIT of the claim's transaction was being sent or
    answered: whether it committed is unknown, the server may still be committing it.
    Never counted as a failed attempt, so never the last one: the message is handed back,
    and its redelivery finds the claim (a duplicate, whose stored outputs are sent again)
    or runs again."""
