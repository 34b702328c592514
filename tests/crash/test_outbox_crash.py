"""Real ``inbox-middleware outbox run`` processes, killed with SIGKILL at named points or
stopped with SIGTERM, delivering to a real HTTP server on 127.0.0.1.

    after_lease      the lease is committed, nothing was delivered
    after_delivery   the remote applied the effect, the outcome was not recorded

Each point blocks the process's event loop (as a hung process would) until it is killed;
another dispatcher must take the effect over once the lease ends, and the remote must
have applied it once.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from inbox_middleware import outbox
from inbox_middleware._storage import InboxSchema

from ..support.dispatchers import DispatcherProcess
from ..support.http_remote import Behaviour, Remote
from ..support.workers import wait_for

pytestmark = pytest.mark.slow
OUTBOX = InboxSchema().tables.outbox
EFFECT = "fx-crash"


@pytest.fixture
def setup(pg_url, pg_engine, tmp_path: Path):
    remote = Remote()
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {"INBOX_TEST_REMOTE_URL": remote.url, "INBOX_TEST_MARKERS": str(markers)}
    started: list[DispatcherProcess] = []

    def start(*args: str, **extra: str) -> DispatcherProcess:
        options = {
            "--lease": "2",
            "--delivery-timeout": "1",
            "--poll-interval": "0.1",
            "--backoff-base": "0.1",
            "--backoff-cap": "0.5",
        }
        flat = [part for pair in options.items() for part in pair]
        log = tmp_path / f"dispatcher-{len(started)}.log"
        process = DispatcherProcess(pg_url, env | extra, log, *flat, *args)
        started.append(process)
        return process

    with Session(pg_engine) as session, session.begin():
        outbox.add(session, destination="remote", payload={"amount": 10}, effect_id=EFFECT)
    yield start, remote, markers
    for process in started:
        process.kill()
    remote.close()


def effect(pg_engine) -> dict:
    with pg_engine.connect() as conn:
        return dict(conn.execute(select(OUTBOX)).mappings().one())


def leased_marker(markers: Path) -> bool:
    return any(path.name.startswith("leased.") for path in markers.iterdir())


@pytest.mark.parametrize("point", ["after_lease", "after_delivery"])
def test_crash__killed_dispatcher_lease_expires_and_another_finishes_the_work(
    setup, pg_engine, point
):
    start, remote, markers = setup
    # Given a dispatcher stopped at `point` holding the effect's lease
    first = start(INBOX_TEST_PAUSE_AT=point)
    wait_for((markers / f"{point}.paused").exists, timeout=30, what=point)
    held = effect(pg_engine)
    assert (held["status"], held["attempts"]) == ("pending", 1)
    assert held["lease_token"] is not None
    # When it is killed, and another dispatcher runs
    first.kill()
    second = start()
    wait_for(lambda: effect(pg_engine)["status"] == "dispatched", timeout=30, what="takeover")
    assert second.terminate() == 0
    # Then the second took over only once the lease had ended, and the remote applied the
    # effect once (after_delivery: the second request carried the same key, and was replayed)
    done = effect(pg_engine)
    assert done["attempts"] == 2
    assert list(remote.applied) == [EFFECT]
    takeover = remote.received[-1].at
    assert takeover >= held["leased_until"].timestamp() - 0.05
    if point == "after_delivery":
        assert remote.requests_for(EFFECT) == 2
        assert done["remote_result"]["body"] == {"replayed": True, "key": EFFECT}
    else:
        assert remote.requests_for(EFFECT) == 1
    assert "dispatched 1," in second.output()


def test_crash__sigterm_lets_the_in_flight_delivery_finish(setup, pg_engine):
    start, remote, markers = setup
    remote.behaviour = Behaviour(slow=1.5)
    dispatcher = start("--lease", "10", "--delivery-timeout", "5")
    wait_for(lambda: leased_marker(markers), timeout=30, what="the lease")
    stopped_at = time.monotonic()

    assert dispatcher.terminate() == 0

    assert time.monotonic() - stopped_at < 10
    done = effect(pg_engine)
    assert (done["status"], done["lease_token"]) == ("dispatched", None)
    assert "dispatched 1, retried 0, failed 0, released 0" in dispatcher.output()


def test_crash__sigterm_releases_a_delivery_that_outlasts_the_grace(setup, pg_engine):
    start, remote, markers = setup
    remote.behaviour = Behaviour(slow=20)
    dispatcher = start("--lease", "10", "--delivery-timeout", "8", "--shutdown-grace", "0.3")
    wait_for(lambda: leased_marker(markers), timeout=30, what="the lease")
    wait_for(lambda: remote.requests_for(EFFECT) == 1, timeout=10, what="the request")

    assert dispatcher.terminate(timeout=10) == 0

    released = effect(pg_engine)
    assert (released["status"], released["attempts"], released["lease_token"]) == (
        "pending",
        0,
        None,
    )
    assert "released 1" in dispatcher.output()
    # and another dispatcher delivers it at once, without waiting for the old lease
    remote.behaviour = Behaviour()
    second = start()
    wait_for(lambda: effect(pg_engine)["status"] == "dispatched", timeout=15, what="redelivery")
    assert second.terminate() == 0
    assert list(remote.applied) == [EFFECT]
