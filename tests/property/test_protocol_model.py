"""A model of the claim protocol, checked step by step against the real PostgreSQL.

Hypothesis drives deliveries of a few intents with a few payloads through `Inbox`
(psycopg) and `AsyncInbox` (asyncpg): first deliveries, redeliveries, conflicting
payloads, crashes at each point of an attempt, bursts of concurrent deliveries, and a
concurrent delivery whose first holder crashes while the other waits on its claim. The
model says what each delivery must decide; after every step the database must hold
exactly the model's claims, effects and quarantine rows. At the end every delivery whose
outcome the broker never learned (a crash) is redelivered, and every intent delivered at
all must then have exactly one effect.

A crash is the loss of the attempt's database connection at that point, as the server
sees a killed process: the attempt's connection runs through a proxy that resets it.
SIGKILLed processes are the business of ``tests/crash`` and ``tests/chaos``.

    before_claim   nothing reached the database       the message comes back
    after_claim    claim inserted, handler not run    the server rolls back; it comes back
    in_body        the handler's writes done          the server rolls back; it comes back
    after_commit   committed, the ack lost            it comes back: a duplicate
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from inbox_middleware import DatabaseUnavailable, Decision, Delivery, Inbox, MessageIdentity
from inbox_middleware._core.identity import hash_json
from inbox_middleware._storage.aio import AsyncInbox

from ..support.cutting_proxy import CuttingProxy

CONSUMER = "model"
SCHEME = "model.v1"
MESSAGE_IDS = st.sampled_from(["m1", "m2", "m3"])
PAYLOADS = st.integers(1, 3)
CRASH_POINTS = st.sampled_from(["before_claim", "after_claim", "in_body", "after_commit"])
SETTINGS = settings(
    max_examples=15,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
pytestmark = pytest.mark.slow

TABLE = "CREATE TABLE IF NOT EXISTS property_effects (message_id text NOT NULL, payload int)"


def sha(payload: int) -> str:
    return hash_json({"delta": payload}, SCHEME).sha256


def delivery(message_id: str, payload: int) -> Delivery:
    return Delivery(
        consumer=CONSUMER,
        identity=MessageIdentity("orders", message_id),
        payload_hash=hash_json({"delta": payload}, SCHEME),
        source="model",
    )


@dataclass(frozen=True)
class Call:
    """One delivery attempt, and what the test does inside it."""

    message_id: str
    payload: int
    crash: str | None = None
    """after_claim or in_body: cut the attempt's connection there."""
    hold: float = 0.0
    """Seconds the handler keeps the claim, after its write."""
    hold_until: Callable[[], bool] | None = None
    """The handler waits, after its write, until this holds."""
    start_when: Callable[[], bool] | None = None
    """The delivery starts only once this holds."""
    claimed: threading.Event | None = None
    """Set when the handler starts: the claim is then held, uncommitted."""


# -- the executors under test --------------------------------------------------------------


class SyncAttempts:
    """Deliveries through `Inbox` on psycopg; concurrent ones on threads."""

    def __init__(self, url: str, proxy: CuttingProxy) -> None:
        self.proxy = proxy
        self.engine = create_engine(url, pool_size=8, max_overflow=4, pool_pre_ping=True)
        self.inbox = Inbox(self.engine, lock_timeout=10)

    def process(self, message_id: str, payload: int, crash: str | None = None) -> Decision:
        return self.run(Call(message_id, payload, crash))

    def run(self, call: Call) -> Decision:
        if call.start_when is not None:
            _until(call.start_when, "the delivery's turn")

        def handler(session: Any) -> None:
            if call.claimed is not None:
                call.claimed.set()
            if call.crash == "after_claim":
                self.cut(session)
            session.execute(INSERT, {"m": call.message_id, "p": call.payload})
            time.sleep(call.hold)
            if call.hold_until is not None:
                _until(call.hold_until, "the other delivery to wait")
            if call.crash == "in_body":
                self.cut(session)

        return self.inbox.process(delivery(call.message_id, call.payload), handler).decision

    def cut(self, session: Any) -> None:
        port = session.execute(text("SELECT inet_client_port()")).scalar_one()
        assert self.proxy.cut_ports({port}) == 1

    def together(self, calls: list[Call]) -> list[Decision | Exception]:
        with ThreadPoolExecutor(len(calls)) as pool:
            futures = [pool.submit(self.run, call) for call in calls]
            return [_result(future.result) for future in futures]

    def close(self) -> None:
        self.engine.dispose()


class AsyncAttempts:
    """Deliveries through `AsyncInbox` on asyncpg, on an event loop of its own;
    concurrent ones as tasks."""

    def __init__(self, url: str, proxy: CuttingProxy) -> None:
        from sqlalchemy.ext.asyncio import create_async_engine

        self.proxy = proxy
        self.loop = asyncio.new_event_loop()
        async_url = make_url(url).set(drivername="postgresql+asyncpg")
        self.engine = create_async_engine(async_url, pool_size=8, pool_pre_ping=True)
        self.inbox = AsyncInbox(self.engine, lock_timeout=10)

    def process(self, message_id: str, payload: int, crash: str | None = None) -> Decision:
        return self.loop.run_until_complete(self.run(Call(message_id, payload, crash)))

    async def run(self, call: Call) -> Decision:
        if call.start_when is not None:
            await _until_async(call.start_when, "the delivery's turn")

        async def handler(session: Any) -> None:
            if call.claimed is not None:
                call.claimed.set()
            if call.crash == "after_claim":
                await self.cut(session)
            await session.execute(INSERT, {"m": call.message_id, "p": call.payload})
            await asyncio.sleep(call.hold)
            if call.hold_until is not None:
                await _until_async(call.hold_until, "the other delivery to wait")
            if call.crash == "in_body":
                await self.cut(session)

        outcome = await self.inbox.process(delivery(call.message_id, call.payload), handler)
        return outcome.decision

    async def cut(self, session: Any) -> None:
        port = (await session.execute(text("SELECT inet_client_port()"))).scalar_one()
        assert self.proxy.cut_ports({port}) == 1

    def together(self, calls: list[Call]) -> list[Decision | Exception]:
        async def gather() -> list[Any]:
            return await asyncio.gather(*(self.run(c) for c in calls), return_exceptions=True)

        return self.loop.run_until_complete(gather())

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.dispose())
        self.loop.close()


INSERT = text("INSERT INTO property_effects VALUES (:m, :p)")


def _result(get: Callable[[], Decision]) -> Decision | Exception:
    try:
        return get()
    except Exception as exc:
        return exc


def _until(check: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


async def _until_async(check: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _someone_waits_on_a_lock(admin: psycopg.Connection[Any]) -> Callable[[], bool]:
    def check() -> bool:
        row = admin.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()
        return bool(row and row[0])

    return check


# -- the model -------------------------------------------------------------------------------


class ProtocolModel(RuleBasedStateMachine):
    """Subclassed per executor (`make_model`); ``admin`` is a direct connection."""

    admin: psycopg.Connection[Any]
    attempts: SyncAttempts | AsyncAttempts

    def __init__(self) -> None:
        super().__init__()
        self.committed: dict[str, int] = {}  # message id -> the payload that won
        self.quarantined: Counter[tuple[str, str]] = Counter()  # (id, conflicting hash)
        self.unacked: list[tuple[str, int]] = []  # deliveries the broker will redeliver
        self.delivered: set[str] = set()

    @initialize()
    def empty_database(self) -> None:
        self.admin.execute("TRUNCATE consumer_inbox, inbox_quarantine, property_effects")

    # -- what the protocol must decide ------------------------------------------------------

    def expected(self, message_id: str, payload: int) -> Decision:
        if message_id not in self.committed:
            return Decision.FIRST
        if self.committed[message_id] == payload:
            return Decision.DUPLICATE
        return Decision.CONFLICT

    def settle(self, message_id: str, payload: int, decision: Decision | BaseException) -> None:
        assert decision == self.expected(message_id, payload), (message_id, payload, decision)
        if decision is Decision.FIRST:
            self.committed[message_id] = payload
        elif decision is Decision.CONFLICT:
            self.quarantined[message_id, sha(payload)] += 1

    # -- rules --------------------------------------------------------------------------------

    @rule(message_id=MESSAGE_IDS, payload=PAYLOADS)
    def deliver(self, message_id: str, payload: int) -> None:
        self.delivered.add(message_id)
        self.settle(message_id, payload, self.attempts.process(message_id, payload))

    @rule(message_id=MESSAGE_IDS, payload=PAYLOADS, point=CRASH_POINTS)
    def crash(self, message_id: str, payload: int, point: str) -> None:
        self.delivered.add(message_id)
        self.unacked.append((message_id, payload))
        if point == "before_claim":
            return  # the process died before sending anything
        if point == "after_commit":
            self.settle(message_id, payload, self.attempts.process(message_id, payload))
            return
        expected = self.expected(message_id, payload)
        if expected is not Decision.FIRST:
            # Already claimed: the attempt decides before any handler runs, so a crash
            # "in" the handler cannot happen; it is a redelivery that was not acked.
            self.settle(message_id, payload, self.attempts.process(message_id, payload))
            return
        with pytest.raises(DatabaseUnavailable):
            self.attempts.process(message_id, payload, crash=point)

    @precondition(lambda self: self.unacked)
    @rule(data=st.data())
    def redeliver(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.unacked) - 1), label="unacked")
        message_id, payload = self.unacked.pop(index)
        self.settle(message_id, payload, self.attempts.process(message_id, payload))

    @rule(message_id=MESSAGE_IDS, payloads=st.lists(PAYLOADS, min_size=2, max_size=6))
    def concurrent(self, message_id: str, payloads: list[int]) -> None:
        """Deliveries of one intent at once; each holds its claim a moment, so the others
        pile up on it. If several payloads race for a new intent, one wins: the model
        learns which from the decisions, and the rest must be duplicates or conflicts."""
        self.delivered.add(message_id)
        before = self.committed.get(message_id)
        decisions = self.attempts.together(
            [Call(message_id, payload, hold=0.05) for payload in payloads]
        )
        assert all(isinstance(d, Decision) for d in decisions), decisions
        firsts = [p for p, d in zip(payloads, decisions, strict=True) if d is Decision.FIRST]
        assert len(firsts) == (0 if before is not None else 1), decisions
        if before is None:
            self.committed[message_id] = firsts[0]
        for payload, decision in zip(payloads, decisions, strict=True):
            if decision is not Decision.FIRST:
                self.settle(message_id, payload, decision)

    @precondition(lambda self: len(self.committed) < 3)
    @rule(message_id=MESSAGE_IDS, first=PAYLOADS, second=PAYLOADS)
    def concurrent_first_crashes(self, message_id: str, first: int, second: int) -> None:
        """A holds a new intent's claim; B's claim waits on it; A's process dies. The
        server rolls A back, and B, which was waiting, owns the intent."""
        if message_id in self.committed:
            return
        self.delivered.add(message_id)
        claimed = threading.Event()
        waits = _someone_waits_on_a_lock(self.admin)
        a = Call(message_id, first, crash="in_body", hold_until=waits, claimed=claimed)
        b = Call(message_id, second, start_when=claimed.is_set)
        decisions = self.attempts.together([a, b])
        assert isinstance(decisions[0], DatabaseUnavailable), decisions
        assert decisions[1] is Decision.FIRST, decisions
        self.committed[message_id] = second
        self.unacked.append((message_id, first))

    # -- the database holds what the model says ----------------------------------------------

    @invariant()
    def database_matches_model(self) -> None:
        effects: dict[str, list[int]] = {}
        for message_id, payload in self.admin.execute(
            "SELECT message_id, payload FROM property_effects"
        ):
            effects.setdefault(message_id, []).append(payload)
        assert effects == {m: [p] for m, p in self.committed.items()}
        claims = dict(
            self.admin.execute(
                "SELECT message_id, payload_sha256 FROM consumer_inbox WHERE consumer_name = %s",
                (CONSUMER,),
            ).fetchall()
        )
        assert claims == {m: sha(p) for m, p in self.committed.items()}
        quarantine = {
            (m, h): attempts
            for m, h, attempts in self.admin.execute(
                "SELECT message_id, conflicting_sha256, attempts FROM inbox_quarantine"
            )
        }
        assert quarantine == dict(self.quarantined)

    def teardown(self) -> None:
        try:
            while self.unacked:  # the broker redelivers whatever was never acknowledged
                self.settle(*self.unacked[0], self.attempts.process(*self.unacked.pop(0)))
            self.database_matches_model()
            assert set(self.committed) == self.delivered, "an intent was delivered, never applied"
        finally:
            self.attempts.close()


# -- the tests ---------------------------------------------------------------------------------


@pytest.fixture
def model_database(pg_url: str, pg_engine: Any) -> Any:
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(TABLE)
    url = make_url(pg_url)
    proxy = CuttingProxy((url.host or "127.0.0.1", url.port or 5432))
    admin = psycopg.connect(
        url.set(drivername="postgresql").render_as_string(hide_password=False), autocommit=True
    )
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    try:
        yield admin, proxy, proxied
    finally:
        admin.close()
        proxy.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_protocol_model__matches_the_database_through_crashes_and_races(model_database, kind):
    admin, proxy, url = model_database
    attempts_class = SyncAttempts if kind == "sync" else AsyncAttempts

    class Model(ProtocolModel):
        def __init__(self) -> None:
            self.admin = admin
            self.attempts = attempts_class(url, proxy)
            super().__init__()

    run_state_machine_as_test(Model, settings=SETTINGS)
