"""The shipped message destinations on real brokers: the effect id travels as the
message's inbox identity, so a consumer using this library processes a re-sent effect
once."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import pytest
from dramatiq.middleware import Middleware
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from inbox_middleware import outbox
from inbox_middleware._core import headers
from inbox_middleware._core.exceptions import InvalidIdentity
from inbox_middleware.dramatiq import InboxMiddleware, current_session
from inbox_middleware.outbox import Dispatcher
from inbox_middleware.outbox.destinations.dramatiq import DramatiqDestination
from inbox_middleware.outbox.destinations.faststream import FastStreamDestination

from ..apps.domain import apply_credit, balance, effects
from ..support import services
from ..support.dramatiq_worker import drain, running_worker

EFFECT = "credit-account-7"


def record_effect(engine: Engine, destination: str, payload: Any) -> None:
    with Session(engine) as session, session.begin():
        outbox.add(session, destination=destination, payload=payload, effect_id=EFFECT)


def dispatch(engine: Engine, destination: str, target: Any) -> Dispatcher:
    dispatcher = Dispatcher(engine, {destination: target}, lease=10.0, delivery_timeout=5.0)
    asyncio.run(dispatcher.run(burst=True))
    return dispatcher


def send_again(engine: Engine) -> None:
    """Make the dispatched effect due once more, as after a lost lease or a lost answer."""
    with engine.begin() as conn:
        conn.execute(text("UPDATE message_outbox SET status = 'pending', next_attempt_at = now()"))


@dataclass
class Skips(Middleware):
    skipped: list[str] = field(default_factory=list)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        self.skipped.append(message.options.get("inbox_message_id"))


def test_dramatiq_destination__downstream_inbox_actor_applies_a_resent_effect_once(
    broker, queue, pg_engine
):
    # Given an inbox actor downstream, and the effect recorded for it
    skips = Skips()
    broker.add_middleware(skips)
    broker.add_middleware(InboxMiddleware(pg_engine))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    destination = DramatiqDestination(add_credit, producer="orders-outbox")
    record_effect(pg_engine, "credit", {"account_id": 7, "delta": 10})
    with running_worker(broker) as worker:
        # When it is dispatched, then dispatched again
        first = dispatch(pg_engine, "credit", destination)
        drain(broker, queue, worker)
        send_again(pg_engine)
        second = dispatch(pg_engine, "credit", destination)
        drain(broker, queue, worker)
    # Then both messages carried the effect id as identity, and the credit happened once
    assert (first.stats.dispatched, second.stats.dispatched) == (1, 1)
    assert skips.skipped == [EFFECT]
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
        claim = conn.execute(text("SELECT producer_name, message_id FROM consumer_inbox")).one()
        result = conn.scalar(text("SELECT remote_result FROM message_outbox"))
    assert tuple(claim) == ("orders-outbox", EFFECT)
    assert result["queue"] == queue


def test_dramatiq_destination__payload_must_be_arguments(stub_broker, queue, pg_engine):
    @dramatiq.actor(queue_name=queue)
    def noop(*args: Any) -> None: ...

    record_effect(pg_engine, "noop", "just text")
    dispatch(pg_engine, "noop", DramatiqDestination(noop, producer="p"))
    with pg_engine.connect() as conn:
        status, error = conn.execute(text("SELECT status, last_error FROM message_outbox")).one()
    assert status == "failed"
    assert "keyword arguments" in error


async def test_faststream_destination__publishes_the_identity_headers_on_rabbitmq(pg_engine, queue):
    from faststream.rabbit import RabbitBroker, RabbitMessage, RabbitQueue

    services.require(services.RABBITMQ, "RabbitMQ")
    # Given a subscriber on RabbitMQ, and a destination with a broker of its own
    consumer = RabbitBroker(services.RABBITMQ, logger=None)
    received: list[tuple[Any, dict[str, Any], str | None]] = []
    arrived = asyncio.Event()

    @consumer.subscriber(RabbitQueue(queue, auto_delete=True))  # gone with its consumer
    async def handle(body: dict[str, Any], message: RabbitMessage) -> None:
        received.append((body, dict(message.headers), message.correlation_id))
        if len(received) == 2:
            arrived.set()

    publisher = RabbitBroker(services.RABBITMQ, logger=None)
    destination = FastStreamDestination(
        publisher, producer="orders-outbox", queue=queue, persist=True
    )
    record_effect(pg_engine, "notify", {"account_id": 7})
    await consumer.start()
    try:
        # When the effect is dispatched twice (the second as after a lost answer)
        first = Dispatcher(pg_engine, {"notify": destination}, lease=10.0, delivery_timeout=5.0)
        await first.run(burst=True)
        send_again(pg_engine)
        second = Dispatcher(pg_engine, {"notify": destination}, lease=10.0, delivery_timeout=5.0)
        await second.run(burst=True)
        await asyncio.wait_for(arrived.wait(), 20)
    finally:
        await consumer.stop()
    # Then both messages carry the effect id as their inbox identity
    assert (first.stats.dispatched, second.stats.dispatched) == (1, 1)
    for body, message_headers, correlation_id in received:
        assert body == {"account_id": 7}
        assert message_headers[headers.PRODUCER] == "orders-outbox"
        assert message_headers[headers.MESSAGE_ID] == EFFECT
        assert correlation_id == EFFECT
    assert publisher._connection is None  # the destination stopped what it had started


def test_destinations__validate_the_producer_name_early(stub_broker):
    actor = dramatiq.actor(lambda: None, broker=stub_broker)
    with pytest.raises(InvalidIdentity, match="producer has leading or trailing white space"):
        DramatiqDestination(actor, producer=" p")
    with pytest.raises(InvalidIdentity, match="producer is empty"):
        FastStreamDestination(object(), producer="")
