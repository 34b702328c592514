"""The workers' side of the infrastructure axes (`space.AXES`: queues, pooler, clock, and
Kafka): what `app_dramatiq` and `app_faststream` ask here, so that each keeps one line
per setting.

Configured by environment variables (set by `tests.explore.run`): EXPLORE_QUORUM ("1":
RabbitMQ quorum queues with a delivery limit of `QUORUM_DELIVERY_LIMIT`), EXPLORE_POOLER
("pgbouncer": the engines set as docs/how-to/pgbouncer.md says), EXPLORE_RETENTION
(seconds: the inbox's ``retention_window``; "" for none), EXPLORE_WORKERS_MAP (a map
file: the inbox on a `MapFile` over the run's databases, as the workers reach them).
Only the library's public API is used, so that it runs on older commits unchanged.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any
from uuid import uuid4

__all__ = [
    "QUORUM_DELIVERY_LIMIT",
    "connect_args",
    "dramatiq_broker",
    "engine",
    "faststream_broker",
    "faststream_subscribe",
    "inbox_settings",
    "pool_size",
    "storage",
]

ENV = os.environ
QUORUM_DELIVERY_LIMIT = 20
"""Above every ``redelivery_limit`` the space draws, as docs/how-to/failures.md asks."""
KAFKA_PARTITIONS = 8
"""Of a run's topic (its quarantine and dead-letter topics too): enough for the group's
members (processes times ``max_workers``) to share."""


def quorum() -> bool:
    return ENV.get("EXPLORE_QUORUM") == "1"


def connect_args(driver: str) -> dict[str, Any]:
    """The engine's ``connect_args`` the pooler needs (none when direct): no statement
    run by a name a server session must remember (docs/how-to/pgbouncer.md)."""
    if ENV.get("EXPLORE_POOLER", "direct") != "pgbouncer":
        return {}
    if driver == "psycopg":
        return {"prepare_threshold": None}
    return {
        "statement_cache_size": 0,
        "prepared_statement_cache_size": 0,
        "prepared_statement_name_func": lambda: f"__asyncpg_{uuid4()}__",
    }


def pool_size(concurrency: int) -> int:
    """Connections for ``concurrency`` handlers and the inbox's own transactions."""
    return 2 * concurrency + 2


def engine(concurrency: int, application: str, *, asynchronous: bool) -> Any:
    """The workers' engine on EXPLORE_DATABASE_URL: an AsyncEngine (asyncpg) or an Engine
    (psycopg), a pool for ``concurrency`` handlers and the inbox's own transactions."""
    options: dict[str, Any] = {
        "pool_size": pool_size(concurrency),
        "max_overflow": 0,
        "pool_pre_ping": True,
    }
    url = ENV["EXPLORE_DATABASE_URL"]
    if asynchronous:
        from sqlalchemy.ext.asyncio import create_async_engine

        settings = {"server_settings": {"application_name": application}}
        return create_async_engine(url, connect_args=settings | connect_args("asyncpg"), **options)
    from sqlalchemy import create_engine

    settings = {"application_name": application}
    return create_engine(url, connect_args=settings | connect_args("psycopg"), **options)


def storage(engine: Any, concurrency: int) -> dict[str, Any]:
    """Where the adapter claims: ``engine`` (the run's database), or over a map the
    ``router`` (the run's map file, read as a `MapFile`) and its budget, as
    docs/how-to/many-databases.md gives them (``engine`` then serves the handlers' own
    bookkeeping only: the attempts they count)."""
    mapped = ENV.get("EXPLORE_WORKERS_MAP", "")
    if not mapped:
        return {"engine": engine}
    from inbox_middleware import MapFile

    router = MapFile(mapped)
    # A pool as large as the engine's: every handler of the process may be in one database.
    pool = pool_size(concurrency)
    budget = pool * len(router.current().databases)
    return {"router": router, "pool_size": pool, "connection_budget": budget}


def inbox_settings() -> dict[str, Any]:
    """The inbox's settings of these axes: a ``retention_window`` where the producer
    stamps ``produced_at``."""
    seconds = ENV.get("EXPLORE_RETENTION", "")
    return {"retention_window": timedelta(seconds=float(seconds))} if seconds else {}


def dramatiq_broker(url: str) -> Any | None:
    """Dramatiq's broker on quorum queues; None for the classic one."""
    if not quorum():
        return None
    from inbox_middleware.dramatiq import QuorumRabbitmqBroker

    return QuorumRabbitmqBroker(
        url=url, confirm_delivery=True, delivery_limit=QUORUM_DELIVERY_LIMIT
    )


def faststream_broker(kind: str, url: str, middlewares: list[Any]) -> Any | None:
    """FastStream's broker of these axes (Kafka); None for the others."""
    if kind != "kafka":
        return None
    from faststream.kafka import KafkaBroker

    return KafkaBroker(url, middlewares=middlewares)


def faststream_subscribe(
    broker: Any, kind: str, source: str, concurrency: int, options: dict[str, Any], handler: Any
) -> bool:
    """Subscribe ``handler`` where these axes decide how (a RabbitMQ quorum queue, a Kafka
    topic); whether they did."""
    if kind == "rabbitmq" and quorum():
        from faststream.rabbit import QueueType, RabbitQueue

        queue = RabbitQueue(
            source,
            durable=True,
            queue_type=QueueType.QUORUM,
            arguments={"x-delivery-limit": QUORUM_DELIVERY_LIMIT},
        )
        broker.subscriber(queue, **options)(handler)
        return True
    if kind == "kafka":
        from faststream import AckPolicy

        # As docs/how-to/faststream.md asks: a group, offsets committed once the inbox
        # settled the message, a new group reading from the start; a short session so a
        # killed member's partitions move within seconds. ``max_workers`` consumers each.
        options = {k: v for k, v in options.items() if k != "ack_policy"}
        broker.subscriber(
            source,
            group_id=f"g{source}",
            ack_policy=AckPolicy.ACK,
            auto_offset_reset="earliest",
            session_timeout_ms=3000,
            heartbeat_interval_ms=300,
            max_workers=concurrency,
            **options,
        )(handler)
        return True
    return False
