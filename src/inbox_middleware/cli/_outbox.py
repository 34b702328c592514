"""``inbox-middleware outbox``: run the dispatcher, list, show and retry effects."""

from __future__ import annotations

import asyncio
import importlib
import signal
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import click
from sqlalchemy import Connection, Engine

from .._core import logs
from .._core.exceptions import ConfigurationError
from .._core.tenancy import MapFile
from .._storage.engines import parse_url, postgresql_driver, sync_engine
from .._storage.migrate import check_schema
from ..outbox._destination import Destination
from ..outbox._dispatcher import Backoff, Dispatcher, DispatcherStats, require_postgresql
from ..outbox._errors import EffectNotFound
from ..outbox._routed import RoutedDispatcher
from ..outbox._statements import PENDING, STATUSES, OutboxStatements, statements_for
from ._options import (
    Seconds,
    connect,
    database,
    database_options,
    naming_from,
    takes_the_map,
)
from ._output import echo_json, echo_row, table, when

__all__ = ["outbox"]


outbox: click.Group = click.Group("outbox", help="Dispatch and inspect the transactional outbox.")


@outbox.command("run")
@database_options
@click.option(
    "--destinations",
    "target",
    envvar="INBOX_OUTBOX_DESTINATIONS",
    show_envvar=True,
    required=True,
    help="MODULE:ATTRIBUTE of a mapping of destination names to destinations "
    "(outbox.Destinations), or of a function returning one.",
)
@click.option("--path", default=".", show_default=True, help="Prepended to the import path.")
@click.option("--batch-size", type=click.IntRange(1, 10_000), default=100, show_default=True)
@click.option(
    "--lease",
    type=Seconds(0, 86400, open_minimum=True),
    default=60.0,
    show_default=True,
    help="Seconds.",
)
@click.option(
    "--delivery-timeout",
    type=Seconds(0, 86400, open_minimum=True),
    default=10.0,
    show_default=True,
    help="Seconds one delivery may take; at most 80% of the lease.",
)
@click.option("--max-attempts", type=click.IntRange(1, 10_000), default=10, show_default=True)
@click.option(
    "--backoff-base",
    type=Seconds(0, 86400, open_minimum=True),
    default=1.0,
    show_default=True,
    help="Seconds.",
)
@click.option(
    "--backoff-cap",
    type=Seconds(0, 7 * 86400, open_minimum=True),
    default=300.0,
    show_default=True,
    help="Seconds.",
)
@click.option(
    "--poll-interval",
    type=Seconds(0, 3600, open_minimum=True),
    default=1.0,
    show_default=True,
    help="Seconds.",
)
@click.option(
    "--listen/--no-listen",
    default=False,
    show_default=True,
    help="Also wake on NOTIFY (needs a session-level connection, not a transaction pooler).",
)
@click.option(
    "--listen-url",
    envvar="INBOX_OUTBOX_LISTEN_URL",
    default=None,
    help="Database URL of the LISTEN connection, when --database-url goes through a "
    "transaction pooler (PgBouncer): the same database on the server itself. Implies --listen.",
)
@click.option(
    "--shutdown-grace",
    type=Seconds(0, 86400),
    default=None,
    help="Seconds in-flight deliveries may take after SIGTERM [default: the delivery timeout].",
)
@click.option(
    "--burst",
    is_flag=True,
    help="Exit once no effect is due, nor due within a second (a first retry).",
)
@click.option(
    "--sweep",
    type=click.IntRange(1, 100_000),
    default=10,
    show_default=True,
    help="With --map: idle databases looked at per poll interval (an idle database is "
    "looked at within ceil(databases / sweep) poll intervals).",
)
@click.option(
    "--parallel",
    type=click.IntRange(1, 1_000),
    default=4,
    show_default=True,
    help="With --map: databases dispatched from at the same time.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="info",
    show_default=True,
    envvar="INBOX_LOG_LEVEL",
    help="Unless logging is configured already (by the destinations module, say).",
)
@takes_the_map
def run_command(
    database_url: str | None,
    map_file: str | None,
    databases: tuple[str, ...] | None,
    schema: str | None,
    prefix: str,
    target: str,
    path: str,
    batch_size: int,
    lease: float,
    delivery_timeout: float,
    max_attempts: int,
    backoff_base: float,
    backoff_cap: float,
    poll_interval: float,
    listen: bool,
    listen_url: str | None,
    shutdown_grace: float | None,
    burst: bool,
    sweep: int,
    parallel: int,
    log_level: str,
) -> None:
    """Deliver due effects until SIGTERM or SIGINT.

    The first signal lets in-flight deliveries finish (for the shutdown grace), then
    releases what is left; a second one releases at once. With --map, one dispatcher
    covers every database of the map (or the tenant's), in a bounded round robin.
    """
    naming = naming_from(schema, prefix)
    settings: dict[str, Any] = {
        "naming": naming,
        "batch_size": batch_size,
        "lease": lease,
        "delivery_timeout": delivery_timeout,
        "max_attempts": max_attempts,
        "backoff": Backoff(base=backoff_base, cap=backoff_cap),
        "poll_interval": poll_interval,
        "shutdown_grace": shutdown_grace,
    }
    if map_file is not None:
        if listen or listen_url:
            raise click.UsageError(
                "--listen is for one database; over a map the rotation is the wake-up"
            )
        _run_over_map(
            map_file, databases, target, path, log_level, burst, settings, sweep, parallel
        )
        return
    assert database_url is not None
    engine = dispatcher_engine(database_url)
    try:
        require_postgresql(engine)
        if engine.dialect.is_async:
            raise ConfigurationError(
                "the outbox dispatcher delivers from threads and needs a synchronous "
                "PostgreSQL driver; run `pip install 'psycopg[binary]'`"
            )
        with engine.connect() as conn:
            check_schema(conn, naming)
        destinations = load_destinations(target, path)
        logs.configure(log_level.upper())  # after the module, which may configure its own
        dispatcher = Dispatcher(
            engine, destinations, listen=listen, listen_url=listen_url, **settings
        )
        asyncio.run(_serve(dispatcher, burst))
    finally:
        engine.dispose()
    _summary(dispatcher.stats)


_LIBPQ_LIVENESS = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60_000,
}
"""A connection attempt ends after 10 s; a connection whose peer stopped answering (a
network fault, a host lost: no reset ever comes) ends after about a minute, not the
system's two hours of keepalive (or a quarter of an hour of retransmissions)."""


def dispatcher_engine(database_url: str) -> Engine:
    """The engine of ``outbox run``: `connect`'s, whose libpq connections (psycopg,
    psycopg2) also give up on a peer that stopped answering (`_LIBPQ_LIVENESS`): its
    statements run in worker threads, and one that waits forever would leave the
    dispatcher leasing nothing."""
    url = parse_url(database_url)
    if url.get_backend_name() == "postgresql" and postgresql_driver(url) in ("psycopg", "psycopg2"):
        return sync_engine(url, connect_args=dict(_LIBPQ_LIVENESS))
    return connect(database_url)


def _run_over_map(
    map_file: str,
    databases: tuple[str, ...] | None,
    target: str,
    path: str,
    log_level: str,
    burst: bool,
    settings: dict[str, Any],
    sweep: int,
    parallel: int,
) -> None:
    """One dispatcher over the map's databases (``databases``: the tenant's or the one
    named). A database that cannot be reached at start is not a refusal: the dispatcher
    tries it again in turn, as it does any database that fails later."""
    routes = MapFile(map_file)
    destinations = load_destinations(target, path)
    logs.configure(log_level.upper())
    dispatcher = RoutedDispatcher(
        routes, destinations, databases=databases, sweep=sweep, parallel=parallel, **settings
    )
    asyncio.run(_serve(dispatcher, burst))
    for name, stats in sorted(dispatcher.stats_by_database().items()):
        click.echo(f"database {name}: " + _counts(stats))
    _summary(dispatcher.stats)


def _counts(stats: DispatcherStats) -> str:
    return (
        f"dispatched {stats.dispatched}, retried {stats.retried}, failed {stats.failed}, "
        f"released {stats.released}, leases lost {stats.leases_lost}"
    )


def _summary(stats: DispatcherStats) -> None:
    click.echo(_counts(stats))


async def _serve(dispatcher: Dispatcher | RoutedDispatcher, burst: bool) -> None:
    loop = asyncio.get_running_loop()
    received = 0

    def on_signal() -> None:
        nonlocal received
        received += 1
        dispatcher.stop(now=received > 1)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)
    await dispatcher.run(burst=burst)


def load_destinations(target: str, path: str = ".") -> Mapping[str, Destination]:
    """Import ``module:attribute``; call it if it is a function."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise click.BadParameter(f"{target!r} is not MODULE:ATTRIBUTE", param_hint="--destinations")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    value: Any = getattr(importlib.import_module(module_name), attribute, None)
    if value is None:
        raise click.BadParameter(f"{module_name} has no {attribute!r}", param_hint="--destinations")
    if callable(value) and not isinstance(value, Mapping):
        value = value()
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"{target} is a {type(value).__name__}, not a mapping of names to destinations"
        )
    return value


@outbox.command("list")
@database_options
@click.option("--status", type=click.Choice(STATUSES), default=None)
@click.option("--destination", default=None)
@click.option("--limit", type=click.IntRange(1, 1_000_000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per effect.")
def list_command(
    database_url: str,
    schema: str | None,
    prefix: str,
    status: str | None,
    destination: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """Effects, newest first, after a count per status."""
    with _database(database_url, schema, prefix) as (conn, statements):
        counts = {row[0]: row[1] for row in conn.execute(statements.counts)}
        rows = [
            dict(row)
            for row in conn.execute(statements.listing(status, destination, limit)).mappings()
        ]
    if as_json:
        for row in rows:
            echo_row(row)
        return
    click.echo(", ".join(f"{name} {counts.get(name, 0)}" for name in STATUSES))
    if not rows:
        return
    table(
        None,
        ["effect id", "destination", "status", "attempts", "next attempt", "last error"],
        [
            [
                row["effect_id"],
                row["destination"],
                row["status"],
                row["attempts"],
                # Only a pending effect has a next attempt; a dispatched or failed one
                # keeps the column's last value, which would read as a time to come.
                when(row["next_attempt_at"]) if row["status"] == PENDING else "-",
                (row["last_error"] or "").splitlines()[0][:80] if row["last_error"] else "",
            ]
            for row in rows
        ],
    )


@outbox.command("show")
@database_options
@click.argument("effect_id")
def show_command(database_url: str, schema: str | None, prefix: str, effect_id: str) -> None:
    """One effect, every column, as JSON."""
    with _database(database_url, schema, prefix) as (conn, statements):
        row = conn.execute(statements.show, {"effect_id": effect_id}).mappings().first()
    if row is None:
        raise EffectNotFound(f"no effect {effect_id!r}")
    echo_json(dict(row))


@outbox.command("retry")
@database_options
@click.argument("effect_ids", nargs=-1)
@click.option("--all-failed", is_flag=True, help="Every failed effect (of --destination).")
@click.option("--destination", default=None, help="With --all-failed: only this destination.")
def retry_command(
    database_url: str,
    schema: str | None,
    prefix: str,
    effect_ids: tuple[str, ...],
    all_failed: bool,
    destination: str | None,
) -> None:
    """Make failed effects pending again, with a fresh attempt budget."""
    if bool(effect_ids) == all_failed:
        raise click.UsageError("give effect ids or --all-failed (not both)")
    with _database(database_url, schema, prefix, write=True) as (conn, statements):
        if all_failed:
            retried = list(conn.scalars(statements.retry_all, {"only_destination": destination}))
        else:
            retried = list(conn.scalars(statements.retry_ids, {"effect_ids": list(effect_ids)}))
            refused = [
                (effect_id, conn.execute(statements.show, {"effect_id": effect_id}).first())
                for effect_id in effect_ids
                if effect_id not in retried
            ]
    for effect_id in retried:
        click.echo(f"pending again: {effect_id}")
    if not all_failed and refused:
        for effect_id, row in refused:
            reason = "no such effect" if row is None else f"it is {row.status}, not failed"
            click.echo(f"not retried: {effect_id}: {reason}", err=True)
        sys.exit(1)
    if all_failed:
        click.echo(f"{len(retried)} failed effects are pending again")


@contextmanager
def _database(
    url: str, schema: str | None, prefix: str, *, write: bool = False
) -> Iterator[tuple[Connection, OutboxStatements]]:
    """A connection (committed at the end when writing) and the outbox's statements."""
    with database(url, schema, prefix, write=write) as (conn, naming):
        yield conn, statements_for(naming, conn.dialect.name)
