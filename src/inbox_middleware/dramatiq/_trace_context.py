"""The producer's trace on what a Dramatiq producer sends: `StampTraceContext`.

Dramatiq messages have no headers, so the trace context travels in the message's options,
like the identity: ``inbox_trace`` holds the W3C ``traceparent`` (and ``tracestate``,
``baggage``: whatever the global propagator writes) of the span current at ``send``. An
inbox worker with ``InboxMiddleware(..., tracing=True)`` starts each delivery's span
under it. Options are not part of the payload hash, so stamping changes no identity.
"""

from __future__ import annotations

from typing import Any

import dramatiq
from dramatiq import Broker, Message

from .._observe import tracing

__all__ = ["StampTraceContext"]


class StampTraceContext(dramatiq.Middleware):
    """Writes the current trace context into each sent message's ``inbox_trace`` option.

    Add it to the producer's broker, beside `StampIdentity` (extra ``otel``). A message
    that has the option already keeps it: Retries and the inbox's hand-backs re-enqueue
    through this middleware, and their redeliveries stay in the producer's trace.
    """

    def __init__(self) -> None:
        tracing.Tracing()  # fails here, with the extra to install, without the API

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        options = message.options
        if tracing.TRACE_OPTION in options:
            return
        carrier = tracing.inject({})
        if carrier:  # nothing is current (no span): no option
            options[tracing.TRACE_OPTION] = carrier
