"""A delivery processed again while its claim is held elsewhere, as a broker would hand it
back: what the concurrent tests of the claims tables share."""

from __future__ import annotations

from typing import Any

from inbox_middleware._core.exceptions import ClaimInProgress


def process_until_settled(inbox: Any, delivery: Any, handler: Any) -> Any:
    """``inbox.process(delivery, handler)``, again each time it is handed back."""
    while True:
        try:
            return inbox.process(delivery, handler)
        except ClaimInProgress:
            continue
