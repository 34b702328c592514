"""The Kafka-protocol broker of the tests (tansu, started by `scripts/services`), asked
directly with aiokafka: topics created and deleted, a topic read from the start, and a
consumer group's committed offsets, each on a client of its own.

Consumer groups here use a short session timeout, so that a member that died is noticed,
and its partitions handed to another member, within seconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from . import services

PARTITIONS = 2  # of every source topic: two group members can share one
GROUP_OPTIONS: dict[str, Any] = {
    "auto_offset_reset": "earliest",  # a new group reads what was published before it
    "session_timeout_ms": 3000,
    "heartbeat_interval_ms": 300,
}


@contextlib.asynccontextmanager
async def admin() -> AsyncIterator[AIOKafkaAdminClient]:
    services.require(services.KAFKA, "Kafka")
    client = AIOKafkaAdminClient(bootstrap_servers=services.KAFKA)
    await client.start()
    try:
        yield client
    finally:
        await client.close()


async def create_topic(name: str, partitions: int = PARTITIONS) -> None:
    async with admin() as client:
        if name not in await client.list_topics():
            await client.create_topics([NewTopic(name, partitions, 1)])


async def partitions(name: str) -> int:
    """How many partitions ``name`` has; 0 if it does not exist (never creates it)."""
    async with admin() as client:
        if name not in await client.list_topics():
            return 0
        (topic,) = await client.describe_topics([name])
        return len(topic["partitions"])


async def delete_topics(names: Iterable[str]) -> None:
    async with admin() as client:
        existing = set(await client.list_topics())
        if wanted := [n for n in names if n in existing]:
            await client.delete_topics(wanted)


async def end_offsets(name: str) -> dict[int, int]:
    """The offset after the last record of each partition of ``name``."""
    tps = [TopicPartition(name, p) for p in range(await partitions(name))]
    if not tps:
        return {}
    consumer = AIOKafkaConsumer(bootstrap_servers=services.KAFKA, enable_auto_commit=False)
    await consumer.start()
    try:
        return {tp.partition: offset for tp, offset in (await consumer.end_offsets(tps)).items()}
    finally:
        await consumer.stop()


async def committed(group: str, name: str) -> dict[int, int]:
    """The offsets ``group`` has committed on ``name``, by partition (absent: none)."""
    # Asked as a consumer of the group that never joins it (the admin client's offset
    # fetch speaks a protocol version tansu answers differently).
    count = await partitions(name)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=services.KAFKA, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        found = {}
        for partition in range(count):
            offset = await consumer.committed(TopicPartition(name, partition))
            if offset is not None and offset >= 0:
                found[partition] = offset
        return found
    finally:
        await consumer.stop()


async def uncommitted(group: str, name: str) -> int:
    """Records of ``name`` behind ``group``'s committed offsets: not acknowledged yet."""
    ends = await end_offsets(name)
    done = await committed(group, name)
    return sum(end - done.get(partition, 0) for partition, end in ends.items())


async def read(name: str) -> list[tuple[bytes, dict[str, str]]]:
    """Every record of ``name`` (partition by partition, oldest first), read without a
    consumer group, so nothing is committed."""
    ends = await end_offsets(name)
    if not any(ends.values()):
        return []
    consumer = AIOKafkaConsumer(bootstrap_servers=services.KAFKA, enable_auto_commit=False)
    await consumer.start()
    found: list[tuple[bytes, dict[str, str]]] = []
    try:
        for partition, end in sorted(ends.items()):
            tp = TopicPartition(name, partition)
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            while await consumer.position(tp) < end:
                for records in (await consumer.getmany(tp, timeout_ms=1000)).values():
                    for record in records:
                        headers = {k: v.decode("utf-8", "replace") for k, v in record.headers}
                        found.append((record.value or b"", headers))
    finally:
        await consumer.stop()
    return found
