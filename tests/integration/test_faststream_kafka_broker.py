"""Kafka on the real broker (tansu, through FastStream's `KafkaBroker` and aiokafka): what
only a consumer group shows. Two members taking one intent at once, offsets that never
pass a message still in its transaction (one consumer, ``max_workers``, manual assignment,
batches), an offset commit that fails after the database commit, members joining and
leaving under load, and the topics the start-up check creates.

The tests shared with the other brokers (duplicates, conflicts, dead letters, the database
down, the guard) run on Kafka too, in `test_faststream.py` and its neighbours.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiokafka.errors import CommitFailedError
from faststream import AckPolicy, BaseMiddleware
from faststream.kafka import KafkaBroker, Topic, TopicPartition
from faststream.kafka.annotations import KafkaMessage
from sqlalchemy import text

from inbox_middleware._core.exceptions import ConfigurationError
from inbox_middleware.faststream import FastStreamInbox, InboxSession, identity_headers

from ..apps.domain import apply_credit_async, effects
from ..support import kafka, services
from ..support.faststream_brokers import Harness, Seen, eventually, recorder

Handler = Callable[..., Awaitable[Any]]


def ident(message_id: str) -> dict[str, str]:
    return identity_headers(producer="orders", message_id=message_id)


@pytest.fixture
def inbox(pg_async_engine: Any) -> FastStreamInbox:
    return FastStreamInbox(pg_async_engine, lock_timeout=30, retry_backoff=(0.05, 0.5))


@pytest.fixture
async def h() -> Any:
    harness = Harness("kafka", [])  # the topic's name and group; members are made below
    yield harness
    await harness.cleanup()


def member(
    h: Harness,
    inbox: FastStreamInbox,
    seen: Seen,
    handler: Handler,
    *middlewares: Any,
    client_id: str = "faststream",
    **options: Any,
) -> KafkaBroker:
    """One member of the test's consumer group: a broker of its own, guarded."""
    broker = KafkaBroker(
        services.KAFKA,
        client_id=client_id,
        middlewares=[*middlewares, recorder(seen), inbox.middleware],
    )
    settings = {"ack_policy": AckPolicy.ACK, **kafka.GROUP_OPTIONS} | options
    topics = () if "partitions" in settings else (h.name,)  # manual assignment: no topic
    broker.subscriber(
        *topics, group_id=h.group, dependencies=[inbox.consumer("billing")], **settings
    )(handler)
    return inbox.guard(broker)


def assignment(broker: KafkaBroker) -> set[int]:
    """The partitions the broker's subscriber holds now."""
    (subscriber,) = broker.subscribers
    consumers = getattr(subscriber, "consumer_subgroup", None) or [subscriber.consumer]
    return {tp.partition for c in consumers if c is not None for tp in c.assignment()}


def claims(pg_engine: Any) -> int:
    with pg_engine.connect() as conn:
        return int(conn.scalar(text("SELECT count(*) FROM consumer_inbox")))


def account_effects(pg_engine: Any) -> dict[int, int]:
    with pg_engine.connect() as conn:
        rows = conn.execute(text("SELECT account_id, count(*) FROM ledger GROUP BY account_id"))
        return {int(account): int(count) for account, count in rows}


# -- two members, one intent ------------------------------------------------------------


async def test_kafka__concurrent_duplicates_on_two_members_have_one_effect(h, inbox, pg_engine):
    # Given two members of one group, each owning one of the topic's two partitions, and a
    # handler that holds its claim for a second
    await kafka.create_topic(h.name, 2)
    seen = Seen()

    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])
        await asyncio.sleep(1)

    first, second = (member(h, inbox, seen, handle) for _ in range(2))
    async with first, second:
        await first.start()
        await second.start()
        await eventually(
            lambda: assignment(first) and assignment(second), timeout=30, what="one each"
        )
        # When the producer sends one intent twice, once to each partition
        await asyncio.gather(
            *(
                first.publish(
                    {"account": 7, "delta": 10}, h.name, partition=p, headers=ident("o-1")
                )
                for p in (0, 1)
            )
        )
        await eventually(
            lambda: len(seen.outcomes) == 2,
            timeout=30,
            what=f"two outcomes {seen} {assignment(first)} {assignment(second)}",
        )
    # Then both members held it at once, one applied it, the other skipped it
    assert abs(seen.arrivals[0] - seen.arrivals[1]) < 1, "the deliveries should overlap"
    assert sorted(seen.outcomes) == ["Skipped", "processed"]
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 1
    assert await kafka.uncommitted(h.group, h.name) == 0


# -- offsets only behind settled messages -------------------------------------------------

SHAPES = [
    pytest.param({}, id="one-consumer"),
    pytest.param({"max_workers": 2}, id="max-workers"),
    pytest.param({"partitions": "both"}, id="manual-assignment"),
]


@pytest.mark.parametrize("shape", SHAPES)
async def test_kafka__offsets_never_pass_a_message_in_its_transaction(h, inbox, pg_engine, shape):
    # Given a topic of two partitions: "slow" first on partition 0, held in its
    # transaction until released, three more behind it there, and five on partition 1
    await kafka.create_topic(h.name, 2)
    if shape.get("partitions"):
        shape = {"partitions": [TopicPartition(h.name, p) for p in (0, 1)]}
    release = asyncio.Event()
    seen = Seen()

    async def handle(body: dict[str, Any], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], 1)
        if body["id"] == "slow":
            await release.wait()

    producer = KafkaBroker(services.KAFKA)
    async with producer:
        await producer.publish(
            {"account": 1, "id": "slow"}, h.name, partition=0, headers=ident("slow")
        )
        for n in range(3):
            await producer.publish(
                {"account": 2, "id": n}, h.name, partition=0, headers=ident(f"p0-{n}")
            )
        for n in range(5):
            await producer.publish(
                {"account": 3, "id": n}, h.name, partition=1, headers=ident(f"p1-{n}")
            )
    broker = member(h, inbox, seen, handle, **shape)
    async with broker:
        await broker.start()
        # When "slow" is in its transaction and everything the consumers may take is done
        await eventually(
            lambda: account_effects(pg_engine).get(1) is None and seen.arrivals,
            timeout=30,
            what="slow",
        )
        if "max_workers" in shape:  # the other consumer owns partition 1 and goes on
            await eventually(lambda: len(seen.outcomes) == 5, timeout=30, what="partition 1")
            await eventually(
                lambda: _committed_is(h, {1: 5}), timeout=10, what="partition 1's commit"
            )
        await asyncio.sleep(1.5)  # time for any commit past "slow" to happen
        # Then partition 0's offset is not past "slow" (offset 0): nothing there is committed
        during = await kafka.committed(h.group, h.name)
        assert during.get(0, 0) == 0
        assert account_effects(pg_engine).get(2) is None, "nothing behind slow ran yet"
        # ... and once it commits, everything is settled and committed, each applied once
        release.set()
        await eventually(lambda: len(seen.outcomes) == 9, timeout=30, what="every message")
        await eventually(lambda: _committed_is(h, {0: 4, 1: 5}), timeout=10, what="the commits")
    assert account_effects(pg_engine) == {1: 1, 2: 3, 3: 5}
    assert seen.outcomes == ["processed"] * 9


async def _committed_is(h: Harness, expected: dict[int, int]) -> bool:
    found = await kafka.committed(h.group, h.name)
    return all(found.get(p) == offset for p, offset in expected.items())


async def test_kafka__a_batch_is_settled_before_its_offsets_are_committed(h, inbox, pg_engine):
    # Given six messages on partition 0, read as one batch whose transaction is held
    await kafka.create_topic(h.name, 2)
    release, entered = asyncio.Event(), asyncio.Event()
    seen = Seen()

    async def handle(bodies: list[dict[str, Any]], session: InboxSession) -> None:
        for body in bodies:
            await apply_credit_async(session, "billing", body["account"], 1)
        entered.set()
        await release.wait()

    producer = KafkaBroker(services.KAFKA)
    async with producer:
        for n in range(6):
            await producer.publish({"account": n}, h.name, partition=0, headers=ident(f"o-{n}"))
    broker = member(h, inbox, seen, handle, batch=True, max_records=10)
    async with broker:
        await broker.start()
        await asyncio.wait_for(entered.wait(), 30)
        await asyncio.sleep(1.5)
        # While the batch is in its transaction, nothing is committed, nothing applied
        assert await kafka.committed(h.group, h.name) == {}
        assert claims(pg_engine) == 0
        release.set()
        await eventually(lambda: _committed_is(h, {0: 6}), timeout=15, what="the commit")
    # Then the whole batch committed in the database before its offsets did
    assert claims(pg_engine) == 6
    assert account_effects(pg_engine) == dict.fromkeys(range(6), 1)


# -- a failed offset commit ---------------------------------------------------------------


POLICIES = [
    pytest.param(AckPolicy.ACK, id="ack"),
    pytest.param(AckPolicy.NACK_ON_ERROR, id="nack-on-error"),
]


def failing_first_commit(failures: list[str]) -> type[BaseMiddleware]:
    """Outside the inbox: the first offset commit fails the way aiokafka's does when the
    group rebalanced meanwhile (the database has committed by then)."""

    class FailingCommit(BaseMiddleware):
        async def consume_scope(self, call_next: Any, msg: Any) -> Any:
            ack = msg.ack

            async def ack_failing_once(*args: Any, **kwargs: Any) -> None:
                if not failures:
                    failures.append(msg.message_id)
                    raise CommitFailedError("the group has already rebalanced")
                await ack(*args, **kwargs)

            msg.ack = ack_failing_once
            return await call_next(msg)

    return FailingCommit


@pytest.mark.parametrize("policy", POLICIES)
async def test_kafka__failed_offset_commit_after_the_database_commit_is_logged_not_rolled_back(
    h, inbox, pg_engine, caplog, capfd, policy
):
    caplog.set_level(logging.INFO)
    await kafka.create_topic(h.name, 2)
    seen, failures = Seen(), []

    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], 1)

    broker = member(h, inbox, seen, handle, failing_first_commit(failures), ack_policy=policy)
    async with broker:
        await broker.start()
        await broker.publish({"account": 1}, h.name, partition=0, headers=ident("o-1"))
        await broker.publish({"account": 2}, h.name, partition=0, headers=ident("o-2"))
        await eventually(
            lambda: account_effects(pg_engine) == {1: 1, 2: 1}, timeout=30, what="both"
        )
        await eventually(lambda: _committed_is(h, {0: 2}), timeout=10, what="the commits")
    # Then the failed commit was logged, the transaction stood, and nothing was handed back
    assert len(failures) == 1
    # (by the inbox, or by FastStream's own logger when the failure reaches it)
    printed = capfd.readouterr()
    assert "CommitFailedError" in caplog.text + printed.out + printed.err
    assert "NackForRedelivery" not in seen.outcomes
    assert "rolled back" not in caplog.text
    assert len(seen.arrivals) == 2, "not sought back: o-1 was not delivered again"
    assert claims(pg_engine) == 2


# -- rebalances ------------------------------------------------------------------------------


@pytest.mark.parametrize("outcome", ["commits", "rolls back"])
async def test_kafka__partition_revoked_mid_transaction_goes_to_the_new_owner(
    h, inbox, pg_engine, outcome
):
    # Given member "z" alone, holding message m-1 of partition 0 in its transaction
    await kafka.create_topic(h.name, 2)
    release, seen = asyncio.Event(), Seen()
    attempts: list[str] = []

    def handler(name: str) -> Handler:
        async def handle(body: dict[str, int], session: InboxSession) -> None:
            attempts.append(name)
            await apply_credit_async(session, "billing", body["account"], 1)
            if name == "z":
                await release.wait()
                if outcome == "rolls back":
                    raise RuntimeError("the old owner's transaction fails")

        return handle

    old = member(h, inbox, seen, handler("z"), client_id="member-z")
    # Roundrobin deals partitions in member-id order: "member-a" gets partition 0.
    new = member(h, inbox, seen, handler("a"), client_id="member-a")
    async with old, new:
        await old.start()
        await old.publish({"account": 1}, h.name, partition=0, headers=ident("m-1"))
        await eventually(lambda: attempts == ["z"], timeout=30, what="m-1 in its transaction")
        # When member "a" joins and the rebalance moves partition 0 to it
        await new.start()
        await eventually(lambda: assignment(new) == {0}, timeout=30, what="partition 0 moved")
        await eventually(lambda: assignment(old) == {1}, timeout=30, what="the old owner's")
        # ... and then the old owner's transaction ends
        release.set()
        await eventually(lambda: _committed_is(h, {0: 1}), timeout=30, what="m-1's offset")
        await eventually(lambda: len(seen.outcomes) == 2, timeout=30, what="both outcomes")
    # Then the new owner got m-1 again: a duplicate if the old commit won, a retry if not
    with pg_engine.connect() as conn:
        assert effects(conn, 1) == 1
    if outcome == "commits":  # the old owner's commit stands; the new owner skips m-1
        assert sorted(seen.outcomes) == ["Skipped", "processed"]
    else:  # rolled back (and handed back): the new owner claims and applies it
        assert "processed" in seen.outcomes
        assert {*seen.outcomes} - {"processed"} <= {"RuntimeError", "NackForRedelivery"}
        assert attempts == ["z", "a"]
    assert claims(pg_engine) == 1


# -- rebalances under load -------------------------------------------------------------------


async def test_kafka__members_joining_and_leaving_under_load_lose_nothing(h, inbox, pg_engine):
    # Given 120 intents, each sent twice, on four partitions, and a handler slow enough
    # that every rebalance finds messages in their transactions
    await kafka.create_topic(h.name, 4)
    seen = Seen()

    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], 1)
        await asyncio.sleep(0.02)

    producer = KafkaBroker(services.KAFKA)
    members = [member(h, inbox, seen, handle) for _ in range(3)]
    async with producer:

        async def produce() -> None:
            for n in range(120):
                for _ in range(2):
                    await producer.publish({"account": n}, h.name, headers=ident(f"o-{n}"))
                await asyncio.sleep(0.03)

        sending = asyncio.create_task(produce())
        # When members join and leave while the stream is consumed
        await members[0].start()
        await asyncio.sleep(2)
        await members[1].start()  # joins: partitions move away from the first member
        await asyncio.sleep(3)
        await members[0].stop()  # leaves with messages in hand
        await members[2].start()
        await asyncio.sleep(3)
        await members[1].stop()
        await sending
        await eventually(lambda: len(account_effects(pg_engine)) == 120, timeout=60, what="all")
        await eventually(_all_committed(h), timeout=30, what="every offset committed")
        await members[2].stop()
    # Then every intent applied exactly once; the rest were skipped duplicates
    assert account_effects(pg_engine) == dict.fromkeys(range(120), 1)
    assert seen.count("processed") == 120
    assert claims(pg_engine) == 120


def _all_committed(h: Harness) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await kafka.uncommitted(h.group, h.name) == 0

    return check


# -- topics declared at start-up ------------------------------------------------------------


@pytest.mark.parametrize("existing", [None, 3], ids=["declared", "existing"])
async def test_kafka__guard_creates_the_destination_topics_with_the_source_partitions(
    h, inbox, existing
):
    # Given a source that exists with three partitions, or is only declared (with five)
    if existing:
        await kafka.create_topic(h.name, existing)
    broker = KafkaBroker(services.KAFKA, middlewares=[inbox.middleware])

    @broker.subscriber(
        Topic(h.name, num_partitions=5),
        group_id=h.group,
        ack_policy=AckPolicy.ACK,
        dependencies=[inbox.consumer("billing")],
    )
    async def handle(body: dict[str, int], session: InboxSession) -> None: ...

    # When the start-up check runs (what the guarded broker's start runs first)
    async with broker:
        await inbox.check(broker)
        # Then both destination topics exist, partitioned like the source
        for suffix in (".quarantine", ".dead-letter"):
            assert await kafka.partitions(f"{h.name}{suffix}") == (existing or 5)


async def test_kafka__guard_refuses_to_start_when_it_cannot_create_a_topic(h, inbox):
    broker = KafkaBroker(services.KAFKA, middlewares=[inbox.middleware])

    @broker.subscriber(
        h.name,
        group_id=h.group,
        ack_policy=AckPolicy.ACK,
        dependencies=[inbox.consumer("billing", quarantine="billing quarantine!")],
    )
    async def handle(body: dict[str, int], session: InboxSession) -> None: ...

    async with broker:
        with pytest.raises(ConfigurationError, match="cannot create the Kafka topics") as refused:
            await inbox.guard(broker).start()
    assert "'billing quarantine!'" in str(refused.value)
    assert await kafka.partitions(h.name) == 0, "no subscriber started"


async def test_kafka__guard_refuses_manual_ack_and_says_which_policy(h, inbox):
    broker = KafkaBroker(services.KAFKA, middlewares=[inbox.middleware])

    @broker.subscriber(
        h.name,
        group_id=h.group,
        ack_policy=AckPolicy.MANUAL,
        dependencies=[inbox.consumer("billing")],
    )
    async def handle(body: dict[str, int], session: InboxSession, msg: KafkaMessage) -> None: ...

    with pytest.raises(ConfigurationError, match="AckPolicy.MANUAL leaves the offset commit"):
        await inbox.check(broker)
