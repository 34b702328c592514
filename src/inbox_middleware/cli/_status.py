"""``inbox-middleware status``, ``explain`` and ``metrics serve``."""

from __future__ import annotations

import difflib
import signal
import threading
from datetime import timedelta
from typing import Any

import click

from .._core.exceptions import ConfigurationError
from .._operate import explain as explaining
from .._operate import status as reading
from .._operate.retention import format_duration
from .._storage.inspection import consumer_pairs
from ._options import DURATION, Seconds, database, database_options, naming_from, naming_options
from ._output import console, echo_json, when

__all__ = ["explain_command", "metrics_group", "status_command"]


@click.command("status")
@database_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see the schema).")
@click.option(
    "--window",
    type=DURATION,
    default="1h",
    show_default=True,
    help="Recent window for counts and rates.",
)
@click.option("--exact", is_flag=True, help="Count every claim exactly (scans a big inbox: slow).")
@click.option("--consumer", default=None, help="Only this consumer.")
@click.option(
    "--metrics-url",
    envvar="INBOX_METRICS_URL",
    show_envvar=True,
    default=None,
    help="A metrics endpoint to read duplicates and shadow-mode counts from "
    "(they are never written to the database).",
)
def status_command(
    database_url: str,
    schema: str | None,
    prefix: str,
    as_json: bool,
    window: timedelta,
    exact: bool,
    consumer: str | None,
    metrics_url: str | None,
) -> None:
    """Per consumer and producer: claims, rates, duplicates, conflicts, what waits.

    Cheap on a big inbox: recent counts through the processed_at BRIN index, totals
    from the catalog's statistics (marked ~, estimates), pending rows through
    partial indexes.
    """
    counters, error = None, None
    if metrics_url:
        try:
            counters = reading.read_metrics(metrics_url)
        except (OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    with database(database_url, schema, prefix) as (conn, naming):
        data = reading.snapshot(
            conn,
            naming,
            window=window,
            exact=exact,
            consumer=consumer,
            counters=counters,
            metrics_source=metrics_url,
            metrics_error=error,
        )
    if as_json:
        echo_json(data)
    else:
        _print_status(data)


@click.command("explain")
@database_options
@click.argument("consumer")
@click.argument("producer")
@click.argument("message_id")
@click.option("--tenant", default="", help="The identity's tenant, if any.")
@click.option(
    "--payload-sha256", default=None, help="Judge a delivery whose payload has this hash."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see the schema).")
def explain_command(
    database_url: str,
    schema: str | None,
    prefix: str,
    consumer: str,
    producer: str,
    message_id: str,
    tenant: str,
    payload_sha256: str | None,
    as_json: bool,
) -> None:
    """Why a message was or would be skipped: its claim, when, payload hash, handler
    version, and its quarantine, poison and failure history."""
    with database(database_url, schema, prefix) as (conn, naming):
        data = explaining.explain(
            conn,
            naming,
            consumer,
            producer,
            message_id,
            tenant=tenant,
            payload_sha256=payload_sha256,
        )
        if data["claim"] is None and not explaining.consumer_known(conn, naming, consumer):
            raise ConfigurationError(_unknown_consumer(conn, naming, consumer))
    if as_json:
        echo_json(data)
    else:
        _print_explanation(data)


def _unknown_consumer(conn: Any, naming: Any, consumer: str) -> str:
    known = sorted({name for name, _ in consumer_pairs(conn, naming)})
    close = difflib.get_close_matches(consumer, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    listing = ", ".join(known[:10]) + (", ..." if len(known) > 10 else "") or "none yet"
    return (
        f"no consumer {consumer!r} has any row in the inbox tables; {hint}"
        f"known consumers: {listing} (check --schema and --prefix too)"
    )


@click.group("metrics")
def metrics_group() -> None:
    """Serve the inbox metrics of every worker process, with the table gauges."""


@metrics_group.command("serve")
@click.option(
    "--database-url",
    envvar="INBOX_DATABASE_URL",
    show_envvar=True,
    default=None,
    help="Where to read the table gauges from; without it, none are served.",
)
@naming_options
@click.option(
    "--port", type=click.IntRange(1, 65535), default=9300, show_default=True, help="TCP port."
)
@click.option("--addr", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option(
    "--cache-seconds",
    type=Seconds(0, 86400),
    default=30.0,
    show_default=True,
    help="How long table gauges are reused between scrapes.",
)
@click.option(
    "--multiprocess-dir",
    envvar="PROMETHEUS_MULTIPROC_DIR",
    show_envvar=True,
    default=None,
    help="The workers' PROMETHEUS_MULTIPROC_DIR.",
)
def serve_command(
    database_url: str | None,
    schema: str | None,
    prefix: str,
    port: int,
    addr: str,
    cache_seconds: float,
    multiprocess_dir: str | None,
) -> None:
    """Serve /metrics until interrupted (SIGINT or SIGTERM)."""
    from .._operate.metrics import serve

    if not multiprocess_dir:
        raise click.UsageError(
            "set PROMETHEUS_MULTIPROC_DIR (or --multiprocess-dir) to the folder the "
            "workers write to: this process has no inbox metrics of its own"
        )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    server = serve(
        port,
        addr=addr,
        engine=database_url,
        naming=naming_from(schema, prefix),
        cache_seconds=cache_seconds,
        multiprocess_dir=multiprocess_dir,
    )
    click.echo(f"serving inbox metrics on {server.url}", err=True)
    try:
        stop.wait()
    finally:
        server.close()


# -- rendering -------------------------------------------------------------------------------


def _n(value: int | None, estimated: bool = False) -> str:
    if value is None:
        return "-"
    return f"~{value:,}" if estimated else f"{value:,}"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return format_duration(timedelta(seconds=round(seconds))) or "0s"


_NEEDS_METRICS = "needs metrics"


def _print_status(data: dict[str, Any]) -> None:
    from rich.table import Table

    # Per-producer duplicates and shadow-mode counts live only in the workers' metrics:
    # without an endpoint, their cells say so rather than a bare "-". A consumer's
    # duplicates and messages without identity come from the workers' count rows then
    # (≈: approximate, totals since each worker started).
    unread = data["metrics"]["source"] is None

    def _m(value: int | None, counted: int | None = None) -> str:
        if unread and value is None:
            return _NEEDS_METRICS if counted is None else f"≈{counted:,}"
        return _n(value)

    out = console()
    window = _age(data["window_seconds"])
    inbox = data["inbox"]
    compact = ""
    if inbox["compact_rows"]:
        rows = _n(inbox["compact_rows"], inbox["compact_rows_estimated"])
        compact = f"; {rows} in the compact claims table (inbox_claims), not counted below"
    out.print(
        f"[bold]inbox[/bold]: {_n(inbox['rows'], inbox['rows_estimated'])} claims; oldest "
        f"{when(inbox['oldest_claim_at'])} ({_age(inbox['oldest_claim_age_seconds'])} ago"
        f"{', estimate' if inbox['oldest_claim_estimated'] else ''}){compact}"
    )
    table = Table(title=f"claims by consumer and producer (last {window})", title_justify="left")
    for column in ("consumer", "producer", "claims", f"last {window}", "per s", "last claim"):
        table.add_column(column, justify="right" if column[0] in "cpl" else "left")
    for column in ("duplicates", "conflicts", "shadow"):
        table.add_column(column, justify="right")
    for consumer in data["consumers"]:
        table.add_row(
            f"[bold]{consumer['consumer']}[/bold]",
            "(all)",
            _n(consumer["claims"], consumer["claims_estimated"]),
            _n(consumer["recent_claims"]),
            f"{consumer['claims_per_second']:.2f}",
            when(consumer["last_processed_at"]),
            _m(consumer["duplicates"], consumer["counted"]["duplicate"]),
            _n(consumer["conflicts"]),
            "",
        )
        for producer in consumer["producers"]:
            table.add_row(
                "",
                producer["producer"],
                _n(producer["claims"], producer["claims_estimated"]),
                _n(producer["recent_claims"]),
                f"{producer['claims_per_second']:.2f}",
                when(producer["last_processed_at"]),
                _m(producer["duplicates"]),
                _n(producer["conflicts"]),
                _m(producer["shadow_processed"]),
            )
    out.print(table)

    waiting = Table(title="waiting and retention", title_justify="left")
    for column in (
        "consumer",
        "quarantine",
        "poison",
        "in repair",
        "oldest unprocessed",
        "no identity",
        "retention (min)",
    ):
        waiting.add_column(column)
    for consumer in data["consumers"]:
        retention = consumer["retention"]
        waiting.add_row(
            consumer["consumer"],
            _n(consumer["quarantine_pending"]),
            _n(consumer["poison_pending"]),
            _n(consumer["awaiting_recovery"]),
            when(consumer["oldest_unprocessed_at"]),
            _m(consumer["missing_identity"], _no_identity(consumer["counted"])),
            "-"
            if retention is None
            else f"{_age(retention['minimum_seconds'])} ({retention['recorded_for']})",
        )
    out.print(waiting)

    _print_counted(out, data)
    outbox = data["outbox"]
    out.print(
        f"[bold]outbox[/bold]: {outbox['pending']:,} pending (oldest "
        f"{_age(outbox['oldest_pending_age_seconds'])}), {outbox['failed']:,} failed"
    )
    for destination in outbox["destinations"]:
        out.print(
            f"  {destination['destination']}: {destination['pending']:,} pending, "
            f"{destination['failed']:,} failed"
        )
    oldest = data["oldest_unprocessed"]
    if oldest is not None:
        who = f" ({oldest['consumer']})" if oldest["consumer"] else ""
        out.print(
            f"[bold]oldest unprocessed[/bold]: {oldest['kind']}{who}, waiting "
            f"{_age(oldest['age_seconds'])}"
        )
    notes = []
    if not data["exact"]:
        notes.append("~ marks estimates from the catalog's statistics (use --exact to count)")
    metrics = data["metrics"]
    if metrics["source"] is None:
        notes.append(
            "≈ marks counts the workers wrote to the database every few seconds, totals "
            "since each worker started (a worker killed with SIGKILL loses its last few "
            "seconds); duplicates by producer, shadow-processed counts, rates within the "
            "window and latencies need the workers' metrics (Prometheus, with "
            "PROMETHEUS_MULTIPROC_DIR set for the workers and `inbox-middleware metrics "
            "serve` over it): pass --metrics-url to show them"
        )
    elif metrics["error"]:
        notes.append(f"the metrics endpoint could not be read: {metrics['error']}")
    for note in notes:
        out.print(f"[dim]{note}[/dim]")


_COUNTED = {
    "processed": "processed",
    "duplicate": "duplicates",
    "quarantined": "quarantined",
    "no_identity": "no identity",
    "unprotected": "unprotected",
    "dead_lettered": "dead-lettered",
    "poisoned": "poisoned",
    "failed": "failed",
    "handed_back": "handed back",
}


def _no_identity(counted: dict[str, int]) -> int:
    """Messages without a usable identity: dead-lettered, or processed by policy."""
    return counted["no_identity"] + counted["unprotected"]


def _print_counted(out: Any, data: dict[str, Any]) -> None:
    from rich.table import Table

    counted = data["counted"]
    if not counted["workers"]:
        out.print(
            "[bold]settlements counted by the workers[/bold]: none written yet (workers "
            "write them every few seconds; count_interval=None turns it off)"
        )
        return
    table = Table(
        title=f"settlements counted by the workers, approximate: since {when(counted['since'])}"
        f", last written {when(counted['updated_at'])}, {counted['workers']:,} worker "
        f"process{'' if counted['workers'] == 1 else 'es'} ({counted['live_workers']:,} "
        "wrote within the last "
        f"{_age(data['window_seconds'])})",
        title_justify="left",
    )
    table.add_column("consumer")
    for label in _COUNTED.values():
        table.add_column(label, justify="right")
    for consumer in data["consumers"]:
        mine = consumer["counted"]
        table.add_row(consumer["consumer"], *(f"≈{mine[key]:,}" for key in _COUNTED))
    out.print(table)


def _print_explanation(data: dict[str, Any]) -> None:
    out = console()
    identity = f"{data['producer']}/{data['message_id']}"
    if data["tenant"]:
        identity += f" (tenant {data['tenant']})"
    out.print(f"[bold]{data['consumer']}[/bold] <- {identity}: [bold]{data['verdict']}[/bold]")
    out.print(data["summary"], markup=False)
    claim = data["claim"]
    if claim is not None:
        out.print(
            f"claim: processed {when(claim['processed_at'])}, received "
            f"{when(claim['received_at'])}, payload {claim['payload_sha256']} "
            f"({claim['hash_scheme']}), handler version {claim['handler_version'] or '-'}",
            markup=False,
        )
        if claim.get("trace_id"):
            out.print(f"trace of the first delivery: {claim['trace_id']}", markup=False)
    for row in data["quarantine"]:
        out.print(
            f"quarantine #{row['id']}: {row['reason_code']}, payload {row['conflicting_sha256']}, "
            f"{row['attempts']} deliveries {when(row['first_seen_at'])} .. "
            f"{when(row['last_seen_at'])}, {row['decision']}"
            + (f" by {row['decided_by']}" if row.get("decided_by") else ""),
            markup=False,
        )
    for row in data["poison"]:
        out.print(
            f"poison #{row['id']}: {row['reason_code']} after {row['attempts']} attempts "
            f"({row['error']}), {when(row['first_failure_at'])} .. "
            f"{when(row['last_failure_at'])}, {row['decision']}",
            markup=False,
        )
    failures = data["failures"]
    if failures is not None:
        out.print(
            f"failed attempts: {failures['attempts']}, redeliveries {failures['redeliveries']}, "
            f"last error: {failures['last_error']}",
            markup=False,
        )
    for effect in data["effects"]:
        out.print(
            f"effect {effect['index']} -> {effect['destination']}: {effect['status']} "
            f"after {effect['attempts']} attempts",
            markup=False,
        )
