"""Settling one inbox message (or batch): claim, body and commit, then the broker.

The inbox acknowledges, hands back or rejects every inbox message itself, before
FastStream's acknowledgement middleware gets to it; that middleware then finds the
message settled and does nothing, whatever the subscriber's ack policy::

    inbox middleware                 PostgreSQL                    broker
    ----------------                 ----------                    ------
    headers -> identity, body -> hash
    BEGIN; INSERT claim ───────────> row (first) or conflict
    handler(body, session)
    COMMIT ────────────────────────> durable
    ack ──────────────────────────────────────────────────────────> settled
    (killed before this line: the message comes back, and is then a duplicate)

    duplicate ─────── COMMIT (nothing) ─────── ack, the handler skipped
    conflict ──────── COMMIT quarantine row ── publish to <source>.quarantine, ack
    no/bad identity ─ nothing written ──────── publish to <source>.dead-letter, ack
    failure ───────── ROLLBACK ─────────────── wait (bounded backoff), hand back (nack)

Skipped messages leave through a FastStream `AckMessage`, so no result is published for
them; a failure re-raises the handler's error, so FastStream logs it as usual.
"""

from __future__ import annotations

import copy
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from faststream.exceptions import AckMessage, HandlerException, NackMessage, RejectMessage
from sqlalchemy.ext.asyncio import AsyncSession

from ..exceptions import (
    ConfigurationError,
    IdentityError,
    InboxError,
    MissingIdentity,
    PayloadNotHashable,
    TransientError,
)
from ..identity import MessageIdentity
from ..metrics import metrics
from ..poison import (
    REDELIVERY_LIMIT,
    RETRIES_EXHAUSTED,
    FailureRecorder,
    PoisonRecord,
    describe,
    reason_code,
)
from ..protocol import Decision, Delivery, Verdict
from ..repair import mark_recovered, parse_marker
from ..retention import ExpiredPolicy, check_expired
from ..storage.errors import as_transient
from ..storage.executors import shadow_verdict
from .brokers import BrokerAdapter, Item
from .consumer import InboxConsumer, MissingIdentityPolicy, _Unset
from .context import Attempt, BatchItem, reset_attempt, set_attempt
from .payload import CanonicalForm, delivery, headers_identity

if TYPE_CHECKING:
    from ..storage.aio import AsyncInbox

__all__ = ["CONFLICT_HEADER", "REJECTED_HEADER", "REPAIR_HEADER", "Backoff", "Subscription"]

logger = logging.getLogger("inbox_middleware.faststream")

CONFLICT_HEADER = "x-inbox-conflict"
"""On a quarantined message: JSON with the conflict's details and its quarantine row id."""

REJECTED_HEADER = "x-inbox-rejected"
"""On a dead-lettered message: JSON with the consumer and the reason."""

REPAIR_HEADER = "x-inbox-repair"
"""On a redriven or accepted message: the row it repairs (``poison:12``, ``quarantine:7``)."""

CallNext = Callable[[Any], Awaitable[Any]]


class Skipped(AckMessage):
    """Settled by the inbox without running the handler (duplicate, conflict, rejected)."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class HandedBack(NackMessage):
    """Rolled back by the inbox and handed back to the broker for a later redelivery."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class Backoff:
    """Delays before handing a message back: doubling per failure of the same message
    from ``first`` up to ``limit`` seconds, remembered for the latest ``memory`` ones."""

    def __init__(self, first: float, limit: float, memory: int = 10_000) -> None:
        if not 0 < first <= limit:
            raise ConfigurationError("retry_backoff needs 0 < first <= limit seconds")
        self.first, self.limit, self.memory = first, limit, memory
        self._failures: OrderedDict[Hashable, int] = OrderedDict()

    def next(self, key: Hashable) -> float:
        count = self._failures.pop(key, 0) + 1
        self._failures[key] = count
        while len(self._failures) > self.memory:
            self._failures.popitem(last=False)
        return float(min(self.limit, self.first * 2 ** min(count - 1, 32)))

    def forget(self, key: Hashable) -> None:
        self._failures.pop(key, None)


class Subscription:
    """One inbox subscriber: its consumer's settings and its broker's adapter."""

    def __init__(
        self,
        *,
        storage: AsyncInbox,
        consumer: InboxConsumer,
        adapter: BrokerAdapter,
        missing_identity: MissingIdentityPolicy,
        canonical_form: CanonicalForm | None,
        quarantine: str,
        dead_letter: str | None,
        backoff: Backoff,
        permanent_errors: tuple[type[BaseException], ...] = (),
        max_attempts: int | None = None,
        redelivery_limit: int | None = None,
        retention_window: timedelta | None = None,
        expired_redelivery: ExpiredPolicy = "reject",
        shadow: bool = False,
    ) -> None:
        self.storage = storage
        self.permanent_errors = permanent_errors
        self.max_attempts = max_attempts
        self.redelivery_limit = redelivery_limit
        self.retention_window = retention_window
        self.expired_redelivery = expired_redelivery
        self.recorder = FailureRecorder(storage.naming, storage.dialect)
        self.consumer = consumer
        self.adapter = adapter
        self.missing_identity = consumer.missing_identity or missing_identity
        self.canonical_form = consumer.canonical_form or canonical_form
        source = adapter.source
        self.quarantine = (consumer.quarantine or quarantine).format(source=source)
        chosen = consumer.dead_letter
        if isinstance(chosen, _Unset):
            chosen = dead_letter
        self.dead_letter = chosen.format(source=source) if chosen is not None else None
        self.backoff = backoff
        self.shadow = consumer.shadow if consumer.shadow is not None else shadow

    @property
    def destinations(self) -> list[str]:
        return [self.quarantine] + ([self.dead_letter] if self.dead_letter else [])

    def describe(self) -> str:
        return f"{self.adapter.name} subscriber {self.adapter.source!r}"

    # -- one message ------------------------------------------------------------------------

    async def consume(self, call_next: CallNext, message: Any) -> Any:
        if self.adapter.batch:
            return await self._consume_batch(call_next, message)
        return await self._consume_one(call_next, message)

    async def _consume_one(self, call_next: CallNext, message: Any) -> Any:
        (item,) = self.adapter.items(message)
        try:
            claim = self.delivery(item)
        except (IdentityError, PayloadNotHashable) as exc:
            reason = _identity_reason(exc)
            missing = isinstance(exc, MissingIdentity)
            if self.shadow or (missing and self.missing_identity == "process"):
                metrics.missing_identity(self.consumer.name, reason, "processed")
                return await self._unprotected(call_next, message, item, exc)
            metrics.missing_identity(self.consumer.name, reason, "rejected")
            await self._reject(message, item, exc, hint=_SEND_IDENTITY if missing else "")

        marker = item.headers.get(REPAIR_HEADER)
        if isinstance(marker, bytes | bytearray):
            marker = bytes(marker).decode("utf-8", "replace")

        async def body(session: AsyncSession) -> Any:
            self._check_expired(claim, session)
            token = set_attempt(Attempt(session))
            try:
                result = await call_next(message)
            finally:
                reset_attempt(token)
            if marker is not None:  # a redriven or accepted message: recovered now
                await session.run_sync(
                    lambda sync: mark_recovered(sync.connection(), self.storage.naming, marker)
                )
            return result

        await self._limit_redeliveries(message, item, claim)
        try:
            outcome = await self.storage.process(claim, body)
        except HandlerException as exc:
            await self._obey(message, item, exc)
        except _INVALID as exc:
            await self._reject(message, item, Unfit(f"the message does not fit the handler: {exc}"))
        except TransientError as exc:
            await self._hand_back(message, claim.key, exc)
        except Exception as exc:
            await self._failed(message, item, claim, exc)
        self.backoff.forget(claim.key)
        if outcome.verdict.runs_handler:  # first seen, or anything in shadow mode
            await message.ack()
            if (repaired := parse_marker(marker)) is not None:
                metrics.recovered(self.consumer.name, repaired[0])
            return outcome.result
        if outcome.decision is Decision.CONFLICT:
            try:
                await self._quarantine(item, claim, outcome.verdict)
            except Exception as exc:
                await self._hand_back(message, claim.key, exc)
        await message.ack()
        raise Skipped(
            f"{outcome.decision} delivery for inbox consumer {self.consumer.name!r}: "
            + ("already processed" if outcome.decision is Decision.DUPLICATE else "quarantined")
        )

    def delivery(self, item: Item) -> Delivery:
        try:
            identity = headers_identity(item.headers)
        except MissingIdentity:
            if self.missing_identity != "broker_id" or item.broker_id is None:
                raise
            metrics.missing_identity(self.consumer.name, "missing", "broker_id")
            identity = MessageIdentity(*item.broker_id)
        claim = delivery(
            consumer=self.consumer.name,
            identity=identity,
            body=item.body,
            headers=item.headers,
            handler_version=self.consumer.handler_version,
            source=self.adapter.source,
            canonical=self.canonical_form,
            content_type=item.content_type,
        )
        return replace(claim, shadow=True) if self.shadow else claim

    def _check_expired(self, claim: Delivery, session: AsyncSession) -> None:
        policy = self.expired_redelivery
        if claim.shadow:
            if shadow_verdict(session.sync_session) is not None:
                return  # a would-be duplicate or conflict: its claim is there, not expired
            policy = "process"  # shadow mode skips nothing: counted, then processed
        check_expired(claim, self.retention_window, policy, consumer=self.consumer.name)

    async def _unprotected(
        self, call_next: CallNext, message: Any, item: Item, missing: InboxError
    ) -> Any:
        logger.warning(
            "processing a message for inbox consumer %s WITHOUT deduplication: %s (%s)",
            self.consumer.name,
            missing,
            "shadow mode" if self.shadow else "missing_identity='process'",
            extra={
                "inbox_event": "unprotected",
                "inbox_consumer": self.consumer.name,
                "inbox_identity": _identity_reason(missing),
                "inbox_shadow": self.shadow,
            },
        )

        async def body(session: AsyncSession) -> Any:
            token = set_attempt(Attempt(session))
            try:
                return await call_next(message)
            finally:
                reset_attempt(token)

        try:
            result = await self.storage.transaction(body)
        except HandlerException as exc:
            await self._obey(message, item, exc)
        except Exception as exc:
            await self._hand_back(message, ("unprotected", item.body), exc)
        await message.ack()
        return result

    # -- a batch ------------------------------------------------------------------------------

    async def _consume_batch(self, call_next: CallNext, message: Any) -> Any:
        items = self.adapter.items(message)
        claims: list[tuple[int, Delivery]] = []
        rejected: dict[int, InboxError] = {}
        for index, item in enumerate(items):
            try:
                claims.append((index, self.delivery(item)))
            except (IdentityError, PayloadNotHashable) as exc:
                metrics.missing_identity(self.consumer.name, _identity_reason(exc), "rejected")
                rejected[index] = exc
        key = ("batch", claims[0][1].key if claims else bytes(items[0].body[:64]))

        async def body(session: AsyncSession, verdicts: tuple[Verdict, ...]) -> Any:
            decided = {index: verdict for (index, _), verdict in zip(claims, verdicts, strict=True)}
            first = [index for index, _ in claims if decided[index].runs_handler]
            token = set_attempt(Attempt(session, _batch_items(items, claims, decided, rejected)))
            try:
                return await call_next(await _view(message, first))
            finally:
                reset_attempt(token)

        try:
            outcome = (
                await self.storage.process_batch([c for _, c in claims], body) if claims else None
            )
        except RejectMessage as exc:
            await self._reject_batch(message, items, _Rejected(str(exc) or "rejected"))
        except HandlerException as exc:
            await self._obey(message, items[0], exc)
        except _INVALID as exc:
            await self._reject_batch(message, items, Unfit(f"the batch does not fit: {exc}"))
        except Exception as exc:
            await self._hand_back(message, key, exc)
        self.backoff.forget(key)
        verdicts = outcome.verdicts if outcome is not None else ()
        try:
            for (index, claim), verdict in zip(claims, verdicts, strict=True):
                if verdict.decision is Decision.CONFLICT and not verdict.shadow:
                    await self._quarantine(items[index], claim, verdict)
            for index, error in rejected.items():
                await self._dead_letter(message, items[index], error, index)
        except Exception as exc:
            await self._hand_back(message, key, exc)
        await message.ack()
        if outcome is not None and any(verdict.runs_handler for verdict in verdicts):
            return outcome.result
        raise Skipped(
            f"batch of {len(items)} for inbox consumer {self.consumer.name!r}: nothing first seen"
        )

    async def _reject_batch(self, message: Any, items: list[Item], reason: InboxError) -> NoReturn:
        try:
            for index, item in enumerate(items):
                await self._dead_letter(message, item, reason, index)
        except Exception as failure:
            await self._hand_back(message, ("reject", items[0].body), failure)
        await message.ack()
        raise Skipped(f"batch rejected for inbox consumer {self.consumer.name!r}: {reason}")

    # -- settling -----------------------------------------------------------------------------

    async def _quarantine(self, item: Item, claim: Delivery, verdict: Verdict) -> None:
        # The quarantine row is committed already (the table is the source of truth); if
        # this publish fails, the message is handed back, and its redelivery records the
        # conflict again (attempts + 1) and publishes again.
        assert verdict.stored is not None
        assert verdict.quarantine is not None
        conflict = {
            "reason": "identity_conflict",
            "consumer": self.consumer.name,
            "producer": claim.identity.producer,
            "tenant": claim.identity.tenant,
            "message_id": claim.identity.message_id,
            "quarantine_id": verdict.quarantine.id,
            "attempts": verdict.quarantine.attempts,
            "stored_sha256": verdict.stored.payload_sha256,
            "conflicting_sha256": claim.payload_hash.sha256,
            "hash_scheme": claim.payload_hash.scheme,
            "source": self.adapter.source,
        }
        headers = {**item.headers, CONFLICT_HEADER: json.dumps(conflict)}
        await self.adapter.publish(self.quarantine, item, headers)
        metrics.moved(self.consumer.name, "quarantine")

    async def _reject(self, message: Any, item: Item, exc: InboxError, hint: str = "") -> NoReturn:
        try:
            await self._dead_letter(message, item, exc, None, hint)
        except Exception as failure:
            await self._hand_back(message, ("reject", item.body), failure)
        if self.dead_letter is not None:
            await message.ack()
        raise Skipped(f"rejected for inbox consumer {self.consumer.name!r}: {exc}")

    async def _dead_letter(
        self, message: Any, item: Item, exc: InboxError, index: int | None, hint: str = ""
    ) -> None:
        where = self.dead_letter or f"the {self.adapter.name} dead-letter path"
        logger.error(
            "rejecting a message for inbox consumer %s to %s: %s%s",
            self.consumer.name,
            where,
            exc,
            hint,
            extra={
                "inbox_event": "rejected",
                "inbox_consumer": self.consumer.name,
                "inbox_reason": str(exc),
                "inbox_identity": (
                    _identity_reason(exc)
                    if isinstance(exc, IdentityError | PayloadNotHashable)
                    else None
                ),
            },
        )
        if self.dead_letter is None:
            await self.adapter.reject(message, None if index is None else [index])
            return
        reason = {
            "reason": type(exc).__name__,
            "detail": str(exc),
            "consumer": self.consumer.name,
            "source": self.adapter.source,
        }
        headers = {**item.headers, REJECTED_HEADER: json.dumps(reason)}
        await self.adapter.publish(self.dead_letter, item, headers)

    async def _obey(self, message: Any, item: Item, exc: HandlerException) -> NoReturn:
        """The handler raised FastStream's own instruction; the transaction rolled back."""
        if isinstance(exc, RejectMessage):
            await self._reject(message, item, _Rejected(str(exc) or "the handler rejected it"))
        if isinstance(exc, NackMessage):
            await message.nack(**exc.extra_options)
        elif isinstance(exc, AckMessage):
            await message.ack(**exc.extra_options)
        raise exc

    async def _failed(self, message: Any, item: Item, claim: Delivery, exc: Exception) -> NoReturn:
        """Count the failure in its own transaction. A permanent failure, or one past
        ``max_attempts``, is kept as poison and moved to the dead-letter destination; any
        other is handed back for a later redelivery."""
        code = reason_code(exc, self.permanent_errors)
        error = describe(exc)
        limit = self.max_attempts

        def record(conn: Any) -> PoisonRecord | None:
            attempts = self.recorder.count_failure(conn, claim, error)
            reason = code or (RETRIES_EXHAUSTED if limit and attempts >= limit else None)
            if reason is None:
                return None
            return self.recorder.record_poison(
                conn, claim, reason_code=reason, error=error, attempts=attempts
            )

        try:
            async with self.storage.engine.begin() as conn:
                poison = await conn.run_sync(record)
        except Exception:
            logger.exception(
                "could not record the failure of a message for inbox consumer %s; it is "
                "handed back",
                self.consumer.name,
            )
            await self._hand_back(message, claim.key, exc)
        metrics.handler_failure(self.consumer.name, code or type(exc).__name__)
        if poison is None:
            await self._hand_back(message, claim.key, exc)
        await self._poisoned(message, item, claim, poison, error)

    async def _limit_redeliveries(self, message: Any, item: Item, claim: Delivery) -> None:
        """Bound crash loops: a message the broker keeps redelivering without an outcome
        (its worker killed, out of memory) is kept as poison after ``redelivery_limit``."""
        limit = self.redelivery_limit
        if limit is None:
            return
        counted = self.adapter.deliveries(message)
        if counted is None and not self.adapter.redelivered(message):
            return
        error = "redelivered: an earlier delivery ended without an outcome"

        def record(conn: Any) -> PoisonRecord | None:
            if counted is not None:  # the broker's count of deliveries
                crashes = counted - 1
            else:  # hand-backs set the flag too: crashes are what failures do not explain
                redeliveries, failures = self.recorder.count_redelivery(conn, claim)
                crashes = redeliveries - failures
            if crashes <= limit or self.recorder.claimed(conn, claim):
                return None  # within the limit, or an ack lost after the commit: a duplicate
            return self.recorder.record_poison(
                conn, claim, reason_code=REDELIVERY_LIMIT, error=error, attempts=crashes
            )

        if counted is not None and counted <= limit + 1:
            return  # the broker's own count: nothing to look up yet
        try:
            async with self.storage.engine.begin() as conn:
                poison = await conn.run_sync(record)
        except Exception as exc:
            # Before the claim, the same database trouble as in it: hand the message back.
            await self._hand_back(message, claim.key, as_transient(exc, claim))
        if poison is not None:
            await self._poisoned(message, item, claim, poison, error)

    async def _poisoned(
        self, message: Any, item: Item, claim: Delivery, poison: PoisonRecord, error: str
    ) -> NoReturn:
        metrics.moved(self.consumer.name, "poison")
        self.backoff.forget(claim.key)
        await self._reject(message, item, Poisoned(poison, error))

    async def _hand_back(self, message: Any, key: Hashable, exc: Exception) -> NoReturn:
        delay = self.backoff.next(key)
        logger.warning(
            "inbox consumer %s rolled back (%s: %s); the message is handed back in %.1fs",
            self.consumer.name,
            type(exc).__name__,
            exc,
            delay,
            extra={"inbox_consumer": self.consumer.name, "inbox_retry_in": delay},
        )
        await self.adapter.retry_later(message, delay)
        if isinstance(exc, TransientError):  # the inbox's own, logged above
            raise HandedBack(f"{type(exc).__name__}: {exc}") from exc
        raise exc  # the handler's: FastStream logs it with its traceback


def _identity_reason(exc: InboxError) -> str:
    """The ``reason`` label of a message without a usable identity."""
    if isinstance(exc, MissingIdentity):
        return "missing"
    return "unhashable" if isinstance(exc, PayloadNotHashable) else "invalid"


class _Rejected(InboxError):
    """The handler raised RejectMessage."""


class Poisoned(InboxError):
    """The message failed permanently and is kept in the poison table."""

    def __init__(self, poison: PoisonRecord, error: str) -> None:
        self.poison = poison
        super().__init__(
            f"poison message #{poison.id} after {poison.attempts} attempts ({error}); kept in "
            "the poison table with its payload"
        )


class Unfit(InboxError):
    """The message's body does not validate against the handler's parameters.

    Retrying cannot help, so it goes where messages with an unusable identity go, with
    the validation error as its reason.
    """


def _validation_errors() -> tuple[type[Exception], ...]:
    try:
        from pydantic import ValidationError
    except ImportError:  # pragma: no cover - FastStream installs pydantic
        return ()
    return (ValidationError,)


_INVALID = _validation_errors()


_SEND_IDENTITY = (
    "; publish it with headers=identity_headers(producer=..., message_id=...) "
    "(inbox_middleware.faststream)"
)


def _batch_items(
    items: list[Item],
    claims: list[tuple[int, Delivery]],
    decided: dict[int, Verdict],
    rejected: dict[int, InboxError],
) -> tuple[BatchItem, ...]:
    identities = {index: claim.identity for index, claim in claims}
    return tuple(
        BatchItem(
            index,
            decided[index].decision if index in decided else None,
            identities.get(index),
            str(rejected[index]) if index in rejected else None,
        )
        for index in range(len(items))
    )


async def _view(message: Any, first: list[int]) -> Any:
    """The batch as the handler sees it: its first-seen messages only, in order."""
    decoded = await message.decode()
    kept = [decoded[index] for index in first]

    async def decoder(_: Any) -> Any:
        return kept

    view = copy.copy(message)
    view.set_decoder(decoder)
    if message.batch_headers:
        view.batch_headers = [message.batch_headers[index] for index in first]
    return view
