"""What the explored handlers do, for Dramatiq and FastStream alike.

A payload is ``{"key": ..., "do": behaviour, "n": ...}``. The effect is a row in
``explore_effects`` written in the inbox's transaction (no unique key: an effect applied
twice must show up, not fail). Attempts are counted in ``explore_attempts`` on a
connection of their own, so that a failed attempt's count survives its rollback.

With the workload's axes (`space.WORKLOAD_AXES`), the handler also records an outbox
effect (``outbox``), returns ``{"key", "n"}`` for an output (``outputs``), and has the
extended behaviours: ``deferred`` writes a row that breaks a DEFERRABLE INITIALLY
DEFERRED foreign key on its first two attempts (the failure comes at COMMIT),
``timelimit`` sleeps in SQL past Dramatiq's time limit on its first attempt, ``msg_ack``
acknowledges its FastStream message itself (refused: ``handler_transaction``), and
``invalid`` is a body that FastStream's validation refuses before the handler runs.
What downstream consumers see is written to ``explore_downstream`` (outputs) and
``explore_outbox_received`` (the outbox's remote, which applies each effect id once and
counts its deliveries).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from sqlalchemy import text

from inbox_middleware import PermanentError, current_delivery

__all__ = ["DDL", "REFUSED", "apply", "apply_async", "downstream", "downstream_async"]

REFUSED = "explore_refused"
AT_WORK = float(os.environ.get("EXPLORE_AT_WORK", "0") or 0)
"""Seconds each handler stays at work once its effect is written (``operator move``: a
tenant is paused while some of its deliveries are in flight); 0: none."""
_AT_WORK = text("SELECT pg_sleep(:s)")
DDL = [
    """CREATE TABLE IF NOT EXISTS explore_effects (
        key text NOT NULL,
        message_id text,
        n bigint NOT NULL,
        pid integer NOT NULL,
        at timestamptz NOT NULL DEFAULT clock_timestamp(),
        -- the applying transaction's start: its claim's processed_at, which a purge reads
        began timestamptz NOT NULL DEFAULT now()
    )""",
    "CREATE TABLE IF NOT EXISTS explore_attempts (key text PRIMARY KEY, attempts int NOT NULL)",
    "CREATE TABLE IF NOT EXISTS explore_parent (id int PRIMARY KEY)",
    """CREATE TABLE IF NOT EXISTS explore_deferred (
        key text NOT NULL,
        parent int REFERENCES explore_parent (id) DEFERRABLE INITIALLY DEFERRED
    )""",
    """CREATE TABLE IF NOT EXISTS explore_downstream (
        key text NOT NULL,
        n bigint NOT NULL,
        via text NOT NULL,
        at timestamptz NOT NULL DEFAULT clock_timestamp()
    )""",
    """CREATE TABLE IF NOT EXISTS explore_outbox_received (
        effect_id text PRIMARY KEY,
        key text NOT NULL,
        n bigint NOT NULL,
        deliveries int NOT NULL
    )""",
]
OUTBOX_DESTINATION = "explore"
COUNTED = ("transient", "sometimes", "deferred", "timelimit")
"""Behaviours whose failures depend on the attempt, counted on a connection of its own."""
_EFFECT = text("INSERT INTO explore_effects (key, message_id, n, pid) VALUES (:k, :m, :n, :p)")
_ORPHAN = text("INSERT INTO explore_deferred (key, parent) VALUES (:k, -1)")
_DOWNSTREAM = text("INSERT INTO explore_downstream (key, n, via) VALUES (:k, :n, :v)")
_COUNT = text(
    "INSERT INTO explore_attempts (key, attempts) VALUES (:k, 1) ON CONFLICT (key) "
    "DO UPDATE SET attempts = explore_attempts.attempts + 1 RETURNING attempts"
)


class Flaky(Exception):
    """A failure that a later attempt may not have."""


def _coin(key: str, attempt: int) -> bool:
    return hashlib.sha256(f"{key}/{attempt}".encode()).digest()[0] % 2 == 0


def _fails(behaviour: str, key: str, attempt: int) -> None:
    if behaviour == "transient" and attempt <= 2:
        raise Flaky(f"{key}: attempt {attempt} fails")
    if behaviour == "sometimes" and _coin(key, attempt):
        raise Flaky(f"{key}: attempt {attempt} fails by its coin")
    if behaviour == "permanent":
        raise PermanentError(REFUSED, f"{key} is refused")


def _effect(session: Any, payload: dict[str, Any]) -> None:
    delivery = current_delivery(session)
    message_id = delivery.identity.message_id if delivery is not None else None
    session.execute(
        _EFFECT, {"k": payload["key"], "m": message_id, "n": payload["n"], "p": os.getpid()}
    )


def _output(payload: dict[str, Any]) -> dict[str, Any]:
    return {"key": payload["key"], "n": payload["n"]}


def batch_effect_id(payload: dict[str, Any]) -> str:
    """The outbox effect id of a body in a batch, whose delivery names no one message: the
    key's and the payload's own, so that a conflict the operator accepted (the same key,
    another payload) records an effect of its own, and a redelivery the same one."""
    return f"explore-{payload['key']}-{payload['n']}"


def _record_outbox(payload: dict[str, Any], effect_id: str | None) -> tuple[Any, dict[str, Any]]:
    from inbox_middleware import outbox

    if payload["do"] == "no-identity":
        # No identity to derive an id from (outbox.add would refuse): the key's own.
        effect_id = f"explore-{payload['key']}"
    kwargs: dict[str, Any] = {"destination": OUTBOX_DESTINATION, "payload": _output(payload)}
    if effect_id is not None:
        kwargs["effect_id"] = effect_id
    return outbox, kwargs


def apply(
    session: Any, payload: dict[str, Any], engine: Any, *, outbox_on: bool = False
) -> dict[str, Any]:
    """The handler body, on the inbox's (sync) session; its output."""
    behaviour = payload["do"]
    attempt = 0
    if behaviour in COUNTED:
        with engine.begin() as conn:
            attempt = int(conn.execute(_COUNT, {"k": payload["key"]}).scalar_one())
        _fails(behaviour, payload["key"], attempt)
    _fails(behaviour if behaviour == "permanent" else "", payload["key"], 0)
    if behaviour == "rollback":
        session.rollback()
    _effect(session, payload)
    if AT_WORK:
        session.execute(_AT_WORK, {"s": AT_WORK})
    if outbox_on:
        module, kwargs = _record_outbox(payload, None)
        module.add(session, **kwargs)
    if behaviour == "deferred" and attempt <= 2:
        session.execute(_ORPHAN, {"k": payload["key"]})  # refused at COMMIT
    if behaviour == "timelimit" and attempt <= 1:
        session.execute(text("SELECT pg_sleep(8)"))  # past the actor's time limit
    if behaviour == "commit":
        session.commit()
    return _output(payload)


async def apply_async(
    session: Any,
    payload: dict[str, Any],
    engine: Any,
    *,
    outbox_on: bool = False,
    effect_id: str | None = None,
    message: Any = None,
) -> dict[str, Any]:
    """The handler body, on the inbox's AsyncSession; its output. ``effect_id``: the
    outbox effect's id where the delivery names none (a batch)."""
    behaviour = payload["do"]
    attempt = 0
    if behaviour in COUNTED:
        async with engine.begin() as conn:
            attempt = int((await conn.execute(_COUNT, {"k": payload["key"]})).scalar_one())
        _fails(behaviour, payload["key"], attempt)
    _fails(behaviour if behaviour == "permanent" else "", payload["key"], 0)
    if behaviour == "rollback":
        await session.rollback()
    await session.run_sync(_effect, payload)
    if AT_WORK:
        await session.execute(_AT_WORK, {"s": AT_WORK})
    if outbox_on:
        module, kwargs = _record_outbox(payload, effect_id)
        await module.add(session, **kwargs)
    if behaviour == "deferred" and attempt <= 2:
        await session.execute(_ORPHAN, {"k": payload["key"]})  # refused at COMMIT
    if behaviour == "timelimit" and attempt <= 1:  # a Dramatiq async actor's
        await session.execute(text("SELECT pg_sleep(8)"))  # past the actor's time limit
    if behaviour == "msg_ack" and message is not None:
        await message.ack()
    if behaviour == "commit":
        await session.commit()
    return _output(payload)


def downstream(session: Any, output: dict[str, Any], via: str) -> None:
    """A consumer downstream of an output: counts what it applied."""
    session.execute(_DOWNSTREAM, {"k": output["key"], "n": output["n"], "v": via})


async def downstream_async(session: Any, output: dict[str, Any], via: str) -> None:
    await session.execute(_DOWNSTREAM, {"k": output["key"], "n": output["n"], "v": via})
