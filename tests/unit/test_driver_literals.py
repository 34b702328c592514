"""The claim's values written as literals for asyncpg's simple protocol (no server)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from inbox_middleware._storage import driver


def test_quote__doubles_quotes_and_keeps_backslashes_and_dollars():
    assert driver._quote("it's") == "'it''s'"
    assert driver._quote("back\\slash $1") == "'back\\slash $1'"
    assert driver._quote(None) == "NULL"
    moment = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
    assert driver._quote(moment) == "'2026-01-02T03:04:05.000006+00:00'"


def test_quote__leaves_what_it_cannot_write_to_the_parameters_path():
    # A NUL PostgreSQL refuses in text, and a type the claim does not have: the claim is
    # then sent with parameters, as SQLAlchemy's adapter would send it
    assert driver._quote("a\x00b") is None
    assert driver._quote(7) is None
    assert driver._quote(b"bytes") is None


def test_template__cuts_the_sql_at_each_placeholder_in_order():
    parts, positions = driver._template("SELECT $1::VARCHAR, $12, $2")
    assert parts == ("SELECT ", "::VARCHAR, ", ", ", "")
    assert positions == (0, 11, 1)


class _Recorder:
    """Just enough of an asyncpg connection for `Transaction.start` to say its BEGIN."""

    _top_xact = None
    _pool_release_ctr = 0

    def __init__(self) -> None:
        self.sent: list[str] = []
        self._protocol = self

    def is_in_transaction(self) -> bool:
        return False

    def is_closed(self) -> bool:
        return False

    async def execute(self, query: str) -> None:
        self.sent.append(query)


@pytest.mark.parametrize(
    "isolation", [None, "read_committed", "read_uncommitted", "repeatable_read", "serializable"]
)
@pytest.mark.parametrize("readonly", [False, True])
@pytest.mark.parametrize("deferrable", [False, True])
def test_begin_asyncpg__is_the_begin_asyncpg_would_send(isolation, readonly, deferrable):
    # The inbox sends the BEGIN in the stead of SQLAlchemy's adapter, which would have
    # asked asyncpg's transaction() for it, with the adapter's characteristics
    from asyncpg.transaction import Transaction

    connection = _Recorder()
    asyncio.run(Transaction(connection, isolation, readonly, deferrable).start())
    [theirs] = connection.sent
    assert driver._begin_asyncpg(isolation, readonly, deferrable) == theirs.rstrip(";") + "; "
