"""The library's own engines: which URLs they accept and which driver serves them."""

from __future__ import annotations

import pytest

from inbox_middleware.exceptions import ConfigurationError
from inbox_middleware.storage import engines


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
