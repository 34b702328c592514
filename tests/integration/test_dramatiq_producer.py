"""Dramatiq producers without send_with_options: StampIdentity and the actor options
``inbox_producer`` / ``inbox_message_id_from``, with real workers on Redis and RabbitMQ."""

from __future__ import annotations

import dramatiq
import pytest
from sqlalchemy import text

from inbox_middleware.dramatiq import IdentityRefused, InboxMiddleware, StampIdentity, identity
from inbox_middleware.dramatiq._middleware import ActorConfigurationError

from ..apps.domain import apply_credit, balance, effects
from ..support.dramatiq_worker import drain, running_worker
from .test_dramatiq import Recorder, _depth


@pytest.fixture
def recorder(broker) -> Recorder:
    recorder = Recorder()
    broker.add_middleware(recorder)
    return recorder


@pytest.fixture
def inbox(broker, pg_engine, recorder) -> InboxMiddleware:
    middleware = InboxMiddleware(pg_engine, lock_timeout=10)
    broker.add_middleware(middleware)
    return middleware


def claims(pg_engine) -> list[tuple[str, str]]:
    with pg_engine.connect() as conn:
        rows = conn.execute(text("SELECT producer_name, message_id FROM consumer_inbox"))
        return sorted(tuple(row) for row in rows)


def queued(broker, queue) -> int:
    return _depth(broker, queue) + _depth(broker, f"{queue}.XQ")


def test_producer__a_duplicate_plain_send_is_skipped(broker, queue, pg_engine, inbox, recorder):
    # Given an actor whose first argument is the intent id, and a producer stamping it
    broker.add_middleware(StampIdentity("shop"))

    @dramatiq.actor(
        queue_name=queue,
        inbox_consumer="billing",
        inbox_producer="orders",
        inbox_message_id_from="order_id",
    )
    def add_credit(order_id: str, account_id: int, delta: int) -> None:
        apply_credit(dramatiq_session(), "billing", account_id, delta)

    with running_worker(broker) as worker:
        # When the producer sends the same intent twice, with plain send() calls
        first = add_credit.send("ord-1", 7, 10)
        drain(broker, queue, worker)
        again = add_credit.send(order_id="ord-1", account_id=7, delta=10)
        drain(broker, queue, worker)

    # Then the options carried the identity, and the second copy was skipped
    assert first.options["inbox_message_id"] == again.options["inbox_message_id"] == "ord-1"
    assert again.options["inbox_producer"] == "orders"  # the actor's, over the middleware's
    assert again.message_id in recorder.skipped
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
    assert claims(pg_engine) == [("orders", "ord-1")]


def test_producer__a_send_with_no_id_is_refused_at_the_producer(broker, queue, inbox):
    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", inbox_producer="orders",
                    inbox_message_id_from="order_id")  # fmt: skip
    def add_credit(account_id: int, delta: int, order_id: str | None = None) -> None: ...

    @dramatiq.actor(queue_name=queue, inbox_consumer="refunds")
    def refund(account_id: int, ref: str | None = None) -> None: ...

    broker.add_middleware(StampIdentity("shop", lambda m: m.kwargs.get("ref"), actors={"refund"}))
    with pytest.raises(IdentityRefused, match="has no argument 'order_id'") as info:
        add_credit.send(7, 10)  # the id argument left out
    assert "refusing to send add_credit message" in str(info.value)
    with pytest.raises(IdentityRefused, match="found no id in the message"):
        refund.send(7)
    with pytest.raises(IdentityRefused, match="is a float"):
        add_credit.send(7, 10, order_id=1.5)
    with pytest.raises(IdentityRefused, match="control characters"):
        add_credit.send(7, 10, order_id="bad\nid")
    assert queued(broker, queue) == 0  # nothing reached the broker


def test_producer__ids_from_dramatiqs_own_message_id_are_refused(broker, queue, inbox):
    broker.add_middleware(
        StampIdentity("shop", lambda message: f"m-{message.message_id}", queues={queue})
    )

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None: ...

    with pytest.raises(IdentityRefused, match="Dramatiq's own message_id"):
        add_credit.send(7, 10)
    assert queued(broker, queue) == 0


def test_producer__an_identity_already_sent_is_never_overwritten_and_survives_retries(
    broker, queue, pg_engine, inbox
):
    # Given a producer that derives ids from a function, for one queue
    broker.add_middleware(
        StampIdentity("shop", lambda m: f"credit-{m.args[0]}-{m.args[1]}", queues={queue})
    )
    attempts: list[int] = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=3)
    def add_credit(account_id: int, delta: int) -> None:
        attempts.append(account_id)
        if len(attempts) == 1:
            raise RuntimeError("the first attempt fails: Retries re-enqueues it")
        apply_credit(dramatiq_session(), "billing", account_id, delta)

    with running_worker(broker) as worker:
        explicit = add_credit.send_with_options(
            args=(8, 5), **identity(producer="orders", message_id="ord-8")
        )
        drain(broker, queue, worker)
        stamped = add_credit.send(9, 5)
        add_credit.send(9, 5)  # the same intent again: the same derived id
        drain(broker, queue, worker)

    assert (explicit.options["inbox_producer"], explicit.options["inbox_message_id"]) == (
        "orders",
        "ord-8",
    )
    assert stamped.options["inbox_message_id"] == "credit-9-5"
    assert claims(pg_engine) == [("orders", "ord-8"), ("shop", "credit-9-5")]
    with pg_engine.connect() as conn:
        assert (balance(conn, 8), balance(conn, 9), effects(conn, 9)) == (5, 5, 1)


def test_consumer__the_identity_argument_needs_no_producer_middleware(
    broker, queue, pg_engine, inbox, recorder
):
    # Given a producer with no identity middleware at all
    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", inbox_producer="orders",
                    inbox_message_id_from="order_id")  # fmt: skip
    def add_credit(order_id: int, account_id: int, delta: int) -> None:
        apply_credit(dramatiq_session(), "billing", account_id, delta)

    with running_worker(broker) as worker:
        add_credit.send(42, 7, 10)
        drain(broker, queue, worker)
        again = add_credit.send(42, 7, 10)
        drain(broker, queue, worker)

    # Then the worker read the identity from the argument (an int, as its digits)
    assert "inbox_message_id" not in again.options
    assert again.message_id in recorder.skipped
    assert claims(pg_engine) == [("orders", "42")]
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"inbox_message_id_from": "order_id"}, "without inbox_producer"),
        ({"inbox_producer": "orders", "inbox_message_id_from": "nope"}, "not a named parameter"),
        ({"inbox_producer": "orders", "inbox_message_id_from": "rest"}, "not a named parameter"),
        ({"inbox_producer": " orders", "inbox_message_id_from": "order_id"}, "white space"),
    ],
)
def test_declaration__identity_options_are_validated_when_the_actor_is_declared(
    stub_broker, pg_engine, options, reason
):
    stub_broker.add_middleware(InboxMiddleware(pg_engine))
    with pytest.raises(ActorConfigurationError, match=reason):

        @dramatiq.actor(inbox_consumer="billing", **options)
        def add_credit(order_id: str, *rest: int) -> None: ...


def dramatiq_session():
    from inbox_middleware.dramatiq import current_session

    return current_session()
