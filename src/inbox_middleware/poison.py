"""Poison messages: where their records are written, and the reason codes.

The decisions (what is permanent, when attempts run out) are the consumption core's
(`consumption`); the statements are in `storage.failures`. This module keeps the names
operators' code imports.
"""

from __future__ import annotations

from .consumption import (
    EXPIRED_REDELIVERY,
    HANDLER_REJECTED,
    INBOX_ERROR,
    REDELIVERY_LIMIT,
    RETRIES_EXHAUSTED,
    describe,
    reason_code,
)
from .storage.failures import FailureRecorder, PoisonRecord

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
