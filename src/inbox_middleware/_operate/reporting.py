"""What each settlement leaves in the logs and the metrics, the same for every adapter.

The adapters call `report` once per delivery, with the settlement the consumption core
chose; the claim's own decisions (claimed, duplicate, conflict) are logged where they
are made, in the executors. Every settlement is counted here too, in memory (`tally`),
for the ``inbox_counts`` rows ``inbox-middleware status`` reads.
"""

from __future__ import annotations

import logging

from .._core.consumption import (
    EXPIRED_REDELIVERY,
    Arrival,
    DeadLettered,
    Duplicate,
    HandBackRequested,
    HandedBack,
    Poisoned,
    Processed,
    Quarantined,
    Settlement,
    identity_reason,
)
from .._core.exceptions import IdentityError, PayloadNotHashable
from .._observe.instruments import metrics
from .tally import outcome_of, tally

__all__ = ["report", "report_sent"]

logger = logging.getLogger("inbox_middleware")


def report(
    arrival: Arrival,
    settlement: Settlement,
    *,
    consumer: str,
    where: str,
    message: object = None,
    database: str = "",
) -> None:
    """Log and count ``settlement`` of ``arrival`` for ``consumer``; ``where`` names the
    dead-letter path (``the dead-letter queue``, ``orders.dead-letter``), ``message`` the
    broker's id of the message (for a message without a usable identity of its own),
    ``database`` the map's database of the delivery (a worker over many databases)."""
    tally.count(consumer, outcome_of(settlement), database)  # flushed to inbox_counts
    if (type(settlement) is Duplicate and settlement.recovered is None) or (
        type(settlement) is Processed
        and settlement.verdict is not None
        and settlement.recovered is None
        and settlement.expired is None
    ):
        return  # the common cases: logged where the claim decided them
    delivery = arrival.delivery
    fields = {
        "inbox_consumer": consumer,
        "inbox_producer": delivery.identity.producer if delivery else None,
        "inbox_message_id": delivery.identity.message_id if delivery else None,
    }
    match settlement:
        case Processed(verdict=None):
            problem = arrival.problem
            reason = identity_reason(problem) if problem is not None else "missing"
            metrics.missing_identity(consumer, reason, "processed")
            logger.warning(
                "processed a message for inbox consumer %s WITHOUT deduplication: %s",
                consumer,
                problem,
                extra=fields | {"inbox_event": "unprotected", "inbox_identity": reason},
            )
        case Processed(recovered=kind, expired=age):
            if kind is not None:
                metrics.recovered(consumer, kind)
            if age is not None:
                metrics.expired(consumer, "processed")
                logger.warning(
                    "processed message %s for %s although it was produced %s ago, beyond the "
                    "retention window: its claim may have been purged (expired_redelivery="
                    "'process')",
                    delivery.identity.message_id if delivery else "?",
                    consumer,
                    age,
                    extra=fields | {"inbox_event": "expired"},
                )
        case Duplicate():
            report_sent(settlement, consumer=consumer)
        case Quarantined():
            metrics.moved(consumer, "quarantine")
        case DeadLettered(reason=reason, error=error):
            if isinstance(error, IdentityError | PayloadNotHashable):
                metrics.missing_identity(consumer, reason, "rejected")
            logger.error(
                "rejecting a message for inbox consumer %s to %s: %s (message %s)",
                consumer,
                where,
                error,
                message,
                extra=fields | {"inbox_event": "rejected", "inbox_reason": reason},
            )
        case Poisoned(reason=reason, record=record, error=error):
            if reason == EXPIRED_REDELIVERY:
                metrics.expired(consumer, "rejected")
            metrics.handler_failure(consumer, reason)
            metrics.moved(consumer, "poison")
            logger.error(
                "poison message %s for %s (%s, %d attempts): kept in the poison table as #%d, "
                "moved to %s; %s",
                delivery.identity.message_id if delivery else "?",
                consumer,
                reason,
                record.attempts,
                record.id,
                where,
                error,
                extra=fields
                | {
                    "inbox_event": "poison",
                    "inbox_reason_code": reason,
                    "inbox_poison_id": record.id,
                },
            )
        case HandedBack(error=error, counted=True):
            metrics.handler_failure(consumer, type(_cause(error)).__name__)
        case HandedBack(error=error):
            logger.warning(
                "inbox consumer %s handed a message back for a later redelivery (%s: %s)",
                consumer,
                type(error).__name__,
                error,
                extra=fields | {"inbox_event": "handed_back", "inbox_error": type(error).__name__},
            )


def _cause(error: BaseException) -> BaseException:
    if isinstance(error, HandBackRequested) and error.cause is not None:
        return error.cause
    return error


def report_sent(settlement: Settlement, *, consumer: str) -> None:
    """Count the repair a duplicate completed: by the claim it met, or by sending its
    outputs (`outputs_sent_steps`; after the framework published them, once `report`
    told the settlement itself)."""
    if type(settlement) is Duplicate and settlement.recovered is not None:
        metrics.recovered(consumer, settlement.recovered)
