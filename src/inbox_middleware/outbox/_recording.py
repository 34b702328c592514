"""Recording effects in the handler's transaction: `add` and the derived effect ids.

An effect is a row in ``message_outbox`` written through the handler's own session, so it
commits with the claim and the domain writes, or rolls back with them::

    handler transaction                               later, outside it
    -------------------                               -----------------
    BEGIN; INSERT claim
    domain writes
    outbox.add(...)  -> INSERT effect ON CONFLICT DO NOTHING
    COMMIT  ─────────── effect durable ─────────────> dispatcher leases, delivers, records
    (ROLLBACK instead: no effect; the retry records it again under the same id)

Inside an inbox handler the effect id is derived from the message's identity and the
effect's index among the handler's effects, so the same message processed again after a
rollback derives the same ids. Each attempt runs in a fresh session, so the index starts
from 0 again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Coroutine, Mapping
from typing import TYPE_CHECKING, Any, cast, overload

from sqlalchemy import event
from sqlalchemy.orm import Session

from .._core.canonical_v1 import (
    canonical_json,  # frozen: fx1 ids must not change with the hash scheme
)
from .._core.exceptions import IdentityError
from .._core.identity import MAX_MESSAGE_ID_LENGTH, MAX_NAME_LENGTH, validate_name
from .._core.protocol import Delivery
from .._storage.executors import current_delivery
from .._storage.tables import InboxSchema
from ._destination import validate_destination
from ._errors import EffectIdRequired, InvalidEffect, OutboxError
from ._statements import OutboxStatements, statements_for

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

__all__ = ["EFFECT_ID_SCHEME", "add", "effect_id_for"]

EFFECT_ID_SCHEME = "fx1"
"""Prefix of derived effect ids; names the derivation below."""

_COUNTER_KEY = "inbox_middleware.outbox.effect_index"
_UNAWAITED_KEY = "inbox_middleware.outbox.unawaited"


def effect_id_for(delivery: Delivery, index: int) -> str:
    """The effect id `add` derives for the ``index``-th effect (from 0) of a delivery.

    ``fx1-`` and the SHA-256 of the canonical JSON array of the consumer, producer,
    tenant, message id and index: stable, unambiguous whatever the names contain, and 68
    characters long, so it is itself a valid message id for an inbox downstream.
    """
    identity = delivery.identity
    material = canonical_json(
        [
            "inbox-middleware/effect",
            delivery.consumer,
            identity.producer,
            identity.tenant,
            identity.message_id,
            index,
        ]
    )
    return f"{EFFECT_ID_SCHEME}-{hashlib.sha256(material).hexdigest()}"


@overload
def add(
    session: Session,
    *,
    destination: str,
    payload: Any,
    headers: Mapping[str, str] | None = None,
    effect_id: str | None = None,
    naming: InboxSchema | None = None,
    notify: bool = False,
) -> str: ...


@overload
def add(
    session: AsyncSession,
    *,
    destination: str,
    payload: Any,
    headers: Mapping[str, str] | None = None,
    effect_id: str | None = None,
    naming: InboxSchema | None = None,
    notify: bool = False,
) -> Coroutine[Any, Any, str]: ...


def add(
    session: Session | AsyncSession,
    *,
    destination: str,
    payload: Any,
    headers: Mapping[str, str] | None = None,
    effect_id: str | None = None,
    naming: InboxSchema | None = None,
    notify: bool = False,
) -> str | Coroutine[Any, Any, str]:
    """Record an effect in ``session``'s transaction; return its effect id.

    With an `AsyncSession` it returns a coroutine: ``await outbox.add(session, ...)``.
    A transaction that would commit with an un-awaited ``add`` is refused instead.

    Parameters:
      session: the handler's session (or any session whose transaction should carry the
        effect). Outside an inbox handler, ``effect_id`` is required.
      destination: the registered destination that will deliver it.
      payload: a JSON value, handed to the destination.
      headers: text headers handed to the destination along with the payload.
      effect_id: the effect's stable id; by default derived from the inbox identity of
        the message being handled and the effect's index within the handler.
      naming: schema and table prefix of the outbox table.
      notify: on PostgreSQL, also ``NOTIFY`` dispatchers that LISTEN (delivered at commit).
        Off by default: a notifying commit takes a database-wide lock.
    """
    sync = _sync_session(session)
    params = _effect(sync, destination, payload, headers, effect_id)
    dialect = sync.get_bind().dialect.name
    statements = statements_for(naming or InboxSchema(), dialect)
    notify = notify and dialect == "postgresql"
    if sync is session:
        _record(sync, statements, params, notify)
        return str(params["effect_id"])
    _expect_await(sync)
    return _record_async(cast("AsyncSession", session), statements, params, notify)


def _record(
    session: Session, statements: OutboxStatements, params: dict[str, Any], notify: bool
) -> None:
    session.execute(statements.insert, params)
    if notify:
        session.execute(statements.notify, {"channel": statements.channel})


async def _record_async(
    session: AsyncSession, statements: OutboxStatements, params: dict[str, Any], notify: bool
) -> str:
    session.sync_session.info[_UNAWAITED_KEY] -= 1
    await session.run_sync(_record, statements, params, notify)
    return str(params["effect_id"])


def _sync_session(session: object) -> Session:
    if isinstance(session, Session):
        return session
    sync = getattr(session, "sync_session", None)
    if isinstance(sync, Session):  # an AsyncSession
        return sync
    raise TypeError(f"outbox.add needs a Session or an AsyncSession, got {type(session).__name__}")


def _effect(
    session: Session,
    destination: str,
    payload: Any,
    headers: Mapping[str, str] | None,
    effect_id: str | None,
) -> dict[str, Any]:
    try:
        destination = validate_destination(destination)
    except Exception as exc:
        raise InvalidEffect(str(exc)) from None
    try:
        json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidEffect(f"the payload of a {destination!r} effect is not JSON: {exc}") from None
    return {
        "effect_id": _effect_id(session, effect_id),
        "destination": destination,
        "payload": payload,
        "headers": _headers(headers),
    }


def _effect_id(session: Session, effect_id: str | None) -> str:
    if effect_id is not None:
        try:
            return validate_name(effect_id, "effect_id", max_length=MAX_MESSAGE_ID_LENGTH)
        except IdentityError as exc:
            raise InvalidEffect(str(exc)) from None
    delivery = current_delivery(session)
    if delivery is None:
        raise EffectIdRequired(
            "outbox.add(...) outside an inbox handler needs effect_id=...: a stable id for "
            "this effect, the same on every retry of the transaction"
        )
    # The counter belongs to this delivery's attempt: the inbox opens a fresh session for
    # every attempt, so an attempt that rolled back gives its successor indexes from 0.
    owner, index = session.info.get(_COUNTER_KEY, (None, 0))
    if owner is not delivery:
        index = 0
    session.info[_COUNTER_KEY] = (delivery, index + 1)
    return effect_id_for(delivery, index)


def _headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    checked: dict[str, str] = {}
    for name, value in (headers or {}).items():
        try:
            validate_name(name, "header name", max_length=MAX_NAME_LENGTH)
        except IdentityError as exc:
            raise InvalidEffect(str(exc)) from None
        if not isinstance(value, str):
            raise InvalidEffect(f"header {name!r} must be text, got {type(value).__name__}")
        checked[name] = value
    return checked


def _expect_await(session: Session) -> None:
    """Refuse to commit a transaction whose ``await outbox.add(...)`` was forgotten."""
    if _UNAWAITED_KEY not in session.info:
        session.info[_UNAWAITED_KEY] = 0
        event.listen(session, "before_commit", _refuse_unawaited)
    session.info[_UNAWAITED_KEY] += 1


def _refuse_unawaited(session: Session) -> None:
    if session.info.get(_UNAWAITED_KEY):
        raise OutboxError(
            "outbox.add(...) was called with an AsyncSession but not awaited, so its effect "
            "was never recorded; write `await outbox.add(session, ...)`"
        )
