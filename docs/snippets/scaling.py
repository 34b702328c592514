"""The scaling guide's set-ups: an engine on a failover pair, Dramatiq on quorum queues,
a FastStream quorum queue. Each is a function the docs test calls with real addresses."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine

from inbox_middleware.dramatiq import InboxMiddleware


def pair_engine(hosts: str = "host=db-a:5432&host=db-b:5432", database: str = "app") -> Engine:
    # --8<-- [start:failover]
    engine = create_engine(
        f"postgresql+psycopg://postgres@/{database}?{hosts}&target_session_attrs=read-write",
        pool_pre_ping=True,
    )
    # --8<-- [end:failover]
    return engine


def quorum_broker(engine: Engine, url: str = "amqp://app@rabbitmq") -> Any:
    # --8<-- [start:dramatiq-quorum]
    from inbox_middleware.dramatiq import QuorumRabbitmqBroker

    broker = QuorumRabbitmqBroker(url=url, confirm_delivery=True, delivery_limit=20)
    broker.add_middleware(InboxMiddleware(engine))
    # --8<-- [end:dramatiq-quorum]
    return broker


def quorum_queue(name: str = "billing") -> Any:
    from faststream.rabbit import QueueType, RabbitQueue

    # --8<-- [start:faststream-quorum]
    queue = RabbitQueue(
        name, durable=True, queue_type=QueueType.QUORUM, arguments={"x-delivery-limit": 20}
    )
    # --8<-- [end:faststream-quorum]
    return queue
