"""What a RabbitMQ publisher confirm says, read from aio-pika's answer: shared by the
outbox's broker destination and the inbox's own quarantine and dead-letter publishes."""

from __future__ import annotations

from typing import Any

__all__ = ["unconfirmed"]


def unconfirmed(result: Any, broker: Any) -> str | None:
    """Why the answer to a ``mandatory`` publish through ``broker`` does not say that
    RabbitMQ has the message; None when it does (a publisher confirm).

    aio-pika answers a confirmed publish with the broker's ``Basic.Ack``, a returned one
    (unroutable: no queue is bound to its routing key) with the returned message, and
    with None when the channel has no publisher confirms. A ``Basic.Nack`` raises.
    FastStream's in-memory test broker answers None too, and is believed.
    """
    from pamqp.commands import Basic

    if isinstance(result, Basic.Ack):
        return None
    if result is None:
        if getattr(getattr(broker, "_channel", None), "publisher_confirms", None) is not False:
            return None  # TestRabbitBroker (a mock channel): nothing to confirm
        return (
            "the broker's channel has no publisher confirms (publisher_confirms=False), so "
            "nothing says RabbitMQ has the message; keep the default Channel()"
        )
    frame = getattr(result, "delivery", None)
    if isinstance(frame, Basic.Return):
        return (
            f"RabbitMQ returned the message: {frame.reply_code} {frame.reply_text} (no queue "
            f"is bound to routing key {frame.routing_key!r} of exchange "
            f"{frame.exchange or '(default)'!r})"
        )
    return f"RabbitMQ answered the publish with {type(result).__name__}, not a confirm"
