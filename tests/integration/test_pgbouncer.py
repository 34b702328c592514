"""What must hold behind a transaction pooler (PgBouncer, ``pool_mode = transaction``) as on
a direct connection. ``scripts/test`` runs this file in both configurations: on a direct
connection each test holds as well, through PgBouncer it is the case the pooler breaks.

Through a transaction pooler each transaction may run on another server session, and
another client's next transaction may run on this one. So nothing the library does may
outlive its transaction in a server session unless it finds out it is not there: no named
prepared statement (psycopg names one after five executions), no session-level setting.
The one exception is the claim's own prepared statement, named after its text (so another
client's of the same name is the same statement), whose EXECUTE that finds none is rolled
back and sent as text.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from inbox_middleware import outbox
from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Decision, Delivery
from inbox_middleware._operate.metrics import serve
from inbox_middleware._storage import AsyncInbox, Inbox, InboxSchema, driver, engines

from ..apps.domain import apply_credit, effects
from ..support import services
from ..support.dispatchers import DispatcherProcess
from ..support.engines import pgbouncer_snippet, sync_engine
from ..support.http_remote import Remote
from ..support.workers import wait_for
from .test_metrics import Scrape
from .test_outbox import dispatcher, running

ROOT = Path(__file__).resolve().parents[2]
OUTBOX = InboxSchema().tables.outbox
NO_WAKE_UPS = "did not reach the LISTEN connection"
# The server session running the statement, its lock_timeout, and the value it would
# have without a SET: a session-level SET leaves the two different after its transaction.
SESSION = text(
    "SELECT pg_backend_pid(), current_setting('lock_timeout'), reset_val "
    "FROM pg_settings WHERE name = 'lock_timeout'"
)


@pytest.fixture
def remote():
    server = Remote()
    yield server
    server.close()


def delivery(message_id: str) -> Delivery:
    return Delivery("billing", MessageIdentity("orders", message_id), hash_json({}, "json.v1"))


def after_on_session(engine, pid: int) -> tuple[str, str]:
    """lock_timeout (and its reset value) in the next transactions that land on server
    session ``pid``: the same pooled connection on the server itself, whichever client
    PgBouncer lends that session to next through a pooler."""
    for _ in range(500):
        with engine.begin() as conn:
            landed, setting, reset = conn.execute(SESSION).one()
        if landed == pid:
            return setting, reset
    raise AssertionError(f"no transaction ran on server session {pid} again")


def add_and_notify(engine, effect_id: str) -> None:
    with Session(engine) as session, session.begin():
        outbox.add(session, destination="remote", payload={}, effect_id=effect_id, notify=True)


def dispatched(engine) -> int:
    with engine.connect() as conn:
        return conn.scalar(
            select(func.count()).select_from(OUTBOX).where(OUTBOX.c.status == "dispatched")
        )


def test_outbox_run__two_dispatcher_processes_deliver_every_effect(
    pg_url, pg_engine, tmp_path: Path
):
    # Given 40 effects and two `inbox-middleware outbox run` processes leasing two at a
    # time and polling every 50 ms: each runs its lease statement far more than 5 times
    effect_ids = [f"fx-{n}" for n in range(40)]
    with Session(pg_engine) as session, session.begin():
        for effect_id in effect_ids:
            outbox.add(
                session, destination="remote", payload={"id": effect_id}, effect_id=effect_id
            )
    remote = Remote()
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {"INBOX_TEST_REMOTE_URL": remote.url, "INBOX_TEST_MARKERS": str(markers)}
    options = ("--batch-size", "2", "--poll-interval", "0.05")
    processes = [
        DispatcherProcess(pg_url, env, tmp_path / f"dispatcher-{n}.log", *options) for n in range(2)
    ]

    def exited() -> bool:
        return any(process.proc.poll() is not None for process in processes)

    try:
        # When they run until every effect is dispatched (and a little longer, idle)
        wait_for(lambda: exited() or dispatched(pg_engine) == 40, timeout=60, what="40 dispatched")
        time.sleep(1)
        alive = [process.proc.poll() is None for process in processes]
        codes = [process.terminate() for process in processes]
    finally:
        for process in processes:
            process.kill()
        remote.close()
    # Then both were still running and stopped cleanly, and each effect was applied once
    outputs = "\n".join(process.output() for process in processes)
    assert (alive, codes) == ([True, True], [0, 0]), outputs
    assert "prepared statement" not in outputs
    assert sorted(remote.applied) == sorted(effect_ids)


def test_dispatcher__listen_on_the_engine_wakes_it_or_warns_behind_a_transaction_pooler(
    pg_engine, remote, caplog
):
    # Given a dispatcher that listens on its own engine's URL. On the server itself the
    # probe NOTIFY arrives and a NOTIFY wakes it long before its 60 s poll; through a
    # transaction pooler the probe cannot arrive: it says so and polls (every 0.2 s here)
    pooled = services.THROUGH_POOLER
    d = dispatcher(pg_engine, remote, poll_interval=0.2 if pooled else 60.0, listen=True)
    with caplog.at_level(logging.INFO, "inbox_middleware.outbox"), running(d):
        wait_for(lambda: d.listening or NO_WAKE_UPS in caplog.text, timeout=15, what="the probe")
        time.sleep(0.5)  # idle, past its first (empty) poll
        add_and_notify(pg_engine, "now")
        wait_for(lambda: remote.requests_for("now") == 1, timeout=10, what="the delivery")
        assert (d.listening, NO_WAKE_UPS in caplog.text) == (not pooled, pooled)


def test_dispatcher__listen_url_on_the_server_wakes_it_whatever_the_engine_goes_through(
    pg_engine, database_name, remote
):
    # Given leases through the engine (maybe a transaction pooler) and LISTEN on the server
    listen_url = services.with_database(services.POSTGRES_SERVER, database_name)
    d = dispatcher(pg_engine, remote, poll_interval=60.0, listen_url=listen_url)
    with running(d):
        wait_for(lambda: d.listening, timeout=15, what="the LISTEN connection")
        time.sleep(0.5)
        # When an effect is recorded with notify=True, Then it is delivered at once
        add_and_notify(pg_engine, "now")
        wait_for(lambda: remote.requests_for("now") == 1, timeout=10, what="the woken dispatcher")


def test_dispatcher__listen_where_no_notify_arrives_warns_and_polls(pg_engine, remote, caplog):
    # Given a LISTEN connection that the engine's NOTIFY cannot reach (another database),
    # as through a transaction pooler
    listen_url = services.with_database(services.POSTGRES_SERVER, "postgres")
    d = dispatcher(pg_engine, remote, poll_interval=0.2, listen_url=listen_url)
    with caplog.at_level(logging.WARNING, "inbox_middleware.outbox"), running(d):
        wait_for(lambda: NO_WAKE_UPS in caplog.text, timeout=15, what="the warning")
        # Then it says so, gives the connection up and polls
        add_and_notify(pg_engine, "later")
        wait_for(lambda: remote.requests_for("later") == 1, timeout=10, what="the poll")
    assert not d.listening
    assert "Wake-ups are off; polling every 0.2s" in caplog.text
    assert "listen_url" in caplog.text


def test_claim__lock_timeout_ends_with_the_claim_transaction(pg_engine):
    # Given a claim with lock_timeout 1.5 s, noting the server session it ran on
    seen = []
    outcome = Inbox(pg_engine, lock_timeout=1.5).process(
        delivery("m-1"), lambda session: seen.append(session.execute(SESSION).one())
    )
    assert outcome.decision is Decision.FIRST
    [(pid, during, _)] = seen
    assert during == "1500ms"
    # Then the next transaction on that server session (another client's, through a
    # pooler) has its own lock_timeout: the claim set it for its transaction only
    after, reset = after_on_session(pg_engine, pid)
    assert after == reset != "1500ms"


async def test_async_claim__lock_timeout_ends_with_the_claim_transaction(pg_async_engine):
    seen = []

    async def handler(session) -> None:
        seen.append((await session.execute(SESSION)).one())

    outcome = await AsyncInbox(pg_async_engine, lock_timeout=1.5).process(delivery("m-2"), handler)
    assert outcome.decision is Decision.FIRST
    [(pid, during, _)] = seen
    assert during == "1500ms"
    for _ in range(500):
        async with pg_async_engine.begin() as conn:
            landed, after, reset = (await conn.execute(SESSION)).one()
        if landed == pid:
            break
    assert landed == pid
    assert after == reset != "1500ms"


def test_claim__prepared_or_as_text_four_threads_claim_each_message_once(pg_url, pg_engine):
    # Given four threads on four connections of their own claiming 150 messages, each
    # twice: through a pooler, a connection's prepared claim meets server sessions that
    # never prepared it
    engine = sync_engine(pg_url, pool_size=4, max_overflow=0)
    inbox = Inbox(engine)
    states = []

    def credit(n: int):
        def handler(session: Session) -> None:
            apply_credit(session, "billing", n % 10, 1)
            states.append(session.connection().info.get(driver.PREPARED))

        return handler

    def claim(n: int) -> Decision:
        return inbox.process(delivery(f"m-{n % 150}"), credit(n % 150)).decision

    try:
        with ThreadPoolExecutor(4) as pool:
            decisions = Counter(pool.map(claim, range(300)))
    finally:
        engine.dispose()

    # Then each message was applied once, its copy a duplicate, prepared or as text
    assert decisions == {Decision.FIRST: 150, Decision.DUPLICATE: 150}
    with pg_engine.connect() as conn:
        assert effects(conn) == 150
    assert all(state is False or isinstance(state, frozenset) for state in states)
    if not services.THROUGH_POOLER:
        assert all(isinstance(state, frozenset) and len(state) == 1 for state in states)


@pytest.mark.parametrize("factories", ["the guide's snippet", "storage.engines"])
def test_pooler_safe_engines__run_a_statement_many_times_and_claim(
    factories, pg_url, pg_async_url, pg_engine
):
    # The guide's engines (docs/snippets/pgbouncer.py) and the library's own, on whatever
    # INBOX_TEST_POSTGRES is: twenty runs of one statement, past psycopg's threshold of five
    if factories == "storage.engines":
        make_sync, make_async = engines.sync_engine, engines.async_engine
    else:
        make_sync = pgbouncer_snippet().psycopg_engine
        make_async = pgbouncer_snippet().asyncpg_engine
    engine = make_sync(pg_url, pool_size=2)
    try:
        for _ in range(20):
            with engine.begin() as conn:
                assert conn.scalar(text("SELECT count(*) FROM consumer_inbox")) == 0
        outcome = Inbox(engine).process(delivery("m-1"), lambda session: None)
        assert outcome.decision is Decision.FIRST
    finally:
        engine.dispose()

    async def asyncpg_runs() -> Decision:
        engine = make_async(pg_async_url, pool_size=2)
        try:
            for _ in range(20):
                async with engine.begin() as conn:
                    assert await conn.scalar(text("SELECT count(*) FROM consumer_inbox")) == 1

            async def handler(session) -> None:
                pass

            return (await AsyncInbox(engine).process(delivery("m-2"), handler)).decision
        finally:
            await engine.dispose()

    assert asyncio.run(asyncpg_runs()) is Decision.FIRST


def test_metrics_endpoint_given_a_url__reads_the_tables_at_every_scrape(pg_url, pg_engine):
    # Given the endpoint's own engine (a URL), read afresh at each of 12 scrapes
    with Session(pg_engine) as session, session.begin():
        outbox.add(session, destination="remote", payload={}, effect_id="backlog")
    with serve(0, engine=pg_url, cache_seconds=0) as server:
        scrapes = [Scrape(server.url) for _ in range(12)]
    # Then every read succeeded, the last as the first
    assert [s.value("inbox_table_stats_up") for s in scrapes] == [1] * 12
    assert scrapes[-1].value("inbox_outbox_pending", destination="remote") == 1


ASYNCPG_PROCESS = """
import asyncio, sys
from sqlalchemy import text
from tests.support.engines import async_engine

async def main():
    engine = async_engine(sys.argv[1], pool_size=2)
    try:
        for n in range(200):
            async with engine.begin() as conn:
                assert await conn.scalar(text(f"SELECT {n % 7}")) == n % 7
    finally:
        await engine.dispose()

asyncio.run(main())
"""


def test_asyncpg_engines_in_two_processes__never_collide_on_a_statement_name(pg_async_url):
    # Two processes, each numbering its statements from 1 (asyncpg's default names):
    # through a transaction pooler their names meet in one server session, unless each
    # statement has a unique name, as the guide's engine gives it
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", ASYNCPG_PROCESS, pg_async_url],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
