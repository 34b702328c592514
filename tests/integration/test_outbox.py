"""The outbox on the real databases: effects recorded with the handler's transaction,
delivered by the dispatcher to a real HTTP server on 127.0.0.1 with idempotency keys."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from typing import Any

import pytest
from sqlalchemy import Engine, event, select, text, update
from sqlalchemy.orm import Session

from inbox_middleware import outbox
from inbox_middleware._core.exceptions import ConfigurationError
from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Decision, Delivery
from inbox_middleware._storage import AsyncInbox, Inbox, InboxSchema
from inbox_middleware.outbox import Backoff, Destinations, Dispatcher, Effect
from inbox_middleware.outbox.destinations.http import HttpDestination

from ..apps.domain import apply_credit, apply_credit_async, effects
from ..support import services
from ..support.engines import sync_engine
from ..support.http_remote import Behaviour, Remote
from ..support.proxy import Proxy
from ..support.workers import wait_for

OUTBOX = InboxSchema().tables.outbox


def delivery(message_id: str = "m-1", tenant: str = "") -> Delivery:
    return Delivery(
        "billing",
        MessageIdentity("orders", message_id, tenant),
        hash_json({"account": 1}, "json.v1"),
    )


def rows(engine: Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(select(OUTBOX).order_by("created_at")).mappings()]


def row(engine: Engine, effect_id: str) -> dict[str, Any]:
    with engine.connect() as conn:
        return dict(
            conn.execute(select(OUTBOX).where(OUTBOX.c.effect_id == effect_id)).mappings().one()
        )


def record(
    engine: Engine, count: int, destination: str = "remote", prefix: str = "fx"
) -> list[str]:
    """Effects recorded outside any handler, with explicit ids."""
    ids = [f"{prefix}-{n}" for n in range(count)]
    with Session(engine) as session, session.begin():
        for n, effect_id in enumerate(ids):
            outbox.add(session, destination=destination, payload={"n": n}, effect_id=effect_id)
    return ids


@pytest.fixture
def remote():
    server = Remote()
    yield server
    server.close()


def dispatcher(engine: Engine, remote: Remote, **options: Any) -> Dispatcher:
    settings: dict[str, Any] = {
        "lease": 2.0,
        "delivery_timeout": 1.0,
        "poll_interval": 0.05,
        "backoff": Backoff(base=0.05, cap=0.2),
    }
    return Dispatcher(engine, {"remote": HttpDestination(remote.url)}, **(settings | options))


def burst(dispatcher: Dispatcher) -> Dispatcher:
    asyncio.run(dispatcher.run(burst=True))
    return dispatcher


@contextlib.contextmanager
def running(dispatcher: Dispatcher):
    thread = dispatcher.start()
    try:
        yield dispatcher
    finally:
        dispatcher.stop()
        thread.join(timeout=30)
        assert not thread.is_alive()


# -- recording: PostgreSQL and SQLite -----------------------------------------------------


def test_add__effect_commits_with_the_handler_transaction(engine):
    inbox = Inbox(engine)

    def handler(session: Session) -> list[str]:
        apply_credit(session, "billing", 1, 10)
        return [
            outbox.add(session, destination="email", payload={"to": "a@example.com"}),
            outbox.add(session, destination="remote", payload=[1, 2], headers={"x-trace": "t"}),
        ]

    ids = inbox.process(delivery(), handler).result

    assert ids == [outbox.effect_id_for(delivery(), 0), outbox.effect_id_for(delivery(), 1)]
    stored = {r["effect_id"]: r for r in rows(engine)}
    assert set(stored) == set(ids)
    first, second = stored[ids[0]], stored[ids[1]]
    assert (first["destination"], first["payload"], first["status"]) == (
        "email",
        {"to": "a@example.com"},
        "pending",
    )
    assert (second["payload"], second["headers"], second["attempts"]) == (
        [1, 2],
        {"x-trace": "t"},
        0,
    )


def test_add__effect_rolls_back_with_the_handler_and_the_retry_derives_the_same_id(engine):
    inbox = Inbox(engine)
    seen: list[str] = []

    def fails(session: Session) -> None:
        seen.append(outbox.add(session, destination="email", payload={"n": 1}))
        raise RuntimeError("the handler failed after recording its effect")

    with pytest.raises(RuntimeError):
        inbox.process(delivery(), fails)
    assert rows(engine) == []

    retried = inbox.process(
        delivery(), lambda s: outbox.add(s, destination="email", payload={"n": 1})
    )
    assert retried.result == seen[0]
    assert [r["effect_id"] for r in rows(engine)] == seen


def test_add__redelivered_message_after_commit_adds_no_second_row(engine):
    inbox = Inbox(engine)

    def handler(session: Session) -> str:
        apply_credit(session, "billing", 1, 10)
        return outbox.add(session, destination="email", payload={"n": 1})

    first = inbox.process(delivery(), handler)
    again = inbox.process(delivery(), handler)

    assert (first.decision, again.decision) == (Decision.FIRST, Decision.DUPLICATE)
    assert len(rows(engine)) == 1
    with engine.connect() as conn:
        assert effects(conn) == 1


def test_add__same_explicit_id_twice_keeps_the_first_effect(engine):
    with Session(engine) as session, session.begin():
        outbox.add(session, destination="email", payload={"v": 1}, effect_id="welcome-7")
    with Session(engine) as session, session.begin():
        outbox.add(session, destination="email", payload={"v": 2}, effect_id="welcome-7")
    assert [(r["effect_id"], r["payload"]) for r in rows(engine)] == [("welcome-7", {"v": 1})]


def test_add__outside_a_handler_requires_an_effect_id(engine):
    with Session(engine) as session, pytest.raises(outbox.EffectIdRequired, match="effect_id="):
        outbox.add(session, destination="email", payload={})


def test_add__refuses_what_cannot_be_stored_or_delivered(engine):
    with Session(engine) as session:
        with pytest.raises(outbox.InvalidEffect, match="not JSON"):
            outbox.add(session, destination="email", payload={"at": object()}, effect_id="x")
        with pytest.raises(outbox.InvalidEffect, match="destination"):
            outbox.add(session, destination=" email", payload={}, effect_id="x")
        with pytest.raises(outbox.InvalidEffect, match="effect_id is 257 characters"):
            outbox.add(session, destination="email", payload={}, effect_id="x" * 257)
        with pytest.raises(outbox.InvalidEffect, match="must be text"):
            outbox.add(session, destination="email", payload={}, headers={"n": 1}, effect_id="x")


def test_effect_id_for__stable_unambiguous_and_usable_as_a_message_id():
    base = outbox.effect_id_for(delivery("m-1"), 0)
    assert base == outbox.effect_id_for(delivery("m-1"), 0)
    others = {
        outbox.effect_id_for(delivery("m-1"), 1),
        outbox.effect_id_for(delivery("m-2"), 0),
        outbox.effect_id_for(delivery("m-1", tenant="t"), 0),
        # "a|b" + "c" and "a" + "b|c" must not collide, whatever separators ids contain
        outbox.effect_id_for(
            Delivery("a|b", MessageIdentity("c", "m"), delivery().payload_hash), 0
        ),
        outbox.effect_id_for(
            Delivery("a", MessageIdentity("b|c", "m"), delivery().payload_hash), 0
        ),
    }
    assert len(others | {base}) == 6
    long = Delivery(
        "c" * 128, MessageIdentity("p" * 128, "m" * 256, "t" * 128), delivery().payload_hash
    )
    derived = outbox.effect_id_for(long, 10_000)
    assert MessageIdentity.parse(producer="outbox", message_id=derived).message_id == derived
    assert derived.startswith("fx1-") and len(derived) == 68


async def test_add__async_session_records_in_the_async_inbox_transaction(
    pg_async_engine, pg_engine
):
    inbox = AsyncInbox(pg_async_engine)

    async def handler(session) -> str:
        await apply_credit_async(session, "billing", 1, 10)
        return await outbox.add(session, destination="email", payload={"n": 1})

    outcome = await inbox.process(delivery(), handler)
    again = await inbox.process(delivery(), handler)

    assert outcome.result == outbox.effect_id_for(delivery(), 0)
    assert again.decision is Decision.DUPLICATE
    assert [r["effect_id"] for r in rows(pg_engine)] == [outcome.result]


async def test_add__async_add_not_awaited_refuses_the_commit(pg_async_engine, pg_engine):
    inbox = AsyncInbox(pg_async_engine)
    forgotten = []

    async def handler(session) -> None:
        await apply_credit_async(session, "billing", 1, 10)
        forgotten.append(outbox.add(session, destination="email", payload={"n": 1}))

    with pytest.raises(outbox.OutboxError, match="not awaited"):
        await inbox.process(delivery(), handler)
    forgotten[0].close()  # the coroutine the handler forgot
    assert rows(pg_engine) == []
    with pg_engine.connect() as conn:
        assert effects(conn) == 0


# -- dispatching: PostgreSQL --------------------------------------------------------------


def test_dispatcher__delivers_with_the_effect_id_as_idempotency_key(pg_engine, remote):
    ids = record(pg_engine, 3)

    stats = burst(dispatcher(pg_engine, remote)).stats

    assert stats.dispatched == 3
    assert sorted(r.key for r in remote.received) == sorted(ids)
    assert {r.key: r.body for r in remote.received} == {f"fx-{n}": {"n": n} for n in range(3)}
    for effect_id in ids:
        stored = row(pg_engine, effect_id)
        assert stored["status"] == "dispatched"
        assert stored["remote_result"] == {
            "status": 201,
            "body": {"applied": True, "key": effect_id},
        }
        assert stored["lease_token"] is None and stored["dispatched_at"] is not None
        assert stored["attempts"] == 1


def test_dispatcher__retries_after_an_ambiguous_timeout_and_the_remote_applies_once(
    pg_engine, remote
):
    # Given a remote that applies the first request and then never answers it
    remote.behaviour = Behaviour(hang_after_apply=1)
    (effect_id,) = record(pg_engine, 1)
    # When the dispatcher times out (1 s) and retries, no earlier than the lease's end
    with running(dispatcher(pg_engine, remote, lease=2.0, delivery_timeout=0.5)) as d:
        wait_for(
            lambda: row(pg_engine, effect_id)["status"] == "dispatched", timeout=20, what="dispatch"
        )
    # Then the remote saw the key twice and applied it once; the answer to the retry is recorded
    assert remote.requests_for(effect_id) == 2
    assert list(remote.applied) == [effect_id]
    stored = row(pg_engine, effect_id)
    assert stored["attempts"] == 2
    assert stored["last_error"].startswith("TimeoutError")
    assert stored["remote_result"]["body"] == {"replayed": True, "key": effect_id}
    first, second = remote.received
    assert second.at - first.at >= 2.0 * 0.8  # the retry waited for the first lease to end
    assert d.stats.retried == 1 and d.stats.dispatched == 1


def test_dispatcher__two_dispatchers_deliver_each_effect_once(pg_url, pg_engine, remote):
    # Given 1,000 effects and two dispatchers with their own connections, started at once
    ids = record(pg_engine, 1000)
    engines = [sync_engine(pg_url, pool_size=2) for _ in range(2)]
    racing = [dispatcher(engine, remote, batch_size=25) for engine in engines]
    try:
        threads = [d.start() for d in racing]
        wait_for(
            lambda: len(remote.received) >= 1000 and dispatched(pg_engine) == 1000,
            timeout=120,
            interval=0.2,
            what="1,000 dispatched effects",
        )
    finally:
        for d in racing:
            d.stop()
        for thread in threads:
            thread.join(timeout=30)
        for engine in engines:
            engine.dispose()
    # Then each effect was applied once and delivered once, but where a delivery's outcome
    # was not recorded as dispatched, which the dispatchers count: its lease ran out first
    # (a stalled dispatcher: a loaded machine, a pooler's queue), or its deadline cut it
    # short (released) or it timed out (retried) after the remote had it; then it was
    # delivered again with the same idempotency key. Both took part, and none was
    # delivered twice at a time
    received = [r.key for r in remote.received]
    assert sorted(set(received)) == sorted(ids)
    assert sorted(remote.applied) == sorted(ids)
    unrecorded = sum(d.stats.leases_lost + d.stats.released + d.stats.retried for d in racing)
    assert len(received) - len(ids) <= unrecorded, [d.stats for d in racing]
    assert [d.stats.leased > 100 for d in racing] == [True, True], [d.stats for d in racing]
    assert sum(d.stats.dispatched for d in racing) == 1000
    assert remote.max_concurrent_per_key == 1


def dispatched(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.scalar(text("SELECT count(*) FROM message_outbox WHERE status = 'dispatched'"))
        )


def test_dispatcher__failed_after_the_attempt_limit_is_visible(pg_engine, remote):
    remote.behaviour = Behaviour(status=503)
    (effect_id,) = record(pg_engine, 1)

    with running(dispatcher(pg_engine, remote, max_attempts=3)) as d:
        wait_for(
            lambda: row(pg_engine, effect_id)["status"] == "failed", timeout=20, what="failure"
        )

    stored = row(pg_engine, effect_id)
    assert stored["attempts"] == 3 and remote.requests_for(effect_id) == 3
    assert (
        stored["last_error"]
        == "gave up after 3 attempts: DeliveryError: HTTP 503 from " + remote.url
    )
    assert stored["remote_result"] == {"status": 503, "body": {"error": "refused"}}
    assert (d.stats.retried, d.stats.failed) == (2, 1)


def test_dispatcher__a_refusal_fails_at_once(pg_engine, remote):
    remote.behaviour = Behaviour(status=422)
    (effect_id,) = record(pg_engine, 1)

    burst(dispatcher(pg_engine, remote))

    stored = row(pg_engine, effect_id)
    assert (stored["status"], stored["attempts"]) == ("failed", 1)
    assert stored["last_error"].startswith("PermanentDeliveryError: HTTP 422")


def test_dispatcher__lost_lease_is_not_recorded_and_is_counted(pg_engine, caplog):
    # Given a delivery during which another dispatcher took the lease over (as after a
    # stall longer than the lease)
    class TakenOver:
        async def deliver(self, effect: Effect, timeout: float) -> Any:
            with pg_engine.begin() as conn:
                conn.execute(
                    update(OUTBOX)
                    .where(OUTBOX.c.effect_id == effect.effect_id)
                    .values(lease_token="the-new-holder")
                )
            return {"ok": True}

    (effect_id,) = record(pg_engine, 1)
    d = Dispatcher(pg_engine, {"remote": TakenOver()}, lease=2.0, delivery_timeout=1.0)
    # When its outcome comes back
    with caplog.at_level(logging.WARNING, "inbox_middleware.outbox"):
        burst(d)
    # Then it is not recorded: the new holder's lease stands, and the loss is counted
    stored = row(pg_engine, effect_id)
    assert (stored["status"], stored["lease_token"]) == ("pending", "the-new-holder")
    assert (d.stats.leases_lost, d.stats.dispatched) == (1, 0)
    assert "lease lost to another dispatcher" in caplog.text


def test_dispatcher__leases_only_its_own_destinations(pg_engine, remote):
    record(pg_engine, 2, destination="remote")
    record(pg_engine, 2, destination="sms", prefix="sms")

    burst(dispatcher(pg_engine, remote))

    statuses = {r["effect_id"]: r["status"] for r in rows(pg_engine)}
    assert statuses == {
        "fx-0": "dispatched",
        "fx-1": "dispatched",
        "sms-0": "pending",
        "sms-1": "pending",
    }


def test_dispatcher__listen_wakes_it_without_waiting_for_the_poll(pg_engine, database_name, remote):
    # Through a transaction pooler, LISTEN needs the server itself (test_pgbouncer.py
    # shows the warning and the polling without it)
    listen_url = services.with_database(services.POSTGRES_SERVER, database_name)
    d = dispatcher(
        pg_engine,
        remote,
        poll_interval=60.0,
        listen=True,
        listen_url=listen_url if services.THROUGH_POOLER else None,
    )
    with running(d):
        time.sleep(1.0)  # idle, past its first (empty) poll
        with Session(pg_engine) as session, session.begin():
            outbox.add(session, destination="remote", payload={}, effect_id="now", notify=True)
        wait_for(lambda: remote.requests_for("now") == 1, timeout=10, what="the woken dispatcher")


def test_dispatcher__in_flight_delivery_finishes_on_stop_and_a_cancelled_one_is_released(
    pg_engine, remote
):
    remote.behaviour = Behaviour(slow=1.0)
    record(pg_engine, 1)
    leased = threading.Event()
    d = dispatcher(pg_engine, remote, lease=10.0, delivery_timeout=5.0)
    d.on_leased = lambda effects: leased.set()
    with running(d):
        assert leased.wait(10)
    assert row(pg_engine, "fx-0")["status"] == "dispatched"  # stop() let it finish

    record(pg_engine, 1, prefix="slow")
    remote.behaviour = Behaviour(slow=5.0)
    leased.clear()
    d = dispatcher(pg_engine, remote, lease=10.0, delivery_timeout=8.0, shutdown_grace=0.2)
    d.on_leased = lambda effects: leased.set()
    with running(d):
        assert leased.wait(10)
        time.sleep(0.2)
    stored = row(pg_engine, "slow-0")
    assert (stored["status"], stored["attempts"], stored["lease_token"]) == ("pending", 0, None)
    assert d.stats.released == 1


def test_dispatcher__refuses_sqlite_and_a_delivery_timeout_as_long_as_the_lease(
    sqlite_engine, pg_engine
):
    destinations = Destinations({"remote": HttpDestination("http://127.0.0.1:9/")})
    with pytest.raises(ConfigurationError, match="needs PostgreSQL.*SKIP LOCKED"):
        Dispatcher(sqlite_engine, destinations)
    with pytest.raises(ConfigurationError, match="at most 80% of the lease"):
        Dispatcher(pg_engine, destinations, lease=10.0, delivery_timeout=9.0)


def test_backoff__exponential_capped_and_jittered():
    backoff = Backoff(base=1.0, factor=2.0, cap=30.0, jitter=0.5)
    rng = random.Random(7)
    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (500, 30.0)]:
        delays = [backoff.delay(attempt, rng) for _ in range(200)]
        assert ceiling / 2 <= min(delays) and max(delays) <= ceiling, attempt
        assert len(set(delays)) > 100  # spread out, not one instant
    with pytest.raises(ConfigurationError):
        Backoff(base=0)


def test_dispatcher__outlives_a_database_outage(pg_url, pg_engine, remote, caplog):
    # Given a dispatcher whose database connections go through a proxy we can break
    proxy = Proxy(services.postgres_address())
    engine = sync_engine(services.via_port(pg_url, proxy.port), pool_pre_ping=True)
    try:
        with (
            caplog.at_level(logging.WARNING, "inbox_middleware.outbox"),
            running(dispatcher(engine, remote)) as d,
        ):
            # When the database is unreachable for a while
            proxy.down()
            time.sleep(0.5)
            record(pg_engine, 2)
            time.sleep(0.5)
            assert remote.received == []
            proxy.up()
            # Then it reports it, keeps polling, and delivers once the database is back
            wait_for(lambda: dispatched(pg_engine) == 2, timeout=20, what="the deliveries")
        assert "the database is unavailable" in caplog.text
        assert d.stats.dispatched == 2
    finally:
        engine.dispose()
        proxy.close()


def test_dispatcher__a_lease_cut_off_before_its_commit_holds_its_effects_no_longer_than_the_lease(
    pg_url, pg_engine, remote, caplog
):
    # Given a dispatcher whose connection turns into a black hole right after its lease
    # statement ran: the server has the effect's row locked in a transaction whose COMMIT
    # never arrives (a connection lost without a reset; the server waits for its client)
    proxy = Proxy(services.postgres_address())
    cut_off = sync_engine(services.via_port(pg_url, proxy.port))

    @event.listens_for(cut_off, "after_cursor_execute")
    def hole(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if "SKIP LOCKED" in statement:
            proxy.blackhole()

    (effect_id,) = record(pg_engine, 1, prefix="held")
    other_engine = sync_engine(pg_url)
    try:
        with (
            caplog.at_level(logging.WARNING, "inbox_middleware.outbox"),
            running(dispatcher(cut_off, remote)) as stalled,
        ):
            try:
                wait_for(lambda: proxy._holed, timeout=10, what="the lease into the black hole")
                # When another dispatcher runs (SKIP LOCKED passes over the locked row)
                with running(dispatcher(other_engine, remote)) as other:
                    # Then it delivers the effect once the server has ended the cut-off
                    # transaction, a lease's length (2 s) after it went idle
                    began = time.monotonic()
                    wait_for(lambda: dispatched(pg_engine) == 1, timeout=15, what="the delivery")
                    waited = time.monotonic() - began
            finally:
                proxy.unblackhole()
            wait_for(lambda: "unavailable" in caplog.text, timeout=15, what="the cut-off's error")
        # It was delivered once, by the other, as its first attempt (the cut-off lease
        # rolled back, its attempt with it)
        assert waited < 10
        assert list(remote.applied) == [effect_id]
        assert (other.stats.dispatched, stalled.stats.dispatched) == (1, 0)
        assert row(pg_engine, effect_id)["attempts"] == 1
    finally:
        proxy.close()
        cut_off.dispose()
        other_engine.dispose()


def test_dispatcher__a_burst_waits_for_a_retry_due_within_a_second(pg_engine):
    # Given an effect whose first delivery fails for a moment, retried after the default
    # backoff (half a second to a second)
    class DownOnce:
        def __init__(self) -> None:
            self.calls = 0

        async def deliver(self, effect: Effect, timeout: float) -> Any:
            self.calls += 1
            if self.calls == 1:
                raise ConnectionError("the remote is restarting")
            return {"ok": True}

    (effect_id,) = record(pg_engine, 1)
    d = Dispatcher(pg_engine, {"remote": DownOnce()}, lease=2.0, delivery_timeout=1.0)
    # When a burst runs, then it drains the retry that was about to be due, and exits
    started = time.monotonic()
    burst(d)
    assert (d.stats.retried, d.stats.dispatched) == (1, 1)
    assert row(pg_engine, effect_id)["status"] == "dispatched"
    assert time.monotonic() - started < 3


def test_dispatcher__a_burst_leaves_a_retry_due_later(pg_engine):
    # Given an effect whose retry is due in a minute, then a burst does not wait for it
    class Down:
        async def deliver(self, effect: Effect, timeout: float) -> Any:
            raise ConnectionError("the remote is down")

    (effect_id,) = record(pg_engine, 1)
    d = Dispatcher(
        pg_engine, {"remote": Down()}, lease=2.0, delivery_timeout=1.0, backoff=Backoff(base=60)
    )
    started = time.monotonic()
    burst(d)
    assert (d.stats.retried, d.stats.dispatched) == (1, 0)
    assert row(pg_engine, effect_id)["status"] == "pending"
    assert time.monotonic() - started < 2
