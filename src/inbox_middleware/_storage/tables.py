"""Table names and SQLAlchemy table definitions.

The migration files are the schema's source of truth; these definitions describe the
same tables for building statements, and a test checks that the two agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    Table,
    Text,
    Uuid,
)
from sqlalchemy.dialects.postgresql import JSONB

from .._core.exceptions import ConfigurationError

__all__ = [
    "ALL_CONSUMERS",
    "CLAIMS_PARTITIONS",
    "HOURLY",
    "IDENTITY_KEY",
    "TABLES",
    "InboxSchema",
    "InboxTables",
]

IDENTITY_KEY = ("consumer_name", "producer_name", "tenant", "message_id")
"""A delivery's identity as columns (`Delivery.key`): the key of the library's claims,
failure counts, poison rows and stored outputs."""

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_IDENTIFIER = 63  # PostgreSQL truncates longer names silently

TABLES = (
    "consumer_inbox",
    "inbox_quarantine",
    "inbox_schema_version",
    "message_outbox",
    "inbox_attempts",
    "inbox_poison",
    "inbox_retention",
    "inbox_outputs",
    "inbox_counts",
    "inbox_claims",
    "inbox_layout",
)
"""Every table the library owns, without prefix."""

CLAIMS_PARTITIONS = ("inbox_claims_untimed", "inbox_claims_other")
"""The lasting partitions of ``inbox_claims`` (PostgreSQL): the ids without a time, and the
default one; the hourly ones are named by `InboxSchema.hourly_partition`."""
HOURLY = "inbox_claims_"
"""The hourly partitions' names: the prefix, this, then the hour (``YYYYMMDDHH``, UTC)."""
_LONGEST = HOURLY + "2026120100"

ALL_CONSUMERS = "*"
"""The consumer name of an ``inbox_retention`` row that applies to every consumer without
a row of its own."""

_JSON = JSON().with_variant(JSONB(), "postgresql")
_TIMESTAMP = DateTime(timezone=True)


@dataclass(frozen=True, slots=True)
class InboxSchema:
    """Where the inbox tables live: an optional database schema and a table-name prefix.

    Both are validated as plain SQL identifiers (letters, digits, underscores) and are
    always quoted when they reach SQL, so configuration can never inject a statement.
    """

    schema: str | None = None
    prefix: str = ""

    def __post_init__(self) -> None:
        if self.schema is not None:
            _check_identifier(self.schema, "schema")
        if self.prefix:
            longest = self.prefix + max((*TABLES, _LONGEST), key=len)
            _check_identifier(longest, "prefix", shown=self.prefix)

    def name(self, table: str) -> str:
        """The unqualified name of one of `TABLES`."""
        return self.prefix + table

    @property
    def tables(self) -> InboxTables:
        return _tables(self)

    def hourly_partition(self, hour: str) -> str:
        """The unqualified name of the partition of ``inbox_claims`` for the ids of one
        hour (``YYYYMMDDHH``, UTC)."""
        return f"{self.prefix}{HOURLY}{hour}"


def _check_identifier(value: str, what: str, *, shown: str | None = None) -> None:
    shown = value if shown is None else shown
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise ConfigurationError(
            f"{what} {shown!r} is not a plain identifier (letters, digits and underscores, "
            "not starting with a digit)"
        )
    if len(value) > _MAX_IDENTIFIER:
        raise ConfigurationError(
            f"{what} {shown!r} makes the name {value!r} longer than {_MAX_IDENTIFIER} characters"
        )


@cache
def _tables(naming: InboxSchema) -> InboxTables:
    return InboxTables(naming)


class InboxTables:
    """The library's tables for one `InboxSchema`."""

    def __init__(self, naming: InboxSchema) -> None:
        self.metadata = MetaData(schema=naming.schema)
        name = naming.name
        self.inbox = Table(
            name("consumer_inbox"),
            self.metadata,
            Column("consumer_name", Text, primary_key=True),
            Column("producer_name", Text, primary_key=True),
            Column("tenant", Text, primary_key=True),
            Column("message_id", Text, primary_key=True),
            Column("payload_sha256", Text, nullable=False),
            Column("hash_scheme", Text, nullable=False),
            Column("handler_version", Text, nullable=False),
            Column("produced_at", _TIMESTAMP),
            Column("received_at", _TIMESTAMP, nullable=False),
            Column("processed_at", _TIMESTAMP, nullable=False),
            Column("trace_id", Text),
        )
        self.quarantine = Table(
            name("inbox_quarantine"),
            self.metadata,
            Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
            Column("consumer_name", Text, nullable=False),
            Column("producer_name", Text, nullable=False),
            Column("tenant", Text, nullable=False),
            Column("message_id", Text, nullable=False),
            Column("stored_sha256", Text, nullable=False),
            Column("conflicting_sha256", Text, nullable=False),
            Column("hash_scheme", Text, nullable=False),
            Column("source", Text, nullable=False),
            Column("payload", LargeBinary),
            Column("headers", _JSON, nullable=False),
            Column("reason_code", Text, nullable=False),
            Column("attempts", Integer, nullable=False),
            Column("first_seen_at", _TIMESTAMP, nullable=False),
            Column("last_seen_at", _TIMESTAMP, nullable=False),
            Column("handler_version", Text, nullable=False),
            Column("decision", Text, nullable=False),
            Column("decided_by", Text),
            Column("decided_at", _TIMESTAMP),
            Column("decision_note", Text),
            Column("payload_format", Text, nullable=False),
            Column("operation_id", Text),
            Column("accepted_message_id", Text),
            Column("recovered_at", _TIMESTAMP),
            Column("published_at", _TIMESTAMP),
        )
        self.outbox = Table(
            name("message_outbox"),
            self.metadata,
            Column("effect_id", Text, primary_key=True),
            Column("destination", Text, nullable=False),
            Column("payload", _JSON, nullable=False),
            Column("headers", _JSON, nullable=False),
            Column("status", Text, nullable=False),
            Column("attempts", Integer, nullable=False),
            Column("next_attempt_at", _TIMESTAMP, nullable=False),
            Column("leased_until", _TIMESTAMP),
            Column("lease_token", Text),
            Column("last_error", Text),
            Column("created_at", _TIMESTAMP, nullable=False),
            Column("dispatched_at", _TIMESTAMP),
            Column("remote_result", _JSON),
        )
        self.attempts = Table(
            name("inbox_attempts"),
            self.metadata,
            Column("consumer_name", Text, primary_key=True),
            Column("producer_name", Text, primary_key=True),
            Column("tenant", Text, primary_key=True),
            Column("message_id", Text, primary_key=True),
            Column("attempts", Integer, nullable=False),
            Column("redeliveries", Integer, nullable=False),
            Column("hand_backs", Integer, nullable=False),
            Column("first_failure_at", _TIMESTAMP, nullable=False),
            Column("last_failure_at", _TIMESTAMP, nullable=False),
            Column("last_error", Text),
        )
        self.poison = Table(
            name("inbox_poison"),
            self.metadata,
            Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
            Column("consumer_name", Text, nullable=False),
            Column("producer_name", Text, nullable=False),
            Column("tenant", Text, nullable=False),
            Column("message_id", Text, nullable=False),
            Column("payload_sha256", Text, nullable=False),
            Column("hash_scheme", Text, nullable=False),
            Column("payload", LargeBinary),
            Column("payload_format", Text, nullable=False),
            Column("headers", _JSON, nullable=False),
            Column("source", Text, nullable=False),
            Column("reason_code", Text, nullable=False),
            Column("error", Text),
            Column("attempts", Integer, nullable=False),
            Column("first_failure_at", _TIMESTAMP, nullable=False),
            Column("last_failure_at", _TIMESTAMP, nullable=False),
            Column("handler_version", Text, nullable=False),
            Column("decision", Text, nullable=False),
            Column("decided_by", Text),
            Column("decided_at", _TIMESTAMP),
            Column("decision_note", Text),
            Column("operation_id", Text),
            Column("recovered_at", _TIMESTAMP),
            Column("published_at", _TIMESTAMP),
        )
        self.retention = Table(
            name("inbox_retention"),
            self.metadata,
            Column("consumer_name", Text, primary_key=True),
            Column("scenarios", _JSON, nullable=False),
            Column("minimum_seconds", BigInteger, nullable=False),
            Column("dominant_scenario", Text, nullable=False),
            Column("updated_at", _TIMESTAMP, nullable=False),
            Column("updated_by", Text),
        )
        self.outputs = Table(
            name("inbox_outputs"),
            self.metadata,
            Column("consumer_name", Text, primary_key=True),
            Column("producer_name", Text, primary_key=True),
            Column("tenant", Text, primary_key=True),
            Column("message_id", Text, primary_key=True),
            Column("body", LargeBinary),
            Column("content_type", Text),
            Column("headers", _JSON, nullable=False),
            Column("created_at", _TIMESTAMP, nullable=False),
        )
        self.counts = Table(
            name("inbox_counts"),
            self.metadata,
            Column("worker", Text, primary_key=True),
            Column("consumer_name", Text, primary_key=True),
            Column("outcome", Text, primary_key=True),
            Column("count", BigInteger, nullable=False),
            Column("since", _TIMESTAMP, nullable=False),
            Column("updated_at", _TIMESTAMP, nullable=False),
        )
        # The compact claim (`_core.claims`): PostgreSQL's uuid is 16 bytes with no length
        # header; SQLite's table exists for the schema's sake, its inbox stays the library's.
        self.claims = Table(
            name("inbox_claims"),
            self.metadata,
            Column("identity", Uuid(as_uuid=False), primary_key=True),
            Column("payload_digest", Uuid(as_uuid=False), nullable=False),
            Column("processed_at", _TIMESTAMP, nullable=False),
            Column("hash_scheme", SmallInteger, nullable=False),
        )
        # Its lasting partitions, each purged row by row (`CLAIMS_PARTITIONS`).
        self.claims_partitions = tuple(
            Table(
                name(partition),
                self.metadata,
                *(Column(c.name, c.type, nullable=c.nullable) for c in self.claims.c),
            )
            for partition in CLAIMS_PARTITIONS
        )
        self.layout = Table(
            name("inbox_layout"),
            self.metadata,
            Column("name", Text, primary_key=True),
            Column("value", Text, nullable=False),
            Column("changed_at", _TIMESTAMP, nullable=False),
            Column("changed_by", Text),
        )
        self.version = Table(
            name("inbox_schema_version"),
            self.metadata,
            Column("version", Integer, primary_key=True),
            Column("name", Text, nullable=False),
            Column("applied_at", _TIMESTAMP, nullable=False),
        )
