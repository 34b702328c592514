"""The consumer settings, in one place: `ConsumerPolicy`, its keyword form, overrides."""

from __future__ import annotations

import typing

import pytest

from inbox_middleware._core.exceptions import ConfigurationError
from inbox_middleware._core.policy import SETTINGS, ConsumerPolicy, PolicySettings


def test_policy__the_keyword_settings_are_the_policy_fields():
    assert set(typing.get_type_hints(PolicySettings)) == set(SETTINGS)
    documented = ConsumerPolicy.__doc__ or ""
    assert [name for name in SETTINGS if f"{name}:" not in documented] == []


def test_policy__an_override_changes_one_setting_and_checks_it():
    policy = ConsumerPolicy().override(max_attempts=3, shadow=True)
    assert (policy.max_attempts, policy.shadow, policy.redelivery_limit) == (3, True, 10)
    assert ConsumerPolicy().override(max_attempts=None).max_attempts is None
    with pytest.raises(ConfigurationError, match="direct_publish must be"):
        ConsumerPolicy().override(direct_publish="sometimes")  # type: ignore[typeddict-item]
    with pytest.raises(ConfigurationError, match="no consumer setting named 'max_attempt'"):
        ConsumerPolicy().override_set({"max_attempt": 3})


def test_policy__both_adapters_take_the_policy_or_its_settings():
    from sqlalchemy import create_engine
    from sqlalchemy.ext.asyncio import create_async_engine

    from inbox_middleware.dramatiq import InboxMiddleware
    from inbox_middleware.faststream import FastStreamInbox

    engine = create_engine("sqlite://")
    base = ConsumerPolicy(redelivery_limit=3)
    dramatiq = InboxMiddleware(engine, policy=base, shadow=True)
    assert (dramatiq.policy.redelivery_limit, dramatiq.policy.shadow) == (3, True)
    assert InboxMiddleware(engine).policy.max_attempts is None  # Retries bounds attempts
    assert {f"inbox_{name}" for name in SETTINGS} <= dramatiq.actor_options
    inbox = FastStreamInbox(create_async_engine("postgresql+asyncpg://127.0.0.1/x"), max_attempts=4)
    assert (inbox.max_attempts, inbox.policy.max_attempts) == (4, 4)
    with pytest.raises(ConfigurationError, match="missing_identity must be"):
        inbox.consumer("billing", missing_identity="drop")  # type: ignore[typeddict-item]
