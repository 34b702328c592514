"""`AsyncInbox`: the claim protocol on an `AsyncEngine` (asyncpg).

Imported on demand, because SQLAlchemy's asyncio support needs ``greenlet``, which a
synchronous-only installation does not have. See `executors` for the protocol's shape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from .._core import faults
from .._core.consumption import CountHandBack, Op
from .._core.exceptions import ConfigurationError
from .._core.protocol import Decision, Delivery, Verdict
from .._observe import tracing
from .base import (
    ABORTED,
    DEFAULT_LOCK_TIMEOUT,
    DEFAULT_SERIALIZATION_RETRIES,
    Attempts,
    BatchAttempts,
    BatchCommitted,
    Committed,
    Executor,
    SingleAttempts,
    any_first_seen,
    database_settings,
    guard_transaction,
    interrupted,
    leave_handler,
    log_event,
    track_aborts,
)
from .errors import as_transient
from .failures import mark_batch_recovered, mark_repaired
from .layout import check_claims
from .migrate import check_schema
from .session import ClaimSession
from .tables import InboxSchema

__all__ = ["AsyncInbox"]

R = TypeVar("R")
V = TypeVar("V")


class AsyncInbox(Executor):
    """The inbox on an `AsyncEngine` (asyncpg); parameters as for `Inbox`."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        naming: InboxSchema | None = None,
        lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT,
        serialization_retries: int = DEFAULT_SERIALIZATION_RETRIES,
        claims: str = "library",
    ) -> None:
        if not isinstance(engine, AsyncEngine):
            raise ConfigurationError(
                f"AsyncInbox needs a sqlalchemy AsyncEngine, got {type(engine).__name__}"
            )
        if engine.dialect.name == "postgresql" and engine.dialect.driver != "asyncpg":
            # The claim's one round trip and the commit's checks speak asyncpg's API.
            raise ConfigurationError(
                f"the inbox's AsyncEngine must use asyncpg, not {engine.dialect.driver} "
                "(under SQLAlchemy 2.1, postgresql:// means psycopg): create it with "
                "create_async_engine('postgresql+asyncpg://...')"
            )
        super().__init__(engine.dialect.name, naming, lock_timeout, serialization_retries, claims)
        self.engine = engine
        if engine.dialect.driver == "asyncpg":
            track_aborts(engine.sync_engine)
        guard_transaction(engine.sync_engine)
        self._session_options: dict[str, Any] = {
            "bind": engine,
            "sync_session_class": ClaimSession,
            "expire_on_commit": False,
        }

    async def check(self) -> None:
        """Verify the schema version and the database settings the guarantee relies on."""
        async with self.engine.connect() as conn:
            await conn.run_sync(check_schema, self.naming)
            await conn.run_sync(check_claims, self.naming, self.claims)
            self._check_settings(await conn.run_sync(database_settings))

    async def process(
        self,
        delivery: Delivery,
        handler: Callable[[AsyncSession], Awaitable[R]],
        *,
        before_handler: Callable[[Verdict], None] | None = None,
        repair_marker: str | None = None,
        refuse_first_seen: BaseException | None = None,
    ) -> Committed[R]:
        """Claim ``delivery`` and, when it is first seen, await ``handler`` in the same
        transaction; commit. Raises when the attempt rolled back: do not ack then. See
        `Inbox.process` for ``before_handler``, ``repair_marker`` and ``refuse_first_seen``."""

        recovered: list[str | None] = [None]

        async def body(session: AsyncSession, verdict: Verdict) -> R | None:
            if before_handler is not None:
                before_handler(verdict)
            if refuse_first_seen is not None and verdict.decision is Decision.FIRST:
                raise refuse_first_seen
            recovered[0] = result = None
            if verdict.runs_handler:
                faults.at("handler", delivery.identity.message_id)
                with tracing.phase("inbox.handler"):
                    result = await handler(session)
            if repair_marker is not None:
                recovered[0] = await session.run_sync(
                    lambda sync: mark_repaired(
                        sync.connection(), self.naming, repair_marker, delivery, verdict
                    )
                )
            return result

        attempts = SingleAttempts(delivery, self.serialization_retries)
        verdict, result, number = await self._run(attempts, body)
        return Committed(verdict, result, number, recovered[0])

    async def process_batch(
        self,
        deliveries: Sequence[Delivery],
        handler: Callable[[AsyncSession, tuple[Verdict, ...]], Awaitable[R]],
        *,
        repair_markers: Sequence[str | None] = (),
    ) -> BatchCommitted[R]:
        """See `Inbox.process_batch`."""

        recovered: list[tuple[str | None, ...]] = [()]  # the attempt that commits marks

        async def body(session: AsyncSession, verdicts: tuple[Verdict, ...]) -> R | None:
            recovered[0] = ()
            result = await handler(session, verdicts) if any_first_seen(verdicts) else None
            recovered[0] = await session.run_sync(
                lambda sync: mark_batch_recovered(
                    sync.connection(), self.naming, deliveries, verdicts, repair_markers
                )
            )
            return result

        attempts = BatchAttempts(deliveries, self.serialization_retries)
        verdicts, result, number = await self._run(attempts, body)
        return BatchCommitted(verdicts, result, number, recovered[0])

    async def _run(
        self,
        attempts: Attempts[V],
        body: Callable[[AsyncSession, V], Awaitable[R | None]],
    ) -> tuple[V, R | None, int]:
        # Every call into an AsyncSession is a greenlet switch, which costs more than the
        # claim statement itself: the claim steps run in one `run_sync`, through the same
        # `_drive` as the synchronous executor, and the commit and close in another.
        while True:
            attempts.start()
            session = AsyncSession(**self._session_options)
            closed = False
            committing = [False]
            try:
                verdict = await session.run_sync(self._claim, attempts)
                attempts.in_handler = True
                result = await body(session, verdict)
                attempts.in_handler = False
                attempts.clock = perf_counter()
                with tracing.phase("inbox.commit"):
                    await session.run_sync(self._commit_and_close, attempts.delivery, committing)
                closed = True
                attempts.committed(verdict)
                faults.at("after_commit", attempts.delivery.identity.message_id)
                return verdict, result, attempts.number
            except Exception as exc:
                await _abandon_async(session, exc, attempts.delivery)
                if not attempts.retry_now(exc):
                    raise
            except BaseException as exc:
                await _abandon_async(session, exc, attempts.delivery)
                if committing[0] or not attempts.in_handler:
                    raise interrupted(attempts.delivery, committing=committing[0]) from exc
                raise
            finally:
                leave_handler(session.sync_session)
                if not closed:
                    await session.run_sync(Session.close)

    def _commit_and_close(
        self, session: Session, delivery: Delivery | None, committing: list[bool]
    ) -> None:
        self._before_commit(session, delivery)
        committing[0] = True  # from here on, an interruption leaves the outcome unknown
        self._commit(session)
        Session.close(session)

    async def bookkeep(self, op: Op, *, before_commit: Callable[[], None] | None = None) -> Any:
        """Perform a bookkeeping operation of the consumption core in its own transaction;
        ``before_commit`` runs last in it (and may raise to roll it back)."""
        if isinstance(op, CountHandBack) and op.unreachable:
            return self._unrecorded_hand_back(op)
        try:
            # Shielded: a cancellation (the broker's connection lost, the worker stopping)
            # must not leave this short transaction's connection half returned.
            return await asyncio.shield(self._bookkeep_now(op, before_commit))
        except Exception as exc:
            self._unrecorded_hand_back(op)
            delivery = getattr(op, "delivery", None)
            if delivery is None:
                raise
            raise as_transient(exc, delivery) from exc

    async def _bookkeep_now(self, op: Op, before_commit: Callable[[], None] | None) -> Any:
        async with self.engine.begin() as conn:
            result = await conn.run_sync(self._bookkeep, op)
            if before_commit is not None:
                before_commit()
            return result

    async def transaction(self, handler: Callable[[AsyncSession], Awaitable[R]]) -> R:
        """Run ``handler`` in a transaction without any claim; see `Inbox.transaction`."""
        session = AsyncSession(**self._session_options)
        closed = False
        try:
            conn = await session.connection(execution_options=self._connection_options)
            conn.info.pop(ABORTED, None)
            result = await handler(session)
            await session.run_sync(self._commit_and_close, None, [False])
            closed = True
            return result
        except BaseException as exc:
            await _abandon_async(session, exc, None)
            raise
        finally:
            if not closed:
                await session.run_sync(Session.close)


async def _abandon_async(
    session: AsyncSession, exc: BaseException, delivery: Delivery | None
) -> None:
    leave_handler(session.sync_session)
    if delivery is not None:
        log_event(logging.INFO, "rolled_back", delivery, "rolled back", error=type(exc).__name__)
    if not isinstance(exc, Exception):
        await session.run_sync(Session.invalidate)
        return
    try:
        await session.run_sync(Session.rollback)
    except Exception:
        await session.run_sync(Session.invalidate)
