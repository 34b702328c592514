"""The many-databases guide's set-ups: a database map, both adapters over it, a resolver.
Engines are created at a database's first delivery, so building these opens nothing; the
docs test builds each one."""

from __future__ import annotations

from typing import Any

from inbox_middleware import DatabaseMap, MessageIdentity, TenantRange


def fleet_map() -> DatabaseMap:
    # --8<-- [start:map]
    from inbox_middleware import DatabaseMap, TenantRange

    databases = DatabaseMap(
        databases={
            "eu-1": "postgresql://app@db-eu-1:5432/app",
            "eu-2": "postgresql://app@db-eu-2:5432/app",
            "us-1": "postgresql://app@db-us-1:5432/app",
        },
        tenants={"acme": "us-1"},  # exact entries first
        ranges=(  # then ranges of tenant names, in order
            TenantRange("a", "m~", "eu-1"),
            TenantRange("n", "z~", "eu-2"),
        ),
    )
    # --8<-- [end:map]
    return databases


def dramatiq_fleet(databases: DatabaseMap) -> Any:
    # --8<-- [start:dramatiq]
    from inbox_middleware.dramatiq import InboxMiddleware

    middleware = InboxMiddleware(router=databases, pool_size=4, connection_budget=64)
    # broker.add_middleware(middleware); actors as with one database
    # --8<-- [end:dramatiq]
    return middleware


def faststream_fleet(databases: DatabaseMap) -> Any:
    # --8<-- [start:faststream]
    from inbox_middleware.faststream import FastStreamInbox

    inbox = FastStreamInbox(router=databases, pool_size=4, connection_budget=64)
    # RabbitBroker(url, middlewares=[inbox.middleware]), inbox.guard(broker), as usual
    # --8<-- [end:faststream]
    return inbox


def patient_fleet(databases: DatabaseMap) -> tuple[Any, Any]:
    # --8<-- [start:patience]
    from inbox_middleware import DatabasePatience
    from inbox_middleware.dramatiq import InboxMiddleware
    from inbox_middleware.faststream import FastStreamInbox

    patience = DatabasePatience(connect_timeout=2, down_pause=2, down_pause_limit=30)
    middleware = InboxMiddleware(router=databases, patience=patience)
    inbox = FastStreamInbox(router=databases, patience=patience)
    # --8<-- [end:patience]
    return middleware, inbox


# --8<-- [start:resolver]
SHARDS = ("eu-1", "eu-2", "us-1")


def shard_of(identity: MessageIdentity) -> str | None:
    """Tenants named ``<region>:<name>`` go to their region's shard; None: ask the map."""
    region, _, name = identity.tenant.partition(":")
    if not name:
        return None
    shards = [shard for shard in SHARDS if shard.startswith(region)]
    if not shards:
        return None
    # A stable function of the tenant alone (never random, never the time, never a
    # lookup that can change while a message is in flight).
    return shards[sum(name.encode()) % len(shards)]


resolved = DatabaseMap(
    databases={name: f"postgresql://app@db-{name}:5432/app" for name in SHARDS},
    resolver=shard_of,
)
# --8<-- [end:resolver]

_ = TenantRange  # imported for the map's snippet


def move_tenant(old: Any, new: Any, tenant: str, move_business_rows: Any) -> None:
    """Steps 3 and 5 of moving a tenant: ``old`` and ``new`` are the two engines."""
    # --8<-- [start:move]
    from inbox_middleware import copy_tenant, delete_tenant

    with old.begin() as source, new.begin() as target:
        copy_tenant(source, target, tenant)
        move_business_rows(source, target, tenant)  # yours
        delete_tenant(source, tenant)
    # --8<-- [end:move]
