"""The example actor, checked with the inbox's pytest plugin: each order is credited once,
however its message is delivered.

    pytest test_actor.py            # from this folder; needs PostgreSQL on 127.0.0.1

``inbox_check`` comes with the library (a pytest plugin, nothing to configure). The actor
runs through the real inbox and a real PostgreSQL database, on Dramatiq's stub broker.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

HERE = Path(__file__).resolve().parent


@pytest.fixture
def database_url(inbox_database: Any) -> str:
    """A throwaway database for this test, with the inbox tables (the plugin's
    ``inbox_database`` fixture: created from a template, dropped after the test)."""
    return str(inbox_database.url)


@pytest.fixture
def service(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The service module, configured for tests: the stub broker, the test database."""
    monkeypatch.setenv("BROKER_URL", "stub")
    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.syspath_prepend(str(HERE))
    for name in ("accounts", "service"):  # imported afresh, with this configuration
        monkeypatch.delitem(sys.modules, name, raising=False)
    service = importlib.import_module("service")
    importlib.import_module("accounts").reset_database(service.engine, accounts=3)
    yield service
    service.broker.close()
    service.engine.dispose()


# --8<-- [start:check]
def test_add_credit__each_order_is_credited_once_however_it_is_delivered(inbox_check, service):
    def credits() -> int:  # the effect: one row per credited order
        with service.engine.connect() as conn:
            return conn.scalar(text("SELECT count(*) FROM credits"))

    check = inbox_check.dramatiq(service.add_credit, effect=credits)

    def order(number: int) -> Any:  # one intent: its own order id, its own message id
        order_id = f"order-{number}"
        return check.message(number, 10, order_id, producer="orders", message_id=order_id)

    check.redelivered(order(1), times=3).assert_one_effect()
    check.crash_between_commit_and_ack(order(2)).assert_one_effect()
    check.concurrent_duplicates(order(3), copies=8).assert_one_effect()
    check.rolled_back(order(4)).assert_one_effect()


# --8<-- [end:check]
