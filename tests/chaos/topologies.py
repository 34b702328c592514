"""The production topologies as chaos runs: what each breaks, and where its database is.

persistent-redis  the persistent Redis (``scripts/services``, 6380) SIGKILLed once under
                  load and started again; PostgreSQL untouched, no connection cuts
failover          the failover pair's primary stopped in immediate mode and its
                  synchronous standby promoted; the workers connect with a URL naming
                  both servers (``target_session_attrs=read-write``); RabbitMQ untouched
failover-async    the same, the primary's replication made asynchronous for the run
                  (``synchronous_standby_names`` empty): what a failover can lose then
quorum            RabbitMQ restarted once under load, every queue a quorum queue with a
                  delivery limit (Dramatiq: ``QuorumRabbitmqBroker``)

The workers are SIGKILLed every one to two seconds throughout. After a failover the pair
is restored as ``scripts/services`` created it, and the run's database dropped there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg

from ..support import database, servers, services
from .run import Config

__all__ = ["TOPOLOGIES", "config", "run_database"]

TOPOLOGIES = ("persistent-redis", "failover", "failover-async", "quorum")
KILL_EVERY = (1.0, 2.0)  # small runs last seconds: kill early and often


def config(topology: str, adapter: str, messages: int, **options: Any) -> Config:
    if topology == "persistent-redis":
        made = Config(adapter, "redis", messages, postgres_fault="none", cuts=False, **options)
        made.broker_restart_at = 0.4
    elif topology == "quorum":
        made = Config(
            adapter, "rabbitmq-quorum", messages, postgres_fault="none", cuts=False, **options
        )
        made.broker_restart_at = 0.4
    elif topology in ("failover", "failover-async"):
        made = Config(
            adapter,
            "rabbitmq",
            messages,
            postgres_fault="failover",
            broker_restart=False,
            cuts=False,
            **options,
        )
        made.postgres_restart_at = 0.4
        made.losses_expected = topology == "failover-async"
    else:
        raise ValueError(f"no topology {topology!r}; one of {', '.join(TOPOLOGIES)}")
    made.kill_every = KILL_EVERY
    return made


def _primary(name: str = "postgres") -> str:
    host, port = services.pair_addresses()[0]
    return f"postgresql://postgres@{host}:{port}/{name}"


@contextlib.contextmanager
def run_database(topology: str, adapter: str) -> Iterator[tuple[str, str | None]]:
    """A migrated database of the run's own, as (the workers' SQLAlchemy URL, the
    harness's libpq URL or None for the default)."""
    if topology not in ("failover", "failover-async"):
        name = database.create_run_database()
        try:
            yield services.with_database(services.POSTGRES, name), None
        finally:
            database.drop_database(name)
        return
    for host, port in services.pair_addresses():
        services.require(f"postgresql://{host}:{port}", "The failover pair")
    driver = "asyncpg" if adapter == "faststream" else "psycopg"
    with servers.failover_pair_locked():
        name = database.create_run_database(_primary())
        try:
            with _asynchronous(topology == "failover-async"):
                yield services.pair_url(name, driver), services.pair_url(name)
        finally:
            # The run restored the pair as created: the old primary's copy is dropped.
            database.drop_database(name, _primary())


@contextlib.contextmanager
def _asynchronous(wanted: bool) -> Iterator[None]:
    """The primary's replication made asynchronous for the run (and made synchronous
    again by ``scripts/services`` when the pair is restored)."""
    if not wanted:
        yield
        return
    with psycopg.connect(_primary(), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET synchronous_standby_names = ''")
        conn.execute("SELECT pg_reload_conf()")
    yield
