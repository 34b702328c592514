"""The example subscriber, checked with the inbox's pytest plugin: each order is credited
once, however its message is delivered.

    pytest test_subscriber.py       # from this folder; needs PostgreSQL on 127.0.0.1

``inbox_check`` comes with the library (a pytest plugin, nothing to configure). The
subscriber runs through the real inbox and a real PostgreSQL database, on FastStream's
in-memory ``TestRabbitBroker``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from faststream.rabbit import TestRabbitBroker
from sqlalchemy import text

HERE = Path(__file__).resolve().parent


@pytest.fixture
def database_url(inbox_database: Any) -> str:
    """A throwaway database for this test, with the inbox tables (the plugin's
    ``inbox_database`` fixture: created from a template, dropped after the test)."""
    return str(inbox_database.async_url)


@pytest_asyncio.fixture
async def service(database_url: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """The service module, configured for tests: the test database."""
    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.syspath_prepend(str(HERE))
    for name in ("accounts", "service"):  # imported afresh, with this configuration
        monkeypatch.delitem(sys.modules, name, raising=False)
    service = importlib.import_module("service")
    await importlib.import_module("accounts").reset_database(service.engine, accounts=3)
    yield service
    await service.engine.dispose()


# --8<-- [start:check]
@pytest.mark.asyncio
async def test_add_credit__each_order_is_credited_once_however_it_is_delivered(
    inbox_check, service
):
    async def credits() -> int:  # the effect: one row per credited order
        async with service.engine.connect() as conn:
            return await conn.scalar(text("SELECT count(*) FROM credits"))

    async with TestRabbitBroker(service.broker) as broker:
        check = inbox_check.faststream(broker, effect=credits)

        def order(number: int) -> Any:  # one intent: its own order id, its own message id
            body = {"account_id": number, "amount": 10, "order_id": f"order-{number}"}
            return check.message(
                body, producer="orders", message_id=body["order_id"], queue=service.QUEUE
            )

        (await check.redelivered(order(1), times=3)).assert_one_effect()
        (await check.crash_between_commit_and_ack(order(2))).assert_one_effect()
        (await check.concurrent_duplicates(order(3), copies=8)).assert_one_effect()
        (await check.rolled_back(order(4))).assert_one_effect()


# --8<-- [end:check]
