"""The claim sent with its BEGIN: the BEGIN is the one psycopg would send itself."""

from __future__ import annotations

import itertools

import psycopg
import pytest

from inbox_middleware._storage.statements import begin_command

LEVELS = [None, *psycopg.IsolationLevel]


@pytest.mark.parametrize(
    ("level", "read_only", "deferrable"),
    list(itertools.product(LEVELS, [None, True, False], [None, True, False])),
)
def test_begin_command__is_psycopgs_own(level, read_only, deferrable):
    # psycopg builds it without connecting: the connection object is not opened here
    conn = psycopg.Connection.__new__(psycopg.Connection)
    conn._begin_statement = b""
    conn._isolation_level = level
    conn._read_only = read_only
    conn._deferrable = deferrable

    assert begin_command(level, read_only, deferrable) == conn._get_tx_start_command()
