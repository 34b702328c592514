"""Traces: an OpenTelemetry span for every delivery, joined to the producer's trace."""

from __future__ import annotations

from typing import Any

# --8<-- [start:faststream]
from faststream.rabbit import RabbitBroker
from faststream.rabbit.opentelemetry import RabbitTelemetryMiddleware

from inbox_middleware.faststream import FastStreamInbox


def traced_middlewares(inbox: FastStreamInbox, tracer_provider: Any = None) -> list[Any]:
    # FastStream's telemetry first: it extracts the producer's context from the headers
    # and opens the "process" span; the inbox's span for the delivery nests under it.
    return [RabbitTelemetryMiddleware(tracer_provider=tracer_provider), inbox.middleware]


def traced_broker(url: str, engine: Any) -> tuple[FastStreamInbox, RabbitBroker]:
    inbox = FastStreamInbox(engine, tracing=True)  # the global tracer provider
    return inbox, RabbitBroker(url, middlewares=traced_middlewares(inbox))


# --8<-- [end:faststream]

# --8<-- [start:dramatiq]
import dramatiq  # noqa: E402

from inbox_middleware.dramatiq import InboxMiddleware, StampTraceContext  # noqa: E402


def trace_worker(broker: dramatiq.Broker, engine: Any, tracer_provider: Any = None) -> None:
    # True: the global tracer provider; or pass a TracerProvider
    broker.add_middleware(InboxMiddleware(engine, tracing=tracer_provider or True))


def trace_producer(broker: dramatiq.Broker) -> None:
    # Writes the span current at send() into the message's inbox_trace option
    broker.add_middleware(StampTraceContext())


# --8<-- [end:dramatiq]
