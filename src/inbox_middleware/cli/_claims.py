"""``inbox-middleware claims show``, ``claims switch`` and ``claims prepare``: where the
workers claim, and the compact claims table's partitions."""

from __future__ import annotations

import click

from .._core.exceptions import ConfigurationError
from .._storage import partitions
from .._storage.layout import ClaimsRecord, claims_record, switch_claims
from .._storage.migrate import check_schema
from ._options import connect, database, database_options, naming_from
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
    click.echo(
        f"inbox_claims: {record.compact_rows} rows, {record.hourly_partitions} hourly partitions"
    )


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


@claims_group.command("prepare")
@database_options
@click.option(
    "--hours",
    type=click.IntRange(1, 24 * 31),
    default=partitions.PREPARE_HOURS,
    show_default=True,
    help="Hours of partitions to have ahead.",
)
def prepare_command(database_url: str, schema: str | None, prefix: str, hours: int) -> None:
    """Make the compact claims table's hourly partitions ahead of time.

    The purge does it too; run this after `migrate`, and whenever no purge has run for
    longer than the hours it makes. Claims never wait for it: an hour without its
    partition keeps its claims in the default partition.
    """
    naming = naming_from(schema, prefix)
    engine = connect(database_url)
    try:
        if engine.dialect.name != "postgresql":
            raise ConfigurationError("the compact claims table is PostgreSQL's: nothing to prepare")
        with engine.connect() as conn:
            check_schema(conn, naming)
        made = partitions.prepare(engine, naming, hours=hours)
        with engine.connect() as conn:
            ahead = partitions.hourly(conn, naming)
    finally:
        engine.dispose()
    click.echo(f"made {len(made)} partitions; {len(ahead)} hourly partitions in all")
    if ahead:
        click.echo(f"the last one holds the ids of {ahead[-1].hour:%Y-%m-%d %H}:00 UTC")
