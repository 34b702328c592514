"""How every command prints: rich tables for people, JSON for programs, one format each.

- Timestamps: in JSON, ISO 8601 with the zone (``2026-12-01T08:51:00.887358+00:00``); in
  tables, the same to the second (``2026-12-01 08:51:00+00:00``). A value stored without
  a zone (SQLite) is UTC.
- Payloads: in JSON, the message as a JSON value when it is JSON (a Dramatiq message, a
  FastStream JSON body), else a string when it is text, else ``{"base64": "..."}``.
- Progress: a rich progress bar on standard error, only when it is a terminal.
- Over a database map (``--map``), still one JSON document: a command that prints one
  (``status --json``, ``explain --json``, ``show``) prints, after the last database,
  ``{"format": "inbox-middleware.databases/1", "databases": {NAME: document, ...},
  "failed": {NAME: error, ...}}``; a command that prints JSON lines (``list --json``)
  prints each row with ``"database": NAME`` first. See `each_database`.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

__all__ = [
    "MAP_FORMAT",
    "console",
    "each_database",
    "echo_json",
    "echo_row",
    "iso",
    "jsonable",
    "payload_value",
    "progress",
    "table",
    "when",
]


def console(*, stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    # Wide enough for the tables when the output goes to a file or a pipe.
    return Console(file=stream, width=None if stream.isatty() else 160, highlight=False)


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def iso(value: datetime | str | None) -> str | None:
    """ISO 8601 with the zone."""
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return _aware(value).isoformat()


def when(value: datetime | str | None) -> str:
    """A timestamp for a table: ISO 8601 to the second, with the zone."""
    if value is None:
        return "-"
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            return value
    else:
        moment = value
    return _aware(moment).isoformat(sep=" ", timespec="seconds")


def payload_value(payload: bytes | memoryview | None) -> Any:
    """A stored payload as a JSON value (see the module docstring)."""
    if payload is None:
        return None
    raw = bytes(payload)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(raw).decode("ascii")}
    try:
        return json.loads(text)
    except ValueError:
        return text


def jsonable(value: Any) -> Any:
    """``value`` with timestamps, payloads and numbers in their JSON form."""
    if isinstance(value, Mapping):
        return {
            key: payload_value(item) if key == "payload" and _binary(item) else jsonable(item)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, datetime):
        return iso(value)
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return float(value)
    if _binary(value):
        return payload_value(value)
    return value


def _binary(value: Any) -> bool:
    return isinstance(value, bytes | bytearray | memoryview)


MAP_FORMAT = "inbox-middleware.databases/1"
"""The ``format`` of the one JSON document a command prints over a map."""


class _OverTheMap:
    """The JSON a command prints over a map, gathered per database (see `each_database`)."""

    def __init__(self) -> None:
        self.database = ""
        self.documents: dict[str, Any] = {}
        self.failed: dict[str, str] = {}


_over_the_map: _OverTheMap | None = None
"""Set while a command runs on each database of a map (a command line runs one command,
in one thread, hence no context variable: an asyncpg command runs in another thread)."""


@contextmanager
def each_database() -> Iterator[Callable[[str, str | None], None]]:
    """While a command runs on each database of a map: yields ``database(name, error)``,
    called before each database's run with ``error`` None, and after a failed one with
    its error. Documents are gathered and printed as one when it ends, if any was."""
    global _over_the_map  # noqa: PLW0603 (one command per process)
    gathered = _OverTheMap()

    def database(name: str, error: str | None) -> None:
        if error is None:
            gathered.database = name
        else:
            gathered.failed[name] = error

    _over_the_map = gathered
    try:
        yield database
    finally:
        _over_the_map = None
        if gathered.documents:
            echo_json(
                {"format": MAP_FORMAT, "databases": gathered.documents, "failed": gathered.failed}
            )


def echo_json(value: Any, *, indent: int | None = 2) -> None:
    """Print one JSON document (over a map: gathered with the other databases')."""
    if _over_the_map is not None:
        _over_the_map.documents[_over_the_map.database] = jsonable(value)
        return
    click.echo(json.dumps(jsonable(value), indent=indent, ensure_ascii=False))


def echo_row(row: Mapping[str, Any]) -> None:
    """Print one row as a line of JSON (over a map: with its database first)."""
    if _over_the_map is not None:
        row = {"database": _over_the_map.database, **row}
    click.echo(json.dumps(jsonable(row), ensure_ascii=False))


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """A rich table on standard output; numbers right-aligned."""
    shown = Table(title=title, title_justify="left")
    rows = [[("-" if cell is None else cell) for cell in row] for row in rows]
    for index, column in enumerate(columns):
        numeric = bool(rows) and all(isinstance(row[index], int | float) for row in rows)
        shown.add_column(column, justify="right" if numeric else "left", overflow="fold")
    for row in rows:
        shown.add_row(*(Text(str(cell)) for cell in row))
    console().print(shown)


@contextmanager
def progress(description: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """A progress bar on standard error (a terminal only); yields ``advance(n)``."""
    err = console(stderr=True)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )
    with bar:
        task = bar.add_task(description, total=total)

        def advance(n: int = 1) -> None:
            bar.advance(task, n)

        yield advance
