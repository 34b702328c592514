"""Deprecated: ``inbox_middleware.consumption`` moved.

Import from ``inbox_middleware``. This path keeps working for one release, with a
`DeprecationWarning`.
"""

# relayout: alias
from typing import TYPE_CHECKING

from inbox_middleware._moved import moved

if TYPE_CHECKING:
    from inbox_middleware._core.consumption import *  # noqa: F403

moved(__name__, "inbox_middleware._core.consumption", "inbox_middleware")
