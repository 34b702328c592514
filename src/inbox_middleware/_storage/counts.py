"""The SQL of the settlement counts (``inbox_counts``): each worker's flush, the totals
``status`` reads, and the purge of dead workers' rows.

A flush upserts the worker's own cumulative counts, one row per consumer and outcome, on
the caller's connection: a row is only ever written by the worker that owns it, so two
workers never wait on each other, and a flush that failed loses nothing (the next one
writes the same cumulative values, grown).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Float, Text, bindparam, delete, func, select
from sqlalchemy.dialects import postgresql, sqlite

from .tables import InboxSchema

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

__all__ = [
    "CountTotals",
    "count_totals",
    "flush_counts",
    "flush_counts_async",
    "purge_counts",
]


def _upsert(naming: InboxSchema, dialect: str, worker: str, since: datetime) -> Any:
    table = naming.tables.counts
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = insert(table).values(
        worker=worker,
        consumer_name=bindparam("consumer_name"),
        outcome=bindparam("outcome"),
        count=bindparam("count"),
        since=since,
        updated_at=func.now(),
    )
    return statement.on_conflict_do_update(
        index_elements=["worker", "consumer_name", "outcome"],
        set_={"count": statement.excluded.count, "updated_at": statement.excluded.updated_at},
    )


def _rows(counts: Mapping[tuple[str, str], int]) -> list[dict[str, Any]]:
    return [
        {"consumer_name": consumer, "outcome": outcome, "count": count}
        for (consumer, outcome), count in sorted(counts.items())
    ]


def flush_counts(
    conn: Connection,
    naming: InboxSchema,
    worker: str,
    since: datetime,
    counts: Mapping[tuple[str, str], int],
) -> None:
    """Upsert ``worker``'s cumulative ``counts`` by (consumer, outcome)."""
    if counts:
        conn.execute(_upsert(naming, conn.dialect.name, worker, since), _rows(counts))


async def flush_counts_async(
    conn: AsyncConnection,
    naming: InboxSchema,
    worker: str,
    since: datetime,
    counts: Mapping[tuple[str, str], int],
) -> None:
    """`flush_counts` on an `AsyncConnection`."""
    if counts:
        await conn.execute(_upsert(naming, conn.dialect.name, worker, since), _rows(counts))


@dataclass(frozen=True, slots=True)
class CountTotals:
    """The counted settlements of every worker that flushed, by consumer and outcome."""

    counts: dict[tuple[str, str], int]
    workers: int
    """Worker rows read (worker processes, live or gone, whose rows purge has not deleted)."""
    since: datetime | None
    """When the earliest of those workers started counting."""
    updated_at: datetime | None
    """The latest flush."""
    live_workers: int
    """Workers that flushed within the window asked for."""


def count_totals(conn: Connection, naming: InboxSchema, live_since: datetime) -> CountTotals:
    """Sum every worker's counts by consumer and outcome (a small table: a few rows per
    worker process and consumer)."""
    table = naming.tables.counts
    sums = select(table.c.consumer_name, table.c.outcome, func.sum(table.c.count)).group_by(
        table.c.consumer_name, table.c.outcome
    )
    counts = {(row[0], row[1]): int(row[2]) for row in conn.execute(sums)}
    span = conn.execute(
        select(
            func.count(table.c.worker.distinct()),
            func.min(table.c.since),
            func.max(table.c.updated_at),
        )
    ).one()
    live = conn.scalar(
        select(func.count(table.c.worker.distinct())).where(table.c.updated_at >= live_since)
    )
    return CountTotals(counts, int(span[0] or 0), span[1], span[2], int(live or 0))


def purge_counts(naming: InboxSchema, dialect: str) -> Any:
    """Deletes the count rows not flushed for ``seconds`` (workers gone that long), of
    one consumer or (``consumer`` None) all."""
    table = naming.tables.counts
    cutoff = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, bindparam("seconds", type_=Float))
    if dialect == "sqlite":
        cutoff = func.datetime("now", func.printf("-%f seconds", bindparam("seconds")))
    consumer = bindparam("consumer", type_=Text)
    return delete(table).where(
        table.c.updated_at < cutoff,
        (consumer.is_(None)) | (table.c.consumer_name == consumer),
    )
