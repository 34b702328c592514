"""Messages a handler publishes directly while its inbox attempt is open.

They leave before the commit, so they are sent even when the attempt rolls back, and a
duplicate does not send them again: follow-up messages belong in the outbox
(``outbox.add`` in the handler's session, delivered by the dispatcher after the commit,
with an effect id derived from the incoming identity). Adapters call `check` from the
framework's publish hook (FastStream's ``publish_scope``, Dramatiq's ``before_enqueue``).
"""

from __future__ import annotations

import warnings
from typing import Literal

from .exceptions import ConfigurationError, DirectPublishRefused, DirectPublishWarning

__all__ = ["DirectPublishPolicy", "check", "check_policy"]

DirectPublishPolicy = Literal["warn", "refuse", "allow"]
"""What a direct publish from inside an inbox handler gets: a `DirectPublishWarning`
(``warn``, the default), a `DirectPublishRefused` error (``refuse``), or nothing."""

_ADVICE = (
    "it leaves before the inbox commits (sent even if the attempt rolls back) and a "
    "duplicate will not send it again; record it with outbox.add(session, destination=..., "
    "payload=...) and let the outbox dispatcher deliver it, or return it as the handler's "
    "result"
)


def check_policy(value: object) -> DirectPublishPolicy:
    if value not in ("warn", "refuse", "allow"):
        raise ConfigurationError(
            f"direct_publish must be 'warn', 'refuse' or 'allow', not {value!r}"
        )
    return value


def check(policy: DirectPublishPolicy, consumer: str, what: str) -> None:
    """``what`` (``"a publish to 'orders'"``) happens inside ``consumer``'s attempt."""
    if policy == "allow":
        return
    text = f"{what} from inside inbox consumer {consumer!r}: {_ADVICE}"
    if policy == "refuse":
        raise DirectPublishRefused(text)
    warnings.warn(text, DirectPublishWarning, stacklevel=3)
