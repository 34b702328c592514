"""The adapters pass a fleet's patience with a slow or down database to its routed inbox."""

from __future__ import annotations

import pytest

from inbox_middleware import ConfigurationError, DatabaseMap, DatabasePatience
from inbox_middleware.dramatiq import InboxMiddleware
from inbox_middleware.faststream import FastStreamInbox

DATABASES = {"a": "postgresql://h/a", "b": "postgresql://h/b"}
PATIENCE = DatabasePatience(connect_timeout=3, down_pause=2, down_pause_limit=20, busy_wait=0.1)


def _patience(inbox: object) -> tuple[object, ...]:
    names = ("connect_timeout", "down_pause", "down_pause_limit", "busy_wait")
    return tuple(getattr(inbox, name) for name in names)


def test_patience__dramatiq_passes_it_to_both_routed_inboxes() -> None:
    middleware = InboxMiddleware(router=DatabaseMap(DATABASES), patience=PATIENCE)
    assert _patience(middleware.inbox) == (3, 2, 20, 0.1)
    assert _patience(middleware.async_inbox) == (3, 2, 20, 0.1)


def test_patience__faststream_passes_it_to_its_routed_inbox() -> None:
    inbox = FastStreamInbox(router=DatabaseMap(DATABASES), patience=PATIENCE)
    assert _patience(inbox.storage) == (3, 2, 20, 0.1)


def test_patience__without_it_the_routed_inboxes_keep_their_defaults() -> None:
    middleware = InboxMiddleware(router=DatabaseMap(DATABASES))
    inbox = FastStreamInbox(router=DatabaseMap(DATABASES))
    defaults = DatabasePatience()
    expected = (
        defaults.connect_timeout,
        defaults.down_pause,
        defaults.down_pause_limit,
        defaults.busy_wait,
    )
    assert _patience(middleware.inbox) == _patience(inbox.storage) == expected


def test_patience__is_refused_without_a_router() -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.ext.asyncio import create_async_engine

    with pytest.raises(ConfigurationError, match="patience is for a router"):
        InboxMiddleware(create_engine("postgresql+psycopg://h/a"), patience=PATIENCE)
    with pytest.raises(ConfigurationError, match="patience is for a router"):
        FastStreamInbox(create_async_engine("postgresql+asyncpg://h/a"), patience=PATIENCE)


@pytest.mark.parametrize(
    "settings",
    [{"down_pause": -1}, {"busy_wait": "1"}, {"connect_timeout": 0}, {"down_pause_limit": True}],
)
def test_patience__bad_values_are_refused_clearly(settings: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        DatabasePatience(**settings)  # type: ignore[arg-type]
