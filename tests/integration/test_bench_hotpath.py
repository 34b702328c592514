"""`python -m bench.hotpath --breakdown` measures both modes and tells the parts; the quick
mode's checks count its calls."""

from __future__ import annotations

import re

import pytest
from bench import hotpath
from bench.__main__ import CALLS_CEILING, QUICK_FLOOR, quick_checks
from bench.common import Report, prepare_database, sqlalchemy_url
from prometheus_client import REGISTRY
from sqlalchemy import create_engine, text

from inbox_middleware._observe.instruments import metrics

pytestmark = pytest.mark.postgres


def test_hotpath__the_breakdown_tells_the_parts_the_calls_and_the_arrival_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert hotpath.main(["--messages", "40", "--reps", "1", "--breakdown"]) == 0

    out = capsys.readouterr().out
    assert re.search(r"^added\s+-?\d+\.\d µs CPU/msg", out, re.MULTILINE)
    assert "claim (BEGIN + INSERT, verdict)" in out
    calls = re.search(r"calls a message: inbox (\d+), bare (\d+); .*: (\d+\.\d) µs", out)
    assert calls is not None, out
    inbox, bare, arrival = int(calls[1]), int(calls[2]), float(calls[3])
    assert inbox > bare > 100  # the inbox's own steps come on top of the bare transaction
    assert arrival > 0


def test_hotpath__the_floor_runs_beside_both_modes(capsys: pytest.CaptureFixture[str]) -> None:
    assert hotpath.main(["--messages", "40", "--reps", "1", "--floor"]) == 0

    out = capsys.readouterr().out
    assert re.search(r"^floor\s+\d+\.\d µs CPU/msg", out, re.MULTILINE)
    assert re.search(r"^floor\+\s+-?\d+\.\d µs CPU/msg", out, re.MULTILINE)


def test_hotpath__the_unmetered_mode_runs_the_inbox_with_its_metrics_off(
    capsys: pytest.CaptureFixture[str],
) -> None:
    labels = {"consumer": "hotpath", "producer": "hotpath", "decision": "first"}

    def counted() -> float:
        return REGISTRY.get_sample_value("inbox_messages_total", labels) or 0.0

    before = counted()
    assert hotpath.main(["--messages", "40", "--reps", "1", "--unmetered"]) == 0

    out = capsys.readouterr().out
    assert re.search(r"^unmetered\+\s+-?\d+\.\d µs CPU/msg", out, re.MULTILINE)
    # counted: both inbox modes' warm-up (200 each, metrics on) and the inbox mode's 40;
    # not the unmetered mode's 40
    assert counted() - before == 440
    assert metrics.enabled  # switched back on after its messages
    with pytest.raises(SystemExit):
        hotpath.main(["--driver", "asyncpg", "--unmetered"])


def test_hotpath__the_floor_claims_and_commits_the_update_once() -> None:
    # Given the floor's actor (the claim, the update, the checked COMMIT, nothing else)
    prepare_database()
    hotpath._reset()
    engine = create_engine(sqlalchemy_url(), pool_size=1)
    try:
        broker, actor = hotpath._broker("floor", engine)
        consume = hotpath._consume(broker, actor)
        message = hotpath._messages(actor, 1)[0]  # account 1
        with engine.connect() as conn:
            before = conn.execute(text("SELECT balance FROM bench_accounts WHERE id = 1")).scalar()
        # When the same message arrives twice
        consume(message)
        consume(message)
        # Then its claim committed, and the update with it, once
        with engine.connect() as conn:
            after = conn.execute(text("SELECT balance FROM bench_accounts WHERE id = 1")).scalar()
            claims = conn.execute(
                text("SELECT count(*) FROM consumer_inbox WHERE message_id = :id"),
                {"id": message.options["inbox_message_id"]},
            ).scalar()
    finally:
        engine.dispose()
    assert (after - before, claims) == (1, 1)


def test_hotpath__the_calls_a_message_are_the_same_in_every_run() -> None:
    first, second = hotpath.calls_per_message(300), hotpath.calls_per_message(300)
    # A counted figure: the same whatever the machine's load (a gauge written once a second
    # may add a few calls over a run)
    assert first.keys() == second.keys() == {"bare", "inbox"}
    assert all(abs(first[mode] - second[mode]) < 0.5 for mode in first)
    assert first["bare"] > 100


@pytest.mark.parametrize(("ratio", "failed"), [(0.6, 0), (QUICK_FLOOR - 0.01, 1)])
def test_hotpath__the_quick_checks_judge_the_calls_and_the_worker_ratio(
    ratio: float, failed: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given the worker's ratio a quick run measured
    report = Report(machine={}, settings={}, ratios={"dramatiq inbox / bare": {"median": ratio}})
    # When the quick checks run, then they count the hot path's calls against their ceiling
    # (today's code is under it) and fail only on the ratio below its floor
    assert quick_checks(report) == failed
    out = capsys.readouterr()
    calls = re.search(r"calls a message: inbox (\d+), bare (\d+), added (\d+)", out.out)
    assert calls is not None, out.out
    assert int(calls[3]) == int(calls[1]) - int(calls[2]) <= CALLS_CEILING
    assert ("is below" in out.err) == bool(failed)


def test_hotpath__the_asyncpg_breakdown_counts_the_calls_of_both_modes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        hotpath.main(["--driver", "asyncpg", "--messages", "40", "--reps", "1", "--breakdown"]) == 0
    )

    out = capsys.readouterr().out
    calls = re.search(r"calls a message: inbox (\d+), bare (\d+)$", out, re.MULTILINE)
    assert calls is not None, out
    assert int(calls[1]) > int(calls[2]) > 100


def test_hotpath__the_asyncpg_floor_runs_beside_both_modes_and_claims_each_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # When the asynchronous path runs with its floor (40 messages a mode, after 200 to warm)
    assert hotpath.main(["--driver", "asyncpg", "--messages", "40", "--reps", "1", "--floor"]) == 0

    out = capsys.readouterr().out
    assert re.search(r"^floor\+\s+-?\d+\.\d µs CPU/msg", out, re.MULTILINE), out
    # Then every message of the floor was first seen: a consumer of its own, not the
    # inbox's duplicates (which would skip the update and cost less than bare)
    engine = create_engine(sqlalchemy_url(), pool_size=1)
    try:
        with engine.connect() as conn:
            claims = conn.execute(
                text("SELECT count(*) FROM consumer_inbox WHERE consumer_name = 'hotpath-floor'")
            ).scalar()
    finally:
        engine.dispose()
    assert claims == 200 + 40


@pytest.mark.parametrize("awaited", [True, False], ids=["update awaited", "one run_sync"])
async def test_floor__claims_and_commits_the_update_once_on_asyncpg(awaited: bool) -> None:
    # Given the floor (the claim, the update, the checked COMMIT) on an AsyncSession
    from bench.floor import Floor
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from inbox_middleware._core.identity import MessageIdentity, hash_json
    from inbox_middleware._core.protocol import Delivery

    prepare_database()
    hotpath._reset()
    engine = create_async_engine(sqlalchemy_url("asyncpg"), pool_size=1)
    floor = Floor(engine.dialect)
    delivery = Delivery(
        "floor-test",
        MessageIdentity("test", f"once-{awaited}"),
        hash_json({"account": 1}, "json.v1"),
    )
    balance = text("SELECT balance FROM bench_accounts WHERE id = 1")
    try:
        async with engine.connect() as conn:
            before = (await conn.execute(balance)).scalar()
        # When the same delivery arrives twice
        for _ in range(2):
            async with AsyncSession(engine) as session:
                if awaited:

                    async def update(session: AsyncSession) -> None:
                        await session.execute(hotpath.UPDATE, {"account": 1})

                    await floor.run_async(session, delivery, update)
                else:
                    await session.run_sync(
                        floor.run, delivery, lambda s: s.execute(hotpath.UPDATE, {"account": 1})
                    )
        # Then its claim committed, and the update with it, once
        async with engine.connect() as conn:
            after = (await conn.execute(balance)).scalar()
            claims = (
                await conn.execute(
                    text(
                        "SELECT count(*) FROM consumer_inbox "
                        "WHERE consumer_name = 'floor-test' AND message_id = :id"
                    ),
                    {"id": delivery.identity.message_id},
                )
            ).scalar()
    finally:
        await engine.dispose()
    assert (after - before, claims) == (1, 1)
