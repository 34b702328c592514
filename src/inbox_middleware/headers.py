"""Header names that carry a message's identity on brokers with headers (FastStream).

Dramatiq messages have no headers; there the same values travel in message options
(``inbox_producer``, ...). Both the FastStream adapter and the outbox's message
destinations use these names, so a message the outbox publishes is deduplicated by a
consumer using this library.
"""

from __future__ import annotations

__all__ = ["MESSAGE_ID", "PRODUCED_AT", "PRODUCER", "TENANT"]

PRODUCER = "x-inbox-producer"
MESSAGE_ID = "x-inbox-message-id"
TENANT = "x-inbox-tenant"
PRODUCED_AT = "x-inbox-produced-at"
