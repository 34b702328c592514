"""The library's own engines: which URLs they accept and which driver serves them."""

from __future__ import annotations

import pytest

from inbox_middleware._core.exceptions import ConfigurationError
from inbox_middleware._storage import engines


@pytest.mark.parametrize(
    ("given", "parsed"),
    [
        ("postgres://u@h/db", "postgresql://u@h/db"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("postgresql+asyncpg://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("sqlite:///x.db", "sqlite:///x.db"),
    ],
)
def test_parse_url__postgres_is_postgresql(given, parsed):
    assert engines.parse_url(given).render_as_string() == parsed


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("notaurl", "'notaurl' is not a database URL; give a URL like postgresql://"),
        ("mysql://u@h/db", "supports PostgreSQL and SQLite, not 'mysql'"),
    ],
)
def test_parse_url__anything_else_is_refused_naming_the_fix(given, message):
    with pytest.raises(ConfigurationError, match=message):
        engines.parse_url(given)


@pytest.mark.parametrize(
    ("url", "installed", "driver"),
    [
        ("postgresql://h/db", {"psycopg", "asyncpg"}, "psycopg"),
        ("postgresql+asyncpg://h/db", {"psycopg", "asyncpg"}, "psycopg"),  # sync first
        ("postgresql+asyncpg://h/db", {"asyncpg"}, "asyncpg"),  # faststream-* extras
        ("postgresql+psycopg://h/db", {"asyncpg"}, "asyncpg"),  # named, not installed
        ("postgresql+psycopg2://h/db", {"psycopg", "psycopg2"}, "psycopg2"),
        ("postgresql://h/db", {"psycopg2"}, "psycopg2"),
    ],
)
def test_postgresql_driver__the_named_one_if_installed_else_the_first(
    monkeypatch, url, installed, driver
):
    monkeypatch.setattr(engines, "_installed", lambda module: module in installed)
    assert engines.postgresql_driver(engines.parse_url(url)) == driver
    assert engines.uses_asyncio(url) is (driver == "asyncpg")


def test_postgresql_driver__none_installed_says_what_to_install(monkeypatch):
    monkeypatch.setattr(engines, "_installed", lambda module: False)
    with pytest.raises(ConfigurationError, match=r"pip install 'psycopg\[binary\]'"):
        engines.postgresql_driver(engines.parse_url("postgresql://h/db"))


# -- engine_from_url: the users' engines, from the command line's DATABASE_URL ----------


@pytest.mark.parametrize(
    "given",
    [
        "postgres://u:pw@h:5433/db",
        "postgresql://u:pw@h:5433/db",
        "postgresql+psycopg2://u:pw@h:5433/db",
        "postgresql+asyncpg://u:pw@h:5433/db",
    ],
)
def test_engine_from_url__any_postgresql_url_gives_psycopg_and_asyncpg_engines(given):
    from sqlalchemy.ext.asyncio import AsyncEngine

    from inbox_middleware import engine_from_url

    engine = engine_from_url(given)
    assert engine.url.render_as_string(hide_password=False) == (
        "postgresql+psycopg://u:pw@h:5433/db"
    )
    assert engine.pool.size() == engines.DEFAULT_CONNECTIONS  # Dramatiq's 8 threads
    engine.dispose()
    async_engine = engine_from_url(given, asynchronous=True, connections=16)
    assert isinstance(async_engine, AsyncEngine)
    assert async_engine.url.drivername == "postgresql+asyncpg"
    assert async_engine.sync_engine.pool.size() == 16


def test_engine_from_url__options_go_to_sqlalchemy_and_sqlite_is_synchronous(tmp_path):
    from inbox_middleware import engine_from_url

    engine = engine_from_url("postgresql://h/db", connections=4, max_overflow=0, echo=True)
    assert (engine.pool.size(), engine.pool._max_overflow, engine.echo) == (4, 0, True)
    sqlite = engine_from_url(f"sqlite:///{tmp_path / 'x.db'}")
    assert sqlite.dialect.name == "sqlite"


@pytest.mark.parametrize(
    ("given", "options", "message"),
    [
        ("mysql://u@h/db", {}, "supports PostgreSQL and SQLite, not 'mysql'"),
        ("not a url", {}, "is not a database URL"),
        ("sqlite:///x.db", {"asynchronous": True}, "an asynchronous engine needs PostgreSQL"),
        ("postgresql://h/db", {"connections": 0}, "connections must be a positive number"),
        ("postgresql://h/db", {"pool_sise": 3}, "postgresql\\+psycopg refuses these options"),
    ],
)
def test_engine_from_url__what_cannot_make_an_engine_is_one_line(given, options, message):
    from inbox_middleware import engine_from_url

    with pytest.raises(ConfigurationError, match=message) as raised:
        engine_from_url(given, **options)
    assert str(raised.value).startswith("the inbox cannot build its database engine")
    assert "\n" not in str(raised.value)
    assert raised.value.__cause__ is None


def test_engine_from_url__a_missing_driver_names_what_to_install(monkeypatch):
    from inbox_middleware import engine_from_url

    monkeypatch.setattr(engines, "_installed", lambda module: module != "asyncpg")
    with pytest.raises(ConfigurationError, match=r"asyncpg driver is not installed: pip install"):
        engine_from_url("postgresql://h/db", asynchronous=True)
