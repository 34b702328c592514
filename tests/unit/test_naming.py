import pytest

from inbox_middleware._core.exceptions import ConfigurationError
from inbox_middleware._storage import InboxSchema, render_sql


@pytest.mark.parametrize(
    "schema", ['x"; DROP TABLE accounts; --', "1abc", "has space", "a" * 64, "dash-ed", ""]
)
def test_schema_name__anything_but_a_plain_identifier_is_refused(schema):
    with pytest.raises(ConfigurationError, match="identifier|longer"):
        InboxSchema(schema=schema)


def test_prefix__refused_when_a_table_name_would_be_truncated():
    with pytest.raises(ConfigurationError, match="longer than 63"):
        InboxSchema(prefix="p" * 50)


def test_render_sql__uses_quoted_configured_names():
    statements = render_sql("postgresql", InboxSchema(schema="billing", prefix="svc_"))
    assert any('CREATE TABLE IF NOT EXISTS "billing"."svc_consumer_inbox"' in s for s in statements)
    assert all("${" not in s for s in statements)


def test_render_sql__sqlite_has_no_schemas():
    with pytest.raises(ConfigurationError, match="SQLite has no schemas"):
        render_sql("sqlite", InboxSchema(schema="billing"))


def test_unsupported_dialect_is_refused_by_name():
    with pytest.raises(ConfigurationError, match="not mysql"):
        render_sql("mysql")
