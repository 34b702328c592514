"""``inbox-middleware status`` and ``explain`` on a seeded PostgreSQL database: their JSON
checked against the published schemas, their figures against what was seeded, and the
estimates a big inbox gets checked against the exact figures."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner
from sqlalchemy import text

from inbox_middleware import outbox
from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Decision, Delivery
from inbox_middleware._operate import explain as explaining
from inbox_middleware._operate import status as reading
from inbox_middleware._operate.metrics import metrics, serve
from inbox_middleware._operate.retention import RetentionPolicy, record_policy
from inbox_middleware._storage import Inbox, InboxSchema, inspection
from inbox_middleware._storage.failures import FailureRecorder
from inbox_middleware.cli import main


def delivery(consumer: str, producer: str, message_id: str, payload: Any) -> Delivery:
    return Delivery(
        consumer,
        MessageIdentity(producer, message_id),
        hash_json(payload, "json.v1"),
        handler_version="3",
    )


@pytest.fixture
def seeded(pg_engine) -> dict[str, Any]:
    """Two consumers with claims, a conflict delivered twice, a poison message, outbox
    effects pending and failed, and recorded retention policies."""
    billing, shipping = f"billing-{uuid.uuid4().hex[:6]}", f"shipping-{uuid.uuid4().hex[:6]}"
    inbox = Inbox(pg_engine)

    def effect(session: Any) -> None:
        outbox.add(session, destination="mail", payload={"to": "a@example.org"})

    for consumer, producer, message_id in [
        (billing, "orders", "ord-1"),
        (billing, "orders", "ord-2"),
        (billing, "orders", "ord-3"),
        (billing, "shop", "s-1"),
        (shipping, "orders", "ord-1"),
        (shipping, "orders", "ord-2"),
    ]:
        handler = effect if (consumer, message_id) == (billing, "ord-1") else (lambda s: None)
        inbox.process(delivery(consumer, producer, message_id, {"id": message_id}), handler)
    for _ in range(2):  # the same conflicting payload, delivered twice
        outcome = inbox.process(delivery(billing, "orders", "ord-1", {"id": "other"}), print)
        assert outcome.decision is Decision.CONFLICT
    poisoned = delivery(shipping, "orders", "ord-9", {"id": "ord-9"})
    recorder = FailureRecorder(InboxSchema(), "postgresql")
    with pg_engine.begin() as conn:
        attempts = recorder.count_failure(conn, poisoned, "ValueError: bad")
        recorder.record_poison(
            conn,
            poisoned,
            reason_code="unknown_account",
            error="ValueError: bad",
            attempts=attempts,
        )
        record_policy(
            conn,
            InboxSchema(),
            RetentionPolicy(broker_retention=timedelta(days=7)),
            consumer="*",
            by="test",
        )
        record_policy(
            conn,
            InboxSchema(),
            RetentionPolicy(producer_retry=timedelta(days=2)),
            consumer=billing,
            by="test",
        )
        conn.execute(
            text(
                "INSERT INTO message_outbox (effect_id, destination, payload, status, created_at) "
                "VALUES ('fx-old', 'mail', '{}', 'pending', now() - interval '1 hour'), "
                "('fx-dead', 'sms', '{}', 'failed', now())"
            )
        )
    return {"billing": billing, "shipping": shipping}


def cli(pg_url: str, *args: str) -> Any:
    result = CliRunner().invoke(main, [*args, "--database-url", pg_url])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    return result.output


def consumer_entry(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in data["consumers"] if c["consumer"] == name)


def producer_entry(consumer: dict[str, Any], name: str) -> dict[str, Any]:
    return next(p for p in consumer["producers"] if p["producer"] == name)


def valid_times(value: Any) -> None:
    """Every ``*_at`` string parses as an ISO 8601 time with a zone."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key.endswith("_at") or key == "horizon":
                assert item is None or datetime.fromisoformat(item).tzinfo is not None, key
            valid_times(item)
    elif isinstance(value, list):
        for item in value:
            valid_times(item)


def test_status__json_follows_the_schema_and_counts_what_was_seeded(pg_url, seeded):
    data = json.loads(cli(pg_url, "status", "--json", "--window", "15m"))
    jsonschema.Draft202012Validator(reading.SCHEMA).validate(data)
    valid_times(data)
    billing, shipping = (consumer_entry(data, seeded[k]) for k in ("billing", "shipping"))

    assert data["exact"] is True and data["window_seconds"] == 900
    assert (data["inbox"]["rows"], data["inbox"]["rows_estimated"]) == (6, False)
    assert 0 <= data["inbox"]["oldest_claim_age_seconds"] < 300
    tables = {t["table"]: t for t in data["tables"]}
    assert tables["consumer_inbox"]["rows"] == 6 and tables["consumer_inbox"]["bytes"] > 0
    assert (billing["claims"], billing["recent_claims"]) == (4, 4)
    assert billing["claims_per_second"] == pytest.approx(4 / 900)
    orders = producer_entry(billing, "orders")
    assert (orders["claims"], orders["conflicts"], orders["conflicting_deliveries"]) == (3, 1, 2)
    assert producer_entry(billing, "shop")["claims"] == 1
    assert (billing["quarantine_pending"], billing["poison_pending"]) == (1, 0)
    assert (shipping["claims"], shipping["poison_pending"], shipping["quarantine_pending"]) == (
        2,
        1,
        0,
    )
    assert shipping["oldest_unprocessed_at"] == shipping["oldest_poison_pending_at"] is not None
    # Duplicates are not in the database: unknown without a metrics endpoint
    assert billing["duplicates"] is None and orders["duplicates"] is None
    assert data["metrics"] == {"source": None, "error": None}
    # Retention: a consumer's own policy, else the default
    assert billing["retention"]["recorded_for"] == seeded["billing"]
    assert billing["retention"]["minimum_seconds"] == int(timedelta(days=2.5).total_seconds())
    assert shipping["retention"]["recorded_for"] == "*"
    assert shipping["retention"]["dominant_scenario"] == "broker redelivery"
    # The outbox backlog, and the oldest message waiting anywhere: the hour-old effect
    assert data["outbox"]["pending"] == 2 and data["outbox"]["failed"] == 1
    assert {d["destination"] for d in data["outbox"]["destinations"]} == {"mail", "sms"}
    assert data["outbox"]["oldest_pending_age_seconds"] >= 3500
    assert data["oldest_unprocessed"]["kind"] == "outbox"
    assert data["oldest_unprocessed"]["age_seconds"] >= 3500

    only = json.loads(cli(pg_url, "status", "--json", "--consumer", seeded["shipping"]))
    assert [c["consumer"] for c in only["consumers"]] == [seeded["shipping"]]


def test_status__table_names_the_figures_and_what_is_missing(pg_url, seeded):
    shown = cli(pg_url, "status")
    assert seeded["billing"] in shown and seeded["shipping"] in shown
    assert "claims by consumer and producer (last 1h)" in shown
    assert "outbox: 2 pending" in shown and "1 failed" in shown
    assert "oldest unprocessed: outbox, waiting 1h" in shown
    assert "pass --metrics-url to show them" in shown
    assert "~" not in shown  # nothing estimated on a small inbox


def test_status__says_plainly_which_figures_need_the_metrics(pg_url, seeded):
    # Given no metrics endpoint and no worker count rows yet, then a consumer's
    # duplicates and no-identity cells read the (approximate) count rows, the figures only
    # the metrics hold say so in their cells (not a bare "-"), and the note names each
    shown = cli(pg_url, "status")
    rows = [line for line in shown.splitlines() if seeded["billing"] in line]
    assert "≈0" in rows[0]  # the consumer's duplicates, from the count rows
    producers = [line for line in shown.splitlines() if "needs metrics" in line]
    assert producers  # duplicates by producer and shadow counts
    assert "≈0" in rows[1]  # the "no identity" column
    assert "none written yet" in shown
    note = " ".join(shown.split())
    assert (
        "≈ marks counts the workers wrote to the database every few seconds, totals since "
        "each worker started (a worker killed with SIGKILL loses its last few seconds); "
        "duplicates by producer, shadow-processed counts, rates within the window and "
        "latencies need the workers' metrics"
    ) in note
    assert "pass --metrics-url to show them" in note


def test_status__reads_duplicates_from_the_metrics_endpoint(pg_url, seeded):
    billing = seeded["billing"]
    metrics.decision(billing, "orders", "duplicate")
    metrics.decision(billing, "orders", "duplicate")
    metrics.decision(billing, "shop", "conflict", shadow=True)
    metrics.missing_identity(billing, "missing", "rejected")
    with serve(0) as server:
        data = json.loads(cli(pg_url, "status", "--json", "--metrics-url", server.url))
        shown = cli(pg_url, "status", "--metrics-url", server.url)
    jsonschema.Draft202012Validator(reading.SCHEMA).validate(data)
    entry = consumer_entry(data, billing)
    assert producer_entry(entry, "orders")["duplicates"] == 2
    assert producer_entry(entry, "shop")["shadow_processed"] == 1
    assert (entry["duplicates"], entry["missing_identity"]) == (2, 1)
    assert data["metrics"] == {"source": server.url, "error": None}
    assert "pass --metrics-url" not in shown

    unreachable = json.loads(
        cli(pg_url, "status", "--json", "--metrics-url", "http://127.0.0.1:9/metrics")
    )
    assert unreachable["metrics"]["error"] is not None
    assert consumer_entry(unreachable, billing)["duplicates"] is None


def test_status__big_inbox_is_estimated_from_the_catalog(pg_url, pg_engine, seeded, monkeypatch):
    # Given statistics for the inbox, and every table counted as "too big to count"
    with pg_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE consumer_inbox"))
        exact_oldest = conn.scalar(text("SELECT min(processed_at) FROM consumer_inbox"))
    monkeypatch.setattr(inspection, "EXACT_BELOW_BYTES", 0)  # the reads live in storage
    data = json.loads(cli(pg_url, "status", "--json"))
    jsonschema.Draft202012Validator(reading.SCHEMA).validate(data)
    # Then totals come from pg_class and pg_stats, marked as estimates
    assert data["exact"] is False
    assert (data["inbox"]["rows"], data["inbox"]["rows_estimated"]) == (6, True)
    billing = consumer_entry(data, seeded["billing"])
    assert (billing["claims"], billing["claims_estimated"]) == (4, True)
    assert producer_entry(billing, "orders")["claims"] is None  # per producer: not estimated
    assert billing["recent_claims"] == 4  # the recent window stays exact
    # And the oldest claim, found through the histogram and the BRIN index, is exact
    assert data["inbox"]["oldest_claim_estimated"] is False
    assert datetime.fromisoformat(data["inbox"]["oldest_claim_at"]) == exact_oldest
    assert "~4" in cli(pg_url, "status")
    # --exact counts again
    assert json.loads(cli(pg_url, "status", "--json", "--exact"))["exact"] is True


def test_explain__a_claimed_message_is_skipped_and_says_why(pg_url, seeded):
    billing = seeded["billing"]
    stored = hash_json({"id": "ord-1"}, "json.v1").sha256
    other = hash_json({"id": "other"}, "json.v1").sha256
    data = json.loads(cli(pg_url, "explain", billing, "orders", "ord-1", "--json"))
    jsonschema.Draft202012Validator(explaining.SCHEMA).validate(data)
    valid_times(data)
    assert data["verdict"] == "skip"
    assert data["claim"]["payload_sha256"] == stored
    assert (data["claim"]["handler_version"], data["claim"]["hash_scheme"]) == ("3", "json.v1")
    (conflict,) = data["quarantine"]
    assert (conflict["conflicting_sha256"], conflict["attempts"]) == (other, 2)
    assert conflict["decision"] == "pending"
    (effect,) = data["effects"]
    assert (effect["index"], effect["destination"], effect["status"]) == (0, "mail", "pending")
    assert data["retention"]["recorded_for"] == billing

    duplicate = json.loads(
        cli(pg_url, "explain", billing, "orders", "ord-1", "--payload-sha256", stored, "--json")
    )
    assert duplicate["verdict"] == "duplicate"
    conflicting = json.loads(
        cli(pg_url, "explain", billing, "orders", "ord-1", "--payload-sha256", other, "--json")
    )
    assert conflicting["verdict"] == "conflict"
    shown = cli(pg_url, "explain", billing, "orders", "ord-1")
    assert f"processed at {data['claim']['processed_at']}" in shown
    assert "quarantine #" in shown and "effect 0 -> mail: pending" in shown


def test_explain__poison_and_unknown_messages_would_be_processed(pg_url, seeded):
    poisoned = json.loads(cli(pg_url, "explain", seeded["shipping"], "orders", "ord-9", "--json"))
    jsonschema.Draft202012Validator(explaining.SCHEMA).validate(poisoned)
    assert (poisoned["verdict"], poisoned["claim"]) == ("process", None)
    (poison,) = poisoned["poison"]
    assert (poison["reason_code"], poison["attempts"], poison["decision"]) == (
        "unknown_account",
        1,
        "pending",
    )
    assert poisoned["failures"]["attempts"] == 1
    assert (
        "poison #" in poisoned["summary"] and "waits for a repair decision" in poisoned["summary"]
    )

    unknown = json.loads(cli(pg_url, "explain", seeded["billing"], "orders", "never", "--json"))
    jsonschema.Draft202012Validator(explaining.SCHEMA).validate(unknown)
    assert (unknown["verdict"], unknown["quarantine"], unknown["effects"]) == ("process", [], [])
    assert "claims are kept at least 2d12h" in unknown["summary"]

    # A library error is one line and exit status 1 (the console script's behaviour).
    empty = CliRunner().invoke(
        main, ["explain", seeded["billing"], "orders", "", "--database-url", pg_url]
    )
    assert (empty.exit_code, empty.output) == (1, "error: message_id is empty\n")


def test_explain__an_unknown_consumer_is_an_error_that_names_the_known_ones(pg_url, seeded):
    typo = seeded["billing"].replace("billing", "bilING")
    result = CliRunner().invoke(
        main, ["explain", typo, "orders", "ord-1", "--database-url", pg_url]
    )
    assert result.exit_code == 1
    assert result.output.startswith(f"error: no consumer {typo!r} has any row in the inbox tables")
    assert f"did you mean {seeded['billing']!r}?" in result.output
