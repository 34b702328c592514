"""A RabbitMQ queue that keeps what the inbox rejects, for an inbox consumer with
``dead_letter=None`` (the FastStream guide). Its test:
``tests/integration/test_faststream_broker_dead_letter.py``."""

from __future__ import annotations

from faststream.rabbit import RabbitQueue


def rejecting_to_a_queue(name: str) -> RabbitQueue:
    # --8<-- [start:queue]
    # What the inbox rejects goes to the default exchange, routed to "<name>.rejected"
    # (a queue to declare as well): subscribe with inbox.consumer(..., dead_letter=None).
    queue = RabbitQueue(
        name,
        durable=True,
        arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": f"{name}.rejected"},
    )
    # --8<-- [end:queue]
    return queue
