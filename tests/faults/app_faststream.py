"""The fault-injection suite's FastStream worker: the chaos run's app, with the hook set.

``faststream run tests.faults.app_faststream:app``, configured as
`tests.apps.chaos_faststream` (``CHAOS_GUARD=0``: without ``inbox.guard``) plus the hook's
variables (`tests.faults.hook`).
"""

from __future__ import annotations

from tests.apps.chaos_faststream import app, broker

from .hook import install

__all__ = ["app", "broker"]

install()
