"""One database per test run, cloned from a template (PostgreSQL's CREATE ... TEMPLATE).

The template holds the migrated inbox schema and the test domain; its name carries a
digest of both, so a changed migration builds a fresh template and an unchanged one is
reused across runs. Each run's database is dropped when the run ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Iterator
from importlib import resources

import psycopg
from sqlalchemy import create_engine, text

from inbox_middleware._storage import migrate

from ..apps import domain
from .services import POSTGRES_SERVER, with_database


def _digest() -> str:
    hasher = hashlib.sha256()
    folder = resources.files("inbox_middleware._storage").joinpath("migrations", "postgresql")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        hasher.update(entry.name.encode() + entry.read_bytes())
    hasher.update(repr(domain.POSTGRES_DDL).encode())
    return hasher.hexdigest()[:12]


def _admin(server: str = POSTGRES_SERVER) -> psycopg.Connection[tuple[object, ...]]:
    # The server itself, never a pooler: the template's advisory lock is session-level.
    url = server.replace("postgresql+psycopg", "postgresql")
    return psycopg.connect(url, autocommit=True)


def create_run_database(server: str = POSTGRES_SERVER) -> str:
    """Create this run's database on ``server`` (a URL of any of its databases); return
    its name."""
    template = f"inbox_tpl_{_digest()}"
    name = f"inbox_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with _admin(server) as admin:
        # Two runs at once must not both build the template.
        admin.execute("SELECT pg_advisory_lock(hashtext('inbox-middleware-test-template'))")
        try:
            if not admin.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (template,)
            ).fetchone():
                _build_template(admin, template, server)
        finally:
            admin.execute("SELECT pg_advisory_unlock(hashtext('inbox-middleware-test-template'))")
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return name


def _build_template(
    admin: psycopg.Connection[tuple[object, ...]], template: str, server: str
) -> None:
    building = f"{template}_building"
    admin.execute(f'DROP DATABASE IF EXISTS "{building}"')
    admin.execute(f'CREATE DATABASE "{building}"')
    engine = create_engine(with_database(server, building), poolclass=None)
    try:
        migrate(engine)
        with engine.begin() as conn:
            domain.create(conn)
    finally:
        engine.dispose()
    admin.execute(f'ALTER DATABASE "{building}" RENAME TO "{template}"')
    for stale in admin.execute(
        "SELECT datname FROM pg_database WHERE datname LIKE 'inbox\\_tpl\\_%%' AND datname <> %s",
        (template,),
    ).fetchall():
        admin.execute(f'DROP DATABASE IF EXISTS "{stale[0]}"')


@contextlib.contextmanager
def scratch_database(**settings: str) -> Iterator[str]:
    """Another database cloned from the template, with ``settings`` as its defaults
    (ALTER DATABASE ... SET), the way they reach every session, through a pooler too."""
    name = create_run_database()  # builds the template again if another run dropped it
    with _admin() as admin:
        for setting, value in settings.items():
            admin.execute(f'ALTER DATABASE "{name}" SET {setting} = {value}')
    try:
        yield name
    finally:
        drop_database(name)


def drop_database(name: str, server: str = POSTGRES_SERVER) -> None:
    with _admin(server) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def truncate(engine_url: str) -> None:
    engine = create_engine(engine_url)
    with engine.begin() as conn:
        tables = ", ".join(
            [
                "consumer_inbox",
                "inbox_quarantine",
                "message_outbox",
                "inbox_attempts",
                "inbox_poison",
                "inbox_retention",
                "inbox_outputs",
                "inbox_counts",
                "inbox_claims",
                "inbox_layout",
                *domain.TABLES,
            ]
        )
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY"))
        # the compact claims table's hourly partitions (`partitions.prepare`)
        conn.execute(
            text(
                "DO $$ DECLARE r record; BEGIN FOR r IN SELECT c.relname "
                "FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "WHERE i.inhparent = 'inbox_claims'::regclass "
                "AND c.relname ~ '^inbox_claims_[0-9]{10}$' "
                "LOOP EXECUTE format('DROP TABLE %I', r.relname); END LOOP; END $$"
            )
        )
    engine.dispose()
