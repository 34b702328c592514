"""A guarded FastStream app under FastStream's own test brokers: the start-up check runs
when the test broker starts (no warning that it did not), and the inbox's quarantine and
dead-letter publishes reach the test broker's fakes (no subscriber of the test's)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from faststream.rabbit import RabbitBroker, RabbitQueue, TestRabbitBroker
from faststream.redis import RedisBroker, StreamSub, TestRedisBroker
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from inbox_middleware.faststream import FastStreamInbox, InboxSession, identity_headers

from ..apps.domain import apply_credit_async, effects
from ..support import services
from .test_testing_plugin import counter


def app(kind: str, inbox: FastStreamInbox, queue: str) -> tuple[Any, Any]:
    if kind == "rabbit":
        broker: Any = RabbitBroker(middlewares=[inbox.middleware])
        subscriber = broker.subscriber(queue, dependencies=[inbox.consumer("billing")])
        return inbox.guard(broker), (subscriber, TestRabbitBroker, {"queue": queue})
    broker = RedisBroker(middlewares=[inbox.middleware])
    subscriber = broker.subscriber(
        stream=StreamSub(queue, group="billing", consumer="c1", claim_min_idle_time=30_000),
        dependencies=[inbox.consumer("billing")],
    )
    return inbox.guard(broker), (subscriber, TestRedisBroker, {"stream": queue})


@pytest.mark.parametrize("kind", ["rabbit"])
async def test_test_broker__guarded_app_checks_at_start_and_quarantines_without_help(
    kind, pg_async_engine, pg_engine, queue, caplog
):
    # Given a guarded app, as the user's module builds it, with no subscriber on the
    # quarantine or dead-letter destinations
    inbox = FastStreamInbox(pg_async_engine)
    broker, (subscriber, test_broker, where) = app(kind, inbox, queue)

    @subscriber
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    caplog.set_level(logging.DEBUG, logger="inbox_middleware")
    async with test_broker(broker) as test:
        # When one intent is sent, then sent again with another payload (a conflict),
        # and a message without identity (a dead letter)
        first = identity_headers(producer="orders", message_id="o-1")
        await test.publish({"account": 7, "delta": 10}, headers=first, **where)
        await test.publish({"account": 7, "delta": 99}, headers=first, **where)
        await test.publish({"account": 7, "delta": 1}, **where)
        declared = {p.routing(): p for p in broker.publishers}
        quarantined = declared[f"{queue}.quarantine"].mock
        rejected = declared[f"{queue}.dead-letter"].mock
        assert (quarantined.call_count, rejected.call_count) == (1, 1)
        assert quarantined.call_args.args[0] == {"account": 7, "delta": 99}
    # Then the check ran when the test broker started, the conflict and the dead letter
    # reached the test broker's fakes, the effect happened once, and nothing warned
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("inbox_middleware")]
    assert any(m.startswith("inbox consumer billing protects") for m in messages)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [w.split(":")[0] for w in warnings] == [
        "identity conflict",
        "rejecting a message for inbox consumer billing to " + f"{queue}.dead-letter",
    ]
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 1
        assert conn.scalar(text("SELECT count(*) FROM inbox_quarantine")) == 1


async def test_test_broker__the_documented_conflict_test_passes(pg_async_engine, pg_engine, queue):
    from .test_testing_plugin import snippet

    inbox = FastStreamInbox(pg_async_engine)
    broker, (subscriber, _, _) = app("rabbit", inbox, queue)

    @subscriber
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    await snippet().conflict_on_the_test_broker(broker, queue)
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 1


@pytest.mark.timeout(30)
async def test_check__a_subscriber_that_never_returns_fails_within_the_timeout(
    inbox_check, pg_async_engine, pg_engine, queue
):
    # Given a subscriber that never returns (a call without a timeout of its own)
    inbox = FastStreamInbox(pg_async_engine)
    broker = RabbitBroker(middlewares=[inbox.middleware])

    @broker.subscriber(queue, dependencies=[inbox.consumer("billing")])
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])
        await asyncio.Event().wait()

    async with TestRabbitBroker(broker):
        check = inbox_check.faststream(broker, effect=counter(pg_engine), timeout=1)
        order = check.message(
            {"account": 7, "delta": 10}, producer="p", message_id="m", queue=queue
        )
        started = time.monotonic()
        # When a scenario runs, then it fails once its timeout is spent, naming what waits
        with pytest.raises(AssertionError) as raised:
            await check.redelivered(order, times=2)
    assert time.monotonic() - started < 5
    assert str(raised.value).startswith(
        "redelivered (2 deliveries of p/m): not finished within 1s (the check's timeout)"
    )
    assert "1 delivery still running in the subscriber (wave 1 of 2)" in str(raised.value)
    with pg_engine.connect() as conn:  # the handler's transaction was rolled back
        assert effects(conn) == 0


@pytest.mark.timeout(30)
async def test_check__a_subscriber_failing_every_time_on_a_real_broker_ends_at_the_timeout(
    inbox_check, pg_async_engine, pg_engine, queue
):
    # Given a subscriber that fails every time, on RabbitMQ, which redelivers it
    inbox = FastStreamInbox(pg_async_engine)
    broker = RabbitBroker(services.RABBITMQ, middlewares=[inbox.middleware])

    @broker.subscriber(queue, dependencies=[inbox.consumer("billing")])
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        raise ConnectionError("the ledger service is down")

    async with broker:
        await broker.start()
        check = inbox_check.faststream(broker, effect=counter(pg_engine), timeout=1)
        order = check.message(
            {"account": 7, "delta": 10}, producer="p", message_id="m", queue=queue
        )
        with pytest.raises(AssertionError, match="not finished within 1s") as raised:
            await check.redelivered(order, times=1)
        await (await broker.declare_queue(RabbitQueue(queue))).delete(
            if_unused=False, if_empty=False
        )
    assert "failed attempts: ConnectionError" in str(raised.value)
    assert "1 delivery not settled (wave 1 of 1)" in str(raised.value)


async def test_check__rolled_back_passes_a_protected_subscriber_and_fails_its_own_session(
    inbox_check, pg_async_engine, pg_engine, queue
):
    # Given a protected subscriber, and one that writes through a session of its own (not
    # bound to the inbox's connection), which passes the other scenarios
    inbox = FastStreamInbox(pg_async_engine)
    broker = RabbitBroker(middlewares=[inbox.middleware])

    @broker.subscriber(queue, dependencies=[inbox.consumer("billing")])
    async def protected(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    @broker.subscriber(f"{queue}-own", dependencies=[inbox.consumer("billing-own")])
    async def own_session(body: dict[str, int], session: InboxSession) -> None:
        async with AsyncSession(pg_async_engine) as own:
            await apply_credit_async(own, "billing", body["account"], body["delta"])
            await own.commit()

    async with TestRabbitBroker(broker):
        check = inbox_check.faststream(broker, effect=counter(pg_engine))

        def order(message_id: str, where: str) -> Any:
            body = {"account": 7, "delta": 10}
            return check.message(body, producer="p", message_id=message_id, queue=where)

        # When the inbox's transaction is rolled back after the handler ran
        good = await check.rolled_back(order("m-1", queue))
        await check.redelivered(order("m-2", f"{queue}-own"))
        await check.concurrent_duplicates(order("m-3", f"{queue}-own"), copies=4)
        bad = await check.rolled_back(order("m-4", f"{queue}-own"))
    # Then nothing of the protected one survived, and the other one's write did
    assert good.assert_one_effect() is good
    assert (good.deliveries, good.rolled_back, good.survived, good.failures) == (2, 1, 0, ())
    assert (bad.survived, bad.effect, bad.processed) == (1, 2, 1)
    with pytest.raises(AssertionError, match="the effect grew by 1 although the inbox's"):
        bad.assert_one_effect()


async def test_check__rolled_back_on_a_real_broker_waits_for_its_redelivery(
    inbox_check, pg_async_engine, pg_engine, queue
):
    inbox = FastStreamInbox(pg_async_engine)
    broker = RabbitBroker(services.RABBITMQ, middlewares=[inbox.middleware])

    @broker.subscriber(queue, dependencies=[inbox.consumer("billing")])
    async def protected(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    async with broker:
        await broker.start()
        check = inbox_check.faststream(broker, effect=counter(pg_engine))
        order = check.message(
            {"account": 7, "delta": 10}, producer="p", message_id="m", queue=queue
        )
        result = await check.rolled_back(order)
        await (await broker.declare_queue(RabbitQueue(queue))).delete(
            if_unused=False, if_empty=False
        )
    # The broker redelivered the rolled-back message: two attempts, one effect
    assert result.assert_one_effect() is result
    assert (result.deliveries, result.rolled_back, result.survived) == (2, 1, 0)
