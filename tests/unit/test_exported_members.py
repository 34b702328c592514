"""The public surface is what __all__ says, and nothing leaks by accident: every other
module is private (``_name``) or a deprecated alias of a module that moved."""

import importlib
import sys
import warnings
from pathlib import Path

import pytest

import inbox_middleware

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "inbox_middleware"

# The old paths the documentation of the previous release imported: each keeps working for
# one release as an alias that warns, naming where its names are imported now.
DEPRECATED = {
    "inbox_middleware.canonical": "inbox_middleware",
    "inbox_middleware.consumption": "inbox_middleware",
    "inbox_middleware.contract": "inbox_middleware.testing",
    "inbox_middleware.exceptions": "inbox_middleware",
    "inbox_middleware.explain": "inbox_middleware.metrics",
    "inbox_middleware.identity": "inbox_middleware",
    "inbox_middleware.instruments": "inbox_middleware.metrics",
    "inbox_middleware.poison": "inbox_middleware",
    "inbox_middleware.policy": "inbox_middleware",
    "inbox_middleware.protocol": "inbox_middleware",
    "inbox_middleware.status": "inbox_middleware.metrics",
    "inbox_middleware.storage": "inbox_middleware",
    "inbox_middleware.storage.executors": "inbox_middleware.metrics",
    "inbox_middleware.throwaway": "inbox_middleware.testing",
    "inbox_middleware.dramatiq.quorum": "inbox_middleware.dramatiq",
    "inbox_middleware.outbox.errors": "inbox_middleware.outbox",
}

PUBLIC = {
    "inbox_middleware": set(inbox_middleware.__all__),
    "inbox_middleware.dramatiq": {
        "CanonicalForm",
        "IdentityRefused",
        "InboxMiddleware",
        "MissingIdentityPolicy",
        "QuarantinePublisher",
        "QuorumRabbitmqBroker",
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
        "RoutedDispatcher",
        "add",
        "effect_id_for",
    },
    "inbox_middleware.testing": {
        "ContractViolation",
        "ProducerContract",
        "PublishedMessage",
        "producer_contract",
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
    "inbox_middleware.outbox.destinations.http": {"RETRYABLE_STATUSES", "HttpDestination"},
    "inbox_middleware.outbox.destinations.dramatiq": {"DramatiqDestination"},
    "inbox_middleware.outbox.destinations.faststream": {"FastStreamDestination"},
    "inbox_middleware.outbox.destinations": set(),
    "inbox_middleware.metrics": {
        "EXPLAIN_SCHEMA",
        "STATUS_SCHEMA",
        "MAX_LABEL_VALUES",
        "Metrics",
        "MetricsServer",
        "TableCollector",
        "explain",
        "label_values",
        "metrics",
        "serve",
        "shadow_verdict",
        "snapshot",
    },
    "inbox_middleware.cli": {"main", "run"},
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


def test_every_other_module_is_private_or_a_deprecated_alias():
    modules = set()
    for path in PACKAGE.rglob("*.py"):
        parts = ["inbox_middleware", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        if not any(part.startswith("_") for part in parts):
            modules.add(".".join(parts))
    assert modules == set(PUBLIC) | set(DEPRECATED)


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_deprecated_alias__warns_naming_the_facade_and_still_imports(old, monkeypatch):
    for name in [*sys.modules]:
        if name == old or name.startswith(old + "."):
            monkeypatch.delitem(sys.modules, name)
    parent, _, leaf = old.rpartition(".")
    # The parent first, quietly: a deprecated package's own warning is its own case's, and
    # whether an earlier test imported it must not decide this one.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        importlib.import_module(parent)
    if leaf in vars(sys.modules.get(parent, object)):
        monkeypatch.delattr(sys.modules[parent], leaf)
    with pytest.warns(DeprecationWarning, match=f"import from {DEPRECATED[old]}$"):
        module = importlib.import_module(old)
    assert module.__all__
    for name in module.__all__:
        assert getattr(module, name) is not None, name
