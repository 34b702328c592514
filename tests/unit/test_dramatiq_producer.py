"""StampIdentity's choices, on Dramatiq's stub broker (what reaches the broker is checked
with real workers in tests/integration/test_dramatiq_producer.py)."""

from __future__ import annotations

import dramatiq
import pytest
from dramatiq import Message
from dramatiq.brokers.stub import StubBroker

from inbox_middleware._core.exceptions import ConfigurationError, MissingIdentity
from inbox_middleware.dramatiq import IdentityRefused, StampIdentity
from inbox_middleware.dramatiq._payload import ActorIdentity, actor_identity
from inbox_middleware.dramatiq._producer import StampConfigurationError


@pytest.fixture
def broker():
    broker = StubBroker()
    dramatiq.set_broker(broker)
    yield broker
    broker.close()


def sent(broker: StubBroker, queue: str = "default") -> list[dict]:
    return [Message.decode(m).options for m in list(broker.queues[queue].queue)]


def test_stamp__a_chosen_queue_is_stamped_also_when_delayed(broker):
    broker.add_middleware(StampIdentity("shop", "order_id", queues={"default"}, tenant="eu"))

    @dramatiq.actor
    def ship(order_id: str) -> None: ...

    ship.send("o-1")
    ship.send_with_options(args=("o-2",), delay=60_000)
    (options,) = sent(broker)
    assert (options["inbox_producer"], options["inbox_message_id"], options["inbox_tenant"]) == (
        "shop",
        "o-1",
        "eu",
    )
    (delayed,) = sent(broker, "default.DQ")
    assert delayed["inbox_message_id"] == "o-2"


def test_stamp__actors_declared_before_the_middleware_and_unchosen_ones(broker):
    @dramatiq.actor
    def ship(order_id: str) -> None: ...

    @dramatiq.actor
    def other(order_id: str) -> None: ...

    broker.add_middleware(StampIdentity("shop", "order_id", actors={"ship"}))
    ship.send("o-1")
    other.send("o-1")
    assert [options.get("inbox_message_id") for options in sent(broker)] == ["o-1", None]


def test_stamp__a_message_sent_by_name_to_an_undeclared_actor(broker):
    broker.add_middleware(StampIdentity("shop", "order_id", actors={"remote"}))
    broker.declare_queue("default")
    message = Message(queue_name="default", actor_name="remote", args=(), kwargs={}, options={})
    broker.enqueue(message.copy(kwargs={"order_id": "o-9"}))
    assert sent(broker)[0]["inbox_message_id"] == "o-9"
    with pytest.raises(IdentityRefused, match="no argument 'order_id'"):
        broker.enqueue(message.copy(args=("o-9",)))  # positional: no signature to bind


def test_stamp__an_explicit_identity_is_kept_and_the_producer_filled_in(broker):
    broker.add_middleware(StampIdentity("shop", lambda m: "computed", actors={"ship"}))

    @dramatiq.actor
    def ship(order_id: str) -> None: ...

    ship.send_with_options(args=("o-1",), inbox_message_id="explicit")
    ship.send_with_options(args=("o-1",), inbox_producer="orders", inbox_message_id="x")
    assert [(o["inbox_producer"], o["inbox_message_id"]) for o in sent(broker)] == [
        ("shop", "explicit"),
        ("orders", "x"),
    ]


def test_stamp__a_failing_id_function_refuses_the_send_instead_of_sending_unstamped(broker):
    broker.add_middleware(StampIdentity("shop", lambda m: m.kwargs["order"]["id"], actors={"ship"}))

    @dramatiq.actor
    def ship(order: dict) -> None: ...

    with pytest.raises(IdentityRefused, match="KeyError"):
        ship.send(order={})
    assert sent(broker) == []


def test_stamp__settings_and_declarations_are_checked_early(broker):
    with pytest.raises(ConfigurationError, match="white space"):
        StampIdentity(" shop")
    with pytest.raises(TypeError, match="collection of names"):
        StampIdentity("shop", actors="ship")
    broker.add_middleware(StampIdentity("shop", "order_id", actors={"ship"}))
    with pytest.raises(StampConfigurationError, match="does not have"):

        @dramatiq.actor
        def ship(reference: str) -> None: ...


def test_actor_identity__reads_the_argument_and_lets_the_options_win():
    def add(order_id: int, amount: int) -> None: ...

    source = actor_identity(
        "add", add, {"inbox_producer": "o", "inbox_message_id_from": "order_id"}
    )
    assert source == ActorIdentity("add", "o", "order_id")
    assert source.read({}, lambda: {"order_id": 42}).message_id == "42"
    explicit = source.read({"inbox_message_id": "m", "inbox_producer": "p"}, dict)
    assert (explicit.producer, explicit.message_id) == ("p", "m")
    with pytest.raises(MissingIdentity, match="no argument 'order_id'"):
        source.read({}, dict)
    assert actor_identity("add", add, {}) is None
