"""The explorer's pieces that need no server: the pairwise array covers every pair of
axis values, the outside report's configuration is in it, and the checker finds what it
is there to find in histories written by hand."""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from .check import check
from .domain import batch_effect_id
from .run import History
from .schedule import Fault, Intent, Schedule, draw
from .space import ISSUE_27, ROWS, WORKLOAD_AXES, Config, uncovered_pairs, valid
from .tenants import tenant_of
from .workload import MOVED, OPERATOR, Extras


def test_space__every_pair_of_axis_values_is_in_some_row() -> None:
    assert uncovered_pairs(ROWS) == set()
    assert all(valid(row) for row in ROWS)


def test_space__the_outside_report_is_row_zero_with_its_schedule() -> None:
    assert ROWS[0] == ISSUE_27
    schedule = draw(0)
    assert [(f.kind, f.seconds) for f in schedule.faults] == [
        ("pg_fast", 3.0),
        ("pg_after_start", 3.0),
    ]
    assert len(schedule.intents) == 405
    assert max(s.at for s in schedule.sends if s.kind == "first") < 0.3
    assert schedule.prefetch == 0


def test_schedule__a_seed_draws_the_same_schedule() -> None:
    assert draw(12).describe() == draw(12).describe()
    assert draw(12).describe() != draw(13).describe()


def _history(**config: object) -> History:
    defaults = {axis: values[0] for axis, values in WORKLOAD_AXES.items()}
    base = dict(ROWS[1]) | defaults | config
    intents = [Intent("a", "ok", 1), Intent("b", "permanent", 2), Intent("c", "ok", 3)]
    schedule = Schedule(1, Config(**base), intents, [], [], [])  # type: ignore[arg-type]
    history = History(schedule, settled=True)
    history.sent = [(0.0, i.key, "first", i.n) for i in intents]
    return history


def _kinds(history: History) -> list[str]:
    return sorted({f.kind for f in check(history)})


def test_check__a_history_as_promised_has_no_finding() -> None:
    history = _history()
    history.effects = [("a", "a", 1), ("c", "c", 3)]
    history.claims = ["a", "c"]
    history.poison = [("b", "explore_refused", "pending")]
    assert check(history) == []


def test_check__loss_doubles_and_contradicting_records_are_findings() -> None:
    history = _history()
    # a applied twice; c never applied nor recorded; b poisoned for another reason and
    # claimed; the broker still holds a message
    history.effects = [("a", "a", 1), ("a", "a", 1)]
    history.claims = ["a", "b"]
    history.poison = [("b", "retries_exhausted", "pending")]
    history.leftover = {"q": 1}
    history.remaining = [{"key": "x"}]
    assert _kinds(history) == [
        "left-in-broker",
        "lost",
        "poison-reason",
        "record-contradicts",
        "refused-unrecorded",
        "twice",
    ]


def test_check__over_a_map_an_intent_applied_outside_its_tenants_database_is_misrouted() -> None:
    history = _history(databases="map")
    history.effects = [("a", "a", 1), ("c", "c", 3)]
    history.claims = ["a", "c"]
    history.poison = [("b", "explore_refused", "pending")]
    placed: list[list[str]] = [[], []]
    for key in ("a", "c"):
        placed[int(tenant_of(key)[1:])].append(key)
    history.placements = placed
    assert check(history) == []
    history.placements = [placed[1], placed[0]]  # each in the other tenant's database
    assert _kinds(history) == ["misrouted"]


def test_check__after_a_move_every_intent_of_the_moved_tenant_is_in_its_new_database() -> None:
    history = _history(databases="map", operator="move")
    history.effects = [("a", "a", 1), ("c", "c", 3)]
    history.claims = ["a", "c"]
    history.poison = [("b", "explore_refused", "pending")]
    assert {tenant_of(key) for key in ("a", "c")} == {MOVED}
    history.extra["moved"] = True
    history.placements = [["a", "c"], []]  # both in d0, where the moved tenant lives now
    assert check(history) == []
    history.placements = [["a"], ["c"]]  # one left behind
    assert _kinds(history) == ["misrouted"]
    history.extra["moved"] = False  # the move did not happen: its tenant's own database
    assert _kinds(history) == ["misrouted"]
    history.placements = [[], ["a", "c"]]
    assert check(history) == []


def test_check__an_unsettled_run_is_stuck() -> None:
    history = _history()
    history.settled = False
    history.effects = [("a", "a", 1), ("c", "c", 3)]
    history.claims = ["a", "c"]
    history.poison = [("b", "explore_refused", "pending")]
    assert _kinds(history) == ["stuck"]


def test_check__conflicts_and_messages_without_identity_are_held_to_their_policy() -> None:
    history = _history(missing_identity="reject")
    history.schedule.intents.append(Intent("d", "no-identity", 4))
    history.sent += [(0.0, "d", "first", 4), (1.0, "a", "conflict", 9)]
    history.effects = [("a", "a", 1), ("c", "c", 3), ("d", None, 4)]
    history.claims = ["a", "c"]
    history.poison = [("b", "explore_refused", "pending")]
    # the conflict reached neither the quarantine table nor its destination
    assert _kinds(history) == ["conflict-unrecorded", "lost", "unidentified-applied"]
    history.quarantine = [("a", "pending", "identity_conflict")]
    history.destinations = {"quarantine": [{"key": "a", "n": 9}], "dead-letter": [{"key": "d"}]}
    history.effects.remove(("d", None, 4))
    assert check(history) == []


def test_check__an_intent_still_in_the_broker_is_unsettled_not_lost() -> None:
    history = _history()
    history.effects = [("a", "a", 1)]
    history.claims = ["a"]
    history.poison = [("b", "explore_refused", "pending")]
    history.leftover = {"q": 1}
    history.remaining = [{"key": "c", "do": "ok", "n": 3}]
    assert _kinds(history) == ["left-in-broker", "unsettled"]
    history.remaining = None  # a broker that cannot name what it holds
    assert _kinds(history) == ["left-in-broker", "lost-or-left"]


def test_check__a_redelivery_limit_poisons_only_where_a_worker_died() -> None:
    history = _history(redelivery_limit=5)
    history.effects = [("a", "a", 1)]
    history.claims = ["a"]
    history.poison = [("b", "explore_refused", "pending"), ("c", "redelivery_limit", "pending")]
    # no worker was killed: the outage's hand-backs are not crashes
    assert _kinds(history) == ["poison-reason"]
    history.schedule.faults.append(Fault(1.0, "worker_kill"))
    assert check(history) == []


def test_check__after_sigterms_a_redelivery_limit_is_explained_by_copies_times_stops() -> None:
    # A stopping worker leaves the messages it receives while stopping unacknowledged:
    # each copy comes back counted against its intent, once per stop (seed 5009)
    history = _history(redelivery_limit=1)
    history.effects = [("a", "a", 1)]
    history.claims = ["a"]
    history.poison = [("b", "explore_refused", "pending"), ("c", "redelivery_limit", "pending")]
    history.schedule.faults.append(Fault(3.7, "worker_term"))
    # c sent once, one stop: at most one delivery without an outcome, within the limit
    assert _kinds(history) == ["poison-reason"]
    # c sent three times around that stop: up to three
    history.sent += [(3.6, "c", "duplicate", 3), (3.7, "c", "concurrent", 3)]
    assert check(history) == []
    # c sent once, two stops: up to two
    history.sent = history.sent[:3]
    history.schedule.faults.append(Fault(11.5, "worker_term"))
    assert check(history) == []
    # a refused intent likewise
    history.poison = [("b", "redelivery_limit", "pending"), ("c", "redelivery_limit", "pending")]
    assert check(history) == []
    history.schedule.faults.pop()
    assert _kinds(history) == ["poison-reason", "refused-unrecorded"]


def test_check__with_processes_an_outage_counts_like_a_stop_once_per_copy() -> None:
    # limits.md, "What counts as a worker dying": a hand-back made while the database was
    # away from its worker is remembered by that worker only; another worker's redelivery
    # takes the delivery for a death, once per copy in flight and per outage (seed 910028)
    history = _history(redelivery_limit=1, processes=3)
    history.effects = [("a", "a", 1)]
    history.claims = ["a"]
    history.poison = [("b", "explore_refused", "pending"), ("c", "redelivery_limit", "pending")]
    history.schedule.faults.append(Fault(7.7, "net_cut"))
    # c sent once, one outage: at most one, within the limit
    assert _kinds(history) == ["poison-reason"]
    history.schedule.faults.append(Fault(9.0, "pg_fast", seconds=1.5))
    assert check(history) == []
    # one process: its own memory knows the hand-back, whatever the outages
    history.schedule = replace(
        history.schedule, config=replace(history.schedule.config, processes=1)
    )
    assert _kinds(history) == ["poison-reason"]


def test_check__a_refused_intent_may_meet_the_redelivery_limit_only_after_a_kill() -> None:
    history = _history(redelivery_limit=1)
    history.effects = [("a", "a", 1), ("c", "c", 3)]
    history.claims = ["a", "c"]
    history.poison = [("b", "redelivery_limit", "pending")]
    assert _kinds(history) == ["poison-reason", "refused-unrecorded"]
    history.schedule.faults.append(Fault(1.0, "pg_after_start"))
    assert check(history) == []


def test_check__a_copy_applied_after_an_earlier_copy_was_poisoned_is_documented() -> None:
    # Given intent a sent twice: its first copy poisoned, its later copy applied
    history = _history(max_attempts=2)
    history.sent.append((1.0, "a", "duplicate", 1))
    history.effects = [("a", "a", 1), ("c", "c", 3)]
    history.claims = ["a", "c"]
    history.poison = [("a", "retries_exhausted", "pending"), ("b", "explore_refused", "pending")]
    # Then that is the documented limit, not a finding
    assert "poisoned-and-applied" not in _kinds(history)
    # Unless its row, still pending, was written well before the effect: the applying
    # copy's claim must have marked it recovered
    history.poison_lead = {"a": 5.0}
    assert "poisoned-copy-pending" in _kinds(history)
    history.poison_lead = {"a": 0.3}
    assert "poisoned-copy-pending" not in _kinds(history)
    # But one copy sent, applied and poisoned is one
    history.sent = [s for s in history.sent if s[2] != "duplicate"]
    assert "poisoned-and-applied" in _kinds(history)


def test_check__an_intent_stamped_older_than_the_window_is_poison_never_applied() -> None:
    history = _history()
    history.schedule.skews = {"a": -3 * 3600.0, "b": -3 * 3600.0, "c": 3 * 3600.0}
    # a and b expired: kept as poison for that reason (b's own refusal never ran); c is
    # stamped ahead of the true time, within any window: applied as usual.
    history.effects = [("c", "c", 3)]
    history.claims = ["c"]
    history.poison = [("a", "expired_redelivery", "pending"), ("b", "expired_redelivery", "")]
    assert check(history) == []
    history.effects.append(("a", "a", 1))
    history.claims.append("a")
    history.poison = [("a", "expired_redelivery", "pending"), ("b", "explore_refused", "")]
    assert {"expired-applied", "expired-unrecorded", "poison-reason"} <= set(_kinds(history))


def test_schedule__the_infrastructure_axes_draw_their_faults_and_clock() -> None:
    for seed, row in enumerate(ROWS):
        schedule = draw(seed)
        kinds = {f.kind for f in schedule.faults}
        if row["infra_fault"] != "none":
            assert row["infra_fault"] in kinds
        assert schedule.proxied == bool(kinds & {"net_cut", "net_delay", "net_blackhole"})
        assert ("pooler_restart" in kinds) <= (row["pooler"] == "pgbouncer")
        assert (schedule.skews is None) == (row["clock"] == "none")
        assert (row["queues"] == "n/a") == (not row["target"].endswith("rabbitmq"))


def test_schedule__over_a_map_one_databases_server_stops_alone() -> None:
    for seed, row in enumerate(ROWS):
        schedule = draw(seed)
        alone = [f for f in schedule.faults if f.kind.startswith("pg_one")]
        if row["databases"] == "map":
            assert 1 <= len(alone) <= 2
            assert all(f.database in (0, 1) and f.seconds > 0 for f in alone)
        else:
            assert alone == []


def test_check__a_stalled_delivery_redelivered_in_flight_counts_as_two_copies() -> None:
    # FastStream on Redis streams: a black hole of 8 s holds a delivery past the reclaim's
    # min_idle_time; the reclaimed delivery fails its last attempt (poison) while the
    # stalled one applies. Two copies in flight together (limits.md), not one message
    # ending in two places; a row left pending well before the effect still is a finding.
    history = _history(target="faststream-redis", queues="n/a", guard="on")
    history.schedule.faults = [Fault(1.0, "net_blackhole", seconds=8.0)]
    history.schedule.intents[0] = Intent("a", "transient", 1)
    history.effects = [("a", "a", 1), ("c", "c", 3)]
    history.claims = ["a", "c"]
    history.poison = [("b", "explore_refused", "pending"), ("a", "retries_exhausted", "recovered")]
    assert check(history) == []
    history.poison_lead = {"a": 5.0}
    history.poison[1] = ("a", "retries_exhausted", "pending")
    assert _kinds(history) == ["poisoned-copy-pending"]
    history.schedule.faults = []
    assert "poisoned-and-applied" in _kinds(history)


def test_check__a_broker_restart_requeues_what_is_in_flight_two_copies() -> None:
    # Seed 930033: RabbitMQ restarted requeues the deliveries a worker still processes; a
    # requeued copy kept as poison (its row recovered) while the other applies is two
    # copies in flight, not one message ending in two places.
    history = _history(target="dramatiq-rabbitmq", queues="quorum")
    history.effects = [("a", "a", 1), ("c", "c", 3)]
    history.claims = ["a", "c"]
    history.poison = [("b", "explore_refused", "pending"), ("a", "redelivery_limit", "recovered")]
    history.schedule.config = replace(history.schedule.config, redelivery_limit=1)
    history.schedule.faults = [Fault(1.0, "worker_kill")]
    assert "poisoned-and-applied" in _kinds(history)
    history.schedule.faults.append(Fault(2.0, "broker_restart"))
    assert "poisoned-and-applied" not in _kinds(history)


# -- the workload axes -----------------------------------------------------------------------


def test_space__the_workload_axes_hold_their_rules() -> None:
    # A batch only where FastStream has batch subscribers, and never with a publisher
    # (refused at start-up); row 0 keeps the earlier space's defaults.
    assert not valid({"target": "faststream-rabbitmq", "batch": "on"})
    assert not valid({"target": "dramatiq-redis", "batch": "on"})
    assert not valid({"batch": "on", "outputs": "result"})
    assert valid({"target": "faststream-nats", "batch": "on", "outputs": "none"})
    # Across the two blocks: the explorer wires neither a batch nor outputs on Kafka, and
    # RabbitMQ's queues (classic or quorum) have no batch subscriber
    assert not valid({"target": "faststream-kafka", "batch": "on"})
    assert not valid({"target": "faststream-kafka", "outputs": "result"})
    assert valid({"target": "faststream-kafka", "outputs": "none", "handlers": "extended"})
    assert not valid({"queues": "quorum", "batch": "on"})
    assert {ROWS[0][axis] for axis in WORKLOAD_AXES} == {
        "off",
        "none",
        "basic",
        "library",
        "sync",
        "one",
    }
    # async actors are Dramatiq's
    assert not valid({"target": "faststream-nats", "actor": "async"})
    assert not valid({"guard": "on", "actor": "async"})
    assert valid({"target": "dramatiq-redis", "actor": "async", "handlers": "extended"})
    # over a map: identified messages, no batch
    assert not valid({"databases": "map", "missing_identity": "process"})
    assert not valid({"databases": "map", "batch": "on"})
    assert valid({"databases": "map", "outbox": "on", "operator": "purge"})
    assert valid({"databases": "map", "operator": "repair"})
    assert valid({"databases": "map", "target": "dramatiq-redis", "actor": "async"})
    for axis, values in WORKLOAD_AXES.items():
        assert {row[axis] for row in ROWS} == set(values)


def test_check__misusing_handlers_are_poisoned_never_applied() -> None:
    history = _history()
    history.schedule.intents.append(Intent("m", "msg_ack", 5))
    history.sent.append((0.0, "m", "first", 5))
    history.effects = [("a", "a", 1), ("c", "c", 3), ("m", "m", 5)]
    history.claims = ["a", "c", "m"]
    history.poison = [("b", "explore_refused", "pending")]
    history.extra = {"not_available": []}
    assert {"misuse-applied", "misuse-unrecorded"} <= set(_kinds(history))
    history.effects.remove(("m", "m", 5))
    history.claims.remove("m")
    history.poison.append(("m", "handler_transaction", "pending"))
    assert check(history) == []


def test_check__outputs_are_applied_downstream_once_and_only_for_commits() -> None:
    history = _history(outputs="result")
    history.effects = [("a", "a", 1), ("c", "c", 3)]
    history.claims = ["a", "c"]
    history.poison = [("b", "explore_refused", "pending")]
    history.extra = {"downstream": [("a", 1, "publisher"), ("a", 1, "publisher")]}
    history.extra["downstream"].append(("b", 2, "publisher"))
    assert _kinds(history) == ["output-missing", "output-twice", "output-uncommitted"]
    history.extra["downstream"] = [("a", 1, "publisher"), ("c", 3, "publisher")]
    assert check(history) == []


def test_check__an_outbox_effect_per_commit_dispatched_and_received() -> None:
    history = _history(outbox="on")
    history.effects = [("a", "a", 1), ("c", "c", 3)]
    history.claims = ["a", "c"]
    history.poison = [("b", "explore_refused", "pending")]
    history.extra = {
        "outbox": [("fx-a", "a", "dispatched"), ("fx-b", "b", "pending")],
        "received": [("fx-z", "z", 9, 1)],
    }
    assert _kinds(history) == [
        "outbox-missing",
        "outbox-uncommitted",
        "outbox-undispatched",
        "outbox-unreceived",
    ]
    history.extra = {
        "outbox": [("fx-a", "a", "dispatched"), ("fx-c", "c", "dispatched")],
        "received": [("fx-a", "a", 1, 2), ("fx-c", "c", 3, 1)],
    }
    assert check(history) == []


def test_check__operator_decisions_leave_their_documented_records() -> None:
    # Given a conflict on a that the operator accepted: its payload is an intent of its
    # own, applied once under its new id
    history = _history(operator="repair")
    history.sent.append((1.0, "a", "conflict", 9))
    history.effects = [("a", "a", 1), ("c", "c", 3), ("a", "a+accepted-1", 9)]
    history.claims = ["a", "c", "a+accepted-1"]
    history.poison = [("b", "explore_refused", "pending")]
    history.quarantine = [("a", "accepted", "identity_conflict")]
    history.destinations = {"quarantine": [{"key": "a", "n": 9}]}
    row = {"id": 1, "message_id": "a", "decided_by": OPERATOR, "published_at": "now"}
    history.extra = {
        "inbox_quarantine": [row | {"decision": "accepted"}],
        "decisions": [("quarantine", 1, "accept", "a", 0)],
        "effect_times": [("a", 1, 0.0), ("c", 3, 0.0), ("a", 9, 1.0)],
    }
    assert check(history) == []
    # Not published though the CLI said it was: a finding
    history.extra["inbox_quarantine"] = [row | {"decision": "accepted", "published_at": None}]
    assert _kinds(history) == ["repair-unpublished"]
    # Discarded instead, and its payload applied all the same: a finding
    history.quarantine = [("a", "discarded", "identity_conflict")]
    history.extra["inbox_quarantine"] = [row | {"decision": "discarded"}]
    history.claims.remove("a+accepted-1")
    assert "discarded-applied" in _kinds(history)


def test_check__a_redriven_row_whose_intent_applied_is_recovered_whichever_copy_applied_it() -> (
    None
):
    # Given b, which fails now and then, poisoned, redriven by the operator, and applied:
    # by its redriven copy, or by a copy the producer sent again (or the broker
    # redelivered) before it
    history = _history(operator="repair")
    history.schedule.intents[1] = Intent("b", "transient", 2)
    history.effects = [("a", "a", 1), ("c", "c", 3), ("b", "b", 2)]
    history.claims = ["a", "c", "b"]
    history.poison = [("b", "retries_exhausted", "recovered")]
    row = {"id": 1, "message_id": "b", "decided_by": OPERATOR, "published_at": "now"}
    history.extra = {
        "inbox_poison": [row | {"decision": "recovered", "reason_code": "retries_exhausted"}],
        "decisions": [("poison", 1, "redrive", "b", 0)],
    }
    for copies in (1, 2):
        history.sent = history.sent[:3] + [(1.0, "b", "duplicate", 2)] * (copies - 1)
        assert check(history) == []
        # Still redriven once it applied: a finding, sent once or twice
        redriven = {"decision": "redriven", "reason_code": "retries_exhausted"}
        history.extra["inbox_poison"] = [row | redriven]
        assert _kinds(history) == ["redriven-not-recovered"]
        history.extra["inbox_poison"] = [row | redriven | {"decision": "recovered"}]
    # Nor where the redriven copy never went out and another copy applied b before the
    # row was written (the two in flight together): nothing is left to mark it
    history.extra["inbox_poison"] = [row | redriven | {"published_at": None}]
    assert "redriven-not-recovered" not in _kinds(history)
    # But not where a copy carried another payload (a conflict: the row may be its own)
    history.sent.append((2.0, "b", "conflict", 9))
    history.extra["inbox_poison"] = [row | redriven]
    assert "redriven-not-recovered" not in _kinds(history)


def test_check__a_purge_keeps_claims_younger_than_its_window() -> None:
    history = _history(operator="purge")
    history.effects = [("a", "a", 1), ("c", "c", 3)]
    history.claims = []
    history.poison = [("b", "explore_refused", "pending")]
    # a applied 30 s before the last purge ended (older than the window), c 1 s before
    history.extra = {"purges": [(100.0, 0)], "first_effect": {"a": 70.0, "c": 99.0}}
    assert _kinds(history) == ["purge-too-young", "record-contradicts"]
    # A copy applied again 20 s after the first, once its claim could be purged: the
    # documented window, not twice
    history.claims = ["c"]
    history.effects.append(("a", "a", 1))
    history.extra["effect_times"] = [("a", 1, 70.0), ("a", 1, 90.0), ("c", 3, 99.0)]
    assert check(history) == []


def test_check__a_conflict_applied_after_a_purge_forgot_its_claim_is_the_window() -> None:
    # Seed 5002: a conflict on c sent once c committed, delivered after the workers'
    # restarts and an outage, when a purge had deleted c's claim: a first delivery
    history = _history(operator="purge")
    history.sent.append((2.0, "c", "conflict", 9))
    history.effects = [("a", "a", 1), ("c", "c", 3), ("c", "c", 9)]
    history.claims = ["a", "c"]
    history.poison = [("b", "explore_refused", "pending")]
    history.extra = {
        "purges": [(100.0, 0)],
        "first_effect": {"a": 70.0, "c": 70.0},
        "effect_times": [("a", 1, 70.0), ("c", 3, 70.0), ("c", 9, 90.0)],
    }
    assert check(history) == []
    # Applied 1 s after the first payload, within the window: the claim was there
    history.extra["effect_times"] = [("a", 1, 70.0), ("c", 3, 70.0), ("c", 9, 71.0)]
    assert _kinds(history) == ["conflict-unrecorded", "twice", "wrong-payload"]


def test_check__a_lapsed_conflicts_output_is_quarantined_downstream() -> None:
    # Seed 5017: the lapsed conflict's output has its first payload's output id and
    # another payload; downstream, whose claims no purge deleted, quarantines it
    history = _history(operator="purge", outputs="result")
    history.sent.append((2.0, "c", "conflict", 9))
    history.effects = [("a", "a", 1), ("c", "c", 3), ("c", "c", 9)]
    history.claims = ["a", "c"]
    history.poison = [("b", "explore_refused", "pending")]
    history.quarantine = [("out.result.0.f00", "pending", "identity_conflict")]
    history.extra = {
        "purges": [(100.0, 0)],
        "first_effect": {"a": 70.0, "c": 70.0},
        "effect_times": [("a", 1, 70.0), ("c", 3, 70.0), ("c", 9, 90.0)],
        "downstream": [("a", 1, "publisher"), ("c", 3, "publisher")],
    }
    assert check(history) == []
    # No lapsed conflict to explain it: a finding
    history.extra["effect_times"] = [("a", 1, 70.0), ("c", 3, 70.0), ("c", 9, 71.0)]
    assert "record-contradicts" in _kinds(history)


def test_check__an_expired_misusing_handler_is_kept_as_expired_poison() -> None:
    # Seed 5006: a handler that would settle its message itself, stamped three hours
    # behind: kept as poison expired_redelivery before it runs, as any expired intent
    history = _history(handlers="extended", clock="skewed")
    history.schedule.intents.append(Intent("m", "msg_ack", 5))
    history.schedule.skews = {"a": 0.0, "b": 0.0, "c": 0.0, "m": -3 * 3600.0}
    history.sent.append((0.0, "m", "first", 5))
    history.effects = [("a", "a", 1), ("c", "c", 3)]
    history.claims = ["a", "c"]
    history.poison = [("b", "explore_refused", "pending"), ("m", "expired_redelivery", "")]
    history.extra = {"not_available": []}
    assert check(history) == []
    history.poison[-1] = ("m", "retries_exhausted", "")
    assert _kinds(history) == ["expired-unrecorded", "poison-reason"]


def test_check__a_failure_at_commit_meets_max_attempts_like_any_failure() -> None:
    # Given a handler whose first two COMMITs fail (a deferred constraint), max_attempts=2
    history = _history(max_attempts=2, handlers="extended")
    history.schedule.intents.append(Intent("d", "deferred", 4))
    history.sent.append((0.0, "d", "first", 4))
    history.effects = [("a", "a", 1), ("c", "c", 3)]
    history.claims = ["a", "c"]
    history.poison = [("b", "explore_refused", "pending"), ("d", "retries_exhausted", "pending")]
    # Then its poison row is what the limit explains (seed 3108 said otherwise)
    assert check(history) == []


def test_check__an_intent_dead_lettered_without_its_poison_row_is_a_finding() -> None:
    # Seed 3114: every message of a batch handler delivered one by one, not fitting it
    history = _history()
    history.effects = [("a", "a", 1)]
    history.claims = ["a"]
    history.poison = [("b", "explore_refused", "pending")]
    history.destinations = {"dead-letter": [{"key": "b"}, {"key": "c"}]}
    history.extra = {"not_available": []}
    assert _kinds(history) == ["dead-lettered-unexplained"]


def test_check__a_batch_poisoned_beside_its_copy_applied_in_another_batch_is_two_copies() -> None:
    # Seed 29195: FastStream on Redis streams, a batch subscriber, PostgreSQL stopped
    # behind PgBouncer. Batches held in flight past the reclaim's min_idle_time while
    # PgBouncer waited for the server were reclaimed into other batches: a, sent once,
    # was in a batch that a misusing handler (b) failed, and in another that applied it.
    # The failed batch's poison row for a, written once the other had committed, is
    # `recovered` (limits.md, "A poisoned copy and a later copy"): two copies in flight.
    history = _history(
        target="faststream-redis", queues="n/a", guard="off", batch="on", pooler="pgbouncer"
    )
    history.schedule.intents[1] = Intent("b", "commit", 2)
    history.schedule.faults = [Fault(0.3, "pg_fast", seconds=3.0)]
    history.effects = [("a", "a", 1), ("c", "c", 3)]
    history.claims = ["a", "c"]
    history.poison = [("a", "handler_transaction", "recovered"), ("b", "handler_transaction", "")]
    assert check(history) == []
    # A row left pending well before the effect still is a finding
    history.poison[0] = ("a", "handler_transaction", "pending")
    history.poison_lead = {"a": 5.0}
    assert _kinds(history) == ["poisoned-copy-pending"]
    # So is the same without anything that delivers a message sent once twice
    history.poison[0] = ("a", "handler_transaction", "recovered")
    history.poison_lead = {}
    history.schedule.faults = []
    assert _kinds(history) == ["poisoned-and-applied"]
    # Directly to PostgreSQL, its outage fails the statements at once: no stall
    history.schedule.faults = [Fault(0.3, "pg_fast", seconds=3.0)]
    history.schedule.config = replace(history.schedule.config, pooler="direct")
    assert _kinds(history) == ["poisoned-and-applied"]
    # A worker SIGKILLed after the rows, before the ack: the batch comes back, and its
    # messages, in other batches, may be applied
    history.schedule.faults = [Fault(1.0, "worker_kill", worker=0)]
    assert check(history) == []
    # So may a SIGTERMed one's (seed 615205: three forked processes, stopped one by one,
    # the batch reclaimed after the restart holding messages acked by none)
    history.schedule.faults = [Fault(1.0, "worker_term", worker=0)]
    assert check(history) == []


def test_extras__the_faults_end_after_the_operator_decision_under_way(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Seed 800045: a `quarantine accept` begun before the end of the faults ended after
    # the workers had stopped, so nothing applied what it sent. The settling begins once
    # the decision under way has ended.
    schedule = draw(1)
    schedule = replace(schedule, config=replace(schedule.config, operator="repair", outbox="off"))
    env = {"EXPLORE_BROKER_URL": "redis://unused", "EXPLORE_QUEUE": "unused"}
    extras = Extras(schedule, "postgresql://unused", env, tmp_path, {"repair"}, None)
    deciding = threading.Event()
    rows = [[{"id": 7, "consumer_name": "explore", "message_id": "m7"}]]
    monkeypatch.setattr(
        extras, "_pending", lambda kind: rows.pop() if rows and kind == "quarantine" else []
    )

    def accept(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        deciding.set()
        time.sleep(1.5)  # a CLI command starting on a loaded machine
        return subprocess.CompletedProcess(list(args), 0, "", "")

    monkeypatch.setattr(extras, "_cli", accept)
    extras.start(time.monotonic())
    assert deciding.wait(10)
    extras.end_of_faults()
    assert [d[0] for d in extras.decisions] == ["quarantine"]
    extras.stop()


def test_harness__an_accepted_conflict_in_a_batch_records_an_outbox_effect_of_its_own() -> None:
    # Seed 223125: the batch's effect id was the key's alone, so the accepted conflict's
    # effect (the same key, another payload) was taken for the first one's and dropped.
    first = {"key": "s1-0027", "n": 27, "do": "ok"}
    accepted = {**first, "n": 1027}
    assert batch_effect_id(first) != batch_effect_id(accepted)
    assert batch_effect_id(first) == batch_effect_id(dict(first))
