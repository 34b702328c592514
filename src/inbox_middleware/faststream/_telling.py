"""What the FastStream adapter tells FastStream: the exceptions that end a settled
message's consume scope, and the headers a quarantined, dead-lettered or repaired message
carries."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from faststream.exceptions import AckMessage, NackMessage

__all__ = [
    "ACKED",
    "CONFLICT_HEADER",
    "REJECTED_HEADER",
    "REPAIR_HEADER",
    "NackForRedelivery",
    "QuietTold",
    "Skipped",
    "message_id_of",
]

CONFLICT_HEADER = "x-inbox-conflict"
"""On a quarantined message: JSON with the conflict's details and its quarantine row id."""

REJECTED_HEADER = "x-inbox-rejected"
"""On a dead-lettered message: JSON with the consumer and the reason."""

REPAIR_HEADER = "x-inbox-repair"
"""On a redriven or accepted message: the row it repairs (``poison:12``, ``quarantine:7``)."""


class _Told(str):
    """A settlement's reason the inbox logged already, with its level and fields."""


class Skipped(AckMessage):
    """Settled by the inbox without running the handler (duplicate, conflict, rejected).

    FastStream logs the text of the exception that ends a consume scope; with ``logged``
    (the inbox logged the decision itself) `QuietTold` drops that second line.
    """

    def __init__(self, reason: str, *, logged: bool = True) -> None:
        super().__init__()
        self.reason = _Told(reason) if logged else reason

    def __str__(self) -> str:
        return self.reason


class NackForRedelivery(NackMessage):
    """Rolled back by the inbox and handed back to the broker for a later redelivery."""

    def __init__(self, reason: str, *, logged: bool = False) -> None:
        super().__init__()
        self.reason = _Told(reason) if logged else reason

    def __str__(self) -> str:
        return self.reason


class _Acknowledged:
    """The handler raised `AckMessage`: its work commits, then the message is acked."""


ACKED = _Acknowledged()


class QuietTold(logging.Filter):
    """On FastStream's logger of a subscriber's lines: drops the line FastStream writes
    with the text of a `Skipped` or `NackForRedelivery` whose decision the inbox logged already
    (one decision, one line, at the inbox's level)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not isinstance(record.msg, _Told)

    @classmethod
    def install(cls, logger: logging.Logger) -> None:
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())


def message_id_of(headers: Mapping[str, Any]) -> str | None:
    """The ``x-inbox-message-id`` header as text, if there is one."""
    value = headers.get("x-inbox-message-id")
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("utf-8", "replace")
    return value if isinstance(value, str) else None
