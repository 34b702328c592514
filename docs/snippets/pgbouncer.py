"""Your own engines behind PgBouncer in transaction mode (``pool_mode = transaction``): no
statement may be run by a name that one server session must remember."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine


# --8<-- [start:psycopg]
def psycopg_engine(url: str, **options: Any) -> Engine:
    # "postgresql+psycopg://app@pgbouncer:6432/app"
    return create_engine(
        url,
        # psycopg prepares a statement the 5th time a connection runs it: never.
        connect_args={"prepare_threshold": None},
        **options,
    )


# --8<-- [end:psycopg]


# --8<-- [start:asyncpg]
def asyncpg_engine(url: str, **options: Any) -> AsyncEngine:
    # "postgresql+asyncpg://app@pgbouncer:6432/app"
    return create_async_engine(
        url,
        connect_args={
            "statement_cache_size": 0,  # asyncpg's own cache of prepared statements
            "prepared_statement_cache_size": 0,  # SQLAlchemy's cache of them
            # SQLAlchemy's dialect still prepares each statement once: under a unique
            # name, so two clients never collide in one server session.
            "prepared_statement_name_func": lambda: f"__asyncpg_{uuid4()}__",
        },
        **options,
    )


# --8<-- [end:asyncpg]
