from datetime import timedelta

import pytest

from inbox_middleware._core.exceptions import ConfigurationError, PermanentError
from inbox_middleware._operate.retention import (
    RetentionPolicy,
    format_duration,
    minimum_window,
    parse_duration,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0", 0),
        ("45s", 45),
        ("90m", 5400),
        ("36h", 129600),
        ("14d", 1209600),
        ("1w2d", 777600),
        ("1.5h", 5400),
    ],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "7", "7 days", "-1d", "1y", "d7"])
def test_parse_duration__refuses_what_it_cannot_read(text):
    with pytest.raises(ConfigurationError, match="cannot read the duration"):
        parse_duration(text)


def test_format_duration__round_trips():
    assert format_duration(parse_duration("1w2d3h")) == "1w2d3h"


def test_minimum_window__the_dominant_scenario_plus_margin():
    policy = RetentionPolicy(
        broker_retention=parse_duration("7d"),
        retry_horizon=parse_duration("1d"),
        dead_letter_retention=parse_duration("14d"),
        producer_retry=parse_duration("1h"),
        outage_allowance=parse_duration("2d"),
        margin=0.2,
    )
    window, dominant = minimum_window(policy)
    assert dominant.name == "dead-letter redrive"
    assert dominant.window == parse_duration("15d")
    assert window == parse_duration("18d")


def test_minimum_window__producer_retry_spans_an_outage():
    policy = RetentionPolicy(
        producer_retry=parse_duration("1d"), outage_allowance=parse_duration("3d"), margin=0
    )
    assert minimum_window(policy)[1].name == "producer retry"
    assert minimum_window(policy)[0] == parse_duration("4d")


def test_policy__refuses_negative_durations():
    with pytest.raises(ConfigurationError, match="cannot be negative"):
        RetentionPolicy(broker_retention=timedelta(days=-1))


def test_permanent_error__needs_a_stable_reason_code():
    assert PermanentError("unknown_account").reason_code == "unknown_account"
    with pytest.raises(ValueError, match="short identifier"):
        PermanentError("account 42 does not exist")
