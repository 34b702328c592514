"""What the explored handlers do, for Dramatiq and FastStream alike.

A payload is ``{"key": ..., "do": behaviour, "n": ...}``. The effect is a row in
``explore_effects`` written in the inbox's transaction (no unique key: an effect applied
twice must show up, not fail). Attempts are counted in ``explore_attempts`` on a
connection of their own, so that a failed attempt's count survives its rollback.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from sqlalchemy import text

from inbox_middleware import PermanentError, current_delivery

__all__ = ["DDL", "REFUSED", "apply", "apply_async"]

REFUSED = "explore_refused"
DDL = [
    """CREATE TABLE IF NOT EXISTS explore_effects (
        key text NOT NULL,
        message_id text,
        n bigint NOT NULL,
        pid integer NOT NULL,
        at timestamptz NOT NULL DEFAULT clock_timestamp()
    )""",
    "CREATE TABLE IF NOT EXISTS explore_attempts (key text PRIMARY KEY, attempts int NOT NULL)",
]
_EFFECT = text("INSERT INTO explore_effects (key, message_id, n, pid) VALUES (:k, :m, :n, :p)")
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


def apply(session: Any, payload: dict[str, Any], engine: Any) -> None:
    """The handler body, on the inbox's (sync) session."""
    behaviour = payload["do"]
    if behaviour in ("transient", "sometimes"):
        with engine.begin() as conn:
            attempt = int(conn.execute(_COUNT, {"k": payload["key"]}).scalar_one())
        _fails(behaviour, payload["key"], attempt)
    _fails(behaviour if behaviour == "permanent" else "", payload["key"], 0)
    if behaviour == "rollback":
        session.rollback()
    _effect(session, payload)
    if behaviour == "commit":
        session.commit()


async def apply_async(session: Any, payload: dict[str, Any], engine: Any) -> None:
    """The handler body, on the inbox's AsyncSession."""
    behaviour = payload["do"]
    if behaviour in ("transient", "sometimes"):
        async with engine.begin() as conn:
            attempt = int((await conn.execute(_COUNT, {"k": payload["key"]})).scalar_one())
        _fails(behaviour, payload["key"], attempt)
    _fails(behaviour if behaviour == "permanent" else "", payload["key"], 0)
    if behaviour == "rollback":
        await session.rollback()
    await session.run_sync(_effect, payload)
    if behaviour == "commit":
        await session.commit()
