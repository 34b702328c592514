"""The chaos run's invariant, checked exactly against what was sent.

* every intent the handler accepts is applied once: one journal row with its first
  payload, one inbox row, and every account's balance is the sum of its intents;
* every conflict is quarantined: one quarantine row (identity, conflicting hash), and the
  message itself at the quarantine destination, with the conflicting payload;
* every refused intent is poison: one poison row with its reason code, never claimed,
  and the message itself at the dead-letter destination;
* nothing else is anywhere: no journal, inbox, quarantine or poison row, and no message
  at either destination, that the plan does not account for.

A destination may hold a message more than once (a worker killed after publishing there
and before acknowledging the original publishes it again); the set of intents must match.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .plan import Plan
from .targets import Found

__all__ = ["Ledger", "check"]

CONSUMER = "ledger"
REASON = "unknown_account"


@dataclass
class Ledger:
    applied: int = 0
    applied_twice: int = 0
    lost: int = 0
    wrong_balances: int = 0
    inbox_rows: int = 0
    quarantine_rows: int = 0
    poison_rows: int = 0
    quarantined_messages: int = 0
    dead_letters: int = 0
    problems: list[str] = field(default_factory=list)

    def expect(self, condition: bool, problem: str) -> None:
        if not condition:
            self.problems.append(problem)


def _sample(values: Any, limit: int = 5) -> str:
    values = sorted(values)
    more = f" and {len(values) - limit} more" if len(values) > limit else ""
    return ", ".join(map(str, values[:limit])) + more


def check(query: Any, plan: Plan, quarantined: Found, dead: Found) -> Ledger:
    """``query(sql)`` returns rows from the run's database."""
    ledger = Ledger()
    applied = {intent.message_id: intent for intent in plan.applied}
    refused = {intent.message_id: intent for intent in plan.refused}
    conflicts = {send.message_id: send for send in plan.conflicts}

    # The journal: one row per applied intent, with its first payload.
    journal: dict[str, list[tuple[int, int]]] = {}
    for message_id, account, delta in query(
        "SELECT message_id, account_id, delta FROM chaos_journal"
    ):
        journal.setdefault(message_id, []).append((account, delta))
    ledger.applied = sum(1 for m in journal if m in applied)
    twice = {m for m, rows in journal.items() if len(rows) > 1}
    ledger.applied_twice = len(twice)
    missing = applied.keys() - journal.keys()
    ledger.lost = len(missing)
    ledger.expect(not twice, f"applied more than once: {_sample(twice)}")
    ledger.expect(not missing, f"never applied: {_sample(missing)}")
    strange = journal.keys() - applied.keys()
    ledger.expect(not strange, f"applied but refused or unknown: {_sample(strange)}")
    wrong = {
        m
        for m, rows in journal.items()
        if m in applied and rows[0] != (applied[m].account, applied[m].delta)
    }
    ledger.expect(not wrong, f"applied with another payload than the first: {_sample(wrong)}")

    balances = dict(query("SELECT id, balance FROM chaos_accounts"))
    expected = plan.balances()
    off = {a for a in expected if balances.get(a) != expected[a]}
    ledger.wrong_balances = len(off)
    ledger.expect(
        not off and balances.keys() == expected.keys(),
        f"balances differ from the intents sent: accounts {_sample(off)}",
    )

    # The inbox: one claim per applied intent; a refused one never committed its claim.
    claims = Counter(
        (consumer, producer, tenant, message_id)
        for consumer, producer, tenant, message_id in query(
            "SELECT consumer_name, producer_name, tenant, message_id FROM consumer_inbox"
        )
    )
    ledger.inbox_rows = sum(claims.values())
    want = {(CONSUMER, "orders", "", m) for m in applied}
    ledger.expect(
        set(claims) == want and ledger.inbox_rows == len(want),
        f"inbox rows: {ledger.inbox_rows} for {len(want)} applied intents; "
        f"missing {_sample(m for *_, m in want - set(claims))}, "
        f"unexpected {_sample(m for *_, m in set(claims) - want)}",
    )

    # Quarantine rows: one per conflict, recording the conflicting hash, pending.
    rows = query(
        "SELECT message_id, stored_sha256 <> conflicting_sha256, decision, reason_code "
        "FROM inbox_quarantine WHERE consumer_name = 'ledger'"
    )
    ledger.quarantine_rows = len(rows)
    ids = Counter(row[0] for row in rows)
    ledger.expect(
        set(ids) == conflicts.keys() and len(rows) == len(conflicts),
        f"quarantine rows: {len(rows)} for {len(conflicts)} conflicts; "
        f"missing {_sample(conflicts.keys() - set(ids))}, "
        f"unexpected {_sample(set(ids) - conflicts.keys())}",
    )
    ledger.expect(
        all(
            differs and decision == "pending" and reason == "identity_conflict"
            for _, differs, decision, reason in rows
        ),
        "a quarantine row is not a pending identity conflict with two different hashes",
    )

    # Poison rows: one per refused intent, with the handler's reason code.
    rows = query("SELECT message_id, reason_code, decision FROM inbox_poison")
    ledger.poison_rows = len(rows)
    reasons = {message_id: reason for message_id, reason, _ in rows}
    ledger.expect(
        reasons.keys() == refused.keys() and len(rows) == len(refused),
        f"poison rows: {len(rows)} for {len(refused)} refused intents; missing "
        f"{_sample(refused.keys() - reasons.keys())}, "
        f"unexpected {_sample(reasons.keys() - refused.keys())}",
    )
    odd = {m: r for m, r in reasons.items() if r != REASON}
    ledger.expect(not odd, f"poison rows with another reason than {REASON}: {odd}")

    # The destinations: the conflicting messages, and the refused ones.
    ledger.quarantined_messages = len(quarantined)
    seen = {m for m, _ in quarantined}
    ledger.expect(
        seen == conflicts.keys(),
        f"quarantine destination: missing {_sample(conflicts.keys() - seen)}, "
        f"unexpected {_sample(seen - conflicts.keys())}",
    )
    odd_payloads = {
        m
        for m, payload in quarantined
        if m in conflicts
        and payload != {"account": conflicts[m].intent.account, "delta": conflicts[m].delta}
    }
    ledger.expect(not odd_payloads, f"quarantined with a wrong payload: {_sample(odd_payloads)}")
    ledger.dead_letters = len(dead)
    seen = {m for m, _ in dead}
    ledger.expect(
        seen == refused.keys(),
        f"dead-letter destination: missing {_sample(refused.keys() - seen)}, "
        f"unexpected {_sample(seen - refused.keys())}",
    )
    return ledger
