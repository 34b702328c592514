"""Deprecated: ``inbox_middleware.outbox.errors`` moved.

Import from ``inbox_middleware.outbox``. This path keeps working for one release, with a
`DeprecationWarning`.
"""

# relayout: alias
from typing import TYPE_CHECKING

from inbox_middleware._moved import moved

if TYPE_CHECKING:
    from inbox_middleware.outbox._errors import *  # noqa: F403

moved(__name__, "inbox_middleware.outbox._errors", "inbox_middleware.outbox")
