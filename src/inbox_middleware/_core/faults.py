"""Named points in the life of one delivery, where the test suite injects faults.

The fault-injection suite runs real workers that set `hook` (from their own code, never
from a message) and then kills the process, cuts its database connection, restarts the
database or raises at one point. In production no hook is set, and each point costs one
global lookup. The points, in the order a delivery meets them::

    check               the start-up check run at the first message (FastStream without guard)
    before_claim        the delivery is prepared; nothing is written yet
    claim               the claim INSERT is done, its transaction still open
    handler             the handler is about to run, inside the claim's transaction
    commit              the handler returned; COMMIT is about to be sent
    after_commit        COMMIT returned; the broker has not been told yet
    outputs_published   FastStream published the stored outputs; the ack is next
    settle              the broker is about to be told the outcome (ack, nack, fail)
    record              a failure, hand-back or poison row is about to be written
    quarantine_publish  a conflicting message is about to be published to quarantine
    dead_letter_publish a rejected or poisoned message is about to be dead-lettered
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["POINTS", "at", "hook"]

POINTS = (
    "check",
    "before_claim",
    "claim",
    "handler",
    "commit",
    "after_commit",
    "outputs_published",
    "settle",
    "record",
    "quarantine_publish",
    "dead_letter_publish",
)

hook: Callable[[str, str | None], None] | None = None
"""Called with the point's name and the delivery's message id (None where no identity is
known yet, or for a batch); set only by the test suite's workers, and by the pytest
plugin's ``rolled_back`` scenario for the duration of the scenario."""


def at(point: str, message_id: str | None = None) -> None:
    """Mark ``point``; the hook, when set, may raise, block or kill the process."""
    if hook is not None:
        hook(point, message_id)
