"""Where a delivery's data lives: a map from its identity to one of several databases.

A fleet over many databases (a database per tenant, or tenants spread over shards) claims
each delivery in the database of its tenant, because the claim is only correct when it
commits in the same transaction as the business change. `DatabaseMap` names the databases
(``name -> URL``) and says which one serves an identity, in this order:

1. ``resolver(identity)``, when given: a user function answering a database name, or None
   for "not mine" (the map's tenants and ranges are asked next);
2. ``tenants``: an exact tenant -> database entry;
3. ``ranges``: the first `TenantRange` holding the tenant (``first <= tenant <= last``,
   compared as strings);
4. otherwise the tenant is unknown: `UnknownTenant`. There is no default database: a
   tenant nobody mapped is a durable rejection (the consumption core dead-letters the
   message with the reason), never a claim in a database that does not hold its data.

The route must be a pure function of the identity (producer, tenant, message id): a
resolver that answers differently for a redelivery sends it to a database where it is
first seen again, and applied twice. A resolver that raises is transient
(`RouteUnavailable`: the delivery is handed back), as is a map file being rewritten.

Pure: no driver, no framework; `inbox_middleware._storage.routed` opens the engines.
"""

from __future__ import annotations

import json
import os
import threading
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypedDict, runtime_checkable

from .exceptions import ConfigurationError, RouteUnavailable, UnknownTenant
from .identity import MAX_NAME_LENGTH, MessageIdentity

__all__ = [
    "DEFAULT_BUSY_WAIT",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_DOWN_PAUSE",
    "DEFAULT_DOWN_PAUSE_LIMIT",
    "DatabaseMap",
    "DatabasePatience",
    "MapFile",
    "Resolver",
    "Router",
    "TenantRange",
    "load_map",
]

DEFAULT_CONNECT_TIMEOUT = 5.0
"""Seconds a connection attempt to a database waits: a database whose packets are
dropped must not hold a worker thread for the kernel's TCP timeout (minutes)."""

DEFAULT_DOWN_PAUSE = 1.0
"""Seconds a database that did not answer is not tried again (its deliveries are handed
back at once meanwhile): the first pause, doubled each time it still does not answer."""

DEFAULT_DOWN_PAUSE_LIMIT = 10.0
"""The longest pause of a database that stays down: after it, one delivery tries the
database again (one at a time, the others handed back at once)."""

DEFAULT_BUSY_WAIT = 0.5
"""Seconds a delivery waits for one of its database's ``pool_size`` places while they are
all taken by deliveries that began less than that ago (a database that answers, only
busy for a moment); once the oldest of them has run that long (a database that hangs),
or the wait is spent, the delivery is handed back."""


class PatienceOptions(TypedDict):
    """`DatabasePatience` as keyword arguments of the routed inboxes."""

    connect_timeout: float
    down_pause: float
    down_pause_limit: float
    busy_wait: float


@dataclass(frozen=True, slots=True)
class DatabasePatience:
    """How a worker over many databases treats one that is slow or down, for the
    adapters' ``patience`` (docs/how-to/many-databases.md): ``connect_timeout``,
    ``down_pause``, ``down_pause_limit`` and ``busy_wait``, seconds, as described by
    their defaults above."""

    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    down_pause: float = DEFAULT_DOWN_PAUSE
    down_pause_limit: float = DEFAULT_DOWN_PAUSE_LIMIT
    busy_wait: float = DEFAULT_BUSY_WAIT

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "down_pause", "down_pause_limit", "busy_wait"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ConfigurationError(f"{name} must be a number of seconds >= 0: {value!r}")
        if self.connect_timeout <= 0:
            raise ConfigurationError("connect_timeout must be more than 0 seconds")

    def options(self) -> PatienceOptions:
        """As keyword arguments of `RoutedInbox` and `AsyncRoutedInbox`."""
        return {
            "connect_timeout": self.connect_timeout,
            "down_pause": self.down_pause,
            "down_pause_limit": self.down_pause_limit,
            "busy_wait": self.busy_wait,
        }


Resolver = Callable[[MessageIdentity], str | None]
"""A user function: the name of the database that holds this identity's data, or None
when it does not know (the map's tenants and ranges decide then). It must answer the same
for every delivery of one identity; raising makes the delivery wait (a hand-back)."""


@runtime_checkable
class Router(Protocol):
    """What the routed inbox needs of a map: which database serves an identity, the URL
    of a database, and the databases it knows (for the commands and the start-up check;
    a resolver may name others, checked when first used)."""

    def route(self, identity: MessageIdentity) -> str: ...

    def url(self, database: str) -> str: ...

    def names(self) -> tuple[str, ...]: ...

    def databases_of(self, tenant: str | None) -> tuple[str, ...]: ...


@dataclass(frozen=True, slots=True)
class TenantRange:
    """Tenants from ``first`` to ``last`` (both included, compared as strings) live in
    ``database``."""

    first: str
    last: str
    database: str

    def holds(self, tenant: str) -> bool:
        return self.first <= tenant <= self.last


@dataclass(frozen=True)
class DatabaseMap:
    """The databases of a fleet and which one serves each identity (see the module).

    Parameters:
      databases: database name -> URL (``postgresql://user@host:5432/db``). The name is
        what metrics and the commands show (a label per database, never per tenant).
      tenants: tenant -> database name.
      ranges: `TenantRange` entries, asked in order after ``tenants``.
      resolver: a function of the identity, asked first.
      paused: tenants whose deliveries are handed back whatever the map says (while
        their rows move to another database: docs/how-to/many-databases.md).
    """

    databases: Mapping[str, str]
    tenants: Mapping[str, str] = field(default_factory=dict)
    ranges: tuple[TenantRange, ...] = ()
    resolver: Resolver | None = None
    paused: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not self.databases:
            raise ConfigurationError("a DatabaseMap needs at least one database")
        for name in self.databases:
            _check_name(name)
        object.__setattr__(self, "ranges", tuple(self.ranges))
        object.__setattr__(self, "paused", frozenset(self.paused))
        targets = [*self.tenants.values(), *(r.database for r in self.ranges)]
        unknown = sorted({name for name in targets if name not in self.databases})
        if unknown:
            raise ConfigurationError(
                f"the map sends tenants to databases it does not name: {', '.join(unknown)}"
            )

    def route(self, identity: MessageIdentity) -> str:
        """The name of the database that serves ``identity``; raises `UnknownTenant`
        when nothing maps it, `RouteUnavailable` when the resolver raised or the tenant is
        paused."""
        if identity.tenant in self.paused:
            raise RouteUnavailable(
                f"tenant {identity.tenant!r} is paused (moving to another database)",
                producer=identity.producer,
                message_id=identity.message_id,
            )
        if self.resolver is not None:
            try:
                found = self.resolver(identity)
            except Exception as exc:
                raise RouteUnavailable(
                    f"the tenant resolver raised {type(exc).__name__}: {exc}",
                    producer=identity.producer,
                    message_id=identity.message_id,
                ) from exc
            if found is not None:
                if found not in self.databases:
                    raise UnknownTenant(
                        f"the resolver sent tenant {identity.tenant!r} to database "
                        f"{found!r}, which the map does not name",
                        tenant=identity.tenant,
                        producer=identity.producer,
                        message_id=identity.message_id,
                    )
                return found
        tenant = identity.tenant
        if tenant in self.tenants:
            return self.tenants[tenant]
        for entry in self.ranges:
            if entry.holds(tenant):
                return entry.database
        raise UnknownTenant(
            f"no database serves tenant {tenant!r}",
            tenant=tenant,
            producer=identity.producer,
            message_id=identity.message_id,
        )

    def url(self, database: str) -> str:
        try:
            return self.databases[database]
        except KeyError:
            raise ConfigurationError(f"the map names no database {database!r}") from None

    def names(self) -> tuple[str, ...]:
        return tuple(self.databases)

    def databases_of(self, tenant: str | None) -> tuple[str, ...]:
        """Every database, or the one serving ``tenant`` (the commands' ``--tenant``)."""
        if tenant is None:
            return self.names()
        return (self.route(MessageIdentity("", "", tenant)),)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], resolver: Resolver | None = None) -> DatabaseMap:
        """A map from its file form: ``databases`` (name -> URL), ``tenants`` (tenant ->
        name), ``ranges`` (a list of ``{first, last, database}``)."""
        try:
            ranges = tuple(
                TenantRange(str(r["first"]), str(r["last"]), str(r["database"]))
                for r in data.get("ranges", ())
            )
            return cls(
                databases={str(k): str(v) for k, v in dict(data["databases"]).items()},
                tenants={str(k): str(v) for k, v in dict(data.get("tenants", {})).items()},
                ranges=ranges,
                resolver=resolver,
                paused=frozenset(str(t) for t in data.get("paused", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigurationError(f"not a database map: {exc!r}") from None


def load_map(path: str | os.PathLike[str], resolver: Resolver | None = None) -> DatabaseMap:
    """Read a map file: TOML (``.toml``) or JSON (anything else)."""
    file = Path(path)
    try:
        text = file.read_text()
        data = tomllib.loads(text) if file.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"cannot read the database map {file}: {exc}") from None
    return DatabaseMap.from_dict(data, resolver)


class MapFile:
    """A `Router` over a map file that is read again when it changes (its modification
    time): tenants can be added without restarting the fleet. While the file cannot be
    read whole (being rewritten), deliveries are handed back (`RouteUnavailable`), never
    routed by a half-written map; the last good map is not used either, since the new
    one may move a tenant. Rewrite the file atomically (write aside, then rename)."""

    def __init__(self, path: str | os.PathLike[str], resolver: Resolver | None = None) -> None:
        self.path = Path(path)
        self.resolver = resolver
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._map: DatabaseMap | None = None
        self._problem: str | None = None
        self.current()  # a map that cannot be read at start-up is a configuration error
        if self._problem is not None:
            raise ConfigurationError(self._problem)

    def current(self) -> DatabaseMap:
        with self._lock:
            try:
                stat = self.path.stat()
                stamp = (stat.st_mtime_ns, stat.st_size)
            except OSError as exc:
                self._problem = f"the database map {self.path} cannot be read: {exc}"
                raise RouteUnavailable(self._problem) from None
            if stamp != self._stamp:
                try:
                    self._map = load_map(self.path, self.resolver)
                    self._problem = None
                except ConfigurationError as exc:
                    self._map, self._problem = None, f"the database map is being reloaded: {exc}"
                self._stamp = stamp
            if self._map is None:
                raise RouteUnavailable(self._problem)
            return self._map

    def route(self, identity: MessageIdentity) -> str:
        return self.current().route(identity)

    def url(self, database: str) -> str:
        return self.current().url(database)

    def names(self) -> tuple[str, ...]:
        return self.current().names()

    def databases_of(self, tenant: str | None) -> tuple[str, ...]:
        return self.current().databases_of(tenant)


def _check_name(name: object) -> None:
    if (
        not isinstance(name, str)
        or not name
        or len(name) > MAX_NAME_LENGTH
        or not all(c.isalnum() or c in "_-." for c in name)
    ):
        raise ConfigurationError(
            f"a database name is a short identifier (letters, digits, '_', '-', '.'), got {name!r}"
        )
