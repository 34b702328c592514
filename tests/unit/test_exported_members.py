"""The public surface is what __all__ says, and nothing leaks by accident."""

import importlib

import pytest

import inbox_middleware

PUBLIC = {
    "inbox_middleware": set(inbox_middleware.__all__),
    "inbox_middleware.dramatiq": {
        "CanonicalForm",
        "InboxMiddleware",
        "MissingIdentityPolicy",
        "QuarantinePublisher",
        "current_async_session",
        "current_session",
        "identity",
    },
    "inbox_middleware.faststream": {
        "BatchItem",
        "CanonicalForm",
        "FastStreamInbox",
        "InboxBatch",
        "InboxSession",
        "MissingIdentityPolicy",
        "StampIdentity",
        "identity_headers",
    },
    "inbox_middleware.outbox": {
        "Backoff",
        "DeliveryError",
        "Destination",
        "Destinations",
        "Dispatcher",
        "DispatcherStats",
        "Effect",
        "EffectIdRequired",
        "EffectNotFound",
        "InvalidEffect",
        "OutboxError",
        "PermanentDeliveryError",
        "add",
        "effect_id_for",
    },
    "inbox_middleware.testing": {
        "DramatiqCheck",
        "FastStreamCheck",
        "FastStreamMessage",
        "InboxCheck",
        "ScenarioResult",
        "inbox_check",
    },
    "inbox_middleware.outbox.destinations.http": {"RETRYABLE_STATUSES", "HttpDestination"},
    "inbox_middleware.outbox.destinations.dramatiq": {"DramatiqDestination"},
    "inbox_middleware.outbox.destinations.faststream": {"FastStreamDestination"},
    "inbox_middleware.metrics": {
        "MAX_LABEL_VALUES",
        "Metrics",
        "MetricsServer",
        "TableCollector",
        "label_values",
        "metrics",
        "serve",
    },
    "inbox_middleware.contract": {
        "ContractViolation",
        "ProducerContract",
        "PublishedMessage",
        "producer_contract",
    },
    "inbox_middleware.explain": {"FORMAT", "SCHEMA", "explain"},
    "inbox_middleware.storage.engines": {"async_engine", "pooler_connect_args", "sync_engine"},
}


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_exported_members(module_name):
    module = importlib.import_module(module_name)
    assert set(module.__all__) == PUBLIC[module_name]
    for name in module.__all__:
        assert getattr(module, name) is not None, name


def test_top_level_names():
    assert {"Inbox", "AsyncInbox", "InboxSchema", "MessageIdentity", "InboxError"} <= set(
        inbox_middleware.__all__
    )
    assert inbox_middleware.AsyncInbox.__name__ == "AsyncInbox"
