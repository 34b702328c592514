"""The start-up check: which subscribers are inbox subscribers, and can the inbox settle
their messages?

It runs before any subscriber starts (`FastStreamInbox.guard` wraps ``broker.start``), so
a subscriber whose messages the inbox could not control is refused before it consumes a
single one: an ACK_FIRST subscriber would have its first message acknowledged before the
inbox could even look at it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from faststream.middlewares import AckPolicy

from ._brokers import BrokerAdapter, Peer, adapter_for
from ._consumer import InboxConsumer, declared_by

__all__ = ["Found", "find", "refusals"]


@dataclass(frozen=True, slots=True)
class Found:
    """A subscriber of the broker, and the inbox consumer its handlers declare (if any)."""

    subscriber: Any
    consumer: InboxConsumer | None
    adapter: BrokerAdapter | None
    problem: str | None = None


def find(broker: Any, owner: object) -> list[Found]:
    """Every subscriber of ``broker``; inbox subscribers are those declaring a consumer of
    ``owner`` (the `FastStreamInbox`)."""
    found = []
    for subscriber in broker.subscribers:
        consumers = [_consumers(call.dependencies, owner) for call in subscriber.calls]
        outer = _consumers(_outer_dependencies(subscriber), owner)
        names = {c.name for group in consumers for c in group}
        if not names and not outer:
            found.append(Found(subscriber, None, None))
            continue
        problem = None
        if outer:
            problem = (
                "inbox.consumer(...) is declared on a router or the broker; declare it on each "
                "subscriber (one consumer name per handler)"
            )
        elif len(names) > 1 or any(not group for group in consumers):
            problem = (
                "its handlers do not all declare the same inbox.consumer(...); give each "
                "handler its own subscriber"
            )
        consumer = next((c for group in consumers for c in group), None) or outer[0]
        try:
            adapter: BrokerAdapter | None = adapter_for(broker, subscriber)
        except Exception as exc:
            adapter, problem = None, problem or str(exc)
        found.append(Found(subscriber, consumer, adapter, problem))
    return found


def refusals(found: Sequence[Found], middleware: object) -> dict[int, str]:
    """Why each refused inbox subscriber is refused, by ``id(subscriber)``."""
    inbox = [f for f in found if f.consumer is not None]
    peers = [Peer(f.adapter, f.consumer.name) for f in inbox if f.adapter and f.consumer]
    handlers: defaultdict[str, set[int]] = defaultdict(set)
    for f in inbox:
        assert f.consumer is not None
        handlers[f.consumer.name] |= {_handler_id(call.handler) for call in f.subscriber.calls}
    refused: dict[int, str] = {}
    for f in inbox:
        assert f.consumer is not None
        problem = f.problem or _refusal(f, peers, middleware)
        if problem is None and len(handlers[f.consumer.name]) > 1:
            problem = (
                f"inbox consumer {f.consumer.name!r} is declared by several handlers; each "
                "handler needs its own consumer name (the same handler may be subscribed "
                "more than once, as a Redis reclaiming subscriber is)"
            )
        if problem is not None:
            refused[id(f.subscriber)] = problem
    return refused


def _refusal(found: Found, peers: Sequence[Peer], middleware: object) -> str | None:
    assert found.consumer is not None
    assert found.adapter is not None
    subscriber = found.subscriber
    if middleware not in tuple(getattr(subscriber, "_broker_middlewares", ())):
        return (
            "the inbox middleware is not on its broker: create the broker with "
            "middlewares=[inbox.middleware]"
        )
    if problem := found.adapter.refusal(found.consumer.name, peers):
        return problem
    policy = subscriber.ack_policy
    if policy is AckPolicy.ACK_FIRST:
        return (
            "AckPolicy.ACK_FIRST acknowledges a message before the inbox commits, so a crash "
            "loses it. Remove ack_policy (the inbox acks after the commit itself)"
        )
    if policy is AckPolicy.MANUAL:
        return (
            "AckPolicy.MANUAL leaves acknowledgement to the handler, but the inbox must ack "
            "only after its commit, and settles every message itself. Remove ack_policy"
        )
    if found.adapter.batch and any(call.handler._publishers for call in subscriber.calls):
        return (
            "a batch subscriber's result belongs to its batch, which a redelivery does not "
            "bring back as it was, so the inbox cannot publish it again for a duplicate. "
            "Record each follow-up message with outbox.add(session, ...) in the handler instead "
            "of a publisher"
        )
    return None


def _handler_id(wrapper: Any) -> int:
    """The function a subscriber calls: one function subscribed twice is one handler."""
    return id(getattr(wrapper, "_declared_call", wrapper))


def _consumers(dependencies: Iterable[Any], owner: object) -> list[InboxConsumer]:
    return [
        dependant.dependency
        for dependant in dependencies
        if declared_by(getattr(dependant, "dependency", None), owner)
    ]


def _outer_dependencies(subscriber: Any) -> Iterable[Any]:
    config = getattr(subscriber, "_outer_config", None)
    return tuple(getattr(config, "broker_dependencies", ()))
