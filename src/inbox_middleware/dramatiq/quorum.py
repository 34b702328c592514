"""Deprecated: ``inbox_middleware.dramatiq.quorum`` moved.

Import from ``inbox_middleware.dramatiq``. This path keeps working for one release, with a
`DeprecationWarning`.
"""

# relayout: alias
from typing import TYPE_CHECKING

from inbox_middleware._moved import moved

if TYPE_CHECKING:
    from inbox_middleware.dramatiq._quorum import *  # noqa: F403

moved(__name__, "inbox_middleware.dramatiq._quorum", "inbox_middleware.dramatiq")
