"""What a delivery's handler produced for something downstream: framework-free.

Outputs are part of the intent (design rule 7). Where something consumes a handler's
result (a FastStream subscriber's publishers or an RPC caller; a Dramatiq actor's Results
backend, pipeline step or ``on_success`` callback), the adapter encodes the result as it
will be published, and the inbox stores that `Output` in the claim's transaction. The first
delivery publishes the stored bytes; a duplicate loads them and publishes them again, so
what follows continues as if the first delivery had been acknowledged.

Messages sent on behalf of a delivery get identities derived from it (`derived_identity`):
the producer is the consumer that sent them, the id a function of the incoming key and of
the output's kind and position, so the next inbox deduplicates a replay.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from .exceptions import PermanentError
from .identity import MessageIdentity
from .protocol import Delivery, ReasonCode

__all__ = [
    "DEFAULT_MAX_OUTPUT_BYTES",
    "OUTPUTS_UNDELIVERABLE",
    "RESULT_UNSTORABLE",
    "Output",
    "derived_identity",
    "unstorable",
]

RESULT_UNSTORABLE = ReasonCode.RESULT_UNSTORABLE
"""Reason code: the result is needed downstream but cannot be encoded, or is too large."""
OUTPUTS_UNDELIVERABLE = ReasonCode.OUTPUTS_UNDELIVERABLE
"""Reason code: the stored outputs could not be published within the attempts allowed."""

DEFAULT_MAX_OUTPUT_BYTES = 1024 * 1024
"""The largest encoded result stored by default (1 MiB)."""


@dataclass(frozen=True, slots=True)
class Output:
    """A handler's result, encoded as it will be published. ``body`` None: the handler
    returned None (which is not the same as nothing stored)."""

    body: bytes | None
    content_type: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    def checked(self, limit: int | None) -> Output:
        """This output, or a `PermanentError` (``result_unstorable``) beyond ``limit``."""
        size = len(self.body or b"")
        if limit is not None and size > limit:
            raise unstorable(f"the result is {size} bytes encoded, over the {limit} limit")
        return self


def unstorable(why: str) -> PermanentError:
    """The permanent failure of a result that is needed and cannot be stored: retrying
    would run the handler, and its external effects, again."""
    return PermanentError(RESULT_UNSTORABLE, f"the handler's result cannot be stored: {why}")


def derived_identity(delivery: Delivery, kind: str, index: int = 0) -> MessageIdentity:
    """The identity of output ``index`` of ``kind`` sent on behalf of ``delivery``: the
    same on every replay, apart from the ids producers choose and from outbox effect ids."""
    consumer, producer, tenant, message_id = delivery.key
    digest = hashlib.sha256(
        "\x1f".join((consumer, producer, tenant, message_id, kind, str(index))).encode()
    ).hexdigest()
    return MessageIdentity(consumer, f"out.{kind}.{index}.{digest[:40]}", tenant=tenant)
