"""Run a delivery through the claim protocol in one database transaction.

`Inbox` drives a synchronous `Engine` (psycopg, sqlite3); `AsyncInbox` (in `.aio`, which
needs SQLAlchemy's asyncio extra) an `AsyncEngine` (asyncpg). Both feed the same
`protocol.claim_steps` machine with the same `ClaimStatements`, and decide retries with
the same `base.Attempts`; they differ only in whether a call is awaited. One attempt is
the transaction drawn in `inbox_middleware._core.protocol`: `process` returns after the COMMIT
(only then may the caller ack), and raises after the ROLLBACK (the message must not be
acked), once the serialization failures and deadlocks it retries at once are spent.

An interruption that is not an `Exception` (a time limit, a task cancellation) can land
in the middle of a driver call; the connection is then invalidated, never reused.

Each attempt is measured where it happens: the claim's duration (the INSERT, including any
wait on a concurrent claim of the same message, and the look-up of a duplicate), the
commit's, and after the commit the decision, by consumer and producer (`metrics`). In
shadow mode (`Delivery.shadow`) the handler runs whatever the decision.

`process_batch` runs a batch the same way, with `protocol.claim_batch_steps`: one claim
statement for every key, one lookup for the keys already claimed, one commit; the handler
sees each delivery's verdict and runs once when at least one of them is first seen.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from .._core import faults
from .._core.consumption import (
    CountHandBack,
    Op,
)
from .._core.exceptions import (
    ConfigurationError,
)
from .._core.protocol import Decision, Delivery, Verdict
from .._observe import tracing
from .base import (
    ABORTED,
    DEFAULT_LOCK_TIMEOUT,
    DEFAULT_SERIALIZATION_RETRIES,
    Attempts,
    BatchAttempts,
    BatchCommitted,
    BatchOutcome,
    Committed,
    Executor,
    Outcome,
    SingleAttempts,
    any_first_seen,
    current_delivery,
    database_settings,
    guard_transaction,
    interrupted,
    leave_handler,
    log_event,
    shadow_verdict,
    track_aborts,
)
from .errors import as_transient
from .failures import mark_batch_recovered, mark_repaired
from .layout import check_claims
from .migrate import check_schema
from .session import ClaimSession
from .tables import InboxSchema

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "DEFAULT_SERIALIZATION_RETRIES",
    "BatchCommitted",
    "BatchOutcome",
    "Committed",
    "Inbox",
    "Outcome",
    "current_delivery",
    "shadow_verdict",
    "track_aborts",
]

R = TypeVar("R")
V = TypeVar("V")


class Inbox(Executor):
    """The inbox on a synchronous SQLAlchemy `Engine`.

    Parameters:
      engine: the engine holding your domain tables and the inbox tables.
      naming: schema and table prefix of the inbox tables.
      lock_timeout: seconds a claim waits for a concurrent delivery of the same message
        before giving up with `ClaimInProgress` (the message is retried later). It applies
        to the whole inbox transaction, so the handler's own lock waits are bounded too.
        None waits indefinitely.
      serialization_retries: how often a transaction that failed on a serialization
        failure or deadlock runs again in-process before the error is raised.
      claims: the table claims go to: ``"library"`` (``consumer_inbox``, every field of a
        claim kept) or ``"compact"`` (``inbox_claims``, about 120 bytes a remembered
        message, PostgreSQL only). A worker set to ``"compact"`` claims in both tables until
        the operator records that every worker is (``inbox-middleware claims switch``); see
        the guide on the compact claim.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        naming: InboxSchema | None = None,
        lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT,
        serialization_retries: int = DEFAULT_SERIALIZATION_RETRIES,
        claims: str = "library",
    ) -> None:
        if not isinstance(engine, Engine):
            raise ConfigurationError(
                f"Inbox needs a sqlalchemy Engine, got {type(engine).__name__}"
            )
        super().__init__(engine.dialect.name, naming, lock_timeout, serialization_retries, claims)
        self.engine = engine
        guard_transaction(engine)
        self._sessions = sessionmaker(engine, class_=ClaimSession, expire_on_commit=False)

    def check(self) -> None:
        """Verify the schema version and the database settings the guarantee relies on."""
        with self.engine.connect() as conn:
            check_schema(conn, self.naming)
            check_claims(conn, self.naming, self.claims)
            self._check_settings(database_settings(conn))

    def process(
        self,
        delivery: Delivery,
        handler: Callable[[Session], R],
        *,
        before_handler: Callable[[Verdict], None] | None = None,
        repair_marker: str | None = None,
        refuse_first_seen: BaseException | None = None,
    ) -> Committed[R]:
        """Claim ``delivery`` and, when it is first seen, run ``handler`` in the same
        transaction; commit. Raises when the attempt rolled back: do not ack then.

        ``before_handler`` sees the verdict first (and may raise to refuse the message);
        ``refuse_first_seen`` is raised instead of running the handler when the claim is
        first seen (the consumption core's refusal of an expired redelivery);
        ``repair_marker`` names the poison or quarantine row a first-seen message repairs,
        marked recovered in the same transaction (by a duplicate too: another copy
        committed the repair's effect, `Verdict.repairs`)."""

        recovered: list[str | None] = [None]

        def body(session: Session, verdict: Verdict) -> R | None:
            if before_handler is not None:
                before_handler(verdict)
            if refuse_first_seen is not None and verdict.decision is Decision.FIRST:
                raise refuse_first_seen
            recovered[0] = result = None
            if verdict.runs_handler:
                faults.at("handler", delivery.identity.message_id)
                with tracing.phase("inbox.handler"):
                    result = handler(session)
            if repair_marker is not None:
                connection = session.connection()
                recovered[0] = mark_repaired(
                    connection, self.naming, repair_marker, delivery, verdict
                )
            return result

        verdict, result, number = self._run(
            SingleAttempts(delivery, self.serialization_retries), body
        )
        return Committed(verdict, result, number, recovered[0])

    def process_batch(
        self,
        deliveries: Sequence[Delivery],
        handler: Callable[[Session, tuple[Verdict, ...]], R],
        *,
        repair_markers: Sequence[str | None] = (),
    ) -> BatchCommitted[R]:
        """Claim every delivery of a batch in one statement and, when at least one is first
        seen, run ``handler`` with every verdict (in the batch's order); commit once.
        Raises when the attempt rolled back: ack none of the batch then.
        ``repair_markers``: each delivery's, as `process` takes one; a first-seen message
        that repairs a row marks it recovered in the batch's transaction."""

        recovered: list[tuple[str | None, ...]] = [()]  # the attempt that commits marks

        def body(session: Session, verdicts: tuple[Verdict, ...]) -> R | None:
            recovered[0] = ()
            result = handler(session, verdicts) if any_first_seen(verdicts) else None
            recovered[0] = mark_batch_recovered(
                session.connection(), self.naming, deliveries, verdicts, repair_markers
            )
            return result

        attempts = BatchAttempts(deliveries, self.serialization_retries)
        verdicts, result, number = self._run(attempts, body)
        return BatchCommitted(verdicts, result, number, recovered[0])

    def _run(
        self, attempts: Attempts[V], body: Callable[[Session, V], R | None]
    ) -> tuple[V, R | None, int]:
        while True:
            attempts.start()
            session = self._sessions()
            committing = False
            try:
                verdict = self._claim(session, attempts)
                attempts.in_handler = True
                result = body(session, verdict)
                attempts.in_handler = False
                self._before_commit(session, attempts.delivery)
                attempts.clock = perf_counter()
                committing = True
                with tracing.phase("inbox.commit"):
                    self._commit(session)
                attempts.committed(verdict)
                faults.at("after_commit", attempts.delivery.identity.message_id)
                return verdict, result, attempts.number
            except Exception as exc:
                _abandon(session, exc, attempts.delivery)
                if not attempts.retry_now(exc):
                    raise
            except BaseException as exc:
                _abandon(session, exc, attempts.delivery)
                if committing or not attempts.in_handler:
                    raise interrupted(attempts.delivery, committing=committing) from exc
                raise
            finally:
                leave_handler(session)
                Session.close(session)

    def bookkeep(self, op: Op, *, before_commit: Callable[[], None] | None = None) -> Any:
        """Perform a bookkeeping operation of the consumption core in its own transaction;
        ``before_commit`` runs last in it (and may raise to roll it back)."""
        if isinstance(op, CountHandBack) and op.unreachable:
            return self._unrecorded_hand_back(op)
        try:
            with self.engine.begin() as conn:
                try:
                    result = self._bookkeep(conn, op)
                    if before_commit is not None:
                        before_commit()
                    return result
                except BaseException as exc:
                    if not isinstance(exc, Exception):
                        # an interruption (a time limit) may have landed mid-statement: the
                        # connection's state is unknown, so it is not used again
                        conn.invalidate()
                    raise
        except Exception as exc:
            self._unrecorded_hand_back(op)
            delivery = getattr(op, "delivery", None)
            if delivery is None:
                raise
            raise as_transient(exc, delivery) from exc
        except BaseException:
            self._unrecorded_hand_back(op)  # the core decides what the interruption means
            raise

    def transaction(self, handler: Callable[[Session], R]) -> R:
        """Run ``handler`` in a transaction of the same kind, without any claim.

        For work the inbox does not protect (an actor called directly, a message the
        missing-identity policy lets through): the same session rules, no deduplication.
        """
        session = self._sessions()
        try:
            session.connection(execution_options=self._connection_options).info.pop(ABORTED, None)
            result = handler(session)
            self._before_commit(session, None)
            Session.commit(session)
            return result
        except BaseException as exc:
            _abandon(session, exc, None)
            raise
        finally:
            Session.close(session)


def _abandon(session: Session, exc: BaseException, delivery: Delivery | None) -> None:
    """Roll back; invalidate instead when the attempt was interrupted mid-call."""
    leave_handler(session)
    if delivery is not None:
        log_event(logging.INFO, "rolled_back", delivery, "rolled back", error=type(exc).__name__)
    if not isinstance(exc, Exception):
        Session.invalidate(session)
        return
    try:
        Session.rollback(session)
    except Exception:
        Session.invalidate(session)
