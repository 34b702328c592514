"""Deprecated: ``inbox_middleware.storage`` moved.

Import from ``inbox_middleware``. This path keeps working for one release, with a
`DeprecationWarning`.
"""

# relayout: alias
from typing import Any

from inbox_middleware._moved import warn_moved
from inbox_middleware._storage import *  # noqa: F403
from inbox_middleware._storage import __all__ as __all__

warn_moved(__name__, "inbox_middleware")


def __getattr__(name: str) -> Any:
    import importlib

    return getattr(importlib.import_module("inbox_middleware._storage"), name)
