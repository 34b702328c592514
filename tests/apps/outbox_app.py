"""The destinations of a dispatcher process started by the crash tests.

``inbox-middleware outbox run --destinations tests.apps.outbox_app:destinations``,
configured by environment variables:

INBOX_TEST_REMOTE_URL    where the "remote" destination POSTs (a test's HTTP server)
INBOX_TEST_PAUSE_AT      a named point where the first effect to reach it stops the
                         process until it is killed: after_lease (leased, not delivered)
                         or after_delivery (delivered, outcome not recorded)
INBOX_TEST_MARKERS       folder where "<point>.paused" is written on reaching it, and
                         "leased" once a batch is leased
"""

from __future__ import annotations

import os
import time
from typing import Any

from inbox_middleware.outbox import Destinations, Effect
from inbox_middleware.outbox.destinations.http import HttpDestination

ENV = os.environ


def mark(name: str, text: str) -> bool:
    """Create ``name`` in the markers folder once across processes; False if it existed."""
    try:
        fd = os.open(
            os.path.join(ENV["INBOX_TEST_MARKERS"], name), os.O_CREAT | os.O_EXCL | os.O_WRONLY
        )
    except FileExistsError:
        return False
    os.write(fd, text.encode())
    os.close(fd)
    return True


def pause_point(name: str, effect: Effect) -> None:
    if name != ENV.get("INBOX_TEST_PAUSE_AT") or not mark(f"{name}.paused", effect.effect_id):
        return
    while True:  # blocks the event loop, as a hung process would, until SIGKILL
        time.sleep(60)


class CrashPoints:
    def __init__(self, inner: HttpDestination) -> None:
        self.inner = inner

    async def deliver(self, effect: Effect, timeout: float) -> Any:
        mark(f"leased.{os.getpid()}", effect.effect_id)
        pause_point("after_lease", effect)
        result = await self.inner.deliver(effect, timeout)
        pause_point("after_delivery", effect)
        return result

    async def aclose(self) -> None:
        await self.inner.aclose()


def destinations() -> Destinations:
    return Destinations({"remote": CrashPoints(HttpDestination(ENV["INBOX_TEST_REMOTE_URL"]))})
