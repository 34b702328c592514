"""The pytest plugin in a user's own tests: an actor whose parameters are named like the
identity, a guarded FastStream app on the test broker, the throwaway database and its
schema. Run by tests/integration/test_testing_plugin.py and test_testing_faststream.py."""

from __future__ import annotations

from typing import Any

import pytest
from faststream.rabbit import TestRabbitBroker
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.ext.asyncio import create_async_engine

from inbox_middleware import migrate
from inbox_middleware.faststream import identity_headers


def order_for_an_actor_with_a_producer_parameter(check: Any) -> Any:
    # --8<-- [start:message_with]
    order = check.message_with(
        args=(7, 10), kwargs={"producer": "the-shop"}, producer="orders", message_id="o-1"
    )
    # --8<-- [end:message_with]
    return order


async def conflict_on_the_test_broker(app_broker: Any, queue: str) -> None:
    # --8<-- [start:test_broker]
    async with TestRabbitBroker(app_broker) as broker:  # the app: inbox.guard(broker)
        headers = identity_headers(producer="orders", message_id="o-1")
        await broker.publish({"account": 7, "delta": 10}, queue, headers=headers)
        await broker.publish({"account": 7, "delta": 99}, queue, headers=headers)  # conflict
        publishers = {p.routing(): p for p in broker.publishers}
        quarantined = publishers[f"{queue}.quarantine"].mock
        quarantined.assert_called_once_with({"account": 7, "delta": 99})
    # --8<-- [end:test_broker]


def engines(inbox_database: Any) -> tuple[Any, Any]:
    # --8<-- [start:throwaway]
    engine = create_engine(inbox_database.url)  # postgresql+psycopg://...
    async_engine = create_async_engine(inbox_database.async_url)  # postgresql+asyncpg://...
    # --8<-- [end:throwaway]
    return engine, async_engine


# --8<-- [start:setup]
@pytest.fixture(scope="session")
def inbox_database_setup() -> Any:
    def setup(conn: Connection) -> None:
        migrate(conn)  # the inbox tables
        conn.execute(text("CREATE TABLE credits (account_id int, amount bigint)"))  # yours

    return setup


# --8<-- [end:setup]
