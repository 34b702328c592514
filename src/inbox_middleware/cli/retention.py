"""``inbox-middleware retention ...`` and ``inbox-middleware purge``."""

from __future__ import annotations

import getpass
import socket
import time
from collections.abc import Callable
from typing import Any

import click

from . import retention
from .retention import ALL_CONSUMERS, RetentionPolicy, format_duration, parse_duration

__all__ = ["purge", "retention_group"]

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
            default="0",
            show_default=True,
            help=f"{text.capitalize()} (like 7d, 36h).",
        )(command)
    return click.option(
        "--margin", default=0.25, show_default=True, help="Safety margin over the dominant one."
    )(command)


def _policy(values: dict[str, Any]) -> RetentionPolicy:
    return RetentionPolicy(
        **{name: parse_duration(values[name]) for name in _SCENARIOS}, margin=values["margin"]
    )


def _describe(policy: RetentionPolicy) -> str:
    window, dominant = retention.minimum_window(policy)
    lines = [f"{'scenario':22s} {'a copy can arrive up to':>24s}"]
    for scenario in policy.scenarios():
        mark = "  <- dominant" if scenario is dominant or scenario == dominant else ""
        lines.append(f"{scenario.name:22s} {format_duration(scenario.window):>24s}{mark}")
    lines.append(
        f"minimum retention window: {format_duration(window)} "
        f"({dominant.name} plus a {policy.margin:.0%} margin)"
    )
    return "\n".join(lines)


@click.group("retention")
def retention_group() -> None:
    """How long the inbox must remember a message, derived from its failure scenarios."""


@retention_group.command("calculate")
@_scenario_options
def calculate_command(**values: Any) -> None:
    """Print the minimum safe window and the scenario that dominates it."""
    click.echo(_describe(_policy(values)))


def _who(by: str | None) -> str:
    return by or f"{getpass.getuser()}@{socket.gethostname()}"


def _register() -> click.Command:
    # The shared options live in `cli`, which imports this module once they exist.
    from .cli import connect, database_options, naming_from

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
        engine = connect(database_url)
        try:
            with engine.begin() as conn:
                retention.record_policy(
                    conn, naming_from(schema, prefix), policy, consumer=consumer, by=_who(by)
                )
        finally:
            engine.dispose()
        click.echo(_describe(policy))
        click.echo(f"recorded for consumer {consumer}")

    @retention_group.command("show")
    @database_options
    @click.option("--consumer", default=None, help="The policy that applies to this consumer.")
    def show_command(
        database_url: str, schema: str | None, prefix: str, consumer: str | None
    ) -> None:
        """Print the recorded policy that applies (the consumer's own, else the default)."""
        engine = connect(database_url)
        try:
            with engine.connect() as conn:
                recorded = retention.recorded_policy(conn, naming_from(schema, prefix), consumer)
        finally:
            engine.dispose()
        if recorded is None:
            raise click.ClickException("no retention policy is recorded")
        click.echo(f"policy recorded for consumer {recorded.consumer}:")
        click.echo(_describe(recorded.policy))

    @click.command("purge")
    @database_options
    @click.option("--older-than", required=True, help="Delete claims processed before this (30d).")
    @click.option("--consumer", default=None, help="Only this consumer's claims.")
    @click.option("--batch-size", default=5000, show_default=True)
    @click.option("--pause", default=0.0, show_default=True, help="Seconds between batches.")
    @click.option(
        "--force",
        is_flag=True,
        help="Purge even without a recorded policy, or below its minimum window.",
    )
    def purge_command(
        database_url: str,
        schema: str | None,
        prefix: str,
        older_than: str,
        consumer: str | None,
        batch_size: int,
        pause: float,
        force: bool,
    ) -> None:
        """Delete processed claims older than the window, in small batches that never block
        live claims. Refused below the recorded retention policy's minimum."""
        window = parse_duration(older_than)
        naming = naming_from(schema, prefix)
        engine = connect(database_url)
        try:
            with engine.connect() as conn:
                recorded = retention.check_window(
                    conn, naming, window, consumer=consumer, force=force
                )
            if force and (recorded is None or window < recorded.minimum):
                click.echo(
                    "warning: purging below the recorded retention policy (--force)", err=True
                )
            started = time.monotonic()
            deleted = retention.purge(
                engine, naming, window, consumer=consumer, batch_size=batch_size, pause=pause
            )
        finally:
            engine.dispose()
        click.echo(
            f"deleted {deleted} claims processed more than {format_duration(window)} ago "
            f"in {time.monotonic() - started:.1f}s"
        )

    return purge_command


purge = _register()
