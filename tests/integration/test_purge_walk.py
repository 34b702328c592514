"""The purge rests on no planner accident: it walks the heap by block ranges.

A batch taken with a sequential scan and ``LIMIT ... FOR UPDATE SKIP LOCKED`` is fast only
while PostgreSQL happens to resume each scan where the last one stopped (synchronized
scans, for tables above a quarter of shared_buffers); otherwise every batch reads again
the dead rows of the batches before it, and the last one reads the rest of the table.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, event, text

from inbox_middleware._operate.retention import purge, purgeable
from inbox_middleware._storage import InboxSchema, migrate

from ..support.engines import sync_engine

pytestmark = pytest.mark.postgres

NAMING = InboxSchema()
OLD, YOUNG = 60_000, 20_000


@pytest.fixture
def filled(pg_engine: Engine, pg_url: str) -> Iterator[Engine]:
    engine = sync_engine(
        pg_url,
        connect_args={"options": "-c synchronize_seqscans=off"},
    )
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO consumer_inbox (consumer_name, producer_name, tenant, message_id, "
                "payload_sha256, hash_scheme, processed_at) SELECT 'walk', 'p', '', 'm' || n, "
                "'x', 's', CASE WHEN n % 4 = 0 THEN now() "
                "ELSE now() - interval '60 days' END "
                f"FROM generate_series(1, {OLD + YOUNG}) n"
            )
        )
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            text("VACUUM ANALYZE consumer_inbox")
        )
    yield engine
    engine.dispose()


def _tuples_scanned(engine: Engine) -> int:
    """Tuples the scans of the inbox returned so far (sequential and TID range scans)."""
    with engine.connect() as conn:
        return int(
            conn.scalar(
                text(
                    "SELECT seq_tup_read FROM pg_stat_user_tables WHERE relname = 'consumer_inbox'"
                )
            )
        )


def _scans(plan: dict[str, Any]) -> Iterator[str]:
    yield plan["Node Type"]
    for child in plan.get("Plans", []):
        yield from _scans(child)


def test_purge__each_batch_reads_only_its_block_range_without_synchronized_scans(
    filled: Engine,
) -> None:
    filled.dispose()  # a backend's counters are flushed when it ends, at the latest
    before = _tuples_scanned(filled)
    ran: list[tuple[str, Any]] = []

    @event.listens_for(filled, "before_cursor_execute")
    def record(conn: Any, cursor: Any, statement: str, params: Any, *args: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE FROM"):
            ran.append((statement, params))

    deleted = purge(filled, NAMING, timedelta(days=30), batch_size=1000)
    event.remove(filled, "before_cursor_execute", record)
    filled.dispose()
    scanned = _tuples_scanned(filled) - before

    # Every old claim went, no young one did.
    assert deleted == OLD
    with filled.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM consumer_inbox")) == YOUNG
    # The heap was read about once, each batch its own block range; a sequential scan per
    # batch reads again every young row before the batch's first old one (and the last
    # batch reads the rest of the table): about 8 times the table here.
    assert scanned < 2 * (OLD + YOUNG), scanned
    # And the plan of each batch statement scans a block range, never the whole table.
    batches = [(s, p) for s, p in ran if "consumer_inbox" in s]
    assert batches
    with filled.connect() as conn:
        statement, params = batches[0]
        raw = conn.connection.dbapi_connection
        assert raw is not None
        with raw.cursor() as cursor:
            cursor.execute("EXPLAIN (FORMAT JSON) " + statement, params)
            plan = cursor.fetchone()[0]
        conn.rollback()
    nodes = list(_scans(plan[0]["Plan"] if isinstance(plan, list) else json.loads(plan)[0]))
    assert "Seq Scan" not in nodes, nodes
    assert "Tid Range Scan" in nodes, nodes


def test_purge__the_count_walks_the_same_ranges_and_agrees_with_the_purge(
    filled: Engine,
) -> None:
    with filled.connect() as conn:
        counted = purgeable(conn, NAMING, timedelta(days=30))
        only_walk = purgeable(conn, NAMING, timedelta(days=30), consumer="walk")
        none = purgeable(conn, NAMING, timedelta(days=30), consumer="other")
    assert (counted, only_walk, none) == (OLD, OLD, 0)
    assert purge(filled, NAMING, timedelta(days=30), consumer="other") == 0
    assert purge(filled, NAMING, timedelta(days=30), consumer="walk", batch_size=7) == OLD


def test_purge__the_fallback_without_tid_range_scans_deletes_the_same_rows(
    filled: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PostgreSQL 13 and older have no TID range scan: the purge names each block's tuples.
    monkeypatch.setattr(filled.dialect, "server_version_info", (13, 0))
    assert purge(filled, NAMING, timedelta(days=30), batch_size=5000) == OLD
    with filled.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM consumer_inbox")) == YOUNG


def test_migration__the_inbox_is_vacuumed_after_a_purge_of_a_hundredth_of_it(
    pg_engine: Engine,
) -> None:
    with pg_engine.connect() as conn:
        options = conn.scalar(
            text("SELECT reloptions FROM pg_class WHERE oid = 'consumer_inbox'::regclass")
        )
    assert {
        "autovacuum_vacuum_scale_factor=0.01",
        "autovacuum_vacuum_threshold=10000",
        "autovacuum_vacuum_insert_scale_factor=0.05",
    } <= set(options)


def test_purge__walks_the_claims_table_of_a_configured_schema_and_prefix(pg_engine: Engine) -> None:
    name = f"Walk_{uuid.uuid4().hex[:8]}"  # a capital: the quotes must keep it
    naming = InboxSchema(schema=name, prefix="svc_")
    migrate(pg_engine, naming)
    try:
        with pg_engine.begin() as conn:
            conn.execute(
                text(
                    f'INSERT INTO "{name}".svc_consumer_inbox (consumer_name, producer_name, '
                    "tenant, message_id, payload_sha256, hash_scheme, processed_at) "
                    "SELECT 'c', 'p', '', 'm' || n, 'x', 's', "
                    "now() - n * interval '1 day' + interval '1 hour' "
                    "FROM generate_series(1, 100) n"
                )
            )
        with pg_engine.connect() as conn:
            assert purgeable(conn, naming, timedelta(days=30)) == 70
        assert purge(pg_engine, naming, timedelta(days=30), batch_size=9) == 70
    finally:
        with pg_engine.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{name}" CASCADE')
