"""The public surface is what __all__ says, and nothing leaks by accident."""

import importlib

import pytest

import inbox_middleware

PUBLIC = {
    "inbox_middleware": set(inbox_middleware.__all__),
    "inbox_middleware.dramatiq": {
        "CanonicalForm",
        "IdentityRefused",
        "InboxMiddleware",
        "MissingIdentityPolicy",
        "QuarantinePublisher",
        "StampIdentity",
        "StampTraceContext",
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
        "ThrowawayDatabase",
        "inbox_check",
        "inbox_database",
        "inbox_database_setup",
    },
    "inbox_middleware.dramatiq.testing": {"DramatiqCheck"},
    "inbox_middleware.faststream.testing": {"FastStreamCheck", "FastStreamMessage"},
    "inbox_middleware.faststream.testbroker": {"guarded", "guard_test_broker"},
    "inbox_middleware.logs": {"FORMAT", "configure", "follow"},
    "inbox_middleware.consumption": {
        "Arrival",
        "CountFailure",
        "CountHandBack",
        "CountRedelivery",
        "DeadLettered",
        "Duplicate",
        "EXPIRED_REDELIVERY",
        "HANDLER_REJECTED",
        "HandBackRequested",
        "HandedBack",
        "INBOX_ERROR",
        "Op",
        "Poisoned",
        "Process",
        "Processed",
        "Publish",
        "Quarantined",
        "REDELIVERY_LIMIT",
        "RETRIES_EXHAUSTED",
        "RecordPoison",
        "RejectRequested",
        "Route",
        "Rules",
        "RunUnprotected",
        "Settlement",
        "Unfit",
        "conflict_details",
        "describe",
        "drive",
        "drive_async",
        "expired",
        "reason_code",
        "rejection_details",
        "settle_steps",
    },
    "inbox_middleware.policy": {
        "ConsumerPolicy",
        "ExpiredPolicy",
        "MissingIdentityPolicy",
        "check_missing_identity",
    },
    "inbox_middleware.outcomes": {
        "report",
    },
    "inbox_middleware.faststream.outcome": {
        "ACKED",
        "CONFLICT_HEADER",
        "HandedBack",
        "REJECTED_HEADER",
        "REPAIR_HEADER",
        "Skipped",
        "message_id_of",
    },
    "inbox_middleware.dramatiq.boot": {
        "EXIT_STATUS",
        "QuietSkips",
        "WorkerBootError",
        "check_database",
        "refuse_boot",
    },
    "inbox_middleware.throwaway": {
        "DEFAULT_SERVER",
        "SERVER_VARIABLE",
        "Setup",
        "Template",
        "ThrowawayDatabase",
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
    "inbox_middleware.instruments": {
        "MAX_LABEL_VALUES",
        "MULTIPROCESS_VARIABLE",
        "Metrics",
        "label_values",
        "metrics",
    },
    "inbox_middleware.headers": {
        "MESSAGE_ID",
        "OPTION_MESSAGE_ID",
        "OPTION_PRODUCED_AT",
        "OPTION_PRODUCER",
        "OPTION_TENANT",
        "PRODUCED_AT",
        "PRODUCER",
        "TENANT",
        "message_options",
    },
    "inbox_middleware.harness": {
        "CONCURRENT",
        "CRASH",
        "REDELIVERED",
        "Effect",
        "Hold",
        "Outcomes",
        "ScenarioResult",
        "Tally",
        "fresh",
        "intent_name",
        "refuse_sqlite",
    },
    "inbox_middleware.contract": {
        "ContractViolation",
        "ProducerContract",
        "PublishedMessage",
        "producer_contract",
    },
    "inbox_middleware.explain": {"FORMAT", "SCHEMA", "consumer_known", "explain"},
    "inbox_middleware.cli": {"main", "run"},
    "inbox_middleware.cli.options": {
        "connect",
        "database",
        "database_options",
        "naming_from",
        "naming_options",
    },
    "inbox_middleware.storage.engines": {
        "async_engine",
        "parse_url",
        "pooler_connect_args",
        "postgresql_driver",
        "run_sync",
        "sync_engine",
        "uses_asyncio",
    },
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
