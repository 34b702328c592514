"""How long the inbox must remember a message: the retention window, from its failures.

Deleting an inbox row makes any later copy of that message new again. So the window is
not a tidy-up preference: it must outlast the latest moment a copy can still arrive.
Each scenario below bounds how old a copy can be when it arrives; the window is the
largest of them, plus a safety margin::

    broker redelivery     the broker keeps, and may redeliver, a message this long
    offset rewind         consumers may be rewound this far back (Kafka, streams)
    dead-letter redrive   retried for `retry_horizon`, then kept as a dead letter for
                          `dead_letter_retention` before someone redrives it
    producer retry        a producer retries an intent for `producer_retry`, possibly
                          across a consumer outage of `outage_allowance`
    backup restore        a broker or producer restored from a backup this old re-sends
    planned replay        replays you plan reach this far back

`minimum_window` returns the window and the scenario that dominates it, so an operator
sees which failure the window is sized for.
"""

from __future__ import annotations

import logging
import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine

from .._core.claims import claim_key
from .._core.exceptions import ConfigurationError, PermanentError
from .._core.policy import ExpiredPolicy
from .._core.protocol import Delivery, ReasonCode
from .._observe.instruments import metrics
from .._storage import partitions
from .._storage.counts import purge_counts
from .._storage.retention import (
    TID_RANGE_SCAN,
    PurgeStatements,
    all_policy_rows,
    compact_rows,
    consumers_with_rows,
    output_purge,
    policy_rows,
    purge_statements,
    write_policy,
)
from .._storage.tables import ALL_CONSUMERS, CLAIMS_PARTITIONS, InboxSchema

logger = logging.getLogger("inbox_middleware")

__all__ = [
    "ALL_CONSUMERS",
    "DEFAULT_PURGE_RATE",
    "ExpiredPolicy",
    "PurgeDecision",
    "RecordedPolicy",
    "RetentionPolicy",
    "RetentionRefused",
    "Scenario",
    "check_expired",
    "check_window",
    "format_duration",
    "minimum_window",
    "parse_duration",
    "purge",
    "purge_plan",
    "record_policy",
    "recorded_policy",
]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def parse_duration(text: str) -> timedelta:
    """``"7d"``, ``"36h"``, ``"1w2d"``, ``"90m"``, ``"45s"``, or ``"0"``."""
    value = text.strip().lower()
    if value == "0":
        return timedelta(0)
    parts = _DURATION.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ConfigurationError(
            f"cannot read the duration {text!r}: use a number with s, m, h, d or w, like 14d"
        )
    try:
        return timedelta(seconds=sum(float(number) * _UNITS[unit] for number, unit in parts))
    except (OverflowError, ValueError):  # beyond timedelta's 999999999 days
        raise ConfigurationError(f"the duration {text!r} is too long to be a window") from None


def format_duration(value: timedelta) -> str:
    seconds = int(value.total_seconds())
    if seconds == 0:
        return "0"
    out = []
    for unit in ("w", "d", "h", "m", "s"):
        count, seconds = divmod(seconds, _UNITS[unit])
        if count:
            out.append(f"{count}{unit}")
    return "".join(out)


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """The failure scenarios the inbox must survive; every duration defaults to zero."""

    broker_retention: timedelta = timedelta(0)
    offset_rewind: timedelta = timedelta(0)
    retry_horizon: timedelta = timedelta(0)
    dead_letter_retention: timedelta = timedelta(0)
    producer_retry: timedelta = timedelta(0)
    outage_allowance: timedelta = timedelta(0)
    backup_restore_age: timedelta = timedelta(0)
    replay_horizon: timedelta = timedelta(0)
    margin: float = 0.25
    """Added on top of the dominant scenario, as a fraction of it."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, timedelta) and value < timedelta(0):
                raise ConfigurationError(f"{field.name} cannot be negative")
        if not 0 <= self.margin <= 10:
            raise ConfigurationError("margin must be between 0 and 10 (a fraction)")

    def scenarios(self) -> list[Scenario]:
        return [
            Scenario("broker redelivery", self.broker_retention),
            Scenario("offset rewind", self.offset_rewind),
            Scenario("dead-letter redrive", self.retry_horizon + self.dead_letter_retention),
            Scenario("producer retry", self.producer_retry + self.outage_allowance),
            Scenario("backup restore", self.backup_restore_age),
            Scenario("planned replay", self.replay_horizon),
        ]


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    window: timedelta
    """How old a copy of a message can be when this scenario delivers it."""


def minimum_window(policy: RetentionPolicy) -> tuple[timedelta, Scenario]:
    """The shortest safe retention window, and the scenario that dominates it."""
    dominant = max(policy.scenarios(), key=lambda scenario: scenario.window)
    window = dominant.window * (1 + policy.margin)
    return timedelta(seconds=round(window.total_seconds())), dominant


# -- the recorded policy and the purge ---------------------------------------------------
#
# A purge deletes claims, so it runs only against a recorded policy: the operator records
# the scenarios once (`inbox-middleware retention set`), and every purge checks its window
# against their minimum. The purge works in small batches, each its own transaction, taking
# rows with FOR UPDATE SKIP LOCKED: a live claim never waits for it, and several purgers
# never wait for each other. On PostgreSQL the batches walk the heap by block ranges, and
# the purge is paced (rows a second), so that claims running beside it keep their latency.


@dataclass(frozen=True, slots=True)
class RecordedPolicy:
    consumer: str
    policy: RetentionPolicy
    minimum: timedelta
    dominant: str


def record_policy(
    conn: Connection, naming: InboxSchema, policy: RetentionPolicy, *, consumer: str, by: str
) -> RecordedPolicy:
    """Store ``policy`` for ``consumer`` (``*``: the default for all); return it, computed."""
    window, dominant = minimum_window(policy)
    scenarios = {
        field.name: (
            getattr(policy, field.name).total_seconds()
            if isinstance(getattr(policy, field.name), timedelta)
            else getattr(policy, field.name)
        )
        for field in fields(policy)
    }
    write_policy(
        conn,
        naming,
        consumer=consumer,
        scenarios=scenarios,
        minimum_seconds=int(window.total_seconds()),
        dominant_scenario=dominant.name,
        updated_by=by,
    )
    return RecordedPolicy(consumer, policy, window, dominant.name)


def recorded_policy(
    conn: Connection, naming: InboxSchema, consumer: str | None
) -> RecordedPolicy | None:
    """The policy recorded for ``consumer``, else the default one (``*``), else None."""
    wanted = [ALL_CONSUMERS] if consumer is None else [consumer, ALL_CONSUMERS]
    rows = policy_rows(conn, naming, wanted)
    row = next((rows[name] for name in wanted if name in rows), None)
    return None if row is None else _recorded(row)


def _recorded(row: Any) -> RecordedPolicy:
    values = dict(row.scenarios)
    margin = float(values.pop("margin", 0.25))
    policy = RetentionPolicy(
        **{name: timedelta(seconds=float(seconds)) for name, seconds in values.items()},
        margin=margin,
    )
    return RecordedPolicy(
        row.consumer_name, policy, timedelta(seconds=row.minimum_seconds), row.dominant_scenario
    )


@dataclass(frozen=True, slots=True)
class PurgeDecision:
    """What a purge may do to one consumer's rows."""

    consumer: str
    recorded: RecordedPolicy | None
    """The policy that applies: the consumer's own, else the default, else None."""
    refused: str | None
    """Why this consumer's rows are kept (None: they may go)."""
    forced: bool = False
    """Allowed only by ``force``: no policy, or a window below its minimum."""


_NO_POLICY = (
    "no retention policy is recorded: record the failure scenarios first "
    "(inbox-middleware retention set ...), or pass --force"
)


def _refusal(older_than: timedelta, recorded: RecordedPolicy | None) -> str | None:
    if recorded is None:
        return _NO_POLICY
    if older_than < recorded.minimum:
        owner = "the default" if recorded.consumer == ALL_CONSUMERS else "its"
        return (
            f"purging claims younger than {format_duration(recorded.minimum)} is refused: "
            f"{owner} recorded policy needs that long for its dominant scenario "
            f"({recorded.dominant}); a copy delivered later would be processed again. "
            "To apply old messages once more, see the replay guide (a versioned consumer or "
            "a compensating migration), never the purge"
        )
    return None


def purge_plan(
    conn: Connection,
    naming: InboxSchema,
    older_than: timedelta,
    *,
    consumer: str | None,
    force: bool,
) -> list[PurgeDecision]:
    """Decide, consumer by consumer, whether claims older than ``older_than`` may go.

    Each consumer (``consumer``, or every consumer with rows) is judged under its own
    recorded policy, else the default one: refused when there is none or when the window
    is below its minimum, unless ``force``. A purge of every consumer is therefore never
    judged by the default policy alone: a consumer that recorded a longer window keeps
    its claims for that long.
    """
    policies = {name: _recorded(row) for name, row in all_policy_rows(conn, naming).items()}
    if not policies and not force:
        raise RetentionRefused(_NO_POLICY)
    consumers = [consumer] if consumer is not None else consumers_with_rows(conn, naming)
    if consumer is None and compact_rows(conn, naming):
        # The compact claims name no consumer: a purge of them is judged by every
        # recorded policy, as if each consumer that recorded one had rows.
        named = set(consumers) | {name for name in policies if name != ALL_CONSUMERS}
        consumers = sorted(named)
    plan = []
    for name in consumers:
        recorded = policies.get(name, policies.get(ALL_CONSUMERS))
        refused = _refusal(older_than, recorded)
        if force:
            plan.append(PurgeDecision(name, recorded, None, forced=refused is not None))
        else:
            plan.append(PurgeDecision(name, recorded, refused))
    return plan


def check_window(
    conn: Connection,
    naming: InboxSchema,
    older_than: timedelta,
    *,
    consumer: str | None,
    force: bool,
) -> RecordedPolicy | None:
    """Refuse a purge window the recorded policies do not allow, unless ``force``: for
    ``consumer``, or (None) for every consumer with rows. Returns the policy that applies
    to ``consumer`` (None: the default one)."""
    for decision in purge_plan(conn, naming, older_than, consumer=consumer, force=force):
        if decision.refused is not None:
            if consumer is None:
                raise RetentionRefused(f"consumer {decision.consumer}: {decision.refused}")
            raise RetentionRefused(decision.refused)
    return recorded_policy(conn, naming, consumer)


DEFAULT_PURGE_RATE = 20_000.0
"""Rows a second the purge deletes at most unless told otherwise: see the performance
page (the purge under claims held at half their saturation rate) for how it was chosen."""
_MAX_RANGE = 2_048
"""Blocks a batch reads at most (16 MB of 8 kB blocks), across blocks without old claims."""
_COUNT_BLOCKS = 16_384
"""Blocks a counting statement reads (128 MB of 8 kB blocks)."""
_ROWS_PER_BLOCK = 40
"""Rows a block is assumed to hold before the table's first ANALYZE (about 200 bytes a row)."""


def purge(
    engine: Engine,
    naming: InboxSchema,
    older_than: timedelta,
    *,
    consumer: str | None = None,
    batch_size: int = 5000,
    pause: float = 0.0,
    rows_per_second: float | None = DEFAULT_PURGE_RATE,
    on_batch: Callable[[int], None] | None = None,
) -> int:
    """Delete claims processed more than ``older_than`` ago, batch by batch; return how many.

    Call `check_window` first. Failure counts and stored outputs older than the window go
    too (an output is written in its claim's transaction, so it is as old as its claim),
    and the settlement counts of workers that have not written them for that long.

    Each batch is its own transaction of at most ``batch_size`` claims, taken with FOR
    UPDATE SKIP LOCKED. On PostgreSQL the batches walk the table's heap once, block range
    by block range, from its first block to the last it had when the purge began (rows
    added since are younger than the window). ``pause`` seconds pass between batches, and
    the purge waits as long as it takes to delete no more than ``rows_per_second`` on
    average (None: as fast as it can): the purge's cost to live claims is the rate at
    which it dirties pages and writes WAL, not its duration. The compact claims' hours
    past the window are emptied whole, an hour a transaction; paced, that takes at most
    a fiftieth of the time (`partitions.EMPTY_SHARE`).
    """
    if batch_size <= 0:
        raise ConfigurationError("batch_size must be positive")
    if rows_per_second is not None and rows_per_second <= 0:
        raise ConfigurationError("rows_per_second must be positive (or None: unpaced)")
    params = {"seconds": older_than.total_seconds(), "consumer": consumer, "limit": batch_size}
    began = time.monotonic()
    total = 0

    paced = 0  # rows deleted one by one: what the pace bounds

    def batch_done(deleted: int, *, truncated: bool = False) -> None:
        nonlocal total, paced
        if not deleted:  # a block range without old claims: nothing done, nothing to wait
            return
        total += deleted
        if on_batch is not None:
            on_batch(deleted)
        if truncated:  # an hour emptied: no row dirtied, no WAL a row (paced by its time)
            return
        paced += deleted
        wait = pause
        if rows_per_second is not None:
            wait = max(wait, paced / rows_per_second - (time.monotonic() - began))
        if wait > 0:
            time.sleep(wait)

    if engine.dialect.name == "postgresql":
        # The compact claims (no consumer in their rows) go in a purge of every consumer:
        # the hours past the window emptied whole, then the lasting partitions walked.
        lasting: tuple[int | None, ...] = (None,)
        if consumer is None:
            lasting = (None, *range(len(CLAIMS_PARTITIONS)))
            partitions.purge_hours(
                engine,
                naming,
                older_than,
                paced=rows_per_second is not None,
                on_hour=lambda removed: batch_done(removed, truncated=True),
            )
        for compact in lasting:
            with engine.connect() as conn:
                statements = _postgresql_statements(conn, naming, compact=compact)
            _walk(engine, statements, params, batch_done)
    else:
        statements = purge_statements(naming, engine.dialect.name)
        while True:
            with engine.begin() as conn:
                deleted = conn.execute(statements.batch, params).rowcount
            batch_done(deleted)
            if deleted < batch_size:
                break
    with engine.begin() as conn:
        conn.execute(statements.failures, params)
        # the settlement counts of workers not heard from for the whole window
        conn.execute(purge_counts(naming, engine.dialect.name), _count_params(params))
        compact = compact_rows(conn, naming)
        if not compact:
            conn.execute(statements.outputs, params)
    if compact:
        _purge_outputs(engine, naming, params)
    return total


def _purge_outputs(engine: Engine, naming: InboxSchema, params: dict[str, Any]) -> None:
    """The stored outputs older than the window whose claim is in neither claims table,
    a page a transaction: an output lives as long as its claim, and a compact claim
    outlives the window until its hour's partition is emptied (a consumer's purge leaves
    the compact rows, which name no consumer, to a purge of every consumer)."""
    statements = output_purge(naming)
    # from before the first identity: its names are never empty but the tenant's
    after = dict.fromkeys(statements.page.selected_columns.keys(), "")
    while True:
        with engine.begin() as conn:
            page = [
                tuple(row)
                for row in conn.execute(
                    statements.page, params | {f"after_{k}": v for k, v in after.items()}
                )
            ]
            if not page:
                return
            keys = {identity: str(uuid.UUID(bytes=claim_key(*identity))) for identity in page}
            live = set(conn.execute(statements.live, {"keys": list(keys.values())}).scalars())
            gone = [identity for identity, key in keys.items() if key not in live]
            if gone:
                conn.execute(statements.gone, params | {"keys": gone})
        if len(page) < params["limit"]:
            return
        after = dict(zip(after, page[-1], strict=True))


def _walk(
    engine: Engine,
    statements: PurgeStatements,
    params: dict[str, Any],
    batch_done: Callable[[int], None],
) -> None:
    """One table's heap walked by block ranges, from its first block to the last it had
    when the walk began (rows added since are younger than the window)."""
    batch_size = params["limit"]
    with engine.connect() as conn:
        blocks, density = conn.execute(statements.extent).one()
    base = max(1, math.ceil(batch_size / float(density or _ROWS_PER_BLOCK)))
    low, step = 0, base
    while low < blocks:
        with engine.begin() as conn:
            ranged = params | {"low": low, "high": low + step}
            deleted = conn.execute(statements.batch, ranged).rowcount
        if deleted < batch_size:  # else the range may hold more: take it again
            low += step
        # Across young blocks (no old claim) the ranges grow, up to _MAX_RANGE blocks, so
        # that a mostly young table costs few statements; a range that held old claims
        # brings them back to a batch's worth.
        step = min(max(step * 2, base), _MAX_RANGE) if not deleted else base
        batch_done(deleted)


def _postgresql_statements(
    conn: Connection, naming: InboxSchema, *, compact: int | None = None
) -> PurgeStatements:
    version = conn.dialect.server_version_info or TID_RANGE_SCAN
    return purge_statements(
        naming, "postgresql", tid_range_scan=version >= TID_RANGE_SCAN, compact=compact
    )


def _count_params(params: dict[str, Any]) -> dict[str, Any]:
    return {"seconds": params["seconds"], "consumer": params["consumer"]}


def purgeable(
    conn: Connection, naming: InboxSchema, older_than: timedelta, *, consumer: str | None = None
) -> int:
    """How many claims `purge` would delete now. On PostgreSQL it reads the heap once, in
    block ranges of 128 MB, each one statement without parallel workers."""
    params = {"seconds": older_than.total_seconds(), "consumer": consumer}
    if conn.dialect.name != "postgresql":
        statement = purge_statements(naming, conn.dialect.name).count
        return int(conn.execute(statement, params).scalar_one())
    total = 0
    lasting: tuple[int | None, ...] = (None,)
    if consumer is None:
        lasting = (None, *range(len(CLAIMS_PARTITIONS)))
        total += partitions.expired_claims(conn, naming, older_than)
    for compact in lasting:
        statements = _postgresql_statements(conn, naming, compact=compact)
        blocks = int(conn.execute(statements.extent).one()[0])
        total += sum(
            int(
                conn.execute(
                    statements.count, params | {"low": low, "high": low + _COUNT_BLOCKS}
                ).scalar_one()
            )
            for low in range(0, blocks, _COUNT_BLOCKS)
        )
    return total


class RetentionRefused(ConfigurationError):
    """The purge window is shorter than the recorded retention policy allows."""


# -- redeliveries older than the window ---------------------------------------------------


def check_expired(
    delivery: Delivery, window: timedelta | None, policy: ExpiredPolicy, *, consumer: str
) -> None:
    """In the claim's transaction, before the handler: refuse (raise `PermanentError`) or
    report a first-seen message older than ``window`` by its producer's timestamp."""
    produced = delivery.identity.produced_at
    if window is None or produced is None:
        return
    age = datetime.now(UTC) - produced
    if age <= window:
        return
    metrics.expired(consumer, "rejected" if policy == "reject" else "processed")
    text = (
        f"produced {format_duration(age)} ago, beyond the {format_duration(window)} retention "
        "window: its claim may have been purged"
    )
    if policy == "reject":
        raise PermanentError(ReasonCode.EXPIRED_REDELIVERY, f"a message {text}")
    logger.warning(
        "processing message %s of %s for %s although it was %s (expired_redelivery='process')",
        delivery.identity.message_id,
        delivery.identity.producer,
        consumer,
        text,
    )
