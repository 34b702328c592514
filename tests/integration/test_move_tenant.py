"""Moving a tenant to another database, as the many-databases guide tells: pause it, copy
its business rows and its inbox rows in one transaction on the target, point the map at
the target, unpause, delete from the source. A message applied before the move is a
duplicate after it; nothing of the tenant stays behind."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, create_engine, text

from inbox_middleware import DatabaseMap, MapFile, MessageIdentity, RouteUnavailable
from inbox_middleware._core.consumption import CountFailure
from inbox_middleware._core.exceptions import ConfigurationError, TransientError
from inbox_middleware._core.identity import hash_json
from inbox_middleware._core.protocol import Decision, Delivery
from inbox_middleware._storage import InboxSchema
from inbox_middleware._storage.layout import switch_claims
from inbox_middleware._storage.routed import AsyncRoutedInbox, RoutedInbox
from inbox_middleware._storage.tenants import copy_tenant, delete_tenant

from ..apps.domain import apply_credit, apply_credit_async
from ..support.servers import _wait
from ..support.tenants import TENANTS, TenantDatabases, tenant_database, write_map


def delivery(message_id: str, delta: int) -> Delivery:
    return Delivery(
        "billing",
        MessageIdentity("orders", message_id, "t3"),
        hash_json({"account": 300, "delta": delta}, "v1"),
        source="q",
    )


def credit(inbox: RoutedInbox, message_id: str, delta: int) -> Decision:
    committed = inbox.process(
        delivery(message_id, delta), lambda session: apply_credit(session, "billing", 300, delta)
    )
    return committed.verdict.decision


def quarantined(url: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.scalar(text("SELECT count(*) FROM inbox_quarantine")) or 0)
    finally:
        engine.dispose()


def guide() -> Any:
    """The guide's snippet, as the page shows it."""
    path = Path(__file__).resolve().parents[2] / "docs" / "snippets" / "many_databases.py"
    spec = importlib.util.spec_from_file_location("snippet_many_databases", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def move_business_rows(source: Connection, target: Connection, tenant: str) -> None:
    """The user's part: the tenant's own rows (here: account 300 and its ledger)."""
    for table, key in (("accounts", "id"), ("ledger", "account_id")):
        rows = source.execute(text(f"SELECT * FROM {table} WHERE {key} = 300")).mappings().all()
        for found in rows:
            row = {k: v for k, v in found.items() if not (table == "ledger" and k == "id")}
            columns = ", ".join(row)
            values = ", ".join(f":{name}" for name in row)
            target.execute(text(f"INSERT INTO {table} ({columns}) VALUES ({values})"), dict(row))
        source.execute(text(f"DELETE FROM {table} WHERE {key} = 300"))


def test_move_tenant__its_claims_move_with_its_rows(tenant_databases: TenantDatabases):
    urls = {f"db{i}": tenant_databases.url(i) for i in range(2)}
    before = RoutedInbox(DatabaseMap(urls, tenants={"t3": "db0"}))
    # Given tenant t3 in db0, with one message applied and one conflict quarantined
    assert credit(before, "m-1", 10) is Decision.FIRST
    assert credit(before, "m-1", 99) is Decision.CONFLICT
    before.dispose()
    # When it is paused, its deliveries are handed back (nothing is claimed anywhere)
    paused = RoutedInbox(DatabaseMap(urls, tenants={"t3": "db0"}, paused=frozenset({"t3"})))
    with pytest.raises(RouteUnavailable):
        credit(paused, "m-2", 5)
    # ... and its rows move: the business rows and the inbox rows, in one transaction
    assert quarantined(urls["db0"]) == 1
    source_engine, target_engine = (create_engine(urls[name]) for name in ("db0", "db1"))
    try:
        guide().move_tenant(source_engine, target_engine, "t3", move_business_rows)
    finally:
        source_engine.dispose()
        target_engine.dispose()
    assert quarantined(urls["db1"]) == 1
    # Then, routed to db1, the message applied before the move is a duplicate there
    after = RoutedInbox(DatabaseMap(urls, tenants={"t3": "db1"}))
    try:
        assert credit(after, "m-1", 10) is Decision.DUPLICATE
        assert credit(after, "m-1", 99) is Decision.CONFLICT
        assert credit(after, "m-2", 5) is Decision.FIRST
    finally:
        after.dispose()
    assert tenant_databases.rows(0) == {"ledger": [], "inbox": []}
    moved = tenant_databases.rows(1)
    assert sorted(moved["ledger"]) == [(300, 5), (300, 10)]
    assert sorted(moved["inbox"]) == [("t3", "m-1"), ("t3", "m-2")]


def _rewrite(path: Path, urls: list[str], **entries: object) -> None:
    """Rewrite the map file as the guide says: aside, then renamed over it."""
    aside = path.with_suffix(".new")
    write_map(aside, urls, **entries)
    os.replace(aside, path)


def _mapped(
    databases: TenantDatabases, tmp_path: Path, tenants: dict[str, str]
) -> tuple[list[str], Path]:
    """The URLs of the first two tenant databases, and a map file sending ``tenants``."""
    urls = [databases.url(i) for i in range(2)]
    path = tmp_path / "map.json"
    _rewrite(path, urls, tenants=tenants)
    return urls, path


@contextlib.contextmanager
def _move_transactions(urls: list[str]) -> Iterator[tuple[Connection, Connection]]:
    """A move's two transactions, in the first and the second database of ``urls`` (the
    old and the new), committed at the end of the block."""
    source_engine, target_engine = (create_engine(url) for url in urls[:2])
    try:
        with source_engine.begin() as source, target_engine.begin() as target:
            yield source, target
    finally:
        source_engine.dispose()
        target_engine.dispose()


class AtWork:
    """A handler that credits account 300 with 10, then stays at work until `finish`."""

    def __init__(self) -> None:
        self.started, self.finish = threading.Event(), threading.Event()

    def __call__(self, session: Any) -> None:
        apply_credit(session, "billing", 300, 10)
        self.started.set()
        assert self.finish.wait(30)


class Background:
    """Deliveries and the guide's move of t3 from db0 to db1, each in a thread of its own;
    the outcome of each delivery (its decision, or the `RouteUnavailable` that handed it
    back)."""

    def __init__(self, inbox: RoutedInbox, urls: list[str]) -> None:
        self.inbox, self.threads = inbox, [threading.Thread(target=self._move, args=(urls,))]
        self.outcomes: dict[str, object] = {}
        self.moved = threading.Event()

    def _move(self, urls: list[str]) -> None:
        source, target = (create_engine(url) for url in urls)
        try:
            guide().move_tenant(source, target, "t3", move_business_rows)
            self.moved.set()
        finally:
            source.dispose()
            target.dispose()

    def deliver(self, message_id: str, delta: int, handler: Any) -> None:
        def run() -> None:
            try:
                committed = self.inbox.process(delivery(message_id, delta), handler)
                self.outcomes[message_id] = committed.decision
            except RouteUnavailable as exc:
                self.outcomes[message_id] = exc

        self.threads.append(threading.Thread(target=run))
        self.threads[-1].start()

    def move(self) -> None:
        self.threads[0].start()

    def join(self) -> None:
        for thread in self.threads:
            if thread.ident is not None:
                thread.join(30)


def _move_waits(url: str) -> bool:
    """Whether a session of ``url``'s database is the move waiting for the transactions in
    flight there (`tenants.wait_for_writers`: its last statement asked which still run)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return bool(
                conn.scalar(
                    text(
                        "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
                        " AND query LIKE '%pg_blocking_pids%'"
                    )
                )
            )
    finally:
        engine.dispose()


def test_move_tenant__a_delivery_at_work_when_it_is_paused_is_moved_with_it(
    tenant_databases: TenantDatabases, tmp_path: Path
):
    urls, path = _mapped(tenant_databases, tmp_path, {"t3": "db0"})
    inbox = RoutedInbox(MapFile(path))
    background, slow = Background(inbox, urls), AtWork()
    try:
        # Given a delivery of tenant t3 claimed in db0, its handler still at work
        background.deliver("m-1", 10, slow)
        assert slow.started.wait(30)
        # When the operator pauses t3 and moves it to db1, as the guide says
        _rewrite(path, urls, tenants={"t3": "db0"}, paused=["t3"])
        background.move()
        _wait(lambda: _move_waits(urls[0]), 30, "the move's wait")  # it waits
        assert not background.moved.is_set()
        slow.finish.set()
        background.join()
        assert background.moved.is_set()
        _rewrite(path, urls, tenants={"t3": "db1"})
        # ... and the message comes again (its ack lost)
        again = credit(inbox, "m-1", 10)
    finally:
        slow.finish.set()
        background.join()
        inbox.dispose()
    # Then it committed before the copy, moved with it: a duplicate in db1, where its
    # effect is, once; nothing of t3 is left in db0
    assert (background.outcomes["m-1"], again) == (Decision.FIRST, Decision.DUPLICATE)
    assert tenant_databases.rows(0) == {"ledger": [], "inbox": []}
    assert tenant_databases.rows(1) == {"ledger": [(300, 10)], "inbox": [("t3", "m-1")]}


def test_move_tenant__a_delivery_routed_before_the_pause_and_claimed_during_the_move_is_handed_back(
    tenant_databases: TenantDatabases, tmp_path: Path
):
    urls, path = _mapped(tenant_databases, tmp_path, {"t3": "db0"})
    # m-2 is routed once before its claim, as it is processed: that routing stops in the
    # resolver (the map it read says db0, not paused)
    routed, go_on = threading.Event(), threading.Event()
    routings: list[str] = []

    def resolver(identity: MessageIdentity) -> None:
        if identity.message_id == "m-2":
            routings.append(identity.message_id)
            if len(routings) == 1:
                routed.set()
                assert go_on.wait(30)

    inbox = RoutedInbox(MapFile(path, resolver=resolver))
    background, slow = Background(inbox, urls), AtWork()
    try:
        # Given m-1 claimed in db0, its handler at work, and m-2 routed to db0
        background.deliver("m-1", 10, slow)
        assert slow.started.wait(30)
        background.deliver("m-2", 5, lambda session: apply_credit(session, "billing", 300, 5))
        assert routed.wait(30)
        # When t3 is paused and its move waits for m-1, m-2 claims behind the move
        _rewrite(path, urls, tenants={"t3": "db0"}, paused=["t3"])
        background.move()
        _wait(lambda: _move_waits(urls[0]), 30, "the move's wait")
        go_on.set()
        # ... handed back at once, the move still waiting for m-1
        _wait(lambda: "m-2" in background.outcomes, 30, "m-2's claim")
        assert not background.moved.is_set()
        slow.finish.set()
        background.join()
        _rewrite(path, urls, tenants={"t3": "db1"})
        again = credit(inbox, "m-2", 5)
    finally:
        go_on.set()
        slow.finish.set()
        background.join()
        inbox.dispose()
    # Then m-1 moved with the copy, m-2 was handed back and applied in db1 when it came again
    assert background.outcomes["m-1"] is Decision.FIRST
    assert isinstance(background.outcomes["m-2"], RouteUnavailable), background.outcomes["m-2"]
    assert again is Decision.FIRST
    assert tenant_databases.rows(0) == {"ledger": [], "inbox": []}
    moved = tenant_databases.rows(1)
    assert sorted(moved["ledger"]) == [(300, 5), (300, 10)]
    assert sorted(moved["inbox"]) == [("t3", "m-1"), ("t3", "m-2")]


def test_move_tenant__the_other_tenants_of_the_old_database_claim_while_it_moves(
    tenant_databases: TenantDatabases, tmp_path: Path
):
    urls, path = _mapped(tenant_databases, tmp_path, {"t3": "db0", "t0": "db0"})
    inbox = RoutedInbox(MapFile(path))
    other = Delivery(
        "billing", MessageIdentity("orders", "o-1", "t0"), hash_json({"account": 1}, "v1")
    )
    claimed = threading.Event()

    def claim_other() -> None:
        inbox.process(other, lambda session: apply_credit(session, "billing", 1, 7))
        claimed.set()

    claimer = threading.Thread(target=claim_other)
    try:
        # Given t3, with a message applied in db0, paused to move to db1
        assert credit(inbox, "m-1", 10) is Decision.FIRST
        _rewrite(path, urls, tenants={"t3": "db0", "t0": "db0"}, paused=["t3"])
        # When the move's copy is done and its transaction in db0 is still open
        with _move_transactions(urls) as (source, target):
            copy_tenant(source, target, "t3")
            move_business_rows(source, target, "t3")
            # ... a delivery of t0, which stays in db0, claims and commits meanwhile
            claimer.start()
            assert claimed.wait(10), "t0's claim waited for t3's move"
            delete_tenant(source, "t3")
    finally:
        claimer.join(30)
        inbox.dispose()
    # Then t0's effect is in db0, t3's moved to db1 whole
    assert tenant_databases.rows(0) == {"ledger": [(1, 7)], "inbox": [("t0", "o-1")]}
    assert tenant_databases.rows(1) == {"ledger": [(300, 10)], "inbox": [("t3", "m-1")]}


def test_move_tenant__a_copy_after_the_tenants_rows_were_written_is_refused_not_stuck(
    tenant_databases: TenantDatabases, tmp_path: Path
):
    urls, path = _mapped(tenant_databases, tmp_path, {"t3": "db0"})
    inbox = RoutedInbox(MapFile(path))
    background, go_on = Background(inbox, urls), threading.Event()
    started = threading.Event()

    def handler(session: Any) -> None:
        started.set()
        assert go_on.wait(30)
        apply_credit(session, "billing", 300, 10)  # waits for the move's row lock

    try:
        # Given m-1 claimed in db0, its handler about to credit account 300
        background.deliver("m-1", 10, handler)
        assert started.wait(30)
        _rewrite(path, urls, tenants={"t3": "db0"}, paused=["t3"])
        # When the move writes account 300 in db0 before its copy (against the guide)
        with _move_transactions(urls) as (source, target):
            source.execute(text("INSERT INTO accounts (id, balance) VALUES (300, 0)"))
            go_on.set()
            with pytest.raises(ConfigurationError, match="call copy_tenant first"):
                copy_tenant(source, target, "t3")
            source.rollback()
            target.rollback()
    finally:
        go_on.set()
        background.join()
        inbox.dispose()
    # Then the copy is refused instead of waiting forever for m-1, which waited for it;
    # m-1 then committed in db0, where t3 still is
    assert background.outcomes["m-1"] is Decision.FIRST
    assert tenant_databases.rows(0) == {"ledger": [(300, 10)], "inbox": [("t3", "m-1")]}
    assert tenant_databases.rows(1) == {"ledger": [], "inbox": []}


def test_move_tenant__its_wait_for_a_delivery_in_flight_ends_at_the_lock_timeout(
    tenant_databases: TenantDatabases, tmp_path: Path
):
    urls, path = _mapped(tenant_databases, tmp_path, {"t3": "db0"})
    inbox = RoutedInbox(MapFile(path))
    background, slow = Background(inbox, urls), AtWork()
    try:
        # Given a delivery of t3 at work in db0 when t3 is paused
        background.deliver("m-1", 10, slow)
        assert slow.started.wait(30)
        _rewrite(path, urls, tenants={"t3": "db0"}, paused=["t3"])
        # When the move's transaction in db0 has a lock_timeout, as a LOCK would obey
        with _move_transactions(urls) as (source, target):
            source.execute(text("SET LOCAL lock_timeout = '300ms'"))
            with pytest.raises(TransientError, match="lock_timeout"):
                copy_tenant(source, target, "t3")
            target.rollback()
    finally:
        slow.finish.set()
        background.join()
        inbox.dispose()
    # Then the copy gave up, nothing moved; the delivery committed in db0, where t3 still is
    assert background.outcomes["m-1"] is Decision.FIRST
    assert tenant_databases.rows(1) == {"ledger": [], "inbox": []}


@pytest.mark.parametrize("batch", [False, True], ids=["one", "batch"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_routed__a_tenant_moved_once_its_delivery_was_routed_is_handed_back_unclaimed(
    tenant_databases: TenantDatabases, asynchronous: bool, batch: bool
):
    # Given a resolver that sends t3 to db0 until the delivery is claimed, then to db1
    # (each delivery is routed once before its claim)
    answers: list[str] = []

    def resolver(identity: MessageIdentity) -> str:
        answers.append("db0" if len(answers) < (2 if batch else 1) else "db1")
        return answers[-1]

    urls = {f"db{i}": tenant_databases.url(i) for i in range(2)}
    routes = DatabaseMap(urls, tenants={"t3": "db0"}, resolver=resolver)
    deliveries = [delivery(f"m-{n}", 10) for n in range(2 if batch else 1)]

    def handler(session: Any, *verdicts: Any) -> None:
        apply_credit(session, "billing", 300, 10)

    async def async_handler(session: Any, *verdicts: Any) -> None:
        await apply_credit_async(session, "billing", 300, 10)

    async def deliver() -> None:
        if asynchronous:
            inbox = AsyncRoutedInbox(routes)
            try:
                if batch:
                    await inbox.process_batch(deliveries, async_handler)
                else:
                    await inbox.process(deliveries[0], async_handler)
            finally:
                await inbox.dispose()
        else:
            routed = RoutedInbox(routes)
            try:
                if batch:
                    routed.process_batch(deliveries, handler)
                else:
                    routed.process(deliveries[0], handler)
            finally:
                routed.dispose()

    # When it is processed, the tenant moving in between
    with pytest.raises(RouteUnavailable, match="moved to database 'db1'"):
        asyncio.run(deliver())
    # Then nothing of it committed in db0 (nor in db1): its redelivery goes to db1
    assert tenant_databases.rows(0) == {"ledger": [], "inbox": []}
    assert tenant_databases.rows(1) == {"ledger": [], "inbox": []}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_routed__a_failure_count_written_once_its_tenant_moved_is_rolled_back(
    tenant_databases: TenantDatabases, asynchronous: bool
):
    # Given a resolver that sends t3 to db0 until the count is written, then to db1 (the
    # count is routed once before it is written)
    answers: list[str] = []

    def resolver(identity: MessageIdentity) -> str:
        answers.append("db0" if len(answers) < 1 else "db1")
        return answers[-1]

    urls = {f"db{i}": tenant_databases.url(i) for i in range(2)}
    routes = DatabaseMap(urls, tenants={"t3": "db0"}, resolver=resolver)
    count = CountFailure(delivery("m-1", 10), "Flaky: failed")

    async def bookkeep() -> None:
        if asynchronous:
            inbox = AsyncRoutedInbox(routes)
            try:
                await inbox.bookkeep(count)
            finally:
                await inbox.dispose()
        else:
            routed = RoutedInbox(routes)
            try:
                routed.bookkeep(count)
            finally:
                routed.dispose()

    # When its failed attempt is counted, the tenant moving in between
    with pytest.raises(RouteUnavailable, match="moved to database 'db1'"):
        asyncio.run(bookkeep())
    # Then the count is in neither database: the message is handed back
    for url in urls.values():
        engine = create_engine(url)
        try:
            with engine.connect() as conn:
                assert conn.scalar(text("SELECT count(*) FROM inbox_attempts")) == 0
        finally:
            engine.dispose()


def test_compact__a_routed_inbox_claims_in_each_tenants_database(tenant_databases):
    # Given a fleet over three databases claiming in the compact row, the switch recorded
    # in each (a new deployment)
    routes = DatabaseMap(
        {f"db{i}": tenant_databases.url(i) for i in range(3)},
        tenants={t: tenant_database(t) for t in TENANTS},
    )
    for index in range(3):
        engine = tenant_databases.engine(index)
        with engine.begin() as conn:
            switch_claims(conn, InboxSchema(), by="test")
        engine.dispose()
    inbox = RoutedInbox(routes, claims="compact")
    try:
        # When every tenant's message is delivered twice
        decided = [
            inbox.process(
                Delivery("billing", MessageIdentity("orders", f"o-{t}", t), hash_json({}, "v1")),
                lambda session: None,
            ).decision
            for t in TENANTS * 2
        ]
    finally:
        inbox.dispose()
    # Then each is first once, its claim in its tenant's database, none in the library's
    assert decided == [Decision.FIRST] * 9 + [Decision.DUPLICATE] * 9
    for index in range(3):
        engine = tenant_databases.engine(index)
        with engine.connect() as conn:
            compact = conn.scalar(text("SELECT count(*) FROM inbox_claims"))
            library = conn.scalar(text("SELECT count(*) FROM consumer_inbox"))
        engine.dispose()
        assert (compact, library) == (3, 0)
    # ... and a tenant's claims, which the compact row cannot tell apart, are not moved
    source, target = tenant_databases.engine(0), tenant_databases.engine(1)
    try:
        with (
            source.connect() as conn,
            target.begin() as into,
            pytest.raises(ConfigurationError, match="names no tenant"),
        ):
            copy_tenant(conn, into, "t0")
    finally:
        source.dispose()
        target.dispose()
