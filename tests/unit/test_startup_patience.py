"""Start-up, decided once for both frameworks: which trouble a worker waits out before it
consumes, and which ends its start at once (no services: the errors are built as the
drivers raise them)."""

from __future__ import annotations

import logging
import socket

import pytest
from sqlalchemy import exc as sa_exc

from inbox_middleware._core.exceptions import ConfigurationError, SchemaError
from inbox_middleware._storage.startup import DatabaseNotReady, StartupPatience, worth_waiting


class _Driver(Exception):
    def __init__(self, text: str, sqlstate: str | None = None) -> None:
        super().__init__(text)
        self.sqlstate = sqlstate


def _operational(text: str, sqlstate: str | None = None) -> sa_exc.OperationalError:
    return sa_exc.OperationalError("SELECT 1", {}, _Driver(text, sqlstate))


@pytest.mark.parametrize(
    "error",
    [
        SchemaError("the inbox tables do not exist; run `inbox-middleware migrate`"),
        _operational("connection to server at 127.0.0.1, port 5432 failed: Connection refused"),
        _operational("the database system is starting up", "57P03"),
        _operational("terminating connection due to administrator command", "57P01"),
        _operational("server closed the connection unexpectedly", "08006"),
        ConnectionRefusedError(111, "Connect call failed"),
    ],
)
def test_startup__a_missing_schema_or_an_outage_is_waited_out(error: Exception) -> None:
    assert worth_waiting(error)


@pytest.mark.parametrize(
    "error",
    [
        ConfigurationError("a subscriber the inbox refuses"),
        _operational('password authentication failed for user "postgres"'),
        _operational("invalid password", "28P01"),
        _operational('database "nope" does not exist', "3D000"),
        _operational('role "nobody" does not exist'),
        socket.gaierror(-2, "Name or service not known"),
        ValueError("a bug"),
    ],
)
def test_startup__a_configuration_error_ends_the_start_at_once(error: Exception) -> None:
    assert worth_waiting(error) is None


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_startup__waits_with_growing_delays_one_line_per_attempt_then_passes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    answers = [_operational("Connection refused")] * 4 + [None]
    slept: list[float] = []

    def check() -> None:
        if (answer := answers.pop(0)) is not None:
            raise answer

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.sleep(seconds)

    with caplog.at_level(logging.INFO, logger="inbox_middleware"):
        StartupPatience(60, clock=clock).run(check, sleep=sleep)
    assert slept == [0.5, 1.0, 2.0, 4.0]
    waiting = [r for r in caplog.records if "is not ready (attempt" in r.getMessage()]
    assert len(waiting) == 4
    assert all("start PostgreSQL" in r.getMessage() for r in waiting)
    assert "is ready (attempt 5)" in caplog.records[-1].getMessage()


def test_startup__past_the_patience_it_gives_up_naming_the_fix() -> None:
    clock = _Clock()

    def check() -> None:
        raise SchemaError("the inbox tables do not exist; run `inbox-middleware migrate`")

    with pytest.raises(DatabaseNotReady, match=r"startup_patience=10\).*migrate") as gave_up:
        StartupPatience(10, clock=clock).run(check, sleep=clock.sleep)
    assert isinstance(gave_up.value.__cause__, SchemaError)
    assert clock.now == 10


def test_startup__no_patience_and_configuration_errors_end_the_start_at_once() -> None:
    clock = _Clock()
    refused = _operational("password authentication failed")

    def fails() -> None:
        raise refused

    with pytest.raises(sa_exc.OperationalError):
        StartupPatience(60, clock=clock).run(fails, sleep=clock.sleep)
    with pytest.raises(sa_exc.OperationalError):
        StartupPatience(0, clock=clock).run(
            lambda: (_ for _ in ()).throw(_operational("Connection refused")),
            sleep=clock.sleep,
        )
    assert clock.now == 0
    with pytest.raises(ConfigurationError, match="startup_patience"):
        StartupPatience(-1)
