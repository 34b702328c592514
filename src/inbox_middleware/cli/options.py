"""What every command that reads the inbox tables shares: the database options, the table
naming, and the connection. Other modules may import this one (and only this one) from
the command line.

Every command takes ``--database-url`` (or ``INBOX_DATABASE_URL``) and the table naming
(``--schema``, ``--prefix``, or ``INBOX_SCHEMA`` / ``INBOX_PREFIX``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import click
from sqlalchemy import Connection, Engine

from ..exceptions import ConfigurationError
from ..storage.engines import parse_url, run_sync, sync_engine, uses_asyncio
from ..storage.migrate import check_schema
from ..storage.tables import InboxSchema

__all__ = [
    "DURATION",
    "ROW_ID",
    "Seconds",
    "connect",
    "database",
    "database_options",
    "naming_from",
    "naming_options",
]

F = TypeVar("F", bound=Callable[..., Any])


# -- numbers and durations ------------------------------------------------------------
#
# Every number an option takes is checked by click, so a bad one is a usage error naming
# the option, never a database error, an OverflowError or a dispatcher that sleeps forever.

_LONGEST = timedelta(days=36500)
"""The longest duration an option takes (100 years): any window beyond it is a typo, and
a timestamp that far back leaves the range of Python's and the database's datetimes."""


class Duration(click.ParamType):  # type: ignore[type-arg]  # generic from click 8.4 only
    """``14d``, ``36h``, ``1w2d``, ``90m``, ``45s`` or ``0``, up to 100 years."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, timedelta):
            return value
        from ..retention import parse_duration  # the one reading of a duration

        try:
            duration = parse_duration(str(value))
        except ConfigurationError as exc:
            self.fail(str(exc), param, ctx)
        if duration > _LONGEST:
            self.fail(f"{value!r} is longer than 100 years (36500d)", param, ctx)
        return duration


DURATION = Duration()


class Seconds(click.ParamType):  # type: ignore[type-arg]  # generic from click 8.4 only
    """A finite number of seconds at least ``minimum`` (above it when ``open_minimum``) and
    at most ``maximum``: ``inf`` and ``nan`` are refused, which `click.FloatRange` lets
    through."""

    name = "seconds"

    def __init__(
        self,
        minimum: float = 0.0,
        maximum: float = 86400.0,
        *,
        open_minimum: bool = False,
        what: str = "a number of seconds",
    ) -> None:
        self.minimum, self.maximum, self.open_minimum = minimum, maximum, open_minimum
        self.what = what

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not {self.what}", param, ctx)
        below = number <= self.minimum if self.open_minimum else number < self.minimum
        if not math.isfinite(number) or below or number > self.maximum:
            low = f"above {self.minimum:g}" if self.open_minimum else f"at least {self.minimum:g}"
            self.fail(
                f"{value!r} is not {self.what} {low} and at most {self.maximum:g}",
                param,
                ctx,
            )
        return number


ROW_ID = click.IntRange(1, 2**63 - 1)
"""A quarantine or poison row's id (a PostgreSQL bigint)."""


def naming_options(command: F) -> F:
    """``--schema`` and ``--prefix``."""
    options = [
        click.option(
            "--schema",
            envvar="INBOX_SCHEMA",
            show_envvar=True,
            default=None,
            help="Schema of the inbox tables.",
        ),
        click.option(
            "--prefix",
            envvar="INBOX_PREFIX",
            show_envvar=True,
            default="",
            help="Prefix of the inbox table names.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def database_options(command: F) -> F:
    """``--database-url``, ``--schema`` and ``--prefix``. The command runs where the URL's
    driver works: with asyncpg only, in the greenlet SQLAlchemy's asyncio driver needs."""

    @functools.wraps(command)
    def under_driver(*args: Any, **kwargs: Any) -> Any:
        try:
            url = parse_url(kwargs["database_url"])
        except ConfigurationError as exc:
            raise click.BadParameter(
                str(exc), click.get_current_context(), param_hint="'--database-url'"
            ) from None
        if uses_asyncio(url):
            return run_sync(command, *args, **kwargs)
        return command(*args, **kwargs)

    wrapped = click.option(
        "--database-url",
        envvar="INBOX_DATABASE_URL",
        show_envvar=True,
        required=True,
        help="SQLAlchemy URL of the database holding the inbox tables (postgresql://, "
        "postgres://, postgresql+asyncpg://, sqlite:///); used through whichever "
        "PostgreSQL driver is installed.",
    )(naming_options(under_driver))
    return wrapped  # type: ignore[return-value]


def naming_from(schema: str | None, prefix: str) -> InboxSchema:
    """The table naming from the common ``--schema`` and ``--prefix`` options."""
    return InboxSchema(schema=schema or None, prefix=prefix)


def connect(database_url: str) -> Engine:
    """An engine for ``database_url``, whatever driver it names (see `database_options`)."""
    return sync_engine(database_url)


@contextmanager
def database(
    database_url: str, schema: str | None, prefix: str, *, write: bool = False
) -> Iterator[tuple[Connection, InboxSchema]]:
    """A connection to tables at this code's version (else `SchemaError`, which names
    ``inbox-middleware migrate``), committed at the end when ``write``."""
    naming = naming_from(schema, prefix)
    engine = connect(database_url)
    try:
        with engine.connect() as conn:
            check_schema(conn, naming)
            conn.commit()
            yield conn, naming
            if write:
                conn.commit()
    finally:
        engine.dispose()
