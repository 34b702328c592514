"""``inbox-middleware quarantine ...`` and ``inbox-middleware poison ...``."""

from __future__ import annotations

import getpass
import json
import socket
from collections.abc import Callable
from typing import Any

import click

from . import repair
from .repair import Kind, Republisher

__all__ = ["poison", "quarantine"]

_PUBLISH_OPTIONS = [
    click.option(
        "--broker-url",
        envvar="INBOX_BROKER_URL",
        required=True,
        help=(
            "Broker to publish to: amqp://, redis://, nats:// or kafka://host:port "
            "(INBOX_BROKER_URL)."
        ),
    ),
    click.option(
        "--redis-namespace",
        default="dramatiq",
        show_default=True,
        help="Key namespace of a Dramatiq Redis broker.",
    ),
    click.option(
        "--operation-id",
        default=None,
        help="Names this decision: running it again with the same id publishes the same "
        "message again (applied once), another id is refused. Default: derived from the row.",
    ),
    click.option("--by", default=None, help="Who decides (default: user@host)."),
    click.option("--note", default=None, help="Why, kept with the decision."),
]


def _publish_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_PUBLISH_OPTIONS):
        command = option(command)
    return command


def _who(by: str | None) -> str:
    return by or f"{getpass.getuser()}@{socket.gethostname()}"


def republisher(broker_url: str, payload_format: str, redis_namespace: str) -> Republisher:
    """The publisher for a row's payload format, connected to ``broker_url``."""
    if payload_format == "dramatiq":
        from .dramatiq.repair import DramatiqRepublisher, broker_from_url

        return DramatiqRepublisher(broker_from_url(broker_url, namespace=redis_namespace))
    if payload_format.startswith("faststream"):
        from .faststream.repair import FastStreamRepublisher

        return FastStreamRepublisher(broker_url)
    raise click.UsageError(f"no publisher for messages kept as {payload_format or 'unknown'}")


def _group(kind: Kind) -> click.Group:
    from .cli import connect, database_options, naming_from

    @click.group(kind, help=f"Inspect and decide on {kind} messages.")
    def group() -> None:
        pass

    @group.command("list")
    @database_options
    @click.option("--consumer", default=None, help="Only this consumer.")
    @click.option(
        "--decision",
        default="pending",
        show_default=True,
        help="Only rows with this decision; 'all' for every row.",
    )
    @click.option("--limit", default=50, show_default=True)
    @click.option("--json", "as_json", is_flag=True, help="One JSON object per row.")
    def list_command(
        database_url: str,
        schema: str | None,
        prefix: str,
        consumer: str | None,
        decision: str,
        limit: int,
        as_json: bool,
    ) -> None:
        """Rows, most recent first."""
        engine = connect(database_url)
        try:
            with engine.connect() as conn:
                rows = repair.list_rows(
                    conn,
                    naming_from(schema, prefix),
                    kind,
                    consumer=consumer,
                    decision=None if decision == "all" else decision,
                    limit=limit,
                )
        finally:
            engine.dispose()
        if as_json:
            for row in rows:
                click.echo(json.dumps(row, default=str))
            return
        if not rows:
            click.echo(f"no {kind} rows" + ("" if decision == "all" else f" ({decision})"))
            return
        for row in rows:
            what = row.get("reason_code", "")
            click.echo(
                f"#{row['id']:<6} {row['decision']:10s} {row['consumer_name']} "
                f"{row['producer_name']}/{row['message_id']}  {what}  attempts={row['attempts']}"
            )

    @group.command("show")
    @database_options
    @click.argument("row_id", type=int)
    def show_command(database_url: str, schema: str | None, prefix: str, row_id: int) -> None:
        """One row, with its payload and headers, as JSON."""
        engine = connect(database_url)
        try:
            with engine.connect() as conn:
                row = repair.show_row(conn, naming_from(schema, prefix), kind, row_id)
        finally:
            engine.dispose()
        payload = row.pop("payload", None)
        row["payload"] = bytes(payload).decode("utf-8", "replace") if payload else None
        click.echo(json.dumps(row, default=str, indent=2))

    @group.command("discard")
    @database_options
    @click.argument("row_id", type=int)
    @click.option("--reason", required=True, help="Why the message is given up.")
    @click.option("--by", default=None, help="Who decides (default: user@host).")
    def discard_command(
        database_url: str,
        schema: str | None,
        prefix: str,
        row_id: int,
        reason: str,
        by: str | None,
    ) -> None:
        """Give up on a pending row; the message is not published again."""
        engine = connect(database_url)
        try:
            with engine.begin() as conn:
                repair.discard(
                    conn, naming_from(schema, prefix), kind, row_id, by=_who(by), reason=reason
                )
        finally:
            engine.dispose()
        click.echo(f"{kind} #{row_id} discarded")

    def publishing(action: str, help_text: str) -> None:
        """A command that records a decision on a row, then publishes the kept message."""

        @group.command(action, help=help_text)
        @database_options
        @click.argument("row_id", type=int)
        @_publish_options
        def command(
            database_url: str,
            schema: str | None,
            prefix: str,
            row_id: int,
            broker_url: str,
            redis_namespace: str,
            operation_id: str | None,
            by: str | None,
            note: str | None,
        ) -> None:
            naming = naming_from(schema, prefix)
            engine = connect(database_url)
            try:
                with engine.connect() as conn:
                    row = repair.show_row(conn, naming, kind, row_id)
                    publisher = republisher(broker_url, row["payload_format"], redis_namespace)
                    who = _who(by)
                    if action == "accept":
                        _, new_id = repair.accept(
                            conn,
                            naming,
                            row_id,
                            by=who,
                            publisher=publisher,
                            operation_id=operation_id,
                            note=note,
                        )
                        done = f"accepted as message id {new_id}"
                    else:
                        _, operation = repair.redrive(
                            conn,
                            naming,
                            kind,
                            row_id,
                            by=who,
                            publisher=publisher,
                            operation_id=operation_id,
                            note=note,
                        )
                        done = f"redriven to {row['source']} (operation {operation})"
            finally:
                engine.dispose()
            click.echo(f"{kind} #{row_id} {done}")

    publishing("redrive", "Publish the kept message again, under its own identity.")
    if kind == "quarantine":
        publishing(
            "accept", "Treat the conflicting payload as a new intent, under a new recorded id."
        )

    return group


quarantine = _group("quarantine")
poison = _group("poison")
