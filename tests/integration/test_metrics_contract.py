"""Producer contract checks: a producer's tests fail when a published message has no
valid identity, or when sending one intent again does not reuse its id."""

from __future__ import annotations

import contextlib
import importlib.util
import uuid
from pathlib import Path

import dramatiq
import pytest
from faststream.rabbit import RabbitBroker, TestRabbitBroker

from inbox_middleware._contract import ContractViolation, producer_contract
from inbox_middleware.dramatiq import identity
from inbox_middleware.faststream import StampIdentity, identity_headers

SNIPPET = Path(__file__).resolve().parents[2] / "docs" / "snippets" / "monitoring_contract.py"


def load_snippet():
    spec = importlib.util.spec_from_file_location("monitoring_contract", SNIPPET)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def charge(stub_broker):
    @dramatiq.actor(broker=stub_broker, queue_name="payments")
    def charge(order_id: int, amount: int) -> None: ...

    return charge


def test_contract__documented_producer_test_passes(stub_broker, charge):
    load_snippet().test_place_order_sends_a_stable_identity(stub_broker, charge)


def test_contract__dramatiq_message_without_identity_fails_the_test(stub_broker, charge):
    with (
        pytest.raises(ContractViolation, match="has no inbox_producer"),
        producer_contract(stub_broker) as contract,
    ):
        charge.send(1, 10)
    assert contract.violations and not contract.messages
    # The check is gone once the block ends
    charge.send(2, 10)


def test_contract__fails_at_the_end_even_if_the_producer_swallowed_the_error(stub_broker, charge):
    with (
        pytest.raises(ContractViolation, match="1 message"),
        producer_contract(stub_broker),
        contextlib.suppress(ContractViolation),  # a producer that logs and carries on
    ):
        charge.send_with_options(args=(1, 10), inbox_producer="shop")


def test_contract__an_id_per_send_is_not_an_intent_id(stub_broker, charge):
    def place_order() -> None:
        charge.send_with_options(
            args=(1, 10), **identity(producer="shop", message_id=str(uuid.uuid4()))
        )

    with (
        producer_contract(stub_broker) as contract,
        pytest.raises(ContractViolation, match="a retry must reuse its id"),
    ):
        contract.same_intent(place_order)


async def test_contract__faststream_publisher_is_checked():
    broker = RabbitBroker(
        middlewares=[
            StampIdentity("shop", lambda body: f"order-{body['id']}", destinations={"orders"})
        ]
    )
    for queue in ("orders", "audit", "elsewhere"):  # the test broker needs a subscriber
        broker.subscriber(queue)(_ignore)
    async with TestRabbitBroker(broker) as test_broker:
        with producer_contract(test_broker, destinations={"orders", "audit"}) as contract:
            await test_broker.publish({"id": 7}, "orders")  # stamped by StampIdentity
            await test_broker.publish(
                {"id": 8}, "audit", headers=identity_headers(producer="shop", message_id="a-8")
            )
            await test_broker.publish({"free": True}, "elsewhere")  # not checked
        assert [(m.destination, m.identity.message_id) for m in contract.messages] == [
            ("orders", "order-7"),
            ("audit", "a-8"),
        ]
        with (
            pytest.raises(ContractViolation, match="'audit' has no valid identity"),
            producer_contract(test_broker, destinations={"audit"}),
        ):
            await test_broker.publish({"id": 9}, "audit")
        # Outside the block, publishing is not checked any more
        await test_broker.publish({"id": 10}, "audit")


async def _ignore(body: object) -> None:
    return None
