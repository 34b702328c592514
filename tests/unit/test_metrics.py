"""Label cardinality stays bounded whatever producers and reason codes messages carry."""

from inbox_middleware.metrics import MAX_LABEL_VALUES, label_values, metrics


def test_metrics__producer_and_reason_labels_are_bounded():
    # Given a consumer that sees thousands of distinct producers and reason codes
    recorder = metrics
    assert recorder.enabled
    for n in range(MAX_LABEL_VALUES * 4):
        recorder.decision("cardinality-test", f"producer-{n}", "first")
        recorder.handler_failure("cardinality-test", f"reason-{n}")
    # Then each label keeps at most MAX_LABEL_VALUES values, plus "other"
    producers = {
        labels["producer"]
        for name, labels in label_values()
        if labels.get("consumer") == "cardinality-test" and "producer" in labels
    }
    reasons = {
        labels["reason_code"]
        for name, labels in label_values()
        if labels.get("consumer") == "cardinality-test" and "reason_code" in labels
    }
    assert len(producers) == MAX_LABEL_VALUES + 1
    assert len(reasons) == MAX_LABEL_VALUES + 1
    assert {"other"} <= producers & reasons


def test_metrics__no_label_carries_a_message_id():
    allowed = {
        "consumer",
        "producer",
        "decision",
        "reason",
        "reason_code",
        "destination",
        "source",
        "outcome",
        "le",
        "table",
    }
    for name, labels in label_values():
        assert set(labels) <= allowed, (name, labels)
