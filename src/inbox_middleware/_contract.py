"""Producer contract checks, for producers' own tests.

The inbox deduplicates on the identity producers put on their messages; when a producer
stops sending one (a refactor drops the ``identity(...)`` call, a new publisher forgets
the headers), every delivery looks new and duplicates slip through silently. These checks
catch that in the producer's test suite::

    def test_place_order_publishes_identified_messages(stub_broker):
        with producer_contract(stub_broker) as contract:
            place_order(order_id=42)
        assert contract.messages  # every one carried a valid identity

    def test_placing_an_order_twice_reuses_its_identity(stub_broker):
        with producer_contract(stub_broker) as contract:
            contract.same_intent(lambda: place_order(order_id=42))

`producer_contract` wraps a Dramatiq broker or a FastStream broker (the real one or its
test broker) for the duration of the block: every message it publishes must carry a
valid producer and message id (Dramatiq: ``inbox_producer`` / ``inbox_message_id``
options; FastStream: ``x-inbox-producer`` / ``x-inbox-message-id`` headers), else the
publish fails with `ContractViolation`, and the block fails at its end too, even if the
code under test swallowed the error. In production the alertable side of the same
contract is the ``inbox_producer_last_identified_timestamp_seconds`` gauge (see the
monitoring guide).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from ._core.exceptions import IdentityError, InboxError
from ._core.identity import MessageIdentity

__all__ = ["ContractViolation", "ProducerContract", "PublishedMessage", "producer_contract"]


class ContractViolation(AssertionError, InboxError):
    """A producer published a message without a valid, stable identity.

    An `AssertionError`, so test runners report it as a failed check.
    """


@dataclass(frozen=True, slots=True)
class PublishedMessage:
    """A message the producer published, with the identity it carried."""

    destination: str
    identity: MessageIdentity
    body: Any


@dataclass
class ProducerContract:
    """What a producer published inside `producer_contract`, checked as it went."""

    destinations: Collection[str] | None = None
    """Only messages to these queues, subjects or streams are checked; None: all."""
    messages: list[PublishedMessage] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def check(self, destination: str, identity: Callable[[], MessageIdentity], body: Any) -> None:
        """Record one published message; raise `ContractViolation` when ``identity()``
        (the framework's own reading of the message's identity) refuses it."""
        if self.destinations is not None and destination not in self.destinations:
            return
        try:
            found = identity()
        except IdentityError as exc:
            problem = f"a message published to {destination!r} has no valid identity: {exc}"
            self.violations.append(problem)
            raise ContractViolation(problem) from None
        self.messages.append(PublishedMessage(destination, found, body))

    def same_intent(self, publish: Callable[[], Any], times: int = 2) -> list[PublishedMessage]:
        """Run ``publish`` (one intent, as a retry would send it again) ``times`` times;
        fail unless every run published the same identities, in the same order.

        Returns the first run's messages.
        """
        runs = []
        for _ in range(times):
            start = len(self.messages)
            publish()
            runs.append(self.messages[start:])
        first = [(m.destination, m.identity.key("")) for m in runs[0]]
        if not first:
            raise ContractViolation("the intent published no message")
        for number, run in enumerate(runs[1:], start=2):
            again = [(m.destination, m.identity.key("")) for m in run]
            if again != first:
                raise ContractViolation(
                    f"publishing the same intent again (run {number}) used other identities: "
                    f"{_show(again)} instead of {_show(first)}; a retry must reuse its id"
                )
        return runs[0]

    def verify(self) -> None:
        if self.violations:
            raise ContractViolation(
                f"{len(self.violations)} message(s) without a valid identity: "
                + "; ".join(self.violations)
            )


def _show(keys: list[tuple[str, tuple[str, str, str, str]]]) -> str:
    return ", ".join(f"{dest}:{key[1]}/{key[3]}" for dest, key in keys) or "nothing"


@contextlib.contextmanager
def producer_contract(
    broker: Any, *, destinations: Collection[str] | None = None
) -> Iterator[ProducerContract]:
    """Check every message ``broker`` publishes inside the block (see the module).

    ``broker``: a Dramatiq broker, or a FastStream broker (also inside ``TestRabbitBroker``
    and the like). ``destinations``: only check messages to these names (a FastStream
    broker also publishes replies, which are not intents).
    """
    contract = ProducerContract(destinations=destinations)
    if _is_dramatiq(broker):
        with _dramatiq(broker, contract):
            yield contract
    elif hasattr(broker, "add_middleware") and hasattr(broker, "config"):
        with _faststream(broker, contract):
            yield contract
    else:
        raise TypeError(f"producer_contract needs a Dramatiq or FastStream broker, not {broker!r}")
    contract.verify()


def _is_dramatiq(broker: Any) -> bool:
    try:
        import dramatiq
    except ImportError:
        return False
    return isinstance(broker, dramatiq.Broker)


@contextlib.contextmanager
def _dramatiq(broker: Any, contract: ProducerContract) -> Iterator[None]:
    from dramatiq.middleware import Middleware, MiddlewareError

    from .dramatiq._payload import identity_options

    class Violation(ContractViolation, MiddlewareError):
        """Raised from a middleware: Dramatiq lets only a MiddlewareError through."""

    class Check(Middleware):
        def before_enqueue(self, broker: Any, message: Any, delay: int) -> None:
            if "retries" in message.options:
                return  # Dramatiq's own retry of a message already checked
            body = (message.args, message.kwargs)
            try:
                contract.check(message.queue_name, lambda: identity_options(message.options), body)
            except ContractViolation as exc:
                raise Violation(str(exc)) from None

    check = Check()
    broker.middleware.append(check)
    try:
        yield
    finally:
        broker.middleware.remove(check)


@contextlib.contextmanager
def _faststream(broker: Any, contract: ProducerContract) -> Iterator[None]:
    from faststream import BaseMiddleware

    from .faststream._payload import headers_identity

    class Check(BaseMiddleware):
        async def publish_scope(self, call_next: Callable[[Any], Any], cmd: Any) -> Any:
            headers = dict(cmd.headers or {})
            contract.check(str(cmd.destination), lambda: headers_identity(headers), cmd.body)
            return await call_next(cmd)

    # Innermost: it sees the headers after any outer middleware (StampIdentity) set them.
    broker.add_middleware(Check)
    config = broker.config
    try:
        yield
    finally:
        for part in getattr(config, "configs", (config,)):
            kept = tuple(m for m in part.broker_middlewares if m is not Check)
            if len(kept) != len(part.broker_middlewares):
                part.broker_middlewares = kept
