"""The settlement counts: what each settlement is counted as, the per-thread counts, the
flushers (a failed flush loses nothing, an outage is logged once) and the count rows on
SQLite (upsert, totals, purge)."""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select, text

from inbox_middleware._core.consumption import (
    DeadLettered,
    Duplicate,
    HandedBack,
    Poisoned,
    Processed,
    Quarantined,
)
from inbox_middleware._core.exceptions import (
    ConfigurationError,
    IdentityError,
    InboxError,
    PayloadNotHashable,
)
from inbox_middleware._core.protocol import Decision, QuarantineRecord, Verdict
from inbox_middleware._operate.tally import (
    OUTCOMES,
    AsyncCountFlusher,
    CountFlusher,
    Tally,
    check_interval,
    outcome_of,
)
from inbox_middleware._storage import InboxSchema, migrate
from inbox_middleware._storage.counts import count_totals, flush_counts, purge_counts

FIRST = Verdict(Decision.FIRST)


@pytest.mark.parametrize(
    ("settlement", "outcome"),
    [
        (Processed(verdict=FIRST), "processed"),
        (Processed(verdict=None), "unprotected"),
        (Duplicate(Verdict(Decision.DUPLICATE)), "duplicate"),
        (Quarantined(Verdict(Decision.CONFLICT), QuarantineRecord(1, 1)), "quarantined"),
        (DeadLettered("missing", IdentityError("no id")), "no_identity"),
        (DeadLettered("unhashable", PayloadNotHashable("no form")), "no_identity"),
        (DeadLettered("unfit", InboxError("bad body")), "dead_lettered"),
        (Poisoned("permanent", QuarantineRecord(1, 3), "ValueError"), "poisoned"),
        (HandedBack(ValueError("boom"), counted=True), "failed"),
        (HandedBack(OSError("database down"), counted=False), "handed_back"),
    ],
)
def test_outcome_of__every_settlement_is_counted_under_one_outcome(settlement, outcome):
    assert outcome_of(settlement) == outcome
    assert outcome in OUTCOMES


def test_tally__threads_count_without_a_lock_and_the_totals_are_exact():
    tally = Tally()
    start = threading.Barrier(4)

    def work() -> None:
        start.wait()
        for _ in range(20_000):
            tally.count("billing", "processed")
        tally.count("billing", "duplicate")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert tally.totals() == {("billing", "processed"): 80_000, ("billing", "duplicate"): 4}


def test_count_interval__positive_seconds_or_none():
    assert check_interval(None) is None
    assert check_interval(2) == 2.0
    for bad in (0, -1, "5", True):
        with pytest.raises(ConfigurationError, match="count_interval"):
            check_interval(bad)  # type: ignore[arg-type]


def test_flusher__a_failed_flush_loses_nothing_and_an_outage_is_logged_once(caplog):
    # Given a database that refuses two flushes, then accepts
    tally = Tally()
    written: list[dict[tuple[str, str], int]] = []
    down = [True, True]

    def write(worker: str, since: datetime, counts: dict[tuple[str, str], int]) -> None:
        if down and down.pop():
            raise OSError("connection refused")
        written.append(dict(counts))

    flusher = CountFlusher(write, 5.0, tally)
    caplog.set_level(logging.INFO, logger="inbox_middleware")
    # When counts grow across the failed flushes
    tally.count("billing", "duplicate")
    flusher.flush()
    tally.count("billing", "duplicate")
    flusher.flush()
    tally.count("billing", "no_identity")
    flusher.flush()
    # Then the next flush writes the cumulative values, and only changed ones after it
    assert written == [{("billing", "duplicate"): 2, ("billing", "no_identity"): 1}]
    tally.count("billing", "no_identity")
    flusher.flush()
    flusher.flush()
    assert written[1:] == [{("billing", "no_identity"): 2}]
    lines = [r.getMessage() for r in caplog.records]
    assert sum("could not write the inbox's settlement counts" in line for line in lines) == 1
    assert sum("written again" in line for line in lines) == 1


def test_flusher__the_thread_flushes_every_interval_and_once_more_on_stop():
    tally = Tally()
    flushed = threading.Event()
    written: list[dict[tuple[str, str], int]] = []

    def write(worker: str, since: datetime, counts: dict[tuple[str, str], int]) -> None:
        assert (worker, since) == (tally.worker, tally.since)
        written.append(dict(counts))
        flushed.set()

    flusher = CountFlusher(write, 0.05, tally)
    flusher.start()
    tally.count("billing", "processed")
    assert flushed.wait(5)
    tally.count("billing", "processed")
    flusher.stop()
    assert written[-1] == {("billing", "processed"): 2}


async def test_flusher__the_task_flushes_what_is_left_when_stopped():
    tally = Tally()
    written: list[dict[tuple[str, str], int]] = []

    async def write(worker: str, since: datetime, counts: dict[tuple[str, str], int]) -> None:
        written.append(dict(counts))

    flusher = AsyncCountFlusher(write, 60.0, tally)
    flusher.start()
    tally.count("billing", "quarantined")
    await flusher.stop()
    assert written == [{("billing", "quarantined"): 1}]


def test_count_rows__each_worker_upserts_its_own_and_status_sums_them(tmp_path: Path):
    engine = create_engine(f"sqlite:///{tmp_path / 'inbox.db'}")
    naming = InboxSchema(prefix="app_")
    migrate(engine, naming)
    since = datetime.now(UTC) - timedelta(minutes=1)
    with engine.begin() as conn:
        flush_counts(conn, naming, "a", since, {("billing", "duplicate"): 1})
        flush_counts(conn, naming, "a", since, {("billing", "duplicate"): 3})  # cumulative
        flush_counts(conn, naming, "b", since, {("billing", "duplicate"): 2})
        flush_counts(conn, naming, "b", since, {("shipping", "no_identity"): 1})
    with engine.connect() as conn:
        totals = count_totals(conn, naming, since)
    assert totals.counts == {("billing", "duplicate"): 5, ("shipping", "no_identity"): 1}
    assert (totals.workers, totals.live_workers) == (2, 2)
    # A worker gone for longer than the purge window loses its rows; the others stay
    table = naming.tables.counts
    with engine.begin() as conn:
        conn.execute(
            table.update().where(table.c.worker == "a").values(updated_at=text("'2000-01-01'"))
        )
        conn.execute(purge_counts(naming, "sqlite"), {"seconds": 3600.0, "consumer": None})
        left = {tuple(row) for row in conn.execute(select(table.c.worker, table.c.consumer_name))}
    assert left == {("b", "billing"), ("b", "shipping")}
    engine.dispose()
