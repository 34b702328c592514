"""`RoutedDispatcher`'s settings and rotation, without a database: it connects only when
it looks at one."""

from __future__ import annotations

import pytest

from inbox_middleware import ConfigurationError, DatabaseMap, outbox


class Nowhere:
    async def deliver(self, effect: outbox.Effect, timeout: float) -> None:
        raise AssertionError("never delivered")


def databases(count: int) -> DatabaseMap:
    return DatabaseMap({f"db{n}": f"postgresql://u@127.0.0.1:1/db{n}" for n in range(count)})


def dispatcher(count: int, **options: object) -> outbox.RoutedDispatcher:
    return outbox.RoutedDispatcher(databases(count), {"remote": Nowhere()}, **options)  # type: ignore[arg-type]


def test_routed_dispatcher__the_latency_bound_is_the_rotation_over_every_database():
    assert dispatcher(500).latency_bound == 50.0  # 10 a second
    assert dispatcher(500, sweep=50, poll_interval=0.5).latency_bound == 5.0
    assert dispatcher(3, sweep=10).latency_bound == 1.0
    assert dispatcher(30, databases=["db4"]).latency_bound == 1.0


def test_routed_dispatcher__the_rotation_takes_sweep_databases_in_turn_past_paused_ones():
    rotation = dispatcher(5, sweep=2)
    assert rotation._next_sweep(0.0, set()) == ["db0", "db1"]
    assert rotation._next_sweep(0.0, {"db2"}) == ["db3", "db4"]
    rotation._down_until["db0"] = 10.0
    assert rotation._next_sweep(0.0, set()) == ["db1", "db2"]
    assert rotation._next_sweep(11.0, set()) == ["db3", "db4"]
    assert rotation._next_sweep(11.0, set()) == ["db0", "db1"]


def test_routed_dispatcher__a_failing_database_is_paused_longer_at_each_failure():
    rotation = dispatcher(2, down_pause=1.0, down_pause_cap=3.0)
    for _ in range(4):
        rotation._went_down("db1", OSError("refused"))
    assert rotation._failures["db1"] == 4
    assert rotation._next_sweep(0.0, set()) == ["db0"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sweep": 0}, "sweep and parallel"),
        ({"parallel": 0}, "sweep and parallel"),
        ({"poll_interval": 0}, "poll_interval"),
        ({"down_pause": 5, "down_pause_cap": 1}, "down_pause"),
        ({"delivery_timeout": 60, "lease": 60}, "delivery_timeout"),
        ({"databases": ["elsewhere"]}, "no database 'elsewhere'"),
    ],
)
def test_routed_dispatcher__settings_that_cannot_work_are_refused(options, message):
    with pytest.raises(ConfigurationError, match=message):
        dispatcher(3, **options)


def test_routed_dispatcher__a_database_that_is_not_postgresql_is_refused():
    mixed = DatabaseMap({"a": "postgresql://u@h/a", "b": "sqlite:///b.db"})
    with pytest.raises(ConfigurationError, match="'b' is not PostgreSQL"):
        outbox.RoutedDispatcher(mixed, {"remote": Nowhere()})  # type: ignore[dict-item]
    with pytest.raises(ConfigurationError, match="a DatabaseMap"):
        outbox.RoutedDispatcher(object(), {"remote": Nowhere()})  # type: ignore[arg-type]
