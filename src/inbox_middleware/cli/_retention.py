"""``inbox-middleware retention ...`` and ``inbox-middleware purge``."""

from __future__ import annotations

import getpass
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import click

from .._operate import retention
from .._operate.retention import ALL_CONSUMERS, RetentionPolicy, format_duration
from ._options import DURATION, Seconds, connect, database, database_options
from ._output import progress, table

__all__ = ["purge_command", "retention_group", "who"]

_SCENARIOS = {
    "broker_retention": "how long the broker keeps, and may redeliver, a message",
    "offset_rewind": "how far back consumers may be rewound",
    "retry_horizon": "how long the framework retries before dead-lettering",
    "dead_letter_retention": "how long a dead letter is kept before a redrive",
    "producer_retry": "how long a producer may send an intent again",
    "outage_allowance": "the longest consumer outage to survive",
    "backup_restore_age": "age of the oldest backup a broker or producer may be restored from",
    "replay_horizon": "how far back planned replays reach",
}


def _scenario_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for name, text in reversed(_SCENARIOS.items()):
        command = click.option(
            f"--{name.replace('_', '-')}",
            name,
            type=DURATION,
            default="0",
            show_default=True,
            help=f"{text.capitalize()} (like 7d, 36h).",
        )(command)
    return click.option(
        "--margin",
        type=Seconds(0, 10, what="a fraction"),
        default=0.25,
        show_default=True,
        help="Safety margin over the dominant one, as a fraction (0 to 10).",
    )(command)


def _policy(values: dict[str, Any]) -> RetentionPolicy:
    return RetentionPolicy(**{name: values[name] for name in _SCENARIOS}, margin=values["margin"])


def _describe(policy: RetentionPolicy) -> None:
    window, dominant = retention.minimum_window(policy)
    table(
        "failure scenarios",
        ["scenario", "a copy can arrive up to", ""],
        [
            [
                scenario.name,
                format_duration(scenario.window) or "0s",
                "<- dominant" if scenario is dominant or scenario == dominant else "",
            ]
            for scenario in policy.scenarios()
        ],
    )
    click.echo(
        f"minimum retention window: {format_duration(window)} "
        f"({dominant.name} plus a {policy.margin:.0%} margin)"
    )


@click.group("retention")
def retention_group() -> None:
    """How long the inbox must remember a message, derived from its failure scenarios."""


@retention_group.command("calculate")
@_scenario_options
def calculate_command(**values: Any) -> None:
    """Print the minimum safe window and the scenario that dominates it."""
    _describe(_policy(values))


def who(by: str | None) -> str:
    return by or f"{getpass.getuser()}@{socket.gethostname()}"


@retention_group.command("set")
@database_options
@click.option(
    "--consumer",
    default=ALL_CONSUMERS,
    show_default=True,
    help="The consumer it applies to; * for every consumer without its own.",
)
@click.option("--by", default=None, help="Who records it (default: user@host).")
@_scenario_options
def set_command(
    database_url: str,
    schema: str | None,
    prefix: str,
    consumer: str,
    by: str | None,
    **values: Any,
) -> None:
    """Record the failure scenarios; every purge is checked against their minimum."""
    policy = _policy(values)
    with database(database_url, schema, prefix, write=True) as (conn, naming):
        retention.record_policy(conn, naming, policy, consumer=consumer, by=who(by))
    _describe(policy)
    click.echo(f"recorded for consumer {consumer}")


@retention_group.command("show")
@database_options
@click.option("--consumer", default=None, help="The policy that applies to this consumer.")
def show_command(database_url: str, schema: str | None, prefix: str, consumer: str | None) -> None:
    """Print the recorded policy that applies (the consumer's own, else the default)."""
    with database(database_url, schema, prefix) as (conn, naming):
        recorded = retention.recorded_policy(conn, naming, consumer)
    if recorded is None:
        raise click.ClickException(
            "no retention policy is recorded; record one with `inbox-middleware retention set`"
        )
    click.echo(f"policy recorded for consumer {recorded.consumer}:")
    _describe(recorded.policy)


@click.command("purge")
@database_options
@click.option(
    "--older-than", type=DURATION, required=True, help="Delete claims processed before this (30d)."
)
@click.option("--consumer", default=None, help="Only this consumer's claims.")
@click.option("--batch-size", type=click.IntRange(1, 1_000_000), default=5000, show_default=True)
@click.option(
    "--pause",
    type=Seconds(0, 3600),
    default=0.0,
    show_default=True,
    help="Seconds between batches.",
)
@click.option(
    "--rate",
    type=click.FloatRange(0, min_open=True),
    default=retention.DEFAULT_PURGE_RATE,
    show_default=True,
    help="Claims deleted a second at most, on average (keeps live claims' latency).",
)
@click.option("--unpaced", is_flag=True, help="Delete as fast as the database allows (no --rate).")
@click.option(
    "--force",
    is_flag=True,
    help="Purge even without a recorded policy, or below its minimum window.",
)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
def purge_command(
    database_url: str,
    schema: str | None,
    prefix: str,
    older_than: timedelta,
    consumer: str | None,
    batch_size: int,
    pause: float,
    rate: float,
    unpaced: bool,
    force: bool,
    dry_run: bool,
) -> None:
    """Delete processed claims older than the window, in small batches that never block
    live claims. Each consumer is judged under its own recorded retention policy, else the
    default one: a consumer whose policy needs a longer window (or that has none) keeps its
    claims, is named on standard error with the reason, and the command exits with 1."""
    age = format_duration(older_than)
    with database(database_url, schema, prefix) as (conn, naming):
        plan = retention.purge_plan(conn, naming, older_than, consumer=consumer, force=force)
        if consumer is not None and plan[0].refused is not None:
            raise retention.RetentionRefused(plan[0].refused)
        allowed = [decision for decision in plan if decision.refused is None]
        doomed = {
            decision.consumer: retention.purgeable(
                conn, naming, older_than, consumer=decision.consumer
            )
            for decision in allowed
        }
        conn.commit()
    _warn_forced(allowed)
    refused = [decision for decision in plan if decision.refused is not None]
    if dry_run:
        click.echo(
            f"would delete {sum(doomed.values())} claims processed more than {age} ago (--dry-run)"
        )
        _refuse(refused)
        return
    engine = connect(database_url)
    try:
        started = time.monotonic()
        deleted = 0
        with progress("purging claims", total=sum(doomed.values())) as advance:
            for decision in allowed:
                deleted += retention.purge(
                    engine,
                    naming,
                    older_than,
                    consumer=decision.consumer,
                    batch_size=batch_size,
                    pause=pause,
                    rows_per_second=None if unpaced else rate,
                    on_batch=advance,
                )
    finally:
        engine.dispose()
    click.echo(
        f"deleted {deleted} claims processed more than {age} ago "
        f"in {time.monotonic() - started:.1f}s"
    )
    _refuse(refused)


def _warn_forced(allowed: list[retention.PurgeDecision]) -> None:
    forced = [decision for decision in allowed if decision.forced]
    if any(decision.recorded is None for decision in forced):
        click.echo("warning: no retention policy is recorded; purging anyway (--force)", err=True)
    minimums = sorted(
        {decision.recorded.minimum for decision in forced if decision.recorded is not None}
    )
    for minimum in minimums:
        names = ", ".join(
            d.consumer for d in forced if d.recorded is not None and d.recorded.minimum == minimum
        )
        click.echo(
            f"warning: purging below the recorded retention policy's minimum of "
            f"{format_duration(minimum)} (consumers {names}; --force)",
            err=True,
        )


def _refuse(refused: list[retention.PurgeDecision]) -> None:
    """Name each consumer whose claims were kept, and why; exit 1 when there is one."""
    for decision in refused:
        click.echo(f"error: consumer {decision.consumer} kept: {decision.refused}", err=True)
    if refused:
        raise SystemExit(1)
