"""The consumption core's dead letters, with a scripted ``perform``: no services."""

from __future__ import annotations

from typing import Any

from inbox_middleware._core.consumption import (
    Arrival,
    DeadLettered,
    Op,
    Publish,
    Route,
    drive,
    settle_steps,
)
from inbox_middleware._core.identity import MissingIdentity
from inbox_middleware._core.policy import ConsumerPolicy


def test_rejection__missing_identity_names_the_declared_consumer_and_source() -> None:
    # Given a message without identity, delivered to the consumer "billing" from "orders"
    arrival = Arrival(
        None, MissingIdentity("no x-inbox-producer"), declared_consumer="billing", source="orders"
    )
    published: list[Op] = []

    def perform(op: Op) -> Any:
        published.append(op)

    # When the core settles it under the default policy (reject)
    settlement = drive(settle_steps(arrival, ConsumerPolicy()), perform)

    # Then it is dead-lettered, and the dead letter names the consumer and the source
    assert isinstance(settlement, DeadLettered)
    (publish,) = published
    assert isinstance(publish, Publish)
    assert publish.route is Route.DEAD_LETTER
    assert publish.details["consumer"] == "billing"
    assert publish.details["source"] == "orders"
    assert arrival.consumer == "billing"
