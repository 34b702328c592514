"""The checker: a history held to what docs/explanation/guarantee.md and limits.md
promise for its configuration.

For every intent sent with an identity:
  * its effect is committed at most once (``twice``), with the first payload's value
    (``wrong-payload``), never for a refused intent (``refused-applied``);
  * it is committed, or there is a durable record of why: a poison row, or a message at
    the dead-letter destination (``lost``); a refused intent has its poison row with the
    handler's reason, or ``redelivery_limit`` where a worker was SIGKILLed, or SIGTERMed
    often enough for its copies (`_died`) (``refused-unrecorded``);
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
``expired-unrecorded``), as docs/how-to/retention.md says.
A refused start-up is a correct outcome, not a finding.

The workload axes (`space.WORKLOAD_AXES`, checked in `_workload`):
  * extended handlers: a handler that ends the transaction or settles its message itself
    is never applied and kept as poison ``handler_transaction`` (``misuse-applied``,
    ``misuse-unrecorded``); a body refused by validation is dead-lettered, never applied
    nor poisoned (``invalid-applied``, ``poison-reason``); a failure at COMMIT or a time
    limit is an ordinary failed attempt (``retries_exhausted`` only after the limit);
  * a batch: a failure counts for each message of the batch, so a message poisoned for a
    reason another message of the schedule explains is no finding;
  * outputs: every applied intent's output applied downstream exactly once, with the
    applied payload, and no output of an intent that did not commit
    (``output-missing``, ``output-twice``, ``output-uncommitted``);
  * the outbox: one effect per applied intent and none for work that rolled back,
    every effect dispatched and received by the remote (``outbox-*``);
  * the operator: a row redriven or accepted with the CLI is published
    (``repair-unpublished``); an accepted conflict applied once under its new id
    (``accepted-not-applied``); a discarded conflict never applied
    (``discarded-applied``); a redriven poison message applied at most once and its row
    then ``recovered``, whichever copy of the intent applied it (the redriven one, the
    producer's next, the broker's redelivery of the poisoned one), where no copy carried
    another payload and the redriven copy was published or the intent sent once
    (``redriven-not-recovered``; a row of outputs that could not be sent is recovered by
    their send, which the checker does not see);
  * a purge (``--older-than 10s``) deletes no claim younger than its window
    (``purge-too-young``); a copy applied again after its claim was purged is the
    documented limit ("Memory is as long as the retention window"), not ``twice``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from .domain import REFUSED
from .run import History
from .tenants import TENANTS, tenant_of
from .workload import MISUSES, MOVED, OPERATOR, PURGE_WINDOW

__all__ = ["Finding", "check"]

LIMIT_REASONS = {"retries_exhausted", "redelivery_limit"}
OUTAGES = {
    "pg_fast",
    "pg_immediate",
    "pg_one_fast",
    "pg_one_immediate",
    "pg_terminate",
    "net_cut",
    "net_blackhole",
    "pooler_restart",
}
"""Faults that take a database away from a worker in the middle of its deliveries."""
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

    extra = history.extra
    accepted = _accepted(history, conflicts_sent)
    """key -> the payload (n) of its quarantined conflict the operator accepted"""
    for key, n in accepted.items():
        # The accepted payload is an intent of its own (a new message id): set it apart.
        if n in effects.get(key, []):
            effects[key].remove(n)
    forgotten = _forgotten(history)
    """keys applied again after a purge deleted their claim: the documented window"""
    purgeable = _purgeable(history)
    """keys whose claim a purge was allowed to delete (older than its window)"""
    lapsed = _lapsed_conflicts(history, conflicts_sent)
    """(key, n) of conflicts applied as messages of their own after a purge: the window"""
    problem(
        "twice",
        (k for k in identified if len(effects.get(k, [])) > 1 and k not in forgotten),
        "intents applied more than once",
    )
    problem(
        "wrong-payload",
        (
            k
            for k, i in identified.items()
            if any(n != i.n and (k, n) not in lapsed for n in effects.get(k, []))
        ),
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
    # Intents the redelivery limit may stop before their handler runs: every one where a
    # worker was SIGKILLed with messages in hand; where workers were only SIGTERMed, those
    # whose copies, each left without an outcome by every stop, exceed the limit.
    died = _died(history, identified)
    # A refused intent's own reason; or the redelivery limit.
    # In a batch, a refused intent is kept as poison with its batch's reason, which another
    # message of the batch may have given (docs/how-to/faststream.md, "Batches").
    batched = _batch_reasons(config, intents, bool(died))

    def refusal(key: str) -> set[str]:
        return {REFUSED} | (_allowed(config, "permanent", key in died) & {"redelivery_limit"})

    problem(
        "refused-unrecorded",
        (
            k
            for k, i in identified.items()
            if i.behaviour == "permanent"
            and k not in expired
            and not set(poison.get(k, [])) & (refusal(k) | batched)
        ),
        f"refused intents without a poison row of reason {REFUSED}",
    )

    def too_old(key: str) -> set[str]:
        return {"expired_redelivery"} | ((refusal(key) | batched) - {REFUSED})

    problem(
        "expired-unrecorded",
        (k for k in expired if not set(poison.get(k, [])) & too_old(k)),
        "intents stamped older than the retention window without a poison row of reason "
        "expired_redelivery",
    )
    innocent = ("ok", "transient", "sometimes", "deferred", "timelimit", "invalid")
    problem(
        "poison-reason",
        (
            f"{k} ({'/'.join(poison[k])})"
            for k, i in identified.items()
            if k in poison
            and k not in expired
            and (
                (i.behaviour == "permanent" and not set(poison[k]) <= refusal(k) | batched)
                or (
                    i.behaviour in innocent
                    and not set(poison[k]) <= _allowed(config, i.behaviour, k in died) | batched
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
    redriven = {
        str(r.get("message_id"))
        for r in extra.get("inbox_poison", [])
        if r.get("decided_by") == OPERATOR or r.get("decision") in ("redriven", "discarded")
    }
    # A worker SIGKILLed, or SIGTERMed: FastStream's supervisor stops its forked
    # processes one after the other, and a process can end with a batch settled but not
    # acknowledged (seed 615205: the batch reclaimed after the restart held messages
    # applied before the stop, and one poisoned before it, applied in that batch).
    ended = any(f.kind in ("worker_kill", "worker_term", "pg_after_start") for f in schedule.faults)
    requeued = any(f.kind == "broker_restart" for f in schedule.faults)
    if _stalled(schedule) or requeued or (config.batch == "on" and ended):
        # A delivery stalled past the broker's redelivery timer (Redis streams' reclaim,
        # JetStream's ack_wait, a Kafka member's session) is delivered again while it is
        # still in flight: two copies in flight together, of a message sent once. A batch
        # whose worker ended after its poison rows, before its ack, is delivered again
        # too, and its messages, in other batches then, may be applied (a batch's poison
        # reason may be another message's): its claim marks the rows recovered.
        # A broker restart closes the workers' connections: RabbitMQ requeues every
        # delivery they hold (JetStream redelivers it after ack_wait) while a worker may
        # still be processing its copy (seed 930033: Dramatiq on a quorum queue, a copy
        # kept as poison by the redelivery limit, its row recovered, the other applied).
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
        (
            f"{k} ({'/'.join(poison[k])})"
            for k in expired
            if not set(poison.get(k, [])) <= too_old(k)
        ),
        "intents stamped older than the window poisoned for another reason",
    )
    problem(
        "poisoned-and-applied",
        (
            f"{k} (poison {'/'.join(poison[k])}, "
            f"{'/'.join(d for m, _, d in history.poison if m == k)})"
            for k in identified
            if k in effects and k in poison and copies[k] == 1 and k not in redriven
        ),
        "intents sent once, applied and also poisoned (a message ends in one place only)",
    )
    problem(
        "record-contradicts",
        (
            f"{k} ({claims[k]} claims)"
            for k in identified
            if k in effects and claims[k] != 1 and not (claims[k] == 0 and k in purgeable)
        ),
        "applied intents without exactly one claim",
    )
    problem(
        "record-contradicts",
        (f"{k}" for k in claims if k not in effects and k.split("+accepted-")[0] not in effects),
        "claims whose effect is not in the database (marked processed, never applied)",
    )
    # Conflicts: recorded and published, their payload never applied.
    problem(
        "conflict-unrecorded",
        (
            k
            for k, n in conflicts_sent.items()
            if quarantined.get(k, ("", ""))[1] != "identity_conflict" and (k, n) not in lapsed
        ),
        "conflicts without their quarantine row",
    )
    problem(
        "conflict-unrecorded",
        (
            k
            for k, n in conflicts_sent.items()
            if k not in _keys(in_quarantine) and (k, n) not in lapsed
        ),
        "conflicts missing from the quarantine destination",
    )
    operated = {
        str(r.get("message_id"))
        for r in extra.get("inbox_quarantine", [])
        if r.get("decided_by") == OPERATOR
    }
    problem(
        "record-contradicts",
        (
            k
            for k, (decision, _) in quarantined.items()
            if decision != "pending" and k not in operated
        ),
        "quarantine rows decided by nobody (not pending)",
    )
    problem(
        "record-contradicts",
        (
            k
            for k in quarantined
            if k not in conflicts_sent
            # a lapsed conflict's output: the same output id as its first payload's,
            # another payload, so downstream quarantines it (its claim was not purged)
            and not (k.startswith("out.") and len(lapsed) >= len(_outputs_quarantined(history)))
        ),
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
    # An expired intent is kept as poison before its handler runs, whatever that handler
    # does (misuse, validation): held to ``expired-*`` above, not to the workload's checks.
    fresh = {k: i for k, i in identified.items() if k not in expired}
    findings += _workload(history, fresh, effects, poison, dead, died, accepted, forgotten, lapsed)
    # Over a map: each intent applied in its tenant's database, and only there (a moved
    # tenant's, all of them in the database it moved to: none left behind).
    homes = {tenant: index for index, tenant in enumerate(TENANTS)}
    if history.extra.get("moved"):
        homes[MOVED] = 0
    for index, keys in enumerate(history.placements):
        problem(
            "misrouted",
            (k for k in keys if homes[tenant_of(k)] != index),
            f"intents applied in database d{index}, not their tenant's",
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
PG_STOPS = ("pg_fast", "pg_immediate", "pg_after_start", "pg_one_fast", "pg_one_immediate")
"""Faults that stop PostgreSQL for a while (``pg_terminate`` only ends its sessions)."""


def _stalled(schedule: Any) -> bool:
    """Whether a delivery may have been redelivered while still in flight: a broker that
    redelivers on a timer, and a network fault that holds a transaction past it, or a
    PostgreSQL outage behind PgBouncer (which holds a client's statements while the
    server is away, rather than failing them: its restart here takes seconds, whatever
    the fault's own duration)."""
    config = schedule.config
    timer = config.target in ("faststream-redis", "faststream-nats", "faststream-kafka")
    held = config.pooler == "pgbouncer" and any(f.kind in PG_STOPS for f in schedule.faults)
    return timer and (
        held or any(f.kind in STALLS and f.seconds >= STALLS[f.kind] for f in schedule.faults)
    )


def _died(history: History, identified: dict[str, Any]) -> set[str]:
    """Intents a redelivery limit may keep as poison: deliveries that ended without an
    outcome. A SIGKILLed worker (or one killed in its start-up) leaves any number of them.
    A SIGTERMed worker finishes what it has in hand, but leaves the messages it receives
    while stopping, and any still in hand when its graceful timeout ends, unacknowledged:
    each comes back redelivered, counted against its intent like a death's, one per copy
    and per stop (docs/explanation/limits.md, "What counts as a worker dying"). So where
    workers were only SIGTERMed, an intent is explained when its copies times the stops
    exceed the limit (seed 5009: three copies, two stops, a limit of 1); and so, with more
    than one worker process, do the database's outages."""
    config = history.schedule.config
    if config.redelivery_limit is None:
        return set()
    faults = history.schedule.faults
    if any(f.kind in ("worker_kill", "pg_after_start") for f in faults):
        return set(identified)
    stops = sum(f.kind == "worker_term" for f in faults)
    # The window limits.md leaves (same section): a delivery counted in the database just
    # before the database went away for its worker, whose hand-back that worker could
    # only remember, looks like a death to another worker's redelivery; at most once per
    # copy in flight and per outage (seed 910028: three processes, four outages, a limit
    # of 1, a batch handed back when its connection was cut).
    if config.processes > 1:
        stops += sum(f.kind in OUTAGES for f in faults)
    copies = Counter(key for _, key, kind, _ in history.sent if kind != "conflict")
    return {k for k in identified if copies[k] * stops > config.redelivery_limit}


def _allowed(config: Any, behaviour: str, killed: bool) -> set[str]:
    """Poison reasons the configuration explains for a handler that does nothing wrong:
    a redelivery limit, where workers ended leaving this message without an outcome
    (``killed``, see `_died`; a hand-back is never counted as a crash,
    docs/how-to/failures.md), and attempts for a handler that fails."""
    allowed = set()
    if config.redelivery_limit is not None and killed:
        allowed.add("redelivery_limit")
    if behaviour in ("transient", "sometimes", "deferred", "timelimit"):
        allowed.add("retries_exhausted")  # fails its first attempts, or by a coin
    return allowed


# -- the workload axes -----------------------------------------------------------------------

MARGIN = 2.0
"""Seconds of slack between an effect's time and its claim's ``processed_at``."""


def _batch_reasons(config: Any, intents: dict[str, Any], killed: bool) -> set[str]:
    """In a batch, a failure counts for each message of the batch (docs/how-to/
    faststream.md, "Batches"): the reasons the schedule's other messages explain."""
    if config.batch != "on":
        return set()
    reasons = {"retries_exhausted"}
    behaviours = {i.behaviour for i in intents.values()}
    if "permanent" in behaviours:
        reasons.add(REFUSED)
    if behaviours & MISUSES:
        reasons.add("handler_transaction")
    if config.redelivery_limit is not None and killed:
        reasons.add("redelivery_limit")
    return reasons


def _accepted(history: History, conflicts_sent: dict[str, int]) -> dict[str, int]:
    return {
        str(r["message_id"]): conflicts_sent[str(r["message_id"])]
        for r in history.extra.get("inbox_quarantine", [])
        if r.get("decision") == "accepted" and str(r.get("message_id")) in conflicts_sent
    }


def _last_purge(history: History) -> float | None:
    starts = [at for at, _ in history.extra.get("purges", [])]
    return max(starts) if starts else None


def _purgeable(history: History) -> set[str]:
    last = _last_purge(history)
    if last is None:
        return set()
    first = history.extra.get("first_effect", {})
    return {k for k, at in first.items() if at < last - PURGE_WINDOW + MARGIN}


def _forgotten(history: History) -> set[str]:
    """Keys applied again more than the purge's window after their first effect, once a
    purge had run: the purge may have deleted the claim before the copy came."""
    if _last_purge(history) is None:
        return set()
    times: dict[str, list[float]] = {}
    for key, _n, at in history.extra.get("effect_times", []):
        times.setdefault(key, []).append(at)
    return {
        k
        for k, ats in times.items()
        if len(ats) > 1 and max(ats) - min(ats) > PURGE_WINDOW - MARGIN
    }


def _outputs_quarantined(history: History) -> list[str]:
    return [m for m, _d, r in history.quarantine if m.startswith("out.")]


def _lapsed_conflicts(history: History, conflicts_sent: dict[str, int]) -> set[tuple[str, int]]:
    """Conflicts whose payload was applied more than the purge's window after their
    intent's first effect, once a purge had run: the purge may have deleted the claim the
    conflict would have met, and a message whose claim is gone is a first delivery
    (limits, "Memory is as long as the retention window"), as for a copy (`_forgotten`)."""
    if _last_purge(history) is None:
        return set()
    times: dict[str, list[tuple[int, float]]] = {}
    for key, n, at in history.extra.get("effect_times", []):
        times.setdefault(key, []).append((n, at))
    return {
        (k, n)
        for k, n in conflicts_sent.items()
        if any(
            m == n and at - min(a for _, a in times[k]) > PURGE_WINDOW - MARGIN
            for m, at in times.get(k, [])
        )
    }


def _workload(
    history: History,
    identified: dict[str, Any],
    effects: dict[str, list[int]],
    poison: dict[str, list[str]],
    dead: Counter[str],
    died: set[str],
    accepted: dict[str, int],
    forgotten: set[str],
    lapsed: set[tuple[str, int]],
) -> list[Finding]:
    config = history.schedule.config
    extra = history.extra
    findings: list[Finding] = []

    def problem(kind: str, keys: Any, what: str) -> None:
        keys = set(keys)
        if keys:
            findings.append(Finding(kind, f"{len(keys)} {what}: {_sample(keys)}"))

    if not extra:
        return findings
    behaviour = {k: i.behaviour for k, i in identified.items()}
    applied = {k for k in identified if effects.get(k)}

    def limits(key: str) -> set[str]:
        return {"redelivery_limit"} if key in died else set()

    # Extended handlers.
    problem(
        "misuse-applied",
        (k for k in applied if behaviour[k] in MISUSES),
        "handlers that ended the transaction or settled the message themselves, applied",
    )
    problem(
        "misuse-unrecorded",
        (
            f"{k} ({'/'.join(poison.get(k, [])) or 'no poison row'})"
            for k in identified
            if behaviour[k] in MISUSES
            and config.batch != "on"
            and not set(poison.get(k, [])) & ({"handler_transaction"} | limits(k))
        ),
        "misusing handlers not kept as poison handler_transaction",
    )
    problem(
        "dead-lettered-unexplained",
        (
            k
            for k in identified
            if dead[k] and k not in poison and behaviour[k] != "invalid" and k not in applied
        ),
        "intents dead-lettered without a poison row (only a body the handler's model refuses is)",
    )
    problem(
        "invalid-applied",
        (k for k in applied if behaviour[k] == "invalid"),
        "bodies refused by validation, applied",
    )
    problem(
        "poison-reason",
        (
            f"{k} ({'/'.join(poison[k])})"
            for k in identified
            if behaviour[k] == "invalid" and k in poison and not set(poison[k]) <= limits(k)
        ),
        "bodies refused by validation kept as poison (a body that does not fit is "
        "dead-lettered without a poison row)",
    )
    # Outputs, applied downstream once each.
    if config.outputs == "result" and "outputs" not in extra.get("not_available", []):
        downstream = Counter((k, n) for k, n, _via in extra.get("downstream", []))
        # A lapsed conflict's output meets its first payload's downstream: quarantined.
        expected = {(k, n) for k in applied for n in effects[k]} | set(accepted.items())
        expected -= lapsed
        problem(
            "output-missing",
            (f"{k}/{n}" for k, n in expected if not downstream[(k, n)]),
            "outputs of applied intents never applied downstream",
        )
        problem(
            "output-twice",
            (
                f"{k}/{n} ({c}x)"
                for (k, n), c in downstream.items()
                if c > 1 and k in identified and k not in forgotten
            ),
            "outputs applied more than once downstream",
        )
        problem(
            "output-uncommitted",
            (f"{k}/{n}" for (k, n) in downstream if k in identified and (k, n) not in expected),
            "outputs applied downstream for an intent that did not commit (or another payload)",
        )
    # The outbox: one effect per commit, dispatched, received.
    if "outbox" in extra:
        rows = extra["outbox"]
        per_key = Counter(str(k) for _e, k, _status in rows)
        received = {e: (k, n, d) for e, k, n, d in extra.get("received", [])}
        problem(
            "outbox-uncommitted",
            (k for k in per_key if k in identified and k not in applied),
            "outbox effects of intents that did not commit",
        )
        problem(
            "outbox-missing",
            (
                f"{k} ({per_key[k]} effects, {len(effects[k])} commits)"
                for k in applied
                if per_key[k] != len(effects[k]) + (k in accepted) and k not in forgotten
            ),
            "applied intents without one outbox effect per commit",
        )
        problem(
            "outbox-undispatched",
            (f"{e} ({status})" for e, _k, status in rows if status != "dispatched"),
            "outbox effects not dispatched once the run settled",
        )
        problem(
            "outbox-unreceived",
            (e for e, _k, status in rows if status == "dispatched" and e not in received),
            "outbox effects recorded dispatched that the remote never received",
        )
        problem(
            "outbox-uncommitted",
            (e for e in received if e not in {r[0] for r in rows}),
            "effects the remote received that are not in the outbox table",
        )
    # The operator's decisions.
    decided = {
        (kind, row_id): (action, status)
        for kind, row_id, action, _m, status in extra.get("decisions", [])
    }
    for table, kind in (("inbox_poison", "poison"), ("inbox_quarantine", "quarantine")):
        for row in extra.get(table, []):
            if row.get("decided_by") != OPERATOR:
                continue
            key = str(row.get("message_id"))
            _action, status = decided.get((kind, row.get("id")), ("", 1))
            if (
                row.get("decision") in ("redriven", "accepted")
                and status == 0
                and "published_at" in row
                and row["published_at"] is None
            ):
                findings.append(Finding("repair-unpublished", f"{kind} row {row['id']} ({key})"))
            if (
                kind == "quarantine"
                and row.get("decision") == "accepted"
                and key in identified
                and accepted.get(key)
                not in (n for k, n, _at in extra.get("effect_times", []) if k == key)
            ):
                findings.append(
                    Finding("accepted-not-applied", f"quarantine row {row['id']} ({key})")
                )
            if kind == "quarantine" and row.get("decision") in ("discarded", "redriven"):
                conflict = next(
                    (n for _, k, c, n in history.sent if k == key and c == "conflict"), None
                )
                if conflict is not None and conflict in effects.get(key, []):
                    findings.append(
                        Finding("discarded-applied", f"quarantine row {row['id']} ({key})")
                    )
            copies = [c for _, k, c, _ in history.sent if k == key]
            if (
                kind == "poison"
                and row.get("decision") == "redriven"
                and row.get("reason_code") != "outputs_undeliverable"
                and key in applied
                and "conflict" not in copies
                # the redriven copy went out (it marks the row, met as a duplicate too),
                # or no copy but the poisoned one could apply it (its claim marks the row)
                and (row.get("published_at") is not None or len(copies) == 1)
            ):
                findings.append(
                    Finding("redriven-not-recovered", f"poison row {row['id']} ({key}) applied")
                )
    # The purge.
    if extra.get("purges"):
        last = _last_purge(history)
        assert last is not None
        claims = Counter(history.claims)
        first = extra.get("first_effect", {})
        problem(
            "purge-too-young",
            (
                f"{k} (applied {last - first[k]:.1f}s before the last purge ended)"
                for k in applied
                if claims[k] == 0 and k in first and first[k] > last - PURGE_WINDOW + MARGIN
            ),
            f"claims deleted younger than the purge's window ({PURGE_WINDOW:.0f}s)",
        )
    return findings
