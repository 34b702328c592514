"""The compact claim: what a remembered message keeps in ``inbox_claims``, and which
table a worker claims in while a deployment moves to it.

The library's claims table (``consumer_inbox``) keeps each claim's four identity texts
in its primary key, the payload's SHA-256 as 64 hex characters, the scheme's name, the
handler version, three times and the trace: about 290 bytes a remembered message. The
compact row keeps what deciding a redelivery needs, in fixed sizes:

- ``identity``: 16 bytes, the key (`claim_key`): 6 bytes of time, then the first 10 bytes
  of the SHA-256 of the identity's four parts. The time is the one the message id carries
  (a UUIDv7, a ULID), in milliseconds, or zero for any other id. Keys led by the time rise
  with it, so a claim writes near the index's right edge, the pages every recent claim
  shares, and the index's working set stays small however large the table grows. A random
  id has no order to keep: its claims sort before every timed one, each on a random page
  of their part of the index. The time leading every key is also what a table
  partitioned by range of it would need: the ids of an hour in a partition of their own,
  those without a time in one more.
- ``payload_digest``: the first 16 bytes of the payload's SHA-256 (`payload_digest`),
  compared with the delivery's own (`same_payload`).
- ``hash_scheme``: a small number for the scheme's name (`scheme_code`), read back by
  the names this version knows and the delivery's own (`stored_scheme`).
- ``processed_at``: the claim's time, for the purge.

What it gives up, and what still shows it: the identity's text (operator commands hash
what a person types, `claim_key`), the handler version, the producer's and receipt times
and the trace id of the first delivery.

A deployment moves to the compact row without stopping its workers (`claims_phase`):
workers configured for it claim in both tables, in one statement, while workers of an
earlier version may still run; once the operator records that none does (``inbox-middleware
claims switch``), they claim in the compact table alone, looking in the library's table
too until its remaining rows have been purged.
"""

from __future__ import annotations

import hashlib
from enum import Enum

__all__ = [
    "KNOWN_SCHEMES",
    "ClaimsPhase",
    "ClaimsTable",
    "claim_key",
    "claims_phase",
    "id_milliseconds",
    "payload_digest",
    "same_payload",
    "scheme_code",
    "stored_scheme",
]

KNOWN_SCHEMES = ("dramatiq.v1", "faststream-json.v1", "faststream-json.v2", "faststream-raw.v1")
"""The payload hash schemes the adapters of this version make or recompute; a compact
row's scheme number is read back among these and the delivery's own."""


_HEX = frozenset("0123456789abcdefABCDEF")
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_CROCKFORD_VALUE = {char: value for value, char in enumerate(_CROCKFORD)}
_MAX_MILLISECONDS = (1 << 48) - 1


class ClaimsTable(Enum):
    """The table a worker is configured to claim in."""

    LIBRARY = "library"
    """``consumer_inbox``: the identity's texts in the key, every field of a claim kept."""
    COMPACT = "compact"
    """``inbox_claims``: the compact row (about 120 bytes a remembered message)."""


class ClaimsPhase(Enum):
    """Where a worker claims, from its configuration and the database's record."""

    LIBRARY = "library"
    """In ``consumer_inbox`` alone (the configured table is the library's)."""
    BOTH = "both"
    """In both tables, in one statement: the message is claimed only when neither holds
    it. Workers of an earlier version may still be claiming in ``consumer_inbox``."""
    COMPACT_CHECKING = "compact, checking the library's table"
    """In ``inbox_claims``, claimed only when ``consumer_inbox`` does not hold the
    message either: it still has rows of the time before the switch."""
    COMPACT = "compact"
    """In ``inbox_claims`` alone: ``consumer_inbox`` is empty."""


def claims_phase(configured: ClaimsTable, *, switched: bool, library_rows: bool) -> ClaimsPhase:
    """Where a worker configured for ``configured`` claims: ``switched`` when the operator
    recorded that every worker claims in the compact table (no worker of an earlier
    version runs), ``library_rows`` when ``consumer_inbox`` still has a row.

    A worker that reads the record late still claims in both tables, and every claim in
    both also writes the compact row, so the compact table's key alone catches a message
    claimed twice from then on, by whichever worker.
    """
    if configured is ClaimsTable.LIBRARY:
        return ClaimsPhase.LIBRARY
    if not switched:
        return ClaimsPhase.BOTH
    return ClaimsPhase.COMPACT_CHECKING if library_rows else ClaimsPhase.COMPACT


def id_milliseconds(message_id: str) -> int | None:
    """The time a message id carries, in milliseconds since the epoch: a UUIDv7's first
    48 bits, or a ULID's first ten characters; None for any other id."""
    if len(message_id) == 36 and message_id[8] == message_id[13] == "-":
        compact = message_id.replace("-", "")
        if len(compact) != 32 or message_id[14] != "7" or not _HEX.issuperset(compact):
            return None
        if compact[16] not in "89abAB":  # the RFC 9562 variant
            return None
        return int(compact[:12], 16)
    if len(message_id) == 26 and message_id[0] in "01234567":
        value = 0
        for char in message_id[:10]:
            digit = _CROCKFORD_VALUE.get(char.upper())
            if digit is None:
                return None
            value = value * 32 + digit
        if not all(char.upper() in _CROCKFORD_VALUE for char in message_id[10:]):
            return None
        return value if value <= _MAX_MILLISECONDS else None
    return None


def claim_key(consumer: str, producer: str, tenant: str, message_id: str) -> bytes:
    """The compact row's key for one consumer's claim of one identity: 16 bytes."""
    # the unit separator between the parts: identity texts never hold a control character
    parts = f"{consumer}\x1f{producer}\x1f{tenant}\x1f{message_id}"
    digest = hashlib.sha256(parts.encode()).digest()
    milliseconds = id_milliseconds(message_id)
    return (milliseconds or 0).to_bytes(6, "big") + digest[:10]


def payload_digest(sha256_hex: str) -> str:
    """The part of a payload's hex SHA-256 the compact row keeps: its first 16 bytes."""
    return sha256_hex[:32]


def same_payload(ours: str, stored: str) -> bool:
    """Whether a stored payload hash (the library's 64 hex characters, or the compact
    row's 32) is the SHA-256 ``ours``."""
    if len(stored) == 32:
        return ours[:32] == stored.lower()
    return ours == stored


def scheme_code(name: str) -> int:
    """The compact row's number for a hash scheme's name: two bytes of its SHA-256, as a
    signed ``smallint``."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:2], "big", signed=True)


_CODE_PREFIX = "code:"


def scheme_tag(code: int) -> str:
    """How a compact row's scheme number reaches the core as a stored scheme."""
    return f"{_CODE_PREFIX}{code}"


def stored_scheme(stored: str, ours: str) -> str | None:
    """The name of a stored claim's scheme: the library row's as it is; a compact row's
    (`scheme_tag`) found among the delivery's own scheme and `KNOWN_SCHEMES`, or None
    when this version knows no scheme of that number."""
    if not stored.startswith(_CODE_PREFIX):
        return stored
    try:
        code = int(stored[len(_CODE_PREFIX) :])
    except ValueError:
        return None
    for name in (ours, *KNOWN_SCHEMES):
        if scheme_code(name) == code:
            return name
    return None
