"""The library's own engines never name a prepared statement (storage.engines)."""

import pytest

from inbox_middleware._core.exceptions import ConfigurationError
from inbox_middleware._storage.engines import async_engine, pooler_connect_args, sync_engine


def test_sync_engine__postgresql_urls_use_psycopg_without_preparing():
    for url in (
        "postgresql://u@h/db",
        "postgresql+asyncpg://u@h/db",
        "postgresql+psycopg://u@h/db",
    ):
        engine = sync_engine(url)
        assert (engine.dialect.driver, engine.pool.size()) == ("psycopg", 1)
        engine.dispose()
    assert pooler_connect_args("psycopg") == {"prepare_threshold": None}


def test_sync_engine__sqlite_as_is_and_other_databases_refused(tmp_path):
    assert sync_engine(f"sqlite:///{tmp_path / 'x.db'}").dialect.name == "sqlite"
    assert pooler_connect_args("pysqlite") == {}
    with pytest.raises(ConfigurationError, match="PostgreSQL and SQLite, not 'mysql'"):
        sync_engine("mysql://u@h/db")


def test_asyncpg__both_caches_off_and_a_unique_name_per_statement():
    arguments = pooler_connect_args("asyncpg")
    assert (arguments["statement_cache_size"], arguments["prepared_statement_cache_size"]) == (0, 0)
    name = arguments["prepared_statement_name_func"]
    assert name() != name()
    assert name().startswith("__asyncpg_")
    with pytest.raises(ConfigurationError, match="needs PostgreSQL"):
        async_engine("sqlite+aiosqlite:///x.db")
