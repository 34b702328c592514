"""Ordered schema migrations, applied idempotently.

Each dialect has a folder of numbered SQL files (``0001_inbox.sql``, ...). Table names in
them are placeholders (``${consumer_inbox}``) that become quoted, validated identifiers,
so a configured schema or prefix never reaches SQL as raw text. Applied versions are
recorded in ``inbox_schema_version``; on PostgreSQL a transaction-scoped advisory lock
makes two ``migrate`` runs at once safe (the second waits, then finds nothing to do).

From Alembic, call `migrate` with ``op.get_bind()`` inside a revision's ``upgrade()``: it
joins Alembic's transaction and records its own versions. In Alembic's offline mode
(``alembic upgrade --sql``) the bind only prints what it is given: `migrate` hands it
every statement of `render_sql`, which is safe to run on a database that has some or all
of them already. `drop_inbox` is the downgrade, refused unless asked for explicitly; and
`exclude_inbox_tables` keeps autogenerate from proposing to drop the inbox tables.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from string import Template
from typing import Any

from sqlalchemy import Connection, Engine, func, inspect, select, text
from sqlalchemy.engine.mock import MockConnection
from sqlalchemy.schema import CreateTable

from .._core.exceptions import ConfigurationError, SchemaError
from .tables import CLAIMS_PARTITIONS, HOURLY, TABLES, InboxSchema

__all__ = [
    "LATEST_VERSION",
    "Migration",
    "check_schema",
    "drop_inbox",
    "exclude_inbox_tables",
    "migrate",
    "migrations",
    "render_sql",
    "schema_version",
]

SUPPORTED_DIALECTS = ("postgresql", "sqlite")
_FILE = re.compile(r"(\d{4})_(\w+)\.sql")
_STATEMENT_END = re.compile(r";[ \t]*$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    template: str

    def statements(self, naming: InboxSchema, dialect: str) -> list[str]:
        """The migration's SQL for one naming, split into single statements."""
        sql = Template(self.template).substitute(_placeholders(naming, dialect))
        chunks = (chunk.strip() for chunk in _STATEMENT_END.split(sql))
        return [chunk for chunk in chunks if _has_code(chunk)]


def _has_code(chunk: str) -> bool:
    return any(line.strip() and not line.strip().startswith("--") for line in chunk.splitlines())


def _placeholders(naming: InboxSchema, dialect: str) -> dict[str, str]:
    if naming.schema is not None and dialect == "sqlite":
        raise ConfigurationError("SQLite has no schemas; leave schema unset and use a prefix")
    names = {table: _qualified(naming, table) for table in (*TABLES, *CLAIMS_PARTITIONS)}
    return {**names, "prefix": naming.prefix}


def _qualified(naming: InboxSchema, table: str) -> str:
    # Identifiers are validated by InboxSchema (letters, digits, underscores), so quoting
    # them is enough; the quotes also keep PostgreSQL from folding their case.
    name = f'"{naming.name(table)}"'
    return f'"{naming.schema}".{name}' if naming.schema else name


def migrations(dialect: str) -> list[Migration]:
    """The shipped migrations for a dialect, in order."""
    if dialect not in SUPPORTED_DIALECTS:
        raise ConfigurationError(
            f"inbox-middleware supports {' and '.join(SUPPORTED_DIALECTS)}, not {dialect}"
        )
    folder = resources.files(__package__).joinpath("migrations", dialect)
    found = []
    for entry in folder.iterdir():
        if match := _FILE.fullmatch(entry.name):
            found.append(Migration(int(match[1]), match[2], entry.read_text("utf-8")))
    found.sort(key=lambda migration: migration.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise SchemaError(f"migration files for {dialect} are not numbered 1..n")
    return found


LATEST_VERSION = len(migrations("postgresql"))


def migrate(
    bind: Engine | Connection | MockConnection, naming: InboxSchema | None = None
) -> list[Migration]:
    """Apply the migrations not yet applied; return them. Safe to run again, or at once."""
    naming = naming or InboxSchema()
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            return _migrate(conn, naming)
    if isinstance(bind, MockConnection):  # Alembic's offline mode: print, run nothing
        for statement in render_sql(bind.dialect.name, naming):
            bind.execute(text(statement))
        return migrations(bind.dialect.name)
    if bind.in_transaction():
        return _migrate(bind, naming)
    with bind.begin():
        return _migrate(bind, naming)


def _lock_name(naming: InboxSchema) -> str:
    return f"inbox-middleware:{naming.schema or ''}:{naming.prefix}"


def _migrate(conn: Connection, naming: InboxSchema) -> list[Migration]:
    dialect = conn.dialect.name
    pending = migrations(dialect)
    if dialect == "postgresql":
        lock = _lock_name(naming)
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:lock))"), {"lock": lock})
        if naming.schema:
            conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{naming.schema}"')
    _placeholders(naming, dialect)  # refuses a schema on SQLite before anything is created
    version_table = naming.tables.version
    version_table.create(conn, checkfirst=True)
    applied = set(conn.scalars(select(version_table.c.version)))
    done = []
    for migration in pending:
        if migration.version in applied:
            continue
        for statement in migration.statements(naming, dialect):
            conn.exec_driver_sql(statement)
        conn.execute(
            version_table.insert().values(
                version=migration.version, name=migration.name, applied_at=func.now()
            )
        )
        done.append(migration)
    return done


def schema_version(conn: Connection, naming: InboxSchema | None = None) -> int | None:
    """The highest applied migration, or None when the inbox tables were never created."""
    naming = naming or InboxSchema()
    table = naming.tables.version
    if not inspect(conn).has_table(table.name, schema=naming.schema):
        return None
    version: int = conn.scalar(select(func.coalesce(func.max(table.c.version), 0))) or 0
    return version


def check_schema(conn: Connection, naming: InboxSchema | None = None) -> None:
    """Raise `SchemaError` unless the inbox tables are at the version this code needs."""
    naming = naming or InboxSchema()
    version = schema_version(conn, naming)
    where = _qualified(naming, "consumer_inbox")
    if version is None:
        raise SchemaError(
            f"the inbox tables ({where}) do not exist; run `inbox-middleware migrate`"
        )
    if version < LATEST_VERSION:
        raise SchemaError(
            f"the inbox schema is at version {version}, this code needs {LATEST_VERSION}; "
            "run `inbox-middleware migrate`"
        )


def drop_inbox(
    bind: Engine | Connection | MockConnection,
    naming: InboxSchema | None = None,
    *,
    confirm: bool = False,
) -> None:
    """Drop every inbox table, for an Alembic ``downgrade()`` or a test's teardown.

    Refused unless ``confirm``: the claims go with the tables, so every message delivered
    again afterwards is processed again. From Alembic, pass the flag through ``-x``
    (``alembic -x drop_inbox=yes downgrade base``; see the migrations guide).
    """
    naming = naming or InboxSchema()
    if not confirm:
        raise SchemaError(
            "dropping the inbox tables forgets every claim, so every redelivered message "
            "would be processed again; ask for it explicitly (drop_inbox(..., confirm=True), or "
            "`alembic -x drop_inbox=yes downgrade ...` with the documented revision)"
        )
    dialect = bind.dialect.name
    cascade = " CASCADE" if dialect == "postgresql" else ""
    statements = [f"DROP TABLE IF EXISTS {_qualified(naming, t)}{cascade}" for t in TABLES]
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            for statement in statements:
                conn.exec_driver_sql(statement)
        return
    for statement in statements:
        bind.execute(text(statement))


def exclude_inbox_tables(
    naming: InboxSchema | None = None,
) -> Callable[[Any, str | None, str, bool, Any], bool]:
    """An Alembic ``include_object`` hook that keeps autogenerate away from our tables
    (and their columns, indexes and constraints), so it never proposes to drop or alter
    them: the library's migrations own them."""
    naming = naming or InboxSchema()
    ours = {naming.name(table) for table in (*TABLES, *CLAIMS_PARTITIONS)}
    hourly = re.compile(re.escape(naming.name(HOURLY)) + r"\d{10}")

    def is_ours(name: str | None) -> bool:
        return name in ours or (name is not None and hourly.fullmatch(name) is not None)

    def owned(obj: Any, name: str | None, type_: str) -> bool:
        if type_ == "table":
            schema = getattr(obj, "schema", None)
            return is_ours(name) and schema in (naming.schema, None)
        table = getattr(obj, "table", None)
        return table is not None and is_ours(table.name)

    def include_object(obj: Any, name: str | None, type_: str, reflected: bool, _: Any) -> bool:
        return not owned(obj, name, type_)

    return include_object


def render_sql(dialect: str, naming: InboxSchema | None = None) -> list[str]:
    """Every statement `migrate` would run, for review, to apply by hand, or for Alembic's
    offline mode: the lock, the schema, the version table, each migration, and the rows
    that record them (so workers find the schema version they check at start-up). Each
    statement is safe to run again, so the whole is safe on a database that has some of
    the migrations already."""
    naming = naming or InboxSchema()
    _placeholders(naming, dialect)
    engine_dialect = _dialect(dialect)
    version = naming.tables.version
    statements = []
    if dialect == "postgresql":
        lock = _lock_name(naming).replace("'", "''")
        statements.append(f"SELECT pg_advisory_xact_lock(hashtext('{lock}'))")
        if naming.schema:
            statements.append(f'CREATE SCHEMA IF NOT EXISTS "{naming.schema}"')
    statements.append(str(CreateTable(version, if_not_exists=True).compile(dialect=engine_dialect)))
    insert = _insert(dialect)
    for migration in migrations(dialect):
        statements += migration.statements(naming, dialect)
        record = (
            insert(version)
            .values(version=migration.version, name=migration.name, applied_at=func.now())
            .on_conflict_do_nothing()
        )
        compiled = record.compile(dialect=engine_dialect, compile_kwargs={"literal_binds": True})
        statements.append(str(compiled))
    return statements


def _insert(dialect: str) -> Any:
    from sqlalchemy.dialects import postgresql, sqlite

    return postgresql.insert if dialect == "postgresql" else sqlite.insert


def _dialect(name: str) -> Any:
    from sqlalchemy.dialects import postgresql, sqlite

    module: Any = postgresql if name == "postgresql" else sqlite
    return module.dialect()
