"""Migrations: idempotent, safe from two processes at once, equal to the table
definitions the code builds statements from, usable from Alembic and the CLI."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
from sqlalchemy import Uuid, create_engine, inspect, text

from inbox_middleware._core.exceptions import SchemaError
from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Decision, Delivery
from inbox_middleware._storage import LATEST_VERSION, Inbox, InboxSchema, check_schema, migrate
from inbox_middleware._storage.tables import TABLES

from ..apps.domain import apply_credit


@pytest.fixture
def fresh_schema(pg_engine):
    name = f"s_{uuid.uuid4().hex[:10]}"
    yield InboxSchema(schema=name, prefix="svc_")
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from inbox_middleware.cli import run; run()", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_migrate__twice_applies_once(pg_engine, fresh_schema):
    assert [m.version for m in migrate(pg_engine, fresh_schema)] == list(
        range(1, LATEST_VERSION + 1)
    )
    assert migrate(pg_engine, fresh_schema) == []
    with pg_engine.connect() as conn:
        check_schema(conn, fresh_schema)


def test_migrate__two_processes_at_once_are_safe(pg_url, pg_engine, fresh_schema):
    args = [
        "migrate",
        "--database-url",
        pg_url,
        "--schema",
        fresh_schema.schema,
        "--prefix",
        fresh_schema.prefix,
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "from inbox_middleware.cli import run; run()", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [proc.communicate(timeout=60) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], results
    outputs = sorted(out for out, _ in results)
    assert "up to date" in outputs[1] and "applied 0001_inbox" in outputs[0]
    with pg_engine.connect() as conn:
        versions = (
            conn.execute(
                text(f'SELECT version FROM "{fresh_schema.schema}".svc_inbox_schema_version')
            )
            .scalars()
            .all()
        )
    assert versions == list(range(1, LATEST_VERSION + 1))


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_migrations__produce_the_tables_the_code_describes(request, dialect):
    # The migration files are the schema; the SQLAlchemy tables build the statements.
    # Reflect what the migrations made and compare it with the definitions.
    engine = request.getfixturevalue("pg_engine" if dialect == "postgresql" else "sqlite_engine")
    tables = InboxSchema().tables
    inspector = inspect(engine)
    every = (
        tables.inbox,
        tables.quarantine,
        tables.outbox,
        tables.attempts,
        tables.poison,
        tables.retention,
        tables.claims,
        tables.layout,
        tables.version,
    )
    for table in every:
        reflected = {column["name"]: column for column in inspector.get_columns(table.name)}
        assert set(reflected) == {column.name for column in table.columns}, table.name
        for column in table.columns:
            if not column.primary_key:  # SQLite reflects INTEGER PRIMARY KEY as nullable
                assert reflected[column.name]["nullable"] == column.nullable, column.name
            assert (
                reflected[column.name]["type"]._type_affinity
                is column.type.dialect_impl(engine.dialect)._type_affinity
                or column.name in ("headers", "scenarios", "id")  # JSON/JSONB, identities
                or (table is tables.outbox and column.name in ("payload", "remote_result"))
                # SQLite has no uuid: SQLAlchemy's Uuid is CHAR(32) there, as migrated
                or (dialect == "sqlite" and isinstance(column.type, Uuid))
            ), (table.name, column.name)
        primary_key = inspector.get_pk_constraint(table.name)["constrained_columns"]
        assert primary_key == [column.name for column in table.primary_key.columns], table.name
    assert set(TABLES) <= set(inspector.get_table_names())


def test_configured_schema_and_prefix__whole_protocol_runs_there(pg_engine, fresh_schema):
    migrate(pg_engine, fresh_schema)
    inbox = Inbox(pg_engine, naming=fresh_schema)
    inbox.check()
    delivery = Delivery("billing", MessageIdentity("orders", "m-1"), hash_json({}, "json.v1"))

    first = inbox.process(delivery, lambda s: apply_credit(s, "billing", 1, 10))
    again = inbox.process(delivery, lambda s: apply_credit(s, "billing", 1, 10))

    assert (first.decision, again.decision) == (Decision.FIRST, Decision.DUPLICATE)
    with pg_engine.connect() as conn:
        rows = (
            conn.execute(text(f'SELECT message_id FROM "{fresh_schema.schema}".svc_consumer_inbox'))
            .scalars()
            .all()
        )
        default_rows = conn.scalar(text("SELECT count(*) FROM public.consumer_inbox"))
    assert (rows, default_rows) == (["m-1"], 0)


def test_check_schema__missing_and_outdated_tables_say_to_migrate(pg_engine, fresh_schema):
    with pg_engine.connect() as conn, pytest.raises(SchemaError, match="do not exist.*migrate"):
        check_schema(conn, fresh_schema)
    migrate(pg_engine, fresh_schema)
    with pg_engine.begin() as conn:
        conn.execute(text(f'DELETE FROM "{fresh_schema.schema}".svc_inbox_schema_version'))
    with pytest.raises(SchemaError, match=f"at version 0, this code needs {LATEST_VERSION}"):
        Inbox(pg_engine, naming=fresh_schema).check()


def test_cli_check__reports_the_version_and_fails_on_a_missing_schema(pg_url, fresh_schema):
    missing = cli("check", "--database-url", pg_url, "--schema", fresh_schema.schema)
    assert missing.returncode == 1
    assert "do not exist; run `inbox-middleware migrate`" in missing.stderr
    ok = cli("check", "--database-url", pg_url)
    assert ok.returncode == 0, ok.stderr
    assert f"version {LATEST_VERSION}" in ok.stdout


def test_cli__bad_identifier_and_unreachable_database_are_one_clear_line(pg_url):
    bad = cli("migrate", "--database-url", pg_url, "--schema", 'x"; DROP TABLE accounts; --')
    assert bad.returncode == 1
    assert bad.stderr.startswith("error: schema") and "Traceback" not in bad.stderr
    down = cli("check", "--database-url", "postgresql://postgres@127.0.0.1:1/none")
    assert down.returncode == 1
    assert "could not be reached" in down.stderr and "Traceback" not in down.stderr


def test_sqlite__refuses_a_schema_with_a_clear_message(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(Exception, match="SQLite has no schemas"):
        migrate(engine, InboxSchema(schema="billing"))
    engine.dispose()


def test_render_sql__applied_by_hand_gives_the_schema_workers_accept(pg_engine, fresh_schema):
    from inbox_middleware._storage import render_sql

    with pg_engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{fresh_schema.schema}"')
        for statement in render_sql("postgresql", fresh_schema):
            conn.exec_driver_sql(statement)
    with pg_engine.connect() as conn:
        check_schema(conn, fresh_schema)
    assert migrate(pg_engine, fresh_schema) == []  # and migrate agrees it is complete
