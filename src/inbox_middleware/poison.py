"""Failed attempts and poison messages, recorded outside the failed transaction.

A failed attempt rolls back, its claim with it, so nothing it wrote survives. What the
operator needs to know about the failure is therefore written by a separate, short
transaction after the rollback::

    attempt transaction                  failure transaction (after the rollback)
    -------------------                  ----------------------------------------
    BEGIN; INSERT claim; handler raises
    ROLLBACK                             BEGIN
                                         UPSERT inbox_attempts: attempts + 1
                                         permanent, or out of attempts:
                                           UPSERT inbox_poison with the payload
                                         COMMIT
    then: retry (transient), or move the message to repair (poison)

A failure is *permanent* when the handler raises `PermanentError` (with a stable reason
code), or an exception type the user configured as permanent. Everything else is
transient and retried by the framework, up to its bound; a message that exhausts it is
recorded as poison too, because the framework's dead-letter store may expire.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, bindparam, func, literal, select
from sqlalchemy.dialects import postgresql, sqlite

from .exceptions import PermanentError
from .protocol import Delivery
from .storage.tables import InboxSchema

__all__ = ["FailureRecorder", "PoisonRecord", "reason_code"]

# Reason codes the library itself records.
RETRIES_EXHAUSTED = "retries_exhausted"
REDELIVERY_LIMIT = "redelivery_limit"
EXPIRED_REDELIVERY = "expired_redelivery"

_ERROR_TEXT = 2000  # longest error text kept


def reason_code(exc: BaseException, permanent: Sequence[type[BaseException]] = ()) -> str | None:
    """The stable reason code when ``exc`` is permanent, else None (transient)."""
    if isinstance(exc, PermanentError):
        return exc.reason_code
    if permanent and isinstance(exc, tuple(permanent)):
        return type(exc).__name__
    return None


def describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _ERROR_TEXT else text[: _ERROR_TEXT - 1] + "…"


@dataclass(frozen=True, slots=True)
class PoisonRecord:
    id: int
    attempts: int


class FailureRecorder:
    """Writes failure counts and poison rows.

    Every method takes a connection in a transaction of its own (``engine.begin()``, or
    ``async_engine.begin()`` with ``run_sync``): never the failed attempt's.
    """

    def __init__(self, naming: InboxSchema, dialect: str) -> None:
        tables = naming.tables
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        key = ["consumer_name", "producer_name", "tenant", "message_id"]
        attempts = tables.attempts
        count = insert(attempts).values(
            **{name: bindparam(name) for name in key},
            attempts=1,
            first_failure_at=func.now(),
            last_failure_at=func.now(),
            last_error=bindparam("error"),
        )
        self._count = count.on_conflict_do_update(
            index_elements=key,
            set_={
                "attempts": attempts.c.attempts + 1,
                "last_failure_at": func.now(),
                "last_error": count.excluded.last_error,
            },
        ).returning(attempts.c.attempts)

        poison = tables.poison
        record = insert(poison).values(
            **{name: bindparam(name) for name in key},
            payload_sha256=bindparam("payload_sha256"),
            hash_scheme=bindparam("hash_scheme"),
            payload=bindparam("payload"),
            payload_format=bindparam("payload_format"),
            headers=bindparam("headers", type_=poison.c.headers.type),
            source=bindparam("source"),
            reason_code=bindparam("reason_code"),
            error=bindparam("error"),
            attempts=bindparam("attempts"),
            first_failure_at=func.now(),
            last_failure_at=func.now(),
            handler_version=bindparam("handler_version"),
            decision="pending",
        )
        # A message redriven after a repair that fails again is pending once more: the
        # row keeps its first failure time and takes everything else from this failure.
        self._poison = record.on_conflict_do_update(
            index_elements=key,
            set_={
                **{
                    name: getattr(record.excluded, name)
                    for name in (
                        "payload_sha256",
                        "hash_scheme",
                        "payload",
                        "payload_format",
                        "headers",
                        "source",
                        "reason_code",
                        "error",
                        "attempts",
                        "handler_version",
                    )
                },
                "last_failure_at": func.now(),
                "decision": "pending",
                "decided_by": None,
                "decided_at": None,
                "decision_note": None,
                "operation_id": None,
            },
        ).returning(poison.c.id, poison.c.attempts)

        redelivery = insert(attempts).values(
            **{name: bindparam(name) for name in key},
            attempts=0,
            redeliveries=1,
            first_failure_at=func.now(),
            last_failure_at=func.now(),
            last_error=bindparam("error"),
        )
        self._redelivery = redelivery.on_conflict_do_update(
            index_elements=key,
            set_={
                "redeliveries": attempts.c.redeliveries + 1,
                "last_failure_at": func.now(),
            },
        ).returning(attempts.c.redeliveries, attempts.c.attempts)

        inbox = tables.inbox
        self._claimed = select(literal(1)).where(
            *(inbox.c[name] == bindparam(name) for name in key)
        )

    def claimed(self, conn: Connection, delivery: Delivery) -> bool:
        """Whether ``delivery``'s processing committed (a redelivery of it is a duplicate)."""
        return conn.execute(self._claimed, self._key(delivery)).first() is not None

    def count_redelivery(self, conn: Connection, delivery: Delivery) -> tuple[int, int]:
        """Count one broker redelivery of ``delivery``; return (redeliveries, failures)."""
        params = self._key(delivery) | {"error": "redelivered"}
        row = conn.execute(self._redelivery, params).one()
        return int(row[0]), int(row[1])

    def count_failure(self, conn: Connection, delivery: Delivery, error: str) -> int:
        """Count one failed attempt of ``delivery``; return its failures so far."""
        params = self._key(delivery) | {"error": error}
        attempts: int = conn.execute(self._count, params).scalar_one()
        return attempts

    def record_poison(
        self,
        conn: Connection,
        delivery: Delivery,
        *,
        reason_code: str,
        error: str,
        attempts: int,
    ) -> PoisonRecord:
        """Keep ``delivery`` with its payload as poison, pending an operator's decision."""
        params = self._key(delivery) | {
            "payload_sha256": delivery.payload_hash.sha256,
            "hash_scheme": delivery.payload_hash.scheme,
            "payload": delivery.stored_payload(),
            "payload_format": delivery.payload_format,
            "headers": delivery.stored_headers(),
            "source": delivery.source,
            "reason_code": reason_code,
            "error": error,
            "attempts": attempts,
            "handler_version": delivery.handler_version,
        }
        row = conn.execute(self._poison, params).one()
        return PoisonRecord(id=row[0], attempts=row[1])

    @staticmethod
    def _key(delivery: Delivery) -> dict[str, Any]:
        consumer, producer, tenant, message_id = delivery.key
        return {
            "consumer_name": consumer,
            "producer_name": producer,
            "tenant": tenant,
            "message_id": message_id,
        }
