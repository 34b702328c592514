"""`FastStreamInbox.guard` under FastStream's test brokers (``TestRabbitBroker`` and the
like), so that a test of the user's app runs the inbox as production does.

A test broker replaces ``broker.start`` with a mock that starts fakes instead of the
subscribers (``TestBroker._patch_broker``), so the guard's wrapper of ``start`` never
runs there. It still calls ``broker.connect()`` first (``async with broker``), then
creates an in-memory subscriber for every publisher of the broker, so that publishing to
a destination nobody consumes in the test works (``TestBroker._fake_start``). Hence the
guard also wraps ``connect``: when the broker connects and its ``start`` is not the
guard's (a test broker patched it), it runs the start-up check there, and declares the
quarantine and dead-letter destinations as publishers of the broker, which the test
broker then gives their fakes. With ``with_real=True`` the real ``start`` runs, guarded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._processing import Subscription

__all__ = ["guard_test_broker", "guarded"]


class Checked(Protocol):
    """What the wrapper needs of the `FastStreamInbox` (which imports this module)."""

    _lock: asyncio.Lock

    @property
    def _subscriptions(self) -> Mapping[Any, Subscription | None]: ...

    async def check(self, broker: Any) -> None: ...


_MARK = "__inbox_guarded__"


def guard_test_broker(inbox: Checked, broker: Any) -> None:
    """Wrap ``broker.connect`` so that a test broker's start runs the check (see module)."""
    connect = broker.connect
    if getattr(connect, _MARK, None) is inbox:
        return
    declared: set[str] = set()

    async def guarded_connect(*args: Any, **kwargs: Any) -> Any:
        connection = await connect(*args, **kwargs)
        # The check itself connects: only the outermost call checks.
        if getattr(broker.start, _MARK, None) is not inbox and not inbox._lock.locked():
            await inbox.check(broker)
            _declare_publishers(inbox, broker, declared)
        return connection

    setattr(guarded_connect, _MARK, inbox)
    broker.connect = guarded_connect


def guarded(inbox: Checked, broker: Any) -> bool:
    """Whether ``inbox.guard(broker)`` ran (the start-up check runs before consuming)."""
    return getattr(getattr(broker, "connect", None), _MARK, None) is inbox


def _declare_publishers(inbox: Checked, broker: Any, declared: set[str]) -> None:
    for subscriber in broker.subscribers:
        subscription = inbox._subscriptions.get(subscriber)
        if subscription is None:
            continue
        for destination in subscription.destinations:
            if destination not in declared:
                subscription.adapter.declare_publisher(destination)
                declared.add(destination)
