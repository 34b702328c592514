"""``inbox-middleware claims show`` and ``claims switch``: where the workers claim."""

from __future__ import annotations

import click

from .._storage.layout import ClaimsRecord, claims_record, switch_claims
from ._options import database, database_options
from ._retention import who

__all__ = ["claims_group"]


@click.group("claims")
def claims_group() -> None:
    """Where the workers claim: the library's table or the compact one."""


def _show(record: ClaimsRecord) -> None:
    if record.switched:
        click.echo(
            f"workers claim in the compact table (inbox_claims) since "
            f"{record.switched_at:%Y-%m-%d %H:%M:%S %Z}, switched by {record.switched_by}"
        )
        if record.library_rows:
            click.echo(
                "they also look in the library's table (consumer_inbox) until the purge "
                "has removed its rows"
            )
    else:
        click.echo(
            "no switch recorded: workers configured with claims='compact' claim in both "
            "tables, the others in the library's table (consumer_inbox)"
        )
    click.echo(f"consumer_inbox: {record.library_rows} rows")
    click.echo(f"inbox_claims: {record.compact_rows} rows")


@claims_group.command("show")
@database_options
def show_command(database_url: str, schema: str | None, prefix: str) -> None:
    """Show where the workers claim, and the rows of each claims table."""
    with database(database_url, schema, prefix) as (conn, naming):
        _show(claims_record(conn, naming))


@claims_group.command("switch")
@database_options
@click.option("--by", default=None, help="Who records it (default: user@host).")
@click.option(
    "--yes",
    is_flag=True,
    help="Confirm that every worker runs with claims='compact' (no older worker is left).",
)
def switch_command(
    database_url: str, schema: str | None, prefix: str, by: str | None, yes: bool
) -> None:
    """Record that every worker claims in the compact table.

    Run it once no worker of an earlier version, and none configured with
    claims='library', is left: from then on the workers claim in the compact table alone,
    and a worker claiming in the library's table would not see their claims.
    """
    if not yes:
        raise click.UsageError(
            "the switch is safe only once every worker runs with claims='compact'; "
            "confirm with --yes"
        )
    with database(database_url, schema, prefix, write=True) as (conn, naming):
        _show(switch_claims(conn, naming, by=who(by)))
