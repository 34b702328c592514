"""The FastStream half of the users' pytest plugin (`inbox_middleware.testing`): runs a
broker's inbox subscriber under the scenarios, on a test broker or a real, started one."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._core.exceptions import ConfigurationError
from .._core.identity import MessageIdentity
from .._operate.harness import (
    CONCURRENT,
    CRASH,
    REDELIVERED,
    ROLLED_BACK,
    Effect,
    Hold,
    Rollback,
    RolledBackByCheck,
    ScenarioResult,
    Tally,
    Wave,
    fresh,
    intent_name,
    refuse_sqlite,
    rollback_at_commit,
    timed_out,
)
from .._storage import InboxSchema
from .._storage.inspection import claim_queries

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["FastStreamCheck", "FastStreamMessage"]


@dataclass(frozen=True)
class FastStreamMessage:
    """A body and identity headers, and where to publish them."""

    body: Any
    headers: Mapping[str, str]
    publish: Mapping[str, Any]
    """Keyword arguments for ``broker.publish`` naming the destination (``queue=...``,
    ``stream=...``, ``subject=...``) and anything else it needs."""

    @property
    def identity(self) -> MessageIdentity:
        from ._payload import headers_identity

        return headers_identity(self.headers)


class FastStreamCheck:
    """Runs a FastStream broker's inbox subscriber under the scenarios; see the module."""

    def __init__(
        self,
        broker: Any,
        effect: Effect,
        *,
        inbox: Any = None,
        hold: float = 0.2,
        timeout: float = 30.0,
    ) -> None:
        from ._middleware import InboxMiddlewareFactory

        self.broker, self.effect = broker, effect
        self.hold, self.timeout = hold, timeout
        if inbox is None:
            factories = [
                m for m in broker.config.broker_middlewares if isinstance(m, InboxMiddlewareFactory)
            ]
            if not factories:
                raise ConfigurationError(
                    "the broker has no inbox middleware: create it with "
                    "middlewares=[inbox.middleware]"
                )
            inbox = factories[0].inbox
        self.inbox = inbox
        self.naming: InboxSchema = inbox.storage.naming
        self.async_engine: AsyncEngine = inbox.storage.engine

    def message(
        self,
        body: Any,
        *,
        producer: str,
        message_id: str,
        tenant: str | None = None,
        headers: Mapping[str, str] | None = None,
        **publish: Any,
    ) -> FastStreamMessage:
        """A message with identity headers; ``publish`` names its destination as
        ``broker.publish`` wants it (``queue="orders"``, ``stream="orders"``, ...)."""
        from ._payload import identity_headers

        stamped = identity_headers(producer=producer, message_id=message_id, tenant=tenant)
        return FastStreamMessage(body, {**(headers or {}), **stamped}, publish)

    async def redelivered(self, message: FastStreamMessage, times: int = 3) -> ScenarioResult:
        return await self._run(REDELIVERED, message, [1] * times)

    async def crash_between_commit_and_ack(self, message: FastStreamMessage) -> ScenarioResult:
        return await self._run(CRASH, message, [1, 1])

    async def rolled_back(self, message: FastStreamMessage) -> ScenarioResult:
        """The subscriber runs and writes, then the inbox's transaction rolls back instead
        of committing (a failed COMMIT, a worker dead before it); then the intent is
        delivered again (by a real broker's redelivery, or published again on a test
        broker, which does not redeliver). Nothing the first attempt wrote may survive: a
        subscriber writing through a session of its own fails here."""
        return await self._run(ROLLED_BACK, message, [1])

    async def concurrent_duplicates(
        self, message: FastStreamMessage, copies: int = 8
    ) -> ScenarioResult:
        refuse_sqlite(self.async_engine.sync_engine)
        return await self._run(CONCURRENT, message, [copies])

    # -- running -------------------------------------------------------------------------

    async def _run(
        self, scenario: str, message: FastStreamMessage, waves: list[int]
    ) -> ScenarioResult:
        # One deadline bounds the whole scenario: the publishes (a test broker runs the
        # subscriber inside them), and the wait for a real broker's redeliveries.
        deadline = time.monotonic() + self.timeout
        await self.inbox.check(self.broker)  # what inbox.guard(broker) runs at start-up
        identity = message.identity
        claims, quarantined, poisoned = claim_queries(self.naming, identity, None)
        fresh(await self._count(claims), identity)
        before = await _call(self.effect)
        conflicts_before = await self._count(quarantined)
        poison_before = await self._count(poisoned)
        hold = Hold(self.async_engine.sync_engine, self.hold, asynchronous=True)
        tally, unsettled, waves = Tally(), 0, list(waves)
        with contextlib.ExitStack() as stack:
            recorder = stack.enter_context(self._recording(identity))
            if scenario == CONCURRENT:
                stack.enter_context(hold.installed())
            if scenario == ROLLED_BACK:  # once: the first attempt to reach its commit
                probe = stack.enter_context(rollback_at_commit(identity.message_id))
                effect = self.effect

                async def measure() -> float:
                    return await _call(effect) - before

                recorder.rollback = (probe, measure, deadline)
            for number, size in enumerate(waves, start=1):
                outcomes = recorder.current = Wave(None, size)
                wave = f"(wave {number} of {len(waves)})"
                running = await self._publish(message, outcomes, deadline)
                if running:
                    tally.add(outcomes)
                    problem = timed_out(
                        scenario,
                        identity,
                        waves,
                        tally,
                        timeout=self.timeout,
                        ending="so its deliveries were cancelled",
                        pending=[f"{_deliveries(running)} still running in the subscriber {wave}"],
                    )
                    raise AssertionError(problem)
                left = await self._settle(outcomes, deadline)
                if left and time.monotonic() > deadline:  # a real broker redelivering it
                    tally.add(outcomes)
                    problem = timed_out(
                        scenario,
                        identity,
                        waves,
                        tally,
                        timeout=self.timeout,
                        ending="the broker may still redeliver it",
                        pending=[f"{_deliveries(left)} not settled {wave}"],
                    )
                    raise AssertionError(problem)
                if scenario == ROLLED_BACK and number == 1 and left and outcomes.failures:
                    waves.append(1)  # a test broker: deliver it again, as a broker would
                    left = 0
                unsettled += left
                recorder.current = None
                tally.add(outcomes)
        conflicts = await self._count(quarantined) - conflicts_before
        poison = await self._count(poisoned) - poison_before
        failures = [f for f in tally.failures if f != RolledBackByCheck.__name__]
        rolled_back = len(tally.failures) - len(failures)
        deliveries = sum(waves)
        if scenario == ROLLED_BACK:  # every attempt: the broker's redeliveries too
            deliveries = tally.processed + tally.skipped + len(tally.failures)
        return ScenarioResult(
            scenario=scenario,
            intent=intent_name(identity),
            deliveries=deliveries,
            processed=tally.processed,
            duplicates=tally.skipped - conflicts - poison,
            conflicts=conflicts,
            poison=poison,
            failures=tuple(failures),
            claims=await self._count(claims),
            effect=await _call(self.effect) - before,
            overlapped=tally.overlapped(hold.first_done),
            unsettled=unsettled,
            rolled_back=rolled_back,
            survived=recorder.rollback[0].survived if recorder.rollback else 0,
        )

    async def _publish(self, message: FastStreamMessage, outcomes: Wave, deadline: float) -> int:
        """Publish the wave's copies of the message; how many deliveries were still running
        at ``deadline`` (then cancelled): a test broker runs the subscriber inside them."""
        publish = [
            self.broker.publish(message.body, headers=dict(message.headers), **message.publish)
            for _ in range(outcomes.size)
        ]
        sent = asyncio.ensure_future(asyncio.gather(*publish, return_exceptions=True))
        done, _ = await asyncio.wait({sent}, timeout=max(deadline - time.monotonic(), 0))
        if not done:
            running = outcomes.size - outcomes.final - len(outcomes.failures)
            sent.cancel()
            with contextlib.suppress(BaseException):
                await sent
            return max(running, 1)
        for raised in sent.result():
            # A test broker raises the subscriber's failure from publish; the check's own
            # rollback is expected, anything else is the test's to see.
            if isinstance(raised, BaseException) and not isinstance(raised, RolledBackByCheck):
                raise raised
        return 0

    async def _settle(self, outcomes: Wave, deadline: float) -> int:
        """Wait until every delivery of the wave was processed or skipped, at most until
        ``deadline``; how many were not. A failed one is redelivered by a real broker; a
        test broker never redelivers, so once every delivery has some outcome and none
        arrives for a second, it is over."""
        quiet_since, seen = time.monotonic(), -1
        while outcomes.final < outcomes.size:
            count = outcomes.final + len(outcomes.failures)
            if count != seen:
                seen, quiet_since = count, time.monotonic()
            elif count >= outcomes.size and time.monotonic() - quiet_since > 1:
                break
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        return outcomes.size - outcomes.final

    async def _count(self, query: Any) -> int:
        async with self.async_engine.connect() as conn:
            return int((await conn.execute(query)).scalar_one())

    @contextlib.contextmanager
    def _recording(self, identity: MessageIdentity) -> Iterator[Any]:
        recorder = _FastStreamRecorder(identity)
        middleware = recorder.middleware()
        self.broker.insert_middleware(middleware)  # outermost: it sees skipped ones too
        try:
            yield recorder
        finally:
            config = self.broker.config
            for part in getattr(config, "configs", (config,)):
                kept = tuple(m for m in part.broker_middlewares if m is not middleware)
                if len(kept) != len(part.broker_middlewares):
                    part.broker_middlewares = kept


class _FastStreamRecorder:
    """Reports the outcomes of the deliveries that carry the scenario's intent."""

    def __init__(self, identity: MessageIdentity) -> None:
        self.identity = identity
        self.current: Wave | None = None
        self.rollback: tuple[Rollback, Callable[[], Awaitable[float]], float] | None = None
        """The rolled-back scenario's probe, its measure of the effect, the deadline."""

    def ours(self, headers: Mapping[str, Any]) -> bool:
        from ._payload import headers_identity

        try:
            return headers_identity(headers).key("") == self.identity.key("")
        except Exception:
            return False

    async def measured(self) -> None:
        """Hold a redelivery until the rolled-back attempt's effect was measured."""
        if self.rollback is None:
            return
        probe, _, deadline = self.rollback
        while probe.owes_measure() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def measure(self) -> str | None:
        """After an attempt: if it was the one rolled back, measure what survived it (a
        write outside the inbox's transaction) and say so."""
        if self.rollback is None or not self.rollback[0].owes_measure():
            return None
        probe, measure, _ = self.rollback
        probe.survived = await measure()
        probe.measured.set()
        return RolledBackByCheck.__name__

    def middleware(self) -> Any:
        from faststream import BaseMiddleware
        from faststream.exceptions import AckMessage

        recorder = self

        class Recorder(BaseMiddleware):
            async def consume_scope(self, call_next: Any, msg: Any) -> Any:
                outcomes = recorder.current
                if outcomes is None or not recorder.ours(msg.headers or {}):
                    return await call_next(msg)
                await recorder.measured()  # a redelivery waits for the measure
                outcomes.begin()
                try:
                    result = await call_next(msg)
                except AckMessage:
                    outcomes.end("skipped")
                    raise
                except BaseException as exc:
                    rolled = await recorder.measure()
                    outcomes.end(rolled or type(exc).__name__, final=False)
                    raise
                rolled = await recorder.measure()
                outcomes.end(rolled or "processed", final=not rolled)
                return result

        return Recorder


def _deliveries(count: int) -> str:
    return f"{count} delivery" if count == 1 else f"{count} deliveries"


async def _call(effect: Effect) -> float:
    value = effect()
    if inspect.isawaitable(value):
        value = await value
    return float(value)
