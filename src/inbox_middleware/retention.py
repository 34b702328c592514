"""How long the inbox must remember a message: the retention window, from its failures.

Deleting an inbox row makes any later copy of that message new again. So the window is
not a tidy-up preference: it must outlast the latest moment a copy can still arrive.
Each scenario below bounds how old a copy can be when it arrives; the window is the
largest of them, plus a safety margin::

    broker redelivery     the broker keeps, and may redeliver, a message this long
    offset rewind         consumers may be rewound this far back (Kafka, streams)
    dead-letter redrive   retried for `retry_horizon`, then kept as a dead letter for
                          `dead_letter_retention` before someone redrives it
    producer retry        a producer retries an intent for `producer_retry`, possibly
                          across a consumer outage of `outage_allowance`
    backup restore        a broker or producer restored from a backup this old re-sends
    planned replay        replays you plan reach this far back

`minimum_window` returns the window and the scenario that dominates it, so an operator
sees which failure the window is sized for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from datetime import timedelta

from .exceptions import ConfigurationError

__all__ = ["RetentionPolicy", "Scenario", "format_duration", "minimum_window", "parse_duration"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def parse_duration(text: str) -> timedelta:
    """``"7d"``, ``"36h"``, ``"1w2d"``, ``"90m"``, ``"45s"``, or ``"0"``."""
    value = text.strip().lower()
    if value == "0":
        return timedelta(0)
    parts = _DURATION.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ConfigurationError(
            f"cannot read the duration {text!r}: use a number with s, m, h, d or w, like 14d"
        )
    return timedelta(seconds=sum(float(number) * _UNITS[unit] for number, unit in parts))


def format_duration(value: timedelta) -> str:
    seconds = int(value.total_seconds())
    if seconds == 0:
        return "0"
    out = []
    for unit in ("w", "d", "h", "m", "s"):
        count, seconds = divmod(seconds, _UNITS[unit])
        if count:
            out.append(f"{count}{unit}")
    return "".join(out)


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """The failure scenarios the inbox must survive; every duration defaults to zero."""

    broker_retention: timedelta = timedelta(0)
    offset_rewind: timedelta = timedelta(0)
    retry_horizon: timedelta = timedelta(0)
    dead_letter_retention: timedelta = timedelta(0)
    producer_retry: timedelta = timedelta(0)
    outage_allowance: timedelta = timedelta(0)
    backup_restore_age: timedelta = timedelta(0)
    replay_horizon: timedelta = timedelta(0)
    margin: float = 0.25
    """Added on top of the dominant scenario, as a fraction of it."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, timedelta) and value < timedelta(0):
                raise ConfigurationError(f"{field.name} cannot be negative")
        if not 0 <= self.margin <= 10:
            raise ConfigurationError("margin must be between 0 and 10 (a fraction)")

    def scenarios(self) -> list[Scenario]:
        return [
            Scenario("broker redelivery", self.broker_retention),
            Scenario("offset rewind", self.offset_rewind),
            Scenario("dead-letter redrive", self.retry_horizon + self.dead_letter_retention),
            Scenario("producer retry", self.producer_retry + self.outage_allowance),
            Scenario("backup restore", self.backup_restore_age),
            Scenario("planned replay", self.replay_horizon),
        ]


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    window: timedelta
    """How old a copy of a message can be when this scenario delivers it."""


def minimum_window(policy: RetentionPolicy) -> tuple[timedelta, Scenario]:
    """The shortest safe retention window, and the scenario that dominates it."""
    dominant = max(policy.scenarios(), key=lambda scenario: scenario.window)
    window = dominant.window * (1 + policy.margin)
    return timedelta(seconds=round(window.total_seconds())), dominant
