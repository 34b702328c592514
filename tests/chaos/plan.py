"""The chaos run's message stream, derived from its size and a seed.

Of every hundred messages, about thirty are redelivered duplicates (the same intent and
payload again, some way behind the first), five are concurrent duplicates (copies right
behind the first, so that several workers hold them at once), two are identity
conflicts (an intent's id with another payload, sent only once the first payload has
committed, so the first always wins) and two are intents the handler refuses with
`PermanentError` (their account does not exist). The rest are first deliveries.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from ..apps.chaos_domain import ACCOUNTS

__all__ = ["Intent", "Plan", "Send", "make_plan"]

REDELIVERED, CONCURRENT, CONFLICTS, PERMANENT = 0.30, 0.05, 0.02, 0.02
Kind = Literal["first", "redelivered", "concurrent", "conflict"]


@dataclass(frozen=True, slots=True)
class Intent:
    message_id: str
    account: int
    delta: int
    refused: bool
    """Its account does not exist: the handler raises PermanentError."""


@dataclass(frozen=True, slots=True)
class Send:
    intent: Intent
    kind: Kind
    delta: int
    """The payload's delta: the intent's, except for a conflict."""

    @property
    def message_id(self) -> str:
        return self.intent.message_id


@dataclass
class Plan:
    messages: int
    seed: int
    intents: list[Intent]
    stream: list[Send]
    """Everything but the conflicts, in sending order."""
    conflicts: list[Send]
    """Each sent once its intent's first payload has committed."""
    counts: Counter[str] = field(default_factory=Counter)

    @property
    def applied(self) -> list[Intent]:
        return [intent for intent in self.intents if not intent.refused]

    @property
    def refused(self) -> list[Intent]:
        return [intent for intent in self.intents if intent.refused]

    def balances(self) -> dict[int, int]:
        """What every account must hold at the end: the sum of its applied intents."""
        expected = dict.fromkeys(range(1, ACCOUNTS + 1), 0)
        for intent in self.applied:
            expected[intent.account] += intent.delta
        return expected


def make_plan(messages: int, seed: int = 0) -> Plan:
    rng = random.Random(seed)
    conflicts = round(messages * CONFLICTS)
    concurrent = round(messages * CONCURRENT)
    redelivered = round(messages * REDELIVERED)
    firsts = messages - conflicts - concurrent - redelivered
    refused = set(rng.sample(range(firsts), round(messages * PERMANENT)))
    intents = [
        Intent(
            message_id=f"i{n:07d}",
            account=ACCOUNTS + 1 + n if n in refused else rng.randint(1, ACCOUNTS),
            delta=rng.randint(1, 1000),
            refused=n in refused,
        )
        for n in range(firsts)
    ]
    # Order by position: a first delivery at its index, concurrent copies right behind
    # it, a redelivery up to a window later.
    keyed: list[tuple[float, int, Send]] = []
    for n, intent in enumerate(intents):
        keyed.append((n, len(keyed), Send(intent, "first", intent.delta)))
    copies = 0
    while copies < concurrent:
        n = rng.randrange(firsts)
        for _ in range(min(rng.randint(1, 3), concurrent - copies)):
            keyed.append((n + 0.5, len(keyed), Send(intents[n], "concurrent", intents[n].delta)))
            copies += 1
    window = max(20, messages // 50)
    for _ in range(redelivered):
        n = rng.randrange(firsts)
        later = n + rng.uniform(1, window)
        keyed.append((later, len(keyed), Send(intents[n], "redelivered", intents[n].delta)))
    stream = [send for _, _, send in sorted(keyed, key=lambda k: (k[0], k[1]))]
    applied = [intent for intent in intents if not intent.refused]
    conflicting = [
        Send(intent, "conflict", intent.delta + rng.randint(1, 99))
        for intent in rng.sample(applied, conflicts)
    ]
    plan = Plan(messages, seed, intents, stream, conflicting)
    plan.counts.update(send.kind for send in stream + conflicting)
    plan.counts["refused"] = len(refused)
    assert len(stream) + len(conflicting) == messages
    return plan
