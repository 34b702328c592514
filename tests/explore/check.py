"""The checker: a history held to what docs/explanation/guarantee.md and limits.md
promise for its configuration.

For every intent sent with an identity:
  * its effect is committed at most once (``twice``), with the first payload's value
    (``wrong-payload``), never for a refused intent (``refused-applied``);
  * it is committed, or there is a durable record of why: a poison row, or a message at
    the dead-letter destination (``lost``); a refused intent has its poison row with the
    handler's reason, or ``redelivery_limit`` where a worker was SIGKILLed
    (``refused-unrecorded``);
  * an intent whose handler does nothing wrong is poisoned only by a limit the
    configuration sets (``poison-reason``); a committed intent has no poison row
    (``poisoned-and-applied``: "every message ends in exactly one place", as
    docs/how-to/failures.md says) unless a later copy applied it, which marks the earlier
    copy's row recovered (``poisoned-copy-pending``), and exactly one claim, and every
    claim has its effect (``record-contradicts``).
Every conflict sent is recorded in ``inbox_quarantine`` as a pending identity conflict
and published to the quarantine destination (``conflict-unrecorded``), and its payload
never applied. A message without identity is dead-lettered and not applied when the
policy is ``reject``; applied at least once (no deduplication: the documented opt-in)
with ``process``. Nothing is stuck: a bounded time after the faults stop every intent is
settled and the broker holds nothing (``stuck``, ``left-in-broker``).

An intent whose producer clock stamped it older than the retention window is kept as
poison (``expired_redelivery``) and never applied (``expired-applied``,
``expired-unrecorded``), as docs/how-to/retention.md says. A refused start-up is a
correct outcome, not a finding.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from .domain import REFUSED
from .run import History

__all__ = ["Finding", "check"]

LIMIT_REASONS = {"retries_exhausted", "redelivery_limit"}
LEAD = 2.0
"""Seconds a pending poison row must come before its intent's first effect to be a
finding: the handlers do not sleep, so a row written that long before the effect was
there before the applying copy's claim, which must have marked it recovered."""


@dataclass(frozen=True)
class Finding:
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


def _keys(found: list[dict[str, Any]]) -> Counter[str]:
    return Counter(str(p.get("key")) for p in found)


def _sample(values: Any, limit: int = 6) -> str:
    values = sorted(values)
    more = f" and {len(values) - limit} more" if len(values) > limit else ""
    return ", ".join(map(str, values[:limit])) + more


def check(history: History) -> list[Finding]:
    schedule = history.schedule
    config = schedule.config
    findings: list[Finding] = []

    def problem(kind: str, keys: Any, what: str) -> None:
        keys = set(keys)
        if keys:
            findings.append(Finding(kind, f"{len(keys)} {what}: {_sample(keys)}"))

    effects: dict[str, list[int]] = {}
    for key, _message_id, n in history.effects:
        effects.setdefault(key, []).append(n)
    poison: dict[str, list[str]] = {}
    for message_id, reason, _decision in history.poison:
        poison.setdefault(message_id, []).append(reason)
    claims = Counter(history.claims)
    quarantined = {m: (d, r) for m, d, r in history.quarantine}
    dead = _keys(history.destinations.get("dead-letter", []))
    in_quarantine = history.destinations.get("quarantine", [])
    sent_keys = {key for _, key, kind, _ in history.sent if kind != "conflict"}
    conflicts_sent = {key: n for _, key, kind, n in history.sent if kind == "conflict"}
    intents = {i.key: i for i in schedule.intents if i.key in sent_keys}
    identified = {k: i for k, i in intents.items() if i.identified}
    unidentified = {k: i for k, i in intents.items() if not i.identified}
    # Stamped by a producer clock behind by more than the retention window: kept as poison
    # (``expired_redelivery``), never applied, whatever their handler would have done.
    expired = {k for k in schedule.expired() if k in identified}

    problem(
        "twice",
        (k for k in identified if len(effects.get(k, [])) > 1),
        "intents applied more than once",
    )
    problem(
        "wrong-payload",
        (k for k, i in identified.items() if any(n != i.n for n in effects.get(k, []))),
        "intents applied with another payload than their first",
    )
    problem(
        "refused-applied",
        (k for k, i in identified.items() if i.behaviour == "permanent" and k in effects),
        "refused intents applied",
    )
    problem(
        "expired-applied",
        (k for k in expired if k in effects),
        "intents stamped older than the retention window applied",
    )
    # Still in the broker: not lost, but not settled either (``stuck``, ``left-in-broker``).
    held = _keys(history.remaining or [])
    unknown = history.remaining is None and any(history.leftover.values())
    unrecorded = {k for k in identified if k not in effects and k not in poison and not dead[k]}
    problem(
        "lost" if not unknown else "lost-or-left",
        (k for k in unrecorded if not held[k]),
        "intents neither applied nor recorded (no poison row, no dead letter)"
        + ("" if not unknown else ", the broker holding messages it cannot name"),
    )
    problem(
        "unsettled",
        (k for k in unrecorded if held[k]),
        "intents neither applied nor recorded, still in the broker once the workers stopped",
    )
    # Workers that died with messages in hand: SIGKILLed (SIGTERM is a graceful stop).
    killed = any(f.kind in ("worker_kill", "pg_after_start") for f in schedule.faults)
    # A refused intent's own reason; or the redelivery limit, which may stop it before its
    # handler runs where a worker died with it in hand.
    refusal = {REFUSED} | (_allowed(config, "permanent", killed) & {"redelivery_limit"})
    problem(
        "refused-unrecorded",
        (
            k
            for k, i in identified.items()
            if i.behaviour == "permanent"
            and k not in expired
            and not set(poison.get(k, [])) & refusal
        ),
        f"refused intents without a poison row of reason {REFUSED}",
    )
    too_old = {"expired_redelivery"} | (refusal - {REFUSED})
    problem(
        "expired-unrecorded",
        (k for k in expired if not set(poison.get(k, [])) & too_old),
        "intents stamped older than the retention window without a poison row of reason "
        "expired_redelivery",
    )
    innocent = ("ok", "transient", "sometimes")
    problem(
        "poison-reason",
        (
            f"{k} ({'/'.join(poison[k])})"
            for k, i in identified.items()
            if k in poison
            and k not in expired
            and (
                (i.behaviour == "permanent" and not set(poison[k]) <= refusal)
                or (
                    i.behaviour in innocent
                    and not set(poison[k]) <= _allowed(config, i.behaviour, killed)
                )
            )
        ),
        "intents poisoned for a reason their configuration does not explain",
    )
    # A later copy of an intent whose earlier copy was poisoned is a first delivery of its
    # own (docs/explanation/limits.md, "A poisoned copy and a later copy"): applied once,
    # and its claim marks the earlier copy's pending row recovered. One copy sent, applied
    # and poisoned: a finding. Several copies: a row still pending that was written well
    # before the intent's first effect (so before the claim of the copy that applied it)
    # is one too; a row written while that copy was in flight is the documented race.
    copies = Counter(key for _, key, kind, _ in history.sent if kind != "conflict")
    if _stalled(schedule):
        # A delivery stalled past the broker's redelivery timer (Redis streams' reclaim,
        # JetStream's ack_wait, a Kafka member's session) is delivered again while it is
        # still in flight: two copies in flight together, of a message sent once.
        copies = Counter({k: max(2, n) for k, n in copies.items()})
    problem(
        "poisoned-copy-pending",
        (
            f"{k} (row written {history.poison_lead[k]:.1f}s before the effect)"
            for k in identified
            if k in effects and copies[k] > 1 and history.poison_lead.get(k, 0.0) > LEAD
        ),
        "applied intents whose earlier copy's poison row stayed pending (not recovered)",
    )
    problem(
        "poison-reason",
        (f"{k} ({'/'.join(poison[k])})" for k in expired if not set(poison.get(k, [])) <= too_old),
        "intents stamped older than the window poisoned for another reason",
    )
    problem(
        "poisoned-and-applied",
        (
            f"{k} (poison {'/'.join(poison[k])}, "
            f"{'/'.join(d for m, _, d in history.poison if m == k)})"
            for k in identified
            if k in effects and k in poison and copies[k] == 1
        ),
        "intents sent once, applied and also poisoned (a message ends in one place only)",
    )
    problem(
        "record-contradicts",
        (f"{k} ({claims[k]} claims)" for k in identified if k in effects and claims[k] != 1),
        "applied intents without exactly one claim",
    )
    problem(
        "record-contradicts",
        (f"{k}" for k in claims if k not in effects),
        "claims whose effect is not in the database (marked processed, never applied)",
    )
    # Conflicts: recorded and published, their payload never applied.
    problem(
        "conflict-unrecorded",
        (k for k in conflicts_sent if quarantined.get(k, ("", ""))[1] != "identity_conflict"),
        "conflicts without their quarantine row",
    )
    problem(
        "conflict-unrecorded",
        (k for k in conflicts_sent if k not in _keys(in_quarantine)),
        "conflicts missing from the quarantine destination",
    )
    problem(
        "record-contradicts",
        (k for k, (decision, _) in quarantined.items() if decision != "pending"),
        "quarantine rows decided by nobody (not pending)",
    )
    problem(
        "record-contradicts",
        (k for k in quarantined if k not in conflicts_sent),
        "quarantine rows for intents never sent a conflicting payload",
    )
    # Messages without identity.
    if config.missing_identity == "reject":
        problem(
            "unidentified-applied",
            (k for k in unidentified if k in effects),
            "messages without identity applied under reject",
        )
        problem(
            "lost",
            (k for k in unidentified if not dead[k]),
            "messages without identity neither applied nor dead-lettered",
        )
    else:
        problem(
            "lost",
            (
                k
                for k, i in unidentified.items()
                if k not in effects and not dead[k] and i.behaviour == "no-identity"
            ),
            "messages without identity never applied under process",
        )
    # Nothing stuck.
    if not history.settled:
        findings.append(
            Finding("stuck", f"not settled {history.settle_seconds:.0f}s after the faults stopped")
        )
    if any(history.leftover.values()):
        findings.append(Finding("left-in-broker", f"after the workers stopped: {history.leftover}"))
    return findings


STALLS = {"net_blackhole": 3.0, "net_delay": 5.0}
"""Network faults (and the shortest that does) that hold a delivery in flight longer than
a redelivery timer of 3 s (the explorer's ``min_idle_time``, ``ack_wait`` and Kafka
session)."""


def _stalled(schedule: Any) -> bool:
    """Whether a delivery may have been redelivered while still in flight: a broker that
    redelivers on a timer, and a network fault that holds a transaction past it."""
    timer = schedule.config.target in ("faststream-redis", "faststream-nats", "faststream-kafka")
    return timer and any(f.kind in STALLS and f.seconds >= STALLS[f.kind] for f in schedule.faults)


def _allowed(config: Any, behaviour: str, killed: bool) -> set[str]:
    """Poison reasons the configuration explains for a handler that does nothing wrong:
    a redelivery limit, where a worker died with messages in hand (``killed``: a hand-back
    is never counted as a crash, docs/how-to/failures.md), and attempts for a handler that
    fails."""
    allowed = set()
    if config.redelivery_limit is not None and killed:
        allowed.add("redelivery_limit")
    if behaviour in ("transient", "sometimes"):
        allowed.add("retries_exhausted")
    return allowed
