"""Label cardinality stays bounded whatever producers and reason codes messages carry; the
OpenTelemetry mirror records what Prometheus does; a disabled recorder does nothing."""

import uuid
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from inbox_middleware._operate.metrics import MAX_LABEL_VALUES, Metrics, label_values, metrics

ALLOWED_LABELS = {
    "consumer",
    "producer",
    "decision",
    "reason",
    "reason_code",
    "destination",
    "source",
    "outcome",
    "kind",
    "le",
    "table",
    "database",  # the map's name of a database (a shard), never a tenant's
}


def test_metrics__producer_and_reason_labels_are_bounded():
    # Given a consumer that sees thousands of distinct producers and reason codes
    consumer = f"cardinality-{uuid.uuid4().hex[:8]}"
    assert metrics.enabled
    for n in range(MAX_LABEL_VALUES * 4):
        metrics.decision(consumer, f"producer-{n}", "first")
        metrics.decision(consumer, f"producer-{n}", "duplicate", shadow=True)
        metrics.handler_failure(consumer, f"reason-{n}")
    # Then each label keeps at most MAX_LABEL_VALUES values, plus "other"
    producers = {
        labels["producer"]
        for name, labels in label_values()
        if labels.get("consumer") == consumer and "producer" in labels
    }
    reasons = {
        labels["reason_code"]
        for name, labels in label_values()
        if labels.get("consumer") == consumer and "reason_code" in labels
    }
    assert len(producers) == MAX_LABEL_VALUES + 1
    assert len(reasons) == MAX_LABEL_VALUES + 1
    assert {"other"} <= producers & reasons
    # And the series cache holds no more than the exported series
    cached = [key for key in metrics._series if consumer in key[1]]
    assert len(cached) == 5 * (
        MAX_LABEL_VALUES + 1
    )  # first, duplicate, identified, shadow, failures


def test_metrics__no_label_carries_a_message_id():
    metrics.decision("no-id-test", "orders", "first")
    metrics.missing_identity("no-id-test", "missing", "rejected")
    metrics.claim_seconds("no-id-test", 0.01)
    names = set()
    for name, labels in label_values():
        names.add(name)
        assert set(labels) <= ALLOWED_LABELS, (name, labels)
        assert not any("ord-" in value for value in labels.values())
    assert "inbox_messages_total" in names
    assert "inbox_claim_seconds_bucket" in names


def test_metrics__opentelemetry_mirror_records_the_same_samples():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        recorder = Metrics(prometheus=False, meter=provider.get_meter("test"))
        recorder.decision("billing", "orders", "first")
        recorder.decision("billing", "orders", "duplicate", shadow=True)
        recorder.claim_seconds("billing", 0.25)
        recorder.missing_identity("billing", "invalid", "rejected")
        data = reader.get_metrics_data()
    finally:
        provider.shutdown()
    points = {
        metric.name: [(dict(p.attributes), p) for p in metric.data.data_points]
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }
    decisions = {attrs["decision"]: p.value for attrs, p in points["inbox.messages"]}
    assert decisions == {"first": 1, "duplicate": 1}
    assert [attrs for attrs, _ in points["inbox.shadow"]] == [
        {"consumer": "billing", "producer": "orders", "decision": "duplicate"}
    ]
    ((_, claim),) = points["inbox.claim_seconds"]
    assert (claim.count, claim.sum) == (1, pytest.approx(0.25))
    ((attrs, _),) = points["inbox.missing_identity"]
    assert attrs == {"consumer": "billing", "reason": "invalid", "outcome": "rejected"}
    assert points["inbox.identified"][0][1].value > 1e9  # a Unix time


def test_metrics__outbox_attempts_carry_the_database_over_a_map_and_none_over_one():
    # Given a dispatcher over one database and one over a map's database db1
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    destination = f"mail-{uuid.uuid4().hex[:8]}"
    try:
        recorder = Metrics(prometheus=True, meter=provider.get_meter("test"))
        recorder.outbox(destination, "delivered")
        recorder.outbox(destination, "delivered", "db1")
        recorder.outbox(destination, "retry", "db1")
        data = reader.get_metrics_data()
    finally:
        provider.shutdown()
    # Then Prometheus labels each attempt with its database, empty over one database
    # (which Prometheus stores as no label: the series of one database do not change)
    exported = sorted(
        (labels["outcome"], labels["database"])
        for name, labels in label_values()
        if name == "inbox_outbox_attempts_total" and labels.get("destination") == destination
    )
    assert exported == [("delivered", ""), ("delivered", "db1"), ("retry", "db1")]
    # And the OpenTelemetry mirror leaves the empty label out
    attributes = sorted(
        (dict(point.attributes) for point in _points(data, "inbox.outbox_attempts")),
        key=lambda attrs: (len(attrs), attrs["outcome"]),
    )
    assert attributes == [
        {"destination": destination, "outcome": "delivered"},
        {"destination": destination, "outcome": "delivered", "database": "db1"},
        {"destination": destination, "outcome": "retry", "database": "db1"},
    ]


def _points(data: Any, name: str) -> list[Any]:
    return [
        point
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == name
        for point in metric.data.data_points
    ]


def test_metrics__disabled_recorder_creates_nothing():
    recorder = Metrics(prometheus=False, meter=None)
    assert not recorder.enabled
    recorder.decision("x", "y", "first")
    recorder.commit_seconds("x", 1.0)
    assert recorder._series == {}
