"""The settlement core over many databases: one row per arrow of ``ResolveRoute`` in the
diagram of `consumption`.

Which database a delivery goes to is a decision: the tenant's database is known (proceed,
every operation after it goes there), no database serves the tenant (a durable
rejection: dead-lettered with the reason, never the default database), or the route
cannot be chosen now (the resolver raised, the map is being reloaded, the connection
budget is spent: handed back, counted against nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from inbox_middleware._core.consumption import (
    UNKNOWN_TENANT,
    Arrival,
    CountHandBack,
    CountRedelivery,
    DeadLettered,
    Duplicate,
    HandedBack,
    Process,
    Processed,
    Publish,
    RedeliveryCount,
    ResolveRoute,
    Route,
)
from inbox_middleware._core.exceptions import (
    DatabaseUnavailable,
    MissingIdentity,
    RouteUnavailable,
    UnknownTenant,
)
from inbox_middleware._core.protocol import Decision, Verdict

from .script import Script, delivery, run, run_async

FIRST = Verdict(Decision.FIRST)
DUPLICATE = Verdict(Decision.DUPLICATE)


@dataclass(frozen=True)
class Row:
    arrival: dict[str, Any]
    answers: dict[type, list[Any]]
    ops: list[str]
    settled: type
    expect: dict[str, Any] = field(default_factory=dict)


ROWS: dict[str, Row] = {
    "routed, the tenant's database known: claimed there, processed": Row(
        {},
        {ResolveRoute: ["shard-a"], Process: [FIRST]},
        ["ResolveRoute", "Process"],
        Processed,
    ),
    "routed, a duplicate in the tenant's database": Row(
        {},
        {ResolveRoute: ["shard-a"], Process: [DUPLICATE]},
        ["ResolveRoute", "Process"],
        Duplicate,
    ),
    "routed, the route comes before the redelivery count (which goes to that database)": Row(
        {"redelivered": True, "deliveries": 2},
        {
            ResolveRoute: ["shard-a"],
            CountRedelivery: [RedeliveryCount(1, 0, 0, claimed=False)],
            Process: [FIRST],
        },
        ["ResolveRoute", "CountRedelivery", "Process"],
        Processed,
    ),
    "routed, unknown tenant: dead-lettered with the reason, nothing claimed anywhere": Row(
        {},
        {
            ResolveRoute: [UnknownTenant("no database serves tenant 'zz'", tenant="zz")],
            Publish: [None],
        },
        ["ResolveRoute", "Publish"],
        DeadLettered,
        {"reason": UNKNOWN_TENANT},
    ),
    "routed, unknown tenant, the dead letter refused: handed back, uncounted": Row(
        {},
        {ResolveRoute: [UnknownTenant(tenant="zz")], Publish: [ConnectionError("down")]},
        ["ResolveRoute", "Publish"],
        HandedBack,
        {"counted": False},
    ),
    "routed, the resolver raised: handed back, uncounted, remembered in this process": Row(
        {},
        {ResolveRoute: [RouteUnavailable("the resolver raised")], CountHandBack: [None]},
        ["ResolveRoute", "CountHandBack"],
        HandedBack,
        {"counted": False},
    ),
    "routed, the map is being reloaded (any error): handed back, uncounted": Row(
        {},
        {ResolveRoute: [ValueError("half a file")], CountHandBack: [None]},
        ["ResolveRoute", "CountHandBack"],
        HandedBack,
        {"counted": False},
    ),
    "routed, the tenant's database is down at the claim: handed back, uncounted": Row(
        {},
        {ResolveRoute: ["shard-b"], Process: [DatabaseUnavailable()], CountHandBack: [None]},
        ["ResolveRoute", "Process", "CountHandBack"],
        HandedBack,
        {"counted": False},
    ),
    "routed, missing identity: rejected before any route (no tenant to route)": Row(
        {"delivery": None, "problem": MissingIdentity()},
        {Publish: [None]},
        ["Publish"],
        DeadLettered,
        {"reason": "missing"},
    ),
}


def _arrival(row: Row) -> Arrival:
    fields: dict[str, Any] = {"delivery": delivery(), "routed": True}
    fields.update(row.arrival)
    return Arrival(**fields)


def _check(row: Row, script: Script, settled: Any) -> None:
    assert script.names == row.ops
    assert type(settled) is row.settled, settled
    for name, value in row.expect.items():
        assert getattr(settled, name) == value, (name, getattr(settled, name))


@pytest.mark.parametrize("name", list(ROWS))
def test_core_routing__settles_each_arrow(name: str) -> None:
    row = ROWS[name]
    script = Script(row.answers)
    _check(row, script, run(_arrival(row), script))


@pytest.mark.parametrize("name", list(ROWS))
def test_core_routing__the_async_driver_settles_alike(name: str) -> None:
    row = ROWS[name]
    script = Script(row.answers)
    _check(row, script, run_async(_arrival(row), script))


def test_core_routing__the_unknown_tenants_dead_letter_names_the_tenant_and_why() -> None:
    script = Script(
        {
            ResolveRoute: [UnknownTenant("no database serves tenant 'zz'", tenant="zz")],
            Publish: [None],
        }
    )
    run(Arrival(delivery(), routed=True, declared_consumer="billing", source="q"), script)
    publish = script.performed[-1]
    assert isinstance(publish, Publish)
    assert publish.route is Route.DEAD_LETTER
    assert publish.details["reason"] == "UnknownTenant"
    assert publish.details["tenant"] == "zz"
    assert "no database serves tenant 'zz'" in publish.details["detail"]


def test_core_routing__a_failed_route_is_remembered_as_unreachable() -> None:
    script = Script({ResolveRoute: [RouteUnavailable()], CountHandBack: [None]})
    run(Arrival(delivery(), routed=True), script)
    count = script.performed[-1]
    assert isinstance(count, CountHandBack) and count.unreachable


def test_core_routing__not_routed_asks_for_no_route() -> None:
    script = Script({Process: [FIRST]})
    run(Arrival(delivery()), script)
    assert script.names == ["Process"]
