"""``inbox-middleware quarantine ...`` and ``inbox-middleware poison ...``.

``redrive``, ``discard`` and ``accept`` take row ids, or a filter (``--consumer``,
``--producer``, ``--reason-code``, ``--since``, ``--until``) that selects pending rows
(and, for ``redrive`` and ``accept``, the rows the same operation decided and whose
publish was never confirmed); ``--dry-run`` lists what would be decided and decides
nothing. Each row's decision is committed on its own before its message is published, and
its publish recorded once confirmed (see `inbox_middleware._operate.repair`), so an interrupted or
failed bulk run is finished by running it again.
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click
from sqlalchemy import Connection

from .._operate import repair
from .._operate.repair import Kind, RepairError, Republisher
from .._storage.tables import InboxSchema
from ._options import DURATION, ROW_ID, database, database_options
from ._output import echo_json, echo_row, progress, table, when

__all__ = ["poison", "quarantine", "republisher"]

_PUBLISH_OPTIONS = [
    click.option(
        "--broker-url",
        envvar="INBOX_BROKER_URL",
        show_envvar=True,
        default=None,
        help="Broker to publish to: amqp://, redis://, nats:// or kafka://host:port "
        "(required, except with --dry-run, which publishes nothing).",
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
        "message again (applied once), another id is refused. Default: derived from the "
        "row. With several rows, each row's operation is this id and the row number.",
    ),
    click.option("--note", default=None, help="Why, kept with the decision."),
]


def _options(options: list[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    def decorate(command: Any) -> Any:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


class Moment(click.ParamType):  # type: ignore[type-arg]  # generic from click 8.4 only
    """An ISO 8601 timestamp (UTC when it names no zone), or a duration ago (``2h``)."""

    name = "moment"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, datetime):
            return value
        try:
            moment = datetime.fromisoformat(str(value))
        except ValueError:
            try:
                return datetime.now(UTC) - DURATION.convert(value, param, ctx)
            except click.BadParameter:
                self.fail(
                    f"{value!r} is neither a timestamp (2026-12-01T08:00:00+00:00) nor a "
                    "duration ago up to 100 years (36h, 7d)",
                    param,
                    ctx,
                )
        return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


MOMENT = Moment()


_FILTER_OPTIONS = [
    click.option("--consumer", default=None, help="Only this consumer."),
    click.option("--producer", default=None, help="Only this producer."),
    click.option("--reason-code", default=None, help="Only rows with this reason code."),
    click.option(
        "--since",
        type=MOMENT,
        default=None,
        help="Only rows last seen (or failed) at or after this: a timestamp, or a duration "
        "ago (7d).",
    ),
    click.option(
        "--until",
        type=MOMENT,
        default=None,
        help="Only rows last seen (or failed) before this (same forms).",
    ),
]

_DECIDE_OPTIONS = [
    click.argument("row_ids", nargs=-1, type=ROW_ID),
    *_FILTER_OPTIONS,
    click.option("--dry-run", is_flag=True, help="List the rows it would decide; change nothing."),
    click.option("--by", default=None, help="Who decides (default: user@host)."),
]


def _who(by: str | None) -> str:
    return by or f"{getpass.getuser()}@{socket.gethostname()}"


def republisher(broker_url: str, payload_format: str, redis_namespace: str) -> Republisher:
    """The publisher for a row's payload format, connected to ``broker_url``."""
    if payload_format == "dramatiq":
        from ..dramatiq._repair import DramatiqRepublisher, broker_from_url

        return DramatiqRepublisher(broker_from_url(broker_url, namespace=redis_namespace))
    if payload_format.startswith("faststream"):
        from ..faststream._repair import FastStreamRepublisher

        return FastStreamRepublisher(broker_url)
    raise click.UsageError(f"no publisher for messages kept as {payload_format or 'unknown'}")


def _listing(kind: Kind, rows: list[dict[str, Any]], title: str) -> None:
    last = "last_seen_at" if kind == "quarantine" else "last_failure_at"
    table(
        title,
        ["#", "decision", "consumer", "producer", "message id", "reason", "attempts", "last"],
        [
            [
                row["id"],
                row["decision"],
                row["consumer_name"],
                row["producer_name"],
                row["message_id"] + (f" (tenant {row['tenant']})" if row["tenant"] else ""),
                row["reason_code"],
                row["attempts"],
                when(row[last]),
            ]
            for row in rows
        ],
    )


def _selected(
    conn: Connection,
    naming: InboxSchema,
    kind: Kind,
    row_ids: tuple[int, ...],
    filters: dict[str, Any],
    resume: tuple[str, str | None] | None = None,
) -> list[dict[str, Any]]:
    """The rows a decision names: by id (any decision: the decision itself refuses), or
    the pending rows the filter matches, oldest first. ``resume`` (an action and its
    ``--operation-id``): also the rows that operation decided and whose publish was never
    confirmed, so that running it again finishes them."""
    given = {name: value for name, value in filters.items() if value is not None}
    if row_ids and given:
        raise click.UsageError("give row ids or a filter (--consumer, --since, ...), not both")
    if not row_ids and not given:
        raise click.UsageError(
            "give row ids, or a filter (--consumer, --producer, --reason-code, --since, --until)"
        )
    if row_ids:
        rows = [repair.show_row(conn, naming, kind, row_id) for row_id in row_ids]
        conn.commit()
        return rows
    selection = {
        "consumer": given.get("consumer"),
        "producer": given.get("producer"),
        "reason": given.get("reason_code"),
        "since": given.get("since"),
        "until": given.get("until"),
    }
    rows = repair.list_rows(conn, naming, kind, decision="pending", limit=None, **selection)
    if resume is not None:
        action, operation_id = resume
        decided = "accepted" if action == "accept" else "redriven"
        unconfirmed = repair.list_unconfirmed(conn, naming, kind, decided, **selection)
        rows += [
            row
            for row in unconfirmed
            if row["operation_id"] in _operations(action, kind, operation_id, row)
        ]
    conn.commit()
    return sorted(rows, key=lambda row: row["id"])


def _operations(
    action: str, kind: Kind, operation_id: str | None, row: dict[str, Any]
) -> tuple[str, ...]:
    """The operation ids this command may have given ``row``."""
    if operation_id is None:
        return (repair.default_operation(action, kind, row),)
    return (operation_id, f"{operation_id}-{row['id']}")


def _decide_all(
    conn: Connection,
    kind: Kind,
    action: str,
    rows: list[dict[str, Any]],
    decide: Callable[[dict[str, Any]], str],
) -> None:
    """Decide row by row under a progress bar; a refused row is reported and the others
    go on. Exit 1 when any was refused."""
    refused = []
    with progress(f"{action} {kind}", total=len(rows)) as advance:
        for row in rows:
            try:
                done = decide(row)
            except RepairError as exc:
                conn.rollback()
                refused.append(str(exc))
            else:
                click.echo(f"{kind} #{row['id']} {done}")
            advance(1)
    for message in refused:
        click.echo(f"error: {message}", err=True)
    if len(rows) > 1:
        click.echo(f"{len(rows) - len(refused)} of {len(rows)} {kind} rows {action}")
    if refused:
        raise SystemExit(1)


def _operation(operation_id: str | None, rows: list[dict[str, Any]], row: dict[str, Any]) -> Any:
    """``--operation-id`` for one row, the id and the row number for several; a row this
    operation decided already keeps the id it was given (a rerun may select fewer rows)."""
    if operation_id is None:
        return None
    if row["decision"] != "pending" and row["operation_id"] in (
        operation_id,
        f"{operation_id}-{row['id']}",
    ):
        return row["operation_id"]
    return operation_id if len(rows) == 1 else f"{operation_id}-{row['id']}"


def _group(kind: Kind) -> click.Group:
    @click.group(kind, help=f"Inspect and decide on {kind} messages.")
    def group() -> None:
        pass

    @group.command("list")
    @database_options
    @_options(_FILTER_OPTIONS)
    @click.option(
        "--decision",
        default="pending",
        show_default=True,
        help="Only rows with this decision; 'all' for every row.",
    )
    @click.option("--limit", type=click.IntRange(1, 1_000_000), default=50, show_default=True)
    @click.option("--json", "as_json", is_flag=True, help="One JSON object per row.")
    def list_command(
        database_url: str,
        schema: str | None,
        prefix: str,
        consumer: str | None,
        producer: str | None,
        reason_code: str | None,
        since: datetime | None,
        until: datetime | None,
        decision: str,
        limit: int,
        as_json: bool,
    ) -> None:
        """Rows, most recent first, in a table (or JSON lines)."""
        with database(database_url, schema, prefix) as (conn, naming):
            rows = repair.list_rows(
                conn,
                naming,
                kind,
                consumer=consumer,
                producer=producer,
                reason=reason_code,
                since=since,
                until=until,
                decision=None if decision == "all" else decision,
                limit=limit,
            )
        if as_json:
            for row in rows:
                echo_row(row)
            return
        if not rows:
            click.echo(f"no {kind} rows" + ("" if decision == "all" else f" ({decision})"))
            return
        _listing(kind, rows, f"{kind} ({decision}), most recent first")

    @group.command("show")
    @database_options
    @click.argument("row_id", type=ROW_ID)
    def show_command(database_url: str, schema: str | None, prefix: str, row_id: int) -> None:
        """One row, with its payload and headers, as JSON."""
        with database(database_url, schema, prefix) as (conn, naming):
            row = repair.show_row(conn, naming, kind, row_id)
        echo_json(row)

    @group.command("discard")
    @database_options
    @_options(_DECIDE_OPTIONS)
    @click.option("--reason", "note", required=True, help="Why the messages are given up.")
    def discard_command(
        database_url: str,
        schema: str | None,
        prefix: str,
        row_ids: tuple[int, ...],
        consumer: str | None,
        producer: str | None,
        reason_code: str | None,
        since: datetime | None,
        until: datetime | None,
        dry_run: bool,
        by: str | None,
        note: str,
    ) -> None:
        """Give up on pending rows; their messages are not published again."""
        filters: dict[str, Any] = {
            "consumer": consumer,
            "producer": producer,
            "reason_code": reason_code,
        }
        with database(database_url, schema, prefix) as (conn, naming):
            filters |= {"since": since, "until": until}
            rows = _selected(conn, naming, kind, row_ids, filters)
            if dry_run:
                _dry_run(kind, "discard", rows)
                return

            def decide(row: dict[str, Any]) -> str:
                with conn.begin():
                    repair.discard(conn, naming, kind, row["id"], by=_who(by), reason=note)
                return "discarded"

            _decide_all(conn, kind, "discarded", rows, decide)

    def publishing(action: str, help_text: str) -> None:
        """A command that records a decision on rows, then publishes each kept message."""

        @group.command(action, help=help_text)
        @database_options
        @_options(_DECIDE_OPTIONS)
        @_options(_PUBLISH_OPTIONS)
        def command(
            database_url: str,
            schema: str | None,
            prefix: str,
            row_ids: tuple[int, ...],
            consumer: str | None,
            producer: str | None,
            reason_code: str | None,
            since: datetime | None,
            until: datetime | None,
            dry_run: bool,
            by: str | None,
            broker_url: str | None,
            redis_namespace: str,
            operation_id: str | None,
            note: str | None,
        ) -> None:
            filters: dict[str, Any] = {
                "consumer": consumer,
                "producer": producer,
                "reason_code": reason_code,
            }
            with database(database_url, schema, prefix) as (conn, naming):
                filters |= {"since": since, "until": until}
                rows = _selected(conn, naming, kind, row_ids, filters, (action, operation_id))
                if dry_run:
                    _dry_run(kind, action, rows)
                    return
                if not broker_url:
                    raise click.MissingParameter(
                        ctx=click.get_current_context(),
                        param_hint="'--broker-url'",
                        param_type="option",
                    )
                publishers: dict[str, Republisher] = {}
                who = _who(by)

                def decide(row: dict[str, Any]) -> str:
                    fmt = row["payload_format"]
                    if fmt not in publishers:
                        publishers[fmt] = republisher(broker_url, fmt, redis_namespace)
                    operation = _operation(operation_id, rows, row)
                    if action == "accept":
                        _, new_id = repair.accept(
                            conn,
                            naming,
                            row["id"],
                            by=who,
                            publisher=publishers[fmt],
                            operation_id=operation,
                            note=note,
                        )
                        return f"accepted as message id {new_id}"
                    _, done = repair.redrive(
                        conn,
                        naming,
                        kind,
                        row["id"],
                        by=who,
                        publisher=publishers[fmt],
                        operation_id=operation,
                        note=note,
                    )
                    return f"redriven to {row['source']} (operation {done})"

                _decide_all(
                    conn, kind, "accepted" if action == "accept" else "redriven", rows, decide
                )

    publishing("redrive", "Publish kept messages again, under their own identity.")
    if kind == "quarantine":
        publishing(
            "accept", "Treat conflicting payloads as new intents, each under a new recorded id."
        )

    return group


def _dry_run(kind: Kind, action: str, rows: list[dict[str, Any]]) -> None:
    if not rows:
        click.echo(f"no {kind} row to {action}")
        return
    _listing(kind, rows, f"would {action} {len(rows)} {kind} rows (--dry-run)")


quarantine = _group("quarantine")
poison = _group("poison")
