"""`FastStreamInbox`: the settings, the broker middleware, the subscriber dependency and
the start-up check, in one object.

```python
inbox = FastStreamInbox(async_engine)
broker = RabbitBroker(url, middlewares=[inbox.middleware])
app = FastStream(inbox.guard(broker))

@broker.subscriber("orders", dependencies=[inbox.consumer("billing", handler_version="3")])
async def handle(order: Order, session: InboxSession) -> None: ...
```
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

from fast_depends import Depends
from sqlalchemy.ext.asyncio import AsyncEngine

from .._core import faults, logs
from .._core.consumption import HandBackDelays
from .._core.exceptions import ConfigurationError, DatabaseUnavailable
from .._core.identity import MAX_NAME_LENGTH, validate_name
from .._core.policy import SETTINGS, ConsumerPolicy, PolicySettings
from .._core.tenancy import DatabasePatience, Router
from .._observe.tracing import tracing_for
from .._operate.tally import (
    DEFAULT_COUNT_INTERVAL,
    AsyncCountFlusher,
    AsyncRoutedCountFlusher,
    check_interval,
)
from .._storage import InboxSchema
from .._storage.executors import DEFAULT_LOCK_TIMEOUT, DEFAULT_SERIALIZATION_RETRIES
from .._storage.routed import DEFAULT_CONNECTION_BUDGET, DEFAULT_POOL_SIZE, AsyncRoutedInbox
from .._storage.startup import DEFAULT_STARTUP_PATIENCE, StartupPatience, validate_patience
from ._boot import refuse_start, watch_supervisor
from ._brokers import adapter_for
from ._brokers.nats import NatsAdapter
from ._consumer import UNSET, InboxConsumer, _Unset
from ._guard import Found, find, refusals
from ._middleware import InboxMiddlewareFactory
from ._payload import CanonicalForm
from ._processing import Subscription
from ._telling import NackForRedelivery
from ._testbroker import guard_test_broker, guarded

if TYPE_CHECKING:
    from .._storage.aio import AsyncInbox

__all__ = ["FastStreamInbox"]

logger = logging.getLogger("inbox_middleware.faststream")

_MARK = "__inbox_guarded__"

B = TypeVar("B")


class FastStreamInbox:
    """Deduplicates the messages of every subscriber that declares ``inbox.consumer(...)``.

    Parameters:
      engine: the `AsyncEngine` (asyncpg) holding your tables and the inbox tables.
      naming: schema and table prefix of the inbox tables.
      lock_timeout: seconds a delivery waits on a concurrent delivery's claim before it is
        handed back (and the bound on any lock wait inside the transaction).
      serialization_retries: in-process reruns after a serialization failure or deadlock.
      claims: the claims table, ``"library"`` or ``"compact"`` (about 120 bytes a
        remembered message; see `Inbox` and the guide on the compact claim).
      quarantine: where conflicting messages are published; ``{source}`` is the queue,
        stream, subject or topic they came from.
      dead_letter: where messages without a usable identity (or rejected by the handler)
        are published, with the reason; None uses the broker's own dead-letter path
        (RabbitMQ: reject without requeue, to the queue's dead-letter exchange; NATS:
        TERM). Redis and Kafka have none.
      canonical_form: a `CanonicalForm` used to hash payloads instead of the body.
      check_database: check the schema and ``synchronous_commit`` at start-up.
      startup_patience: seconds the start-up check of a guarded broker waits out a
        database that does not answer yet, or a schema not migrated yet, before the app
        refuses to start (0: refuse at once); nothing is consumed meanwhile. A
        configuration error refuses at once.
      tracing: an OpenTelemetry span for every delivery (extra ``otel``): True for the
        global tracer provider, or a ``TracerProvider``; see `inbox_middleware._observe.tracing`.
        It nests under the span of FastStream's `TelemetryMiddleware` when that middleware
        comes before ``inbox.middleware``, else under the producer's context in the headers.
      count_interval: seconds between two writes of the process's settlement counts to
        ``inbox_counts`` (what ``inbox-middleware status`` shows), from when the start-up
        check runs until the guarded broker stops; None: not written.
      policy: the consumer settings (`ConsumerPolicy`: missing identities, attempts,
        redeliveries, retention, shadow mode, the hand-back backoff, outputs, direct
        publishes), documented there once.
      **settings: any `ConsumerPolicy` setting by name, changing ``policy``
        (``max_attempts=5``, ``shadow=True``).
      router: instead of ``engine``, a `DatabaseMap` (or `MapFile`): each delivery is
        claimed and handled in the database of its tenant (docs/how-to/many-databases.md);
        ``pool_size`` connections per open database, ``connection_budget`` over all of them
        (`inbox_middleware._storage.routed`), and ``patience`` (`DatabasePatience`: the
        connect timeout, the pauses of a database that is down, the wait for a busy one).

    The consumer name and handler version come from ``inbox.consumer(...)``, which also
    overrides any consumer setting for its subscriber.
    """

    def __init__(
        self,
        engine: AsyncEngine | None = None,
        *,
        naming: InboxSchema | None = None,
        lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT,
        serialization_retries: int = DEFAULT_SERIALIZATION_RETRIES,
        claims: str = "library",
        quarantine: str = "{source}.quarantine",
        dead_letter: str | None = "{source}.dead-letter",
        canonical_form: CanonicalForm | None = None,
        check_database: bool = True,
        startup_patience: float = DEFAULT_STARTUP_PATIENCE,
        tracing: Any = False,
        count_interval: float | None = DEFAULT_COUNT_INTERVAL,
        policy: ConsumerPolicy | None = None,
        router: Router | None = None,
        pool_size: int = DEFAULT_POOL_SIZE,
        connection_budget: int = DEFAULT_CONNECTION_BUDGET,
        patience: DatabasePatience | None = None,
        **settings: Unpack[PolicySettings],
    ) -> None:
        from .._storage.aio import AsyncInbox  # SQLAlchemy's asyncio extra, on demand

        if (engine is None) == (router is None):
            raise ConfigurationError("give FastStreamInbox an AsyncEngine or a router")
        if patience is not None and router is None:
            raise ConfigurationError("patience is for a router (a DatabaseMap): give one")
        self.storage: AsyncInbox | AsyncRoutedInbox
        if router is not None:
            self.storage = AsyncRoutedInbox(
                router,
                naming=naming,
                lock_timeout=lock_timeout,
                serialization_retries=serialization_retries,
                claims=claims,
                pool_size=pool_size,
                connection_budget=connection_budget,
                **(patience or DatabasePatience()).options(),
            )
        else:
            assert engine is not None
            self.storage = AsyncInbox(
                engine,
                naming=naming,
                lock_timeout=lock_timeout,
                serialization_retries=serialization_retries,
                claims=claims,
            )
        self.policy = (policy or ConsumerPolicy()).override(**settings)
        self.quarantine = quarantine
        self.dead_letter = dead_letter
        self.canonical_form = canonical_form
        self.check_database = check_database
        self.startup_patience = validate_patience(startup_patience)
        # Delays of the messages of a refused subscriber, held back.
        self.backoff = HandBackDelays(*self.policy.retry_backoff)
        self.tracing = tracing_for(tracing)
        self.counts: AsyncCountFlusher | None = None
        interval = check_interval(count_interval)
        if engine is not None and interval is not None:  # one database: counts there
            self.counts = AsyncCountFlusher.for_engine(engine, self.storage.naming, interval)
        elif interval is not None:  # many databases: each one's counts there
            self.counts = AsyncRoutedCountFlusher.for_routed(self.storage, interval)
        self.middleware = InboxMiddlewareFactory(self)
        """The broker middleware: ``RabbitBroker(url, middlewares=[inbox.middleware])``."""
        # Verdicts by subscriber object, forgotten with it: FastStream keeps a broker's
        # subscribers in a WeakSet, so a dropped dynamic subscriber's id can come back as
        # a new subscriber's, which must not inherit its verdict.
        self._subscriptions: weakref.WeakKeyDictionary[Any, Subscription | None] = (
            weakref.WeakKeyDictionary()
        )
        self._refused: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        # Subscriptions whose start-up check has not passed yet (the database's trouble):
        # their messages are handed back through them, each with its own delays.
        self._waiting: weakref.WeakKeyDictionary[Any, Subscription] = weakref.WeakKeyDictionary()
        self._warned = False
        self._lock = asyncio.Lock()
        self._database_checked = False

    if not TYPE_CHECKING:  # hidden from mypy, which would accept any attribute then

        def __getattr__(self, name: str) -> Any:
            # The consumer settings read as attributes (inbox.max_attempts): the policy's.
            if name in SETTINGS:
                return getattr(self.policy, name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def consumer(
        self,
        name: str,
        handler_version: str = "",
        *,
        canonical_form: CanonicalForm | None = None,
        quarantine: str | None = None,
        dead_letter: str | _Unset | None = UNSET,
        **settings: Unpack[PolicySettings],
    ) -> Any:
        """A subscriber dependency naming the handler's inbox consumer::

            @broker.subscriber("orders", dependencies=[inbox.consumer("billing", "3")])

        One name per handler; the handler version is recorded with every claim.

        Parameters:
          name: the consumer's name in the inbox key; keep it when code moves.
          handler_version: recorded with each claim, compared on replays and in
            quarantine decisions.
          canonical_form: overrides the inbox's setting for this subscriber.
          quarantine: overrides the inbox's setting for this subscriber.
          dead_letter: overrides the inbox's setting for this subscriber; None uses the
            broker's own dead-letter path here.
          **settings: any `ConsumerPolicy` setting, for this subscriber alone
            (``shadow=True``, ``max_attempts=3``, ``missing_identity="broker_id"``).
        """
        try:
            validate_name(name, "consumer name", max_length=MAX_NAME_LENGTH)
        except Exception as exc:
            raise ConfigurationError(str(exc)) from None
        self.policy.override(**settings)  # a setting that cannot work fails here
        declaration = InboxConsumer(
            self, name, str(handler_version), canonical_form, quarantine, dead_letter, settings
        )
        return Depends(declaration, cast=False)

    def guard(self, broker: B) -> B:
        """Run `check` whenever ``broker`` starts, before any of its subscribers does, and
        again before a subscriber added later starts (``await subscriber.start()`` on a
        running broker), so none consumes a message unchecked.

        Returns the broker: ``app = FastStream(inbox.guard(broker))``.
        """
        start = broker.start  # type: ignore[attr-defined]
        if getattr(start, _MARK, None) is self:
            return broker

        async def guarded_start(*args: Any, **kwargs: Any) -> Any:
            for subscriber in broker.subscribers:  # type: ignore[attr-defined]
                self._watch(broker, subscriber)  # those of routers included since
            try:
                async with self._lock:
                    await self._check(broker, patience=self.startup_patience)
            except Exception as exc:
                refuse_start(exc)  # under faststream run, uvicorn, ...: one block, exit 3
                raise
            return await start(*args, **kwargs)

        setattr(guarded_start, _MARK, self)
        broker.start = guarded_start  # type: ignore[attr-defined]
        stop = broker.stop  # type: ignore[attr-defined]

        async def guarded_stop(*args: Any, **kwargs: Any) -> Any:
            try:
                return await stop(*args, **kwargs)
            finally:
                if self.counts:  # the last flush, once the subscribers stopped
                    await self.counts.stop()

        broker.stop = guarded_stop  # type: ignore[attr-defined]
        declare = broker.subscriber  # type: ignore[attr-defined]

        def subscriber(*args: Any, **kwargs: Any) -> Any:
            return self._watch(broker, declare(*args, **kwargs))

        broker.subscriber = subscriber  # type: ignore[attr-defined]
        include = broker.include_router  # type: ignore[attr-defined]

        def include_router(*args: Any, **kwargs: Any) -> Any:
            included = include(*args, **kwargs)
            for added in broker.subscribers:  # type: ignore[attr-defined]
                self._watch(broker, added)
            return included

        broker.include_router = include_router  # type: ignore[attr-defined]
        for existing in broker.subscribers:  # type: ignore[attr-defined]
            self._watch(broker, existing)
        guard_test_broker(self, broker)
        watch_supervisor()
        return broker

    def _watch(self, broker: Any, subscriber: Any) -> Any:
        """Check ``subscriber`` when it starts, unless the start-up check saw it already:
        a subscriber added to a running broker is refused before it consumes."""
        start = subscriber.start
        if getattr(start, _MARK, None) is self:
            return subscriber

        async def checked_start(*args: Any, **kwargs: Any) -> Any:
            if subscriber not in self._subscriptions:
                async with self._lock:
                    await self._check(broker, only=subscriber)
            return await start(*args, **kwargs)

        setattr(checked_start, _MARK, self)
        subscriber.start = checked_start
        return subscriber

    async def check(self, broker: Any) -> None:
        """Refuse, with what to change, any inbox subscriber whose messages the inbox could
        not settle; check the schema and database settings; declare the quarantine and
        dead-letter destinations. Raises `ConfigurationError` listing every problem."""
        async with self._lock:
            await self._check(broker)

    async def _check(self, broker: Any, only: Any = None, patience: float = 0.0) -> None:
        """The check; with ``only`` (a subscriber starting on a running broker), raise for
        that subscriber's refusal alone (another refused one, declared and never started,
        does not stop it). The database's trouble is waited out for ``patience`` seconds
        (`inbox_middleware._storage.startup`); refusals are not."""
        logs.follow("faststream")  # FastStream configures its own logger only
        found = find(broker, self)
        refused = refusals(found, self.middleware)
        subscriptions: dict[int, Subscription] = {}
        for f in found:
            if f.consumer is None or f.adapter is None or id(f.subscriber) in refused:
                continue
            subscription = self._waiting.get(f.subscriber) or self._subscription(f)
            if problem := _settings_refusal(subscription):
                refused[id(f.subscriber)] = problem
            else:
                subscriptions[id(f.subscriber)] = subscription
        for f in found:
            if id(f.subscriber) in refused:
                self._refused[f.subscriber] = refused[id(f.subscriber)]
        stopping = {k: v for k, v in refused.items() if only is None or k == id(only)}
        if stopping:
            raise ConfigurationError(_report(found, stopping))
        if self.check_database and not self._database_checked:
            try:
                await StartupPatience(patience, log=logger).run_async(self.storage.check)
            except Exception:
                for f in found:
                    if id(f.subscriber) in subscriptions:
                        self._waiting[f.subscriber] = subscriptions[id(f.subscriber)]
                raise
            self._database_checked = True
        # Only what this check sees first: a subscriber added later checks them all again.
        known = {id(f.subscriber) for f in found if f.subscriber in self._subscriptions}
        fresh = {key: sub for key, sub in subscriptions.items() if key not in known}
        if fresh:
            await broker.connect()
        for subscription in fresh.values():
            await subscription.adapter.prepare(subscription.destinations)
        for f in found:
            if id(f.subscriber) in refused or f.subscriber in self._subscriptions:
                continue  # a known one keeps its subscription, and its hand-back delays
            self._subscriptions[f.subscriber] = subscriptions.get(id(f.subscriber))
            self._refused.pop(f.subscriber, None)
            self._waiting.pop(f.subscriber, None)
        if self.counts and subscriptions:
            self.counts.start()
        for subscription in fresh.values():
            logger.info(
                "inbox consumer %s protects %s (quarantine %s, dead letters %s)",
                subscription.consumer.name,
                subscription.describe(),
                subscription.quarantine,
                subscription.dead_letter or "the broker's dead-letter path",
            )
            drops = subscription.dead_letter is None and await subscription.adapter.reject_drops()
            if drops:
                logger.warning(
                    "inbox consumer %s has dead_letter=None, and %s: a message it rejects "
                    "with no record of its own (no usable identity, a body that does not fit "
                    "the handler) would be lost; keep a dead_letter destination, or give "
                    "the broker's dead-letter path somewhere to keep it",
                    subscription.consumer.name,
                    drops,
                )

    def _subscription(self, found: Found) -> Subscription:
        assert found.consumer is not None
        assert found.adapter is not None
        return Subscription(
            storage=self.storage,
            consumer=found.consumer,
            adapter=found.adapter,
            policy=self.policy,
            canonical_form=self.canonical_form,
            quarantine=self.quarantine,
            dead_letter=self.dead_letter,
            tracing=self.tracing,
        )

    async def subscription_for(self, subscriber: Any, broker: Any) -> Subscription | None:
        """The inbox subscription of ``subscriber``, None if it is not an inbox subscriber.

        Normally known since `check` ran at start-up. Without `guard`, the check runs at
        the first message, too late for an ACK_FIRST subscriber: hence the warning.
        """
        if subscriber in self._subscriptions:
            return self._subscriptions[subscriber]
        if subscriber not in self._refused:
            # A guarded broker under a test broker: its fakes come after the check.
            log = logger.debug if guarded(self, broker) or self._warned else logger.warning
            self._warned = True  # once: every message runs this until the check passes
            log(
                "the inbox start-up check did not run before this broker started; running it "
                "now. Wrap the broker with inbox.guard(broker) so that a subscriber the inbox "
                "cannot protect is refused before it consumes anything"
            )
            faults.at("check")
            # Raises while the check fails (the database down, the tables missing, a
            # setting that breaks the guarantee): the caller hands the message back.
            await self.check(broker)
        if subscriber in self._refused:
            raise ConfigurationError(self._refused[subscriber])
        return self._subscriptions.get(subscriber)

    def _not_checked(self, broker: Any, subscriber: Any) -> Subscription | None:
        """The subscription of an inbox subscriber whose start-up check failed before it
        could say (its messages are still handed back through the core), or None."""
        try:
            for f in find(broker, self):
                if f.subscriber is not subscriber or f.problem is not None:
                    continue
                if f.consumer is None or f.adapter is None:
                    return None
                subscription = self._subscription(f)
                if _settings_refusal(subscription) is not None:
                    return None
                self._waiting[subscriber] = subscription
                return subscription
        except Exception:  # the message is still handed back, the way a refusal is
            logger.debug("no subscription to hand a message back through", exc_info=True)
        return None

    async def hold(self, broker: Any, subscriber: Any, message: Any, error: Exception) -> Any:
        """Hand back a message the inbox cannot settle yet (its subscriber is refused, or
        the start-up check failed), so it is not lost meanwhile. Ends as the settlement
        of a consumed message does (raises `NackForRedelivery`)."""
        waiting = self._waiting.get(subscriber)
        if waiting is None and not isinstance(error, ConfigurationError):
            waiting = self._not_checked(broker, subscriber)
        if waiting is not None:
            # Through the core, as every hand-back: counted as one (for each message of a
            # batch), with this message's own delays (a crash count would otherwise take
            # the redelivery for a crash).
            held = DatabaseUnavailable(f"the inbox start-up check has not passed: {error}")
            held.__cause__ = error
            return await waiting.hold(message, held)
        # A subscriber the inbox refused (its settings, its broker) has no consumer, and so
        # no settings the core could decide with: its messages wait with the broker, told
        # CRITICAL, until it is fixed; nothing of theirs is counted, since none is consumed.
        delay = self.backoff.next(("check", id(subscriber)))
        logger.log(
            logging.CRITICAL if isinstance(error, ConfigurationError) else logging.WARNING,
            "the inbox holds a message back for %.1fs: %s",
            delay,
            error,
        )
        await adapter_for(broker, subscriber).retry_later(message, delay)
        raise NackForRedelivery(f"{type(error).__name__}: {error}", logged=True) from error


def _settings_refusal(subscription: Subscription) -> str | None:
    adapter = subscription.adapter
    if subscription.dead_letter is None and not adapter.native_reject:
        return (
            f"dead_letter=None, but {adapter.name} has no dead-letter path of its own: "
            "keep the default (a dead-letter destination the inbox publishes to)"
        )
    if adapter.batch and subscription.missing_identity == "process":
        return (
            "missing_identity='process' cannot apply to a batch subscriber, whose batch is "
            "claimed as a whole; use 'reject' or 'broker_id'"
        )
    for destination in subscription.destinations:
        if destination == adapter.source:
            return f"its quarantine or dead-letter destination is its own source {destination!r}"
        if isinstance(adapter, NatsAdapter):
            if any(token in ("*", ">") for token in destination.split(".")):
                return (
                    f"its destination {destination!r} has a wildcard: pass quarantine= and "
                    "dead_letter= as plain subjects to inbox.consumer(...)"
                )
            if adapter.captures(destination):
                return (
                    f"it would consume its own destination {destination!r}: choose "
                    "quarantine= and dead_letter= subjects outside its subject filter"
                )
    return None


def _report(found: list[Found], refused: dict[int, str]) -> str:
    lines = ["the inbox refuses to start these subscribers:"]
    for f in found:
        if id(f.subscriber) in refused:
            what = f.adapter.name if f.adapter else type(f.subscriber).__name__
            where = repr(f.adapter.source) if f.adapter else ""
            consumer = f.consumer.name if f.consumer else "?"
            lines.append(
                f"  - {what} subscriber {where} (inbox consumer {consumer!r}): "
                f"{refused[id(f.subscriber)]}"
            )
    return "\n".join(lines)
