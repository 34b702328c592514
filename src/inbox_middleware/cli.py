"""The ``inbox-middleware`` command line.

Every command takes ``--database-url`` (or ``INBOX_DATABASE_URL``) and the table naming
(``--schema``, ``--prefix``, or ``INBOX_SCHEMA`` / ``INBOX_PREFIX``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from .exceptions import ConfigurationError, InboxError
from .storage import LATEST_VERSION, InboxSchema, check_schema, migrate, render_sql
from .storage.engines import sync_engine
from .storage.migrate import schema_version

__all__ = ["main", "run"]

F = TypeVar("F", bound=Callable[..., Any])


def database_options(command: F) -> F:
    options = [
        click.option(
            "--database-url",
            envvar="INBOX_DATABASE_URL",
            required=True,
            help="SQLAlchemy URL of the database holding the inbox tables "
            "(an asyncpg URL is used through psycopg).",
        ),
        click.option(
            "--schema", envvar="INBOX_SCHEMA", default=None, help="Schema of the inbox tables."
        ),
        click.option(
            "--prefix", envvar="INBOX_PREFIX", default="", help="Prefix of the inbox table names."
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def connect(database_url: str) -> Engine:
    """A synchronous engine for ``database_url``, whatever driver the URL names; safe
    behind a transaction pooler (`storage.engines`)."""
    try:
        return sync_engine(database_url)
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from exc


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="inbox-middleware")
def main() -> None:
    """Operate the transactional inbox: schema, status and repair."""


@main.command("migrate")
@database_options
@click.option("--sql", "print_sql", is_flag=True, help="Print the SQL instead of running it.")
def migrate_command(database_url: str, schema: str | None, prefix: str, print_sql: bool) -> None:
    """Create or upgrade the inbox tables. Safe to run twice, or from two hosts at once."""
    naming = naming_from(schema, prefix)
    engine = connect(database_url)
    try:
        if print_sql:
            for statement in render_sql(engine.dialect.name, naming):
                click.echo(statement + ";\n")
            return
        applied = migrate(engine, naming)
    finally:
        engine.dispose()
    if applied:
        for migration in applied:
            click.echo(f"applied {migration.version:04d}_{migration.name}")
    else:
        click.echo(f"the inbox schema is up to date (version {LATEST_VERSION})")


@main.command("check")
@database_options
def check_command(database_url: str, schema: str | None, prefix: str) -> None:
    """Exit with an error unless the inbox tables are at the version this code needs."""
    naming = naming_from(schema, prefix)
    engine = connect(database_url)
    try:
        with engine.connect() as conn:
            check_schema(conn, naming)
            click.echo(f"the inbox schema is at version {schema_version(conn, naming)}")
    finally:
        engine.dispose()


def naming_from(schema: str | None, prefix: str) -> InboxSchema:
    """The table naming from the common ``--schema`` and ``--prefix`` options."""
    return InboxSchema(schema=schema or None, prefix=prefix)


def run() -> None:
    """Entry point: library and database errors become one clear line and exit status 1."""
    try:
        main()
    except InboxError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except DBAPIError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        click.echo(f"error: the database refused or could not be reached: {reason}", err=True)
        sys.exit(1)


# Subcommand groups, in modules of their own; they use the helpers above.
from .outbox.cli import outbox as _outbox  # noqa: E402
from .repair_cli import poison as _poison  # noqa: E402
from .repair_cli import quarantine as _quarantine  # noqa: E402
from .retention_cli import purge as _purge  # noqa: E402
from .retention_cli import retention_group as _retention  # noqa: E402
from .status_cli import explain_command as _explain  # noqa: E402
from .status_cli import metrics_group as _metrics  # noqa: E402
from .status_cli import status_command as _status  # noqa: E402

for _group in (_status, _explain, _outbox, _quarantine, _poison, _retention, _purge, _metrics):
    main.add_command(_group)
