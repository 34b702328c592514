"""The command line's one style: errors as one line naming the fix, tables for people,
JSON with zoned ISO timestamps, bulk decisions by filter with a dry run, the purge."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import select, text

from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Delivery
from inbox_middleware._operate.retention import RetentionPolicy, record_policy
from inbox_middleware._storage import Inbox, InboxSchema
from inbox_middleware._storage.failures import FailureRecorder
from inbox_middleware.cli import main

NAMING = InboxSchema()


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """The console script, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-c", "from inbox_middleware.cli import run; run()", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def invoke(pg_url: str, *args: str) -> Any:
    return CliRunner().invoke(main, [*args, "--database-url", pg_url])


def test_cli__errors_are_one_line_that_names_the_fix(pg_url):
    not_a_url = run("status", "--database-url", "notaurl")
    assert not_a_url.returncode == 2
    assert not_a_url.stderr.splitlines() == [
        "error: Invalid value for '--database-url': 'notaurl' is not a database URL; give a "
        "URL like postgresql://user:password@host:5432/dbname "
        "(see `inbox-middleware status --help`)"
    ]
    for command in (["status"], ["quarantine", "list"], ["poison", "list"], ["outbox", "list"]):
        before_migrate = run(*command, "--database-url", pg_url, "--schema", "not_migrated")
        assert before_migrate.returncode == 1, command
        assert before_migrate.stderr == (
            'error: the inbox tables ("not_migrated"."consumer_inbox") do not exist; '
            "run `inbox-middleware migrate`\n"
        ), command
    missing = run("status")
    assert (missing.returncode, missing.stdout) == (2, "")
    assert missing.stderr.startswith("error: Missing option '--database-url'")


def test_cli__postgres_urls_and_the_environment_variables_in_help(pg_url):
    # postgres:// (Heroku's, libpq's spelling) is PostgreSQL; the driver is whichever is
    # installed.
    postgres = "postgres://" + pg_url.split("://", 1)[1]
    assert "the inbox schema is at version" in invoke(postgres, "check").output
    shown = CliRunner().invoke(main, ["quarantine", "redrive", "--help"]).output
    for variable in ("INBOX_DATABASE_URL", "INBOX_SCHEMA", "INBOX_PREFIX", "INBOX_BROKER_URL"):
        assert f"env var: {variable}" in " ".join(shown.split())


def poison(engine, consumer: str, message_id: str, reason: str) -> None:
    delivery = Delivery(
        consumer, MessageIdentity("orders", message_id), hash_json({"id": message_id}, "json.v1")
    )
    recorder = FailureRecorder(NAMING, "postgresql")
    with engine.begin() as conn:
        recorder.record_poison(conn, delivery, reason_code=reason, error="E: no", attempts=1)


def test_cli__bulk_discard_by_filter_with_a_dry_run_first(pg_url, pg_engine):
    billing, shipping = f"billing-{uuid.uuid4().hex[:6]}", f"shipping-{uuid.uuid4().hex[:6]}"
    for n in range(3):
        poison(pg_engine, billing, f"b-{n}", "account_closed")
    poison(pg_engine, billing, "b-9", "unknown_sku")
    poison(pg_engine, shipping, "s-1", "account_closed")
    selection = ["--consumer", billing, "--reason-code", "account_closed", "--since", "1h"]

    # Given a dry run: the rows it would discard, in a table, and nothing decided
    dry = invoke(pg_url, "poison", "discard", *selection, "--reason", "closed", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "would discard 3 poison rows (--dry-run)" in dry.output
    assert all(f"b-{n}" in dry.output for n in range(3)) and "b-9" not in dry.output
    listed = invoke(pg_url, "poison", "list", "--json")
    rows = [json.loads(line) for line in listed.output.splitlines()]
    assert {row["decision"] for row in rows} == {"pending"} and len(rows) == 5
    assert all(datetime.fromisoformat(row["last_failure_at"]).tzinfo for row in rows)

    # When it runs for real
    done = invoke(pg_url, "poison", "discard", *selection, "--reason", "closed", "--by", "ops")
    assert done.exit_code == 0, done.output
    assert "3 of 3 poison rows discarded" in done.output
    # Then those three only are discarded, and a second run finds nothing left
    with pg_engine.connect() as conn:
        table = NAMING.tables.poison
        decided = dict(conn.execute(select(table.c.message_id, table.c.decision)).all())
    assert decided == {
        "b-0": "discarded",
        "b-1": "discarded",
        "b-2": "discarded",
        "b-9": "pending",
        "s-1": "pending",
    }
    again = invoke(pg_url, "poison", "discard", *selection, "--reason", "closed", "--dry-run")
    assert "no poison row to discard" in again.output
    table_view = invoke(pg_url, "poison", "list", "--decision", "all")
    assert "┃ #" in table_view.output and "account_closed" in table_view.output

    # Ids and a filter together are refused, and so is neither
    both = invoke(pg_url, "poison", "discard", "1", "--consumer", billing, "--reason", "x")
    neither = invoke(pg_url, "poison", "discard", "--reason", "x")
    assert both.exit_code == neither.exit_code == 2
    assert "not both" in both.output and "give row ids, or a filter" in neither.output


def test_cli__purge_dry_run_and_force_without_a_policy(pg_url, pg_engine):
    inbox = Inbox(pg_engine)
    for n in range(12):
        delivery = Delivery("c", MessageIdentity("p", f"m-{n}"), hash_json(n, "json.v1"))
        inbox.process(delivery, lambda s: None)
    with pg_engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE consumer_inbox SET processed_at = now() - interval '40 days' "
                "WHERE message_id <> 'm-0'"
            )
        )

    dry = run("purge", "--older-than", "30d", "--force", "--dry-run", "--database-url", pg_url)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout == "would delete 11 claims processed more than 4w2d ago (--dry-run)\n"
    assert dry.stderr == "warning: no retention policy is recorded; purging anyway (--force)\n"
    assert "below the recorded retention policy" not in dry.stderr

    forced = run(
        "purge", "--older-than", "30d", "--force", "--batch-size", "5", "--database-url", pg_url
    )
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.startswith("deleted 11 claims processed more than 4w2d ago in ")
    with pg_engine.begin() as conn:
        assert conn.scalar(text("SELECT count(*) FROM consumer_inbox")) == 1
        record_policy(
            conn, NAMING, RetentionPolicy(broker_retention=timedelta(days=45)), consumer="*", by="t"
        )
    below = run("purge", "--older-than", "30d", "--force", "--dry-run", "--database-url", pg_url)
    assert below.stderr.startswith(
        "warning: purging below the recorded retention policy's minimum of"
    )


@pytest.mark.parametrize("command", ["migrate", "check", "status", "explain"])
def test_cli__every_database_command_reads_the_url_from_the_environment(command):
    # (no database needed: click reports what is missing before connecting)
    shown = CliRunner().invoke(main, [command, "--help"]).output
    assert "INBOX_DATABASE_URL" in shown


def test_engines__an_asyncpg_only_engine_works_under_run_sync_from_any_thread(
    pg_async_url, monkeypatch
):
    # As with inbox-middleware[faststream-rabbit]: asyncpg is the only driver
    import threading

    from inbox_middleware._operate.metrics import TableCollector
    from inbox_middleware._storage import engines

    monkeypatch.setattr(engines, "_installed", lambda module: module == "asyncpg")
    engine = engines.sync_engine(pg_async_url)
    try:
        assert engine.dialect.driver == "asyncpg"
        assert engines.run_sync(lambda: engine.connect().close()) is None
        # The metrics server reads the table gauges from its own threads
        collector = TableCollector(engine, NAMING, cache_seconds=0)
        families: list[Any] = []
        reader = threading.Thread(target=lambda: families.extend(collector.collect()))
        reader.start()
        reader.join(30)
        assert collector.reads == 1 and families
        assert all(
            sample.value == 1
            for f in families
            if f.name == "inbox_tables_up"
            for sample in f.samples
        )
    finally:
        engine.dispose()
