"""The settings of an inbox consumer, as one frozen object, documented here once.

`InboxMiddleware` (Dramatiq) and `FastStreamInbox` take a ``policy=ConsumerPolicy(...)``,
or any of its settings as keyword arguments (`PolicySettings`), which change the policy
given (or the adapter's defaults). One consumer overrides any of them for itself: a
Dramatiq actor with the option ``inbox_<setting>`` (``inbox_max_output_bytes=...``), a
FastStream subscriber with ``inbox.consumer(name, <setting>=...)``. The consumption core
(`consumption.settle_steps`) and the adapters read them from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any, Literal, TypedDict, Unpack

from .direct import DirectPublishPolicy, check_policy
from .exceptions import ConfigurationError
from .outputs import DEFAULT_MAX_OUTPUT_BYTES

__all__ = [
    "ConsumerPolicy",
    "ExpiredPolicy",
    "MissingIdentityPolicy",
    "PolicySettings",
    "check_missing_identity",
]

MissingIdentityPolicy = Literal["reject", "process", "broker_id"]
"""What to do with a message that carries no identity.

``reject`` (default): to the dead-letter path, with an error log line.
``process``: run the handler without deduplication, with a warning per message.
``broker_id``: deduplicate on what the broker keeps stable across redeliveries (Dramatiq's
message id, RabbitMQ's message-id property, a stream entry id, a JetStream sequence, a
Kafka offset). That catches redeliveries, never a producer sending the same intent twice.
"""

ExpiredPolicy = Literal["reject", "process"]
"""What to do with a first-seen message older than the retention window."""


@dataclass(frozen=True, slots=True)
class ConsumerPolicy:
    """How one inbox consumer treats what it cannot simply process.

    Attributes:
      missing_identity: see `MissingIdentityPolicy`.
      permanent_errors: exception types that mean "retrying cannot help", besides
        `PermanentError`: such a failure is kept as poison at once.
      max_attempts: failed attempts after which a message is kept as poison
        (``retries_exhausted``); None: no limit of the inbox's own (Dramatiq's Retries
        sets the limit there, and the inbox records poison when Retries gives up).
      redelivery_limit: deliveries that ended without an outcome (the worker died) after
        which a message is kept as poison (``redelivery_limit``); None: no limit.
      retention_window: how long claims are kept (the purge window); a first-seen message
        whose producer timestamp is older may have been processed and purged already.
      expired_redelivery: what to do with such a message; both are counted.
      shadow: claim and decide as usual, but skip nothing (see the monitoring guide).
      retry_backoff: (first, limit) seconds before a hand-back is redelivered, doubling
        per hand-back of the same message.
      max_output_bytes: the largest encoded result stored with a claim, where something
        downstream consumes it (publishers, replies, pipelines); a larger one is a
        permanent failure (``result_unstorable``). None: no limit.
      direct_publish: what a message published or sent directly from inside the handler
        gets (it leaves before the commit, and a duplicate does not repeat it):
        ``warn``, ``refuse`` or ``allow``; see `inbox_middleware._core.direct`.
    """

    missing_identity: MissingIdentityPolicy = "reject"
    permanent_errors: tuple[type[BaseException], ...] = ()
    max_attempts: int | None = 10
    redelivery_limit: int | None = 10
    retention_window: timedelta | None = None
    expired_redelivery: ExpiredPolicy = "reject"
    shadow: bool = False
    retry_backoff: tuple[float, float] = (0.5, 30.0)
    max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES
    direct_publish: DirectPublishPolicy = "warn"

    def __post_init__(self) -> None:
        check_missing_identity(self.missing_identity)
        if self.expired_redelivery not in ("reject", "process"):
            raise ConfigurationError(
                f"expired_redelivery must be 'reject' or 'process', not {self.expired_redelivery!r}"
            )
        for name in ("max_attempts", "redelivery_limit", "max_output_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ConfigurationError(f"{name} must be a whole number of zero or more, or None")
        first, limit = self.retry_backoff
        if not 0 < first <= limit:
            raise ConfigurationError("retry_backoff needs 0 < first <= limit seconds")
        check_policy(self.direct_publish)
        object.__setattr__(self, "permanent_errors", tuple(self.permanent_errors))

    def override(self, **changes: Unpack[PolicySettings]) -> ConsumerPolicy:
        """A copy with the given settings changed."""
        return self.override_set(changes)

    def override_set(self, changes: Mapping[str, Any]) -> ConsumerPolicy:
        """`override` from a mapping (actor options, a subscriber's settings)."""
        unknown = set(changes) - set(SETTINGS)
        if unknown:
            raise ConfigurationError(f"no consumer setting named {sorted(unknown)[0]!r}")
        return replace(self, **changes) if changes else self


class PolicySettings(TypedDict, total=False):
    """The `ConsumerPolicy` settings as keyword arguments (each one means what the
    attribute of the same name does there)."""

    missing_identity: MissingIdentityPolicy
    permanent_errors: tuple[type[BaseException], ...] | list[type[BaseException]]
    max_attempts: int | None
    redelivery_limit: int | None
    retention_window: timedelta | None
    expired_redelivery: ExpiredPolicy
    shadow: bool
    retry_backoff: tuple[float, float]
    max_output_bytes: int | None
    direct_publish: DirectPublishPolicy


SETTINGS = tuple(f.name for f in fields(ConsumerPolicy))
"""The names of the consumer settings."""


def check_missing_identity(value: object) -> MissingIdentityPolicy:
    if value not in ("reject", "process", "broker_id"):
        raise ConfigurationError(
            f"missing_identity must be 'reject', 'process' or 'broker_id', not {value!r}"
        )
    return value
