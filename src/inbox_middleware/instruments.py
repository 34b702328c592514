"""Deprecated: ``inbox_middleware.instruments`` moved.

Import from ``inbox_middleware.metrics``. This path keeps working for one release, with a
`DeprecationWarning`.
"""

# relayout: alias
from typing import TYPE_CHECKING

from inbox_middleware._moved import moved

if TYPE_CHECKING:
    from inbox_middleware._observe.instruments import *  # noqa: F403

moved(__name__, "inbox_middleware._observe.instruments", "inbox_middleware.metrics")
