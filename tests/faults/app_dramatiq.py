"""The fault-injection suite's Dramatiq worker: the chaos run's app, with the hook set.

``dramatiq tests.faults.app_dramatiq``, configured as `tests.apps.chaos_dramatiq` plus the
hook's variables (`tests.faults.hook`).
"""

from __future__ import annotations

from tests.apps.chaos_dramatiq import broker, credit

from .hook import install

__all__ = ["broker", "credit"]

install()
