"""Why a message was, or would be, skipped: everything the tables hold about one identity.

The claim row answers the question: a delivery of an identity that has one is skipped, as
a duplicate when its payload hashes to the stored hash, else as an identity conflict. No
claim means no committed processing (never delivered, every attempt rolled back, or the
claim purged after the retention window): a delivery now would be processed. The
quarantine, poison and failure rows tell the rest of the story, and the outbox rows the
effects the processing recorded.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection

from .._core import claims
from .._core.identity import MessageIdentity, PayloadHash
from .._core.protocol import Delivery
from .._storage.inspection import (
    compact_claim_row,
    consumer_known,
    effects,
    identity_row,
    identity_rows,
)
from .._storage.tables import IDENTITY_KEY, InboxSchema
from ..outbox._recording import effect_id_for
from .retention import format_duration, recorded_policy

__all__ = ["FORMAT", "SCHEMA", "consumer_known", "explain"]

FORMAT = "inbox-middleware.explain/1"

_EFFECTS_LOOKED_UP = 64  # derived effect ids checked per message (indexes 0..63)


def explain(
    conn: Connection,
    naming: InboxSchema,
    consumer: str,
    producer: str,
    message_id: str,
    *,
    tenant: str = "",
    payload_sha256: str | None = None,
) -> dict[str, Any]:
    """The story of one identity for one consumer, JSON-ready (see `SCHEMA`).

    ``payload_sha256``: the hash of a delivery to judge (as logged, or as a quarantine row
    shows it); without it the verdict says what either kind of payload would meet.
    """
    identity = MessageIdentity.parse(
        producer=producer, message_id=message_id, tenant=tenant or None
    )
    t = naming.tables
    key = identity.key(consumer)
    claim = identity_row(conn, t.inbox, key) or compact_claim_row(conn, naming, key)
    quarantine = identity_rows(conn, t.quarantine, key, t.quarantine.c.first_seen_at, payload=False)
    poison = identity_rows(conn, t.poison, key, t.poison.c.first_failure_at, payload=False)
    failures = identity_row(conn, t.attempts, key)
    policy = recorded_policy(conn, naming, consumer)
    window = policy.minimum if policy is not None else None
    verdict, summary = _verdict(claim, payload_sha256, poison, window)
    return {
        "format": FORMAT,
        "consumer": consumer,
        "producer": identity.producer,
        "tenant": identity.tenant,
        "message_id": identity.message_id,
        "verdict": verdict,
        "summary": summary,
        "claim": None if claim is None else _claim(claim),
        "retention": (
            None
            if policy is None
            else {
                "recorded_for": policy.consumer,
                "minimum_seconds": int(policy.minimum.total_seconds()),
                "dominant_scenario": policy.dominant,
            }
        ),
        "quarantine": [_jsonable(row) for row in quarantine],
        "poison": [_jsonable(row) for row in poison],
        "failures": None if failures is None else _jsonable(failures, skip=IDENTITY_KEY),
        "effects": _effects(conn, naming, consumer, identity),
    }


def _verdict(
    claim: dict[str, Any] | None,
    payload_sha256: str | None,
    poison: list[dict[str, Any]],
    window: timedelta | None,
) -> tuple[str, str]:
    if claim is not None:
        when = _iso(claim["processed_at"])
        who = f"handler version {claim['handler_version'] or '(none)'}"
        if payload_sha256 is None:
            return "skip", (
                f"processed at {when} by {who}: a delivery is skipped, as a duplicate if its "
                f"payload hashes to {claim['payload_sha256']} ({claim['hash_scheme']}), else "
                "as an identity conflict (quarantined, not processed)"
            )
        if claims.same_payload(payload_sha256.lower(), claim["payload_sha256"]):
            return "duplicate", (
                f"a duplicate: the same payload was processed at {when} by {who}; "
                "a delivery is skipped and acknowledged"
            )
        return "conflict", (
            f"an identity conflict: another payload ({claim['payload_sha256']}) was processed "
            f"under this id at {when} by {who}; a delivery is quarantined, not processed"
        )
    pending = [row for row in poison if row["decision"] == "pending"]
    summary = "no committed processing: a delivery now would be processed as first seen"
    if pending:
        row = pending[0]
        summary += (
            f"; it failed permanently before (poison #{row['id']}, {row['reason_code']}, "
            f"{row['attempts']} attempts) and waits for a repair decision"
        )
    if window is not None:
        summary += (
            f"; claims are kept at least {format_duration(window)} (the recorded retention "
            "policy), so a copy of a message processed longer ago than that may have had its "
            "claim purged"
        )
    return "process", summary


def _claim(row: dict[str, Any]) -> dict[str, Any]:
    return {
        name: _iso(row[name]) if isinstance(row[name], datetime) else row[name]
        for name in (
            "payload_sha256",
            "hash_scheme",
            "handler_version",
            "produced_at",
            "received_at",
            "processed_at",
            "trace_id",
        )
    }


def _effects(
    conn: Connection, naming: InboxSchema, consumer: str, identity: MessageIdentity
) -> list[dict[str, Any]]:
    """The outbox effects this message's processing recorded under derived ids."""
    probe = Delivery(consumer, identity, PayloadHash("", ""))
    ids = {effect_id_for(probe, index): index for index in range(_EFFECTS_LOOKED_UP)}
    rows = effects(conn, naming, list(ids), _EFFECT_COLUMNS)
    found = [{"index": ids[row["effect_id"]], **_jsonable(row)} for row in rows]
    return sorted(found, key=lambda effect: int(effect["index"]))


_EFFECT_COLUMNS = (
    "effect_id",
    "destination",
    "status",
    "attempts",
    "created_at",
    "dispatched_at",
    "last_error",
)


def _jsonable(row: dict[str, Any], skip: tuple[str, ...] = IDENTITY_KEY) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in row.items():
        if name in skip or isinstance(value, bytes | memoryview):
            continue
        out[name] = _iso(value) if isinstance(value, datetime) else value
    return out


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()


_TIME = {"type": ["string", "null"], "format": "date-time"}

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "inbox-middleware explain",
    "type": "object",
    "required": [
        "format",
        "consumer",
        "producer",
        "tenant",
        "message_id",
        "verdict",
        "summary",
        "claim",
        "retention",
        "quarantine",
        "poison",
        "failures",
        "effects",
    ],
    "additionalProperties": False,
    "properties": {
        "format": {"const": FORMAT},
        "consumer": {"type": "string"},
        "producer": {"type": "string"},
        "tenant": {"type": "string"},
        "message_id": {"type": "string"},
        "verdict": {"enum": ["skip", "duplicate", "conflict", "process"]},
        "summary": {"type": "string"},
        "claim": {
            "oneOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "required": [
                        "payload_sha256",
                        "hash_scheme",
                        "handler_version",
                        "produced_at",
                        "received_at",
                        "processed_at",
                    ],
                    "additionalProperties": False,
                    "properties": {
                        # a compact claim keeps the hash's first 16 bytes, and neither
                        # the handler version nor the receipt time
                        "payload_sha256": {
                            "type": "string",
                            "pattern": "^([0-9a-f]{64}|[0-9a-f]{32})$",
                        },
                        "hash_scheme": {"type": "string"},
                        "handler_version": {"type": ["string", "null"]},
                        "produced_at": _TIME,
                        "received_at": _TIME,
                        "processed_at": {"type": "string", "format": "date-time"},
                        "trace_id": {
                            "description": "the OpenTelemetry trace of the first delivery, "
                            "when it was traced and sampled",
                            "oneOf": [
                                {"type": "null"},
                                {"type": "string", "pattern": "^[0-9a-f]{32}$"},
                            ],
                        },
                    },
                },
            ]
        },
        "retention": {
            "oneOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "required": ["recorded_for", "minimum_seconds", "dominant_scenario"],
                    "additionalProperties": False,
                    "properties": {
                        "recorded_for": {"type": "string"},
                        "minimum_seconds": {"type": "integer", "minimum": 0},
                        "dominant_scenario": {"type": "string"},
                    },
                },
            ]
        },
        "quarantine": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "id",
                    "stored_sha256",
                    "conflicting_sha256",
                    "reason_code",
                    "attempts",
                    "first_seen_at",
                    "last_seen_at",
                    "decision",
                ],
            },
        },
        "poison": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "id",
                    "payload_sha256",
                    "reason_code",
                    "error",
                    "attempts",
                    "first_failure_at",
                    "last_failure_at",
                    "decision",
                ],
            },
        },
        "failures": {
            "oneOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "required": ["attempts", "redeliveries", "last_error"],
                },
            ]
        },
        "effects": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "effect_id", "destination", "status", "attempts"],
            },
        },
    },
}
"""The JSON schema ``inbox-middleware explain --json`` follows."""
