"""The ``inbox-middleware`` command line: the group, ``migrate`` and ``check``, and the
one place where errors become a line on standard error.

Every error ends a command with one line that names the fix (``error: ...``) and a
non-zero exit status, never a traceback: 1 for a library, database or broker error, 2
for a usage error (a missing option, a URL that is not one). ``INBOX_DEBUG=1`` lets an
unexpected error through with its traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import click
from sqlalchemy.exc import DBAPIError

from .._core.exceptions import InboxError
from .._storage import LATEST_VERSION, migrate, render_sql
from .._storage.engines import parse_url
from .._storage.migrate import check_schema, schema_version
from . import _claims as claims
from . import _hashing as hashing
from . import _outbox as outbox
from . import _repair as repair
from . import _retention as retention
from . import _status as status
from ._options import connect, database_options, naming_from

__all__ = ["main", "run"]

_MISSING_TABLE = ("42P01", "no such table")


class InboxCommands(click.Group):
    """A group whose errors are one line each (see the module docstring)."""

    def main(  # type: ignore[override]
        self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any
    ) -> Any:
        extra.pop("standalone_mode", None)
        try:
            return super().main(
                args, prog_name or "inbox-middleware", standalone_mode=False, **extra
            )
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.Abort:
            _fail("aborted", 1)
        except click.UsageError as exc:
            hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx else ""
            _fail(exc.format_message() + hint, exc.exit_code)
        except click.ClickException as exc:
            _fail(exc.format_message(), exc.exit_code)
        except InboxError as exc:
            _fail(str(exc), 1)
        except DBAPIError as exc:
            _fail(_database_error(exc), 1)
        except Exception as exc:  # a broker or an import that failed: still one line
            if os.environ.get("INBOX_DEBUG"):
                raise
            _fail(f"{type(exc).__name__}: {exc} (INBOX_DEBUG=1 shows the traceback)", 1)


def _fail(message: str, status: int) -> None:
    first = (message.strip().splitlines() or [""])[0]
    click.echo(f"error: {first}", err=True)
    sys.exit(status)


def _database_error(exc: DBAPIError) -> str:
    reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
    code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    if code == _MISSING_TABLE[0] or _MISSING_TABLE[1] in reason:
        return (
            f"{reason}: the inbox tables are missing here (or named otherwise: "
            "--schema, --prefix); run `inbox-middleware migrate`"
        )
    return f"the database refused or could not be reached: {reason}"


@click.group(cls=InboxCommands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="inbox-middleware")
def main() -> None:
    """Operate the transactional inbox: schema, status and repair."""


@main.command("migrate")
@database_options
@click.option("--sql", "print_sql", is_flag=True, help="Print the SQL instead of running it.")
def migrate_command(database_url: str, schema: str | None, prefix: str, print_sql: bool) -> None:
    """Create or upgrade the inbox tables. Safe to run twice, or from two hosts at once."""
    naming = naming_from(schema, prefix)
    if print_sql:  # needs no connection, nor a driver
        for statement in render_sql(parse_url(database_url).get_backend_name(), naming):
            click.echo(statement + ";\n")
        return
    engine = connect(database_url)
    try:
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


for _command in (
    status.status_command,
    status.explain_command,
    outbox.outbox,
    repair.quarantine,
    repair.poison,
    retention.retention_group,
    retention.purge_command,
    status.metrics_group,
    hashing.hash_command,
    claims.claims_group,
):
    main.add_command(_command)


def run() -> None:
    """The console script's entry point."""
    main()
