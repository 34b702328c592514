"""Deprecated: ``inbox_middleware.throwaway`` moved.

Import from ``inbox_middleware.testing``. This path keeps working for one release, with a
`DeprecationWarning`.
"""

# relayout: alias
from typing import TYPE_CHECKING

from inbox_middleware._moved import moved

if TYPE_CHECKING:
    from inbox_middleware._operate.throwaway import *  # noqa: F403

moved(__name__, "inbox_middleware._operate.throwaway", "inbox_middleware.testing")
