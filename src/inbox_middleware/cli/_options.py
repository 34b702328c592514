"""What every command that reads the inbox tables shares: the database options, the table
naming, and the connection. Other modules may import this one (and only this one) from
the command line.

Every command takes ``--database-url`` (or ``INBOX_DATABASE_URL``) and the table naming
(``--schema``, ``--prefix``, or ``INBOX_SCHEMA`` / ``INBOX_PREFIX``). A fleet over many
databases gives ``--map FILE`` (or ``INBOX_DATABASE_MAP``: the `DatabaseMap` file its
workers read) instead of the URL: the command then runs on every database of the map, one
after the other, or on the database of one tenant (``--tenant``); each database's output
follows a line ``== database NAME`` on standard error, a database that fails is reported
and the others still run, and the command fails at the end if any did. Its JSON is still
one document, keyed by database (see `_output`), or JSON lines each naming its database.
``outbox run`` takes the map itself (its function is marked ``takes_the_map``): one
dispatcher over every database of the map, or the tenant's, in rotation.
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

from .._core.exceptions import ConfigurationError
from .._storage.engines import parse_url, run_sync, sync_engine, uses_asyncio
from .._storage.migrate import check_schema
from .._storage.tables import InboxSchema

__all__ = [
    "DURATION",
    "ROW_ID",
    "Seconds",
    "connect",
    "database",
    "database_options",
    "map_options",
    "naming_from",
    "naming_options",
    "takes_the_map",
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
        from .._operate.retention import parse_duration  # the one reading of a duration

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

    # A command with a tenant of its own (explain: the identity's) routes by that one.
    own_tenant = any(p.name == "tenant" for p in getattr(command, "__click_params__", []))
    # A command that takes the map itself (outbox run: one dispatcher over every database).
    whole_map = getattr(command, "takes_the_map", False)

    @functools.wraps(command)
    def per_database(*args: Any, **kwargs: Any) -> Any:
        map_file = kwargs.pop("map_file")
        name = kwargs.pop("database_name")
        tenant = kwargs.get("tenant") if own_tenant else kwargs.pop("tenant")
        if map_file is None:
            if (tenant is not None and not own_tenant) or name is not None:
                raise click.UsageError("--tenant and --database need --map (the database map)")
            if kwargs["database_url"] is None:
                raise click.UsageError("Missing option '--database-url' (or --map).")
            if whole_map:
                kwargs.update(map_file=None, databases=None)
            return under_driver(*args, **kwargs)
        if kwargs["database_url"] is not None:
            raise click.UsageError("give --database-url or --map, not both")
        if name is not None and tenant is not None and not own_tenant:
            raise click.UsageError("give --tenant or --database, not both")
        if whole_map:
            names = _databases(map_file, tenant, name)
            return command(*args, **kwargs, map_file=map_file, databases=names)
        return _each_database(map_file, tenant, name, under_driver, args, kwargs)

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
        default=None,
        help="SQLAlchemy URL of the database holding the inbox tables (postgresql://, "
        "postgres://, postgresql+asyncpg://, sqlite:///); used through whichever "
        "PostgreSQL driver is installed.",
    )(naming_options(map_options(per_database, tenant=not own_tenant)))
    return wrapped  # type: ignore[return-value]


def map_options(command: F, *, tenant: bool = True) -> F:
    """``--map``, ``--tenant`` and ``--database``: every database of a fleet's map, one
    tenant's, or one by name."""
    command = click.option(
        "--database",
        "database_name",
        default=None,
        help="With --map: only this database of the map (by its name in the map).",
    )(command)
    if tenant:
        command = click.option(
            "--tenant",
            default=None,
            help="With --map: only the database that serves this tenant.",
        )(command)
    return click.option(
        "--map",
        "map_file",
        envvar="INBOX_DATABASE_MAP",
        show_envvar=True,
        default=None,
        type=click.Path(exists=True, dir_okay=False),
        help="A database map file (JSON or TOML, as DatabaseMap reads it): run on every "
        "database it names, instead of --database-url.",
    )(command)


_PER_DATABASE_IDS = ("row_id", "row_ids", "effect_id", "effect_ids")
"""Arguments that name rows by an id of one database: over a map, they need the one."""


def _databases(map_file: str, tenant: str | None, name: str | None) -> tuple[str, ...] | None:
    """The databases ``--tenant`` or ``--database`` select (None: every one)."""
    from .._core.tenancy import load_map

    routes = load_map(map_file)
    if name is not None:
        routes.url(name)  # ConfigurationError naming a database the map does not have
        return (name,)
    return None if tenant is None else routes.databases_of(tenant)


def _each_database(
    map_file: str,
    tenant: str | None,
    name: str | None,
    run: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Run the command on each database of the map (or the tenant's, or the one named);
    report each failure and go on, then fail when any did."""
    from sqlalchemy.exc import DBAPIError

    from .._core.exceptions import InboxError
    from .._core.tenancy import load_map
    from ._output import each_database

    names = _databases(map_file, tenant, name) or load_map(map_file).names()
    if len(names) > 1 and any(kwargs.get(arg) for arg in _PER_DATABASE_IDS):
        raise click.UsageError(
            "ids name rows of one database: with --map, give --tenant or --database too"
        )
    routes = load_map(map_file)
    failed: list[str] = []
    with each_database() as database:  # one JSON document for the map, not one each
        for one in names:
            click.echo(f"== database {one}", err=True)
            database(one, None)
            try:
                run(*args, **{**kwargs, "database_url": routes.url(one)})
            except (InboxError, DBAPIError, click.ClickException) as exc:
                text = str(exc.orig if isinstance(exc, DBAPIError) and exc.orig else exc)
                first = (text.strip().splitlines() or [type(exc).__name__])[0]
                click.echo(f"error: database {one}: {first}", err=True)
                database(one, first)
                failed.append(one)
            except SystemExit as exc:  # a command that said why on standard error, exited
                if exc.code not in (None, 0):
                    database(one, f"exited with status {exc.code}")
                    failed.append(one)
    if failed:
        raise click.ClickException(
            f"{len(failed)} of {len(names)} databases failed: {', '.join(failed)}"
        )


def takes_the_map(command: F) -> F:
    """Mark a command that takes ``--map`` and ``--tenant`` itself (below
    `database_options`), rather than being run once per database."""
    command.takes_the_map = True  # type: ignore[attr-defined]
    return command


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
