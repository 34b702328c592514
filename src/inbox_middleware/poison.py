"""Deprecated: ``inbox_middleware.poison`` goes in the next release.

The reason codes are `inbox_middleware.ReasonCode`; the records are the storage's. This
path keeps working for one release, with a `DeprecationWarning`.
"""

from __future__ import annotations

from ._core.consumption import (
    EXPIRED_REDELIVERY,
    HANDLER_REJECTED,
    INBOX_ERROR,
    REDELIVERY_LIMIT,
    RETRIES_EXHAUSTED,
    describe,
    reason_code,
)
from ._moved import warn_moved
from ._storage.failures import FailureRecorder, PoisonRecord

__all__ = [
    "EXPIRED_REDELIVERY",
    "HANDLER_REJECTED",
    "INBOX_ERROR",
    "REDELIVERY_LIMIT",
    "RETRIES_EXHAUSTED",
    "FailureRecorder",
    "PoisonRecord",
    "describe",
    "reason_code",
]

warn_moved(__name__, "inbox_middleware")
