"""The names that carry a message's identity: headers on brokers with headers (FastStream),
message options on Dramatiq, whose messages have no headers.

The adapters and the outbox's message destinations use these names, so a message the
outbox publishes is deduplicated by a consumer using this library.
"""

from __future__ import annotations

__all__ = [
    "MESSAGE_ID",
    "OPTION_MESSAGE_ID",
    "OPTION_PRODUCED_AT",
    "OPTION_PRODUCER",
    "OPTION_TENANT",
    "PRODUCED_AT",
    "PRODUCER",
    "TENANT",
    "message_options",
]

PRODUCER = "x-inbox-producer"
MESSAGE_ID = "x-inbox-message-id"
TENANT = "x-inbox-tenant"
PRODUCED_AT = "x-inbox-produced-at"

OPTION_PRODUCER = "inbox_producer"
OPTION_MESSAGE_ID = "inbox_message_id"
OPTION_TENANT = "inbox_tenant"
OPTION_PRODUCED_AT = "inbox_produced_at"


def message_options(
    producer: str, message_id: str, tenant: str | None, produced_at: str | None
) -> dict[str, str]:
    """The Dramatiq message options of an identity validated already."""
    options = {OPTION_PRODUCER: producer, OPTION_MESSAGE_ID: message_id}
    if tenant:
        options[OPTION_TENANT] = tenant
    if produced_at is not None:
        options[OPTION_PRODUCED_AT] = produced_at
    return options
