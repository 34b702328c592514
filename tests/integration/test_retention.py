"""Retention: the recorded policy, the purge, and the hazard it exists to prevent."""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import dramatiq
import pytest
from sqlalchemy import select, text

from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Decision, Delivery
from inbox_middleware._operate.retention import (
    RetentionPolicy,
    RetentionRefused,
    check_window,
    parse_duration,
    purge,
    record_policy,
)
from inbox_middleware._storage import Inbox, InboxSchema
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity

from ..apps.domain import apply_credit, effects
from ..support.dramatiq_worker import drain, running_worker
from .test_compact_partitions import uuid7

NAMING = InboxSchema()
DEAD_LETTERS_FOR_TWO_WEEKS = RetentionPolicy(
    retry_horizon=parse_duration("1d"), dead_letter_retention=parse_duration("14d"), margin=0.2
)  # minimum window: 18 days


def cli(pg_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "from inbox_middleware.cli import run; run()",
            *args,
            "--database-url",
            pg_url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def age_claims(engine, days: float) -> None:
    """Pretend the claims were made ``days`` ago."""
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE consumer_inbox SET processed_at = now() - make_interval(days => :d)"),
            {"d": days},
        )


def test_purge__refused_without_a_policy_and_below_its_minimum(pg_engine, pg_url):
    with pg_engine.connect() as conn, pytest.raises(RetentionRefused, match="no retention policy"):
        check_window(conn, NAMING, timedelta(days=30), consumer=None, force=False)
    set_ = cli(
        pg_url,
        "retention",
        "set",
        "--retry-horizon",
        "1d",
        "--dead-letter-retention",
        "14d",
        "--margin",
        "0.2",
        "--by",
        "ops",
    )
    assert set_.returncode == 0, set_.stderr
    assert "minimum retention window: 2w4d (dead-letter redrive" in set_.stdout
    delivery = Delivery("billing", MessageIdentity("orders", "o-1"), hash_json(1, "json.v1"))
    Inbox(pg_engine).process(delivery, lambda session: None)
    refused = cli(pg_url, "purge", "--older-than", "7d")
    assert refused.returncode == 1
    assert refused.stderr.startswith(
        "error: consumer billing kept: purging claims younger than 2w4d is refused"
    )
    assert "replay guide" in refused.stderr and "Traceback" not in refused.stderr
    allowed = cli(pg_url, "purge", "--older-than", "30d")
    assert allowed.returncode == 0, allowed.stderr
    shown = cli(pg_url, "retention", "show", "--consumer", "billing")
    assert "policy recorded for consumer *" in shown.stdout


def test_purge__deletes_only_claims_older_than_the_window(pg_engine):
    inbox = Inbox(pg_engine)
    for n in range(30):
        inbox.process(
            Delivery("c", MessageIdentity("p", f"old-{n}"), hash_json(n, "s")), lambda s: None
        )
    age_claims(pg_engine, 40)
    for n in range(5):
        inbox.process(
            Delivery("c", MessageIdentity("p", f"new-{n}"), hash_json(n, "s")), lambda s: None
        )
    batches: list[int] = []
    deleted = purge(pg_engine, NAMING, timedelta(days=30), batch_size=7, on_batch=batches.append)
    assert (deleted, batches) == (30, [7, 7, 7, 7, 2])
    with pg_engine.connect() as conn:
        kept = conn.execute(select(NAMING.tables.inbox.c.message_id)).scalars().all()
    assert sorted(kept) == [f"new-{n}" for n in range(5)]


def test_purge__takes_the_stored_outputs_with_their_claims(pg_engine):
    # Given claims with stored outputs, some older than the window
    from inbox_middleware._core.outputs import Output

    inbox = Inbox(pg_engine)

    def claim(message_id: str) -> None:
        delivery = Delivery("c", MessageIdentity("p", message_id), hash_json(message_id, "s"))
        output = Output(b'{"ok":true}', "application/json")
        inbox.process(delivery, lambda s: inbox.keep_output(s, delivery, output))

    for n in range(3):
        claim(f"old-{n}")
    age_claims(pg_engine, 40)
    with pg_engine.begin() as conn:
        conn.execute(text("UPDATE inbox_outputs SET created_at = now() - interval '40 days'"))
    claim("new-0")
    # When the purge runs, then the old outputs go with their claims, the new one stays
    assert purge(pg_engine, NAMING, timedelta(days=30)) == 3
    with pg_engine.connect() as conn:
        kept = conn.execute(select(NAMING.tables.outputs.c.message_id)).scalars().all()
    assert kept == ["new-0"]


def _claim_with_output(inbox: Inbox, message_id: str) -> tuple[Delivery, Any]:
    from inbox_middleware._core.outputs import Output

    delivery = Delivery("c", MessageIdentity("p", message_id), hash_json(message_id, "s"))
    output = Output(b'{"ok":true}', "application/json")
    inbox.process(delivery, lambda s: inbox.keep_output(s, delivery, output))
    return delivery, output


def test_purge__a_claim_made_again_after_its_purge_keeps_its_own_output(engine):
    # Given a claim and its stored output, the claim purged and its output not yet (the
    # purge takes the outputs after the claims)
    from inbox_middleware._core.outputs import Output

    inbox = Inbox(engine)
    delivery, _ = _claim_with_output(inbox, "m-1")
    with engine.begin() as conn:
        conn.execute(NAMING.tables.inbox.delete())
    # When a copy past the window is claimed again, its handler answering anew
    again = Output(b'{"ok":"again"}', "application/json")
    inbox.process(delivery, lambda s: inbox.keep_output(s, delivery, again))
    # Then its duplicate would send the output of the claim that stands, not the old one
    with engine.connect() as conn:
        assert inbox.outputs.load(conn, delivery) == again


def _age_everything(engine, days: int) -> None:
    """Claims (both tables) and stored outputs made ``days`` ago, as the purge sees them."""
    with engine.begin() as conn:
        for table, column in (
            ("consumer_inbox", "processed_at"),
            ("inbox_claims", "processed_at"),
            ("inbox_outputs", "created_at"),
        ):
            conn.execute(
                text(f"UPDATE {table} SET {column} = now() - make_interval(days => {days})")
            )


@pytest.mark.parametrize("phase", ["both", "compact"])
def test_purge__keeps_a_stored_output_while_its_claim_stays(pg_engine, phase):
    # Given claims with stored outputs, all older than the window, whose compact claims a
    # purge leaves: a consumer's purge leaves the compact rows (they name no consumer)
    # while both tables are written; a UUIDv7's compact claim stays in its hour's
    # partition until that hour is past the window (here, one two hours ahead, made by
    # `claims prepare`, whenever the claim was made).
    from inbox_middleware._core.claims import ClaimsPhase
    from inbox_middleware._storage import partitions
    from inbox_middleware._storage.layout import switch_claims

    if phase == "compact":
        with pg_engine.begin() as conn:
            switch_claims(conn, NAMING, by="test")
        partitions.prepare(pg_engine, NAMING)  # the hours ahead, as `claims prepare` makes
    inbox = Inbox(pg_engine, claims="compact")
    message_id = (
        uuid7(datetime.now(UTC) + timedelta(hours=2))
        if phase == "compact"
        else f"order-{uuid.uuid4()}"
    )
    delivery, output = _claim_with_output(inbox, message_id)
    assert inbox.phase is (ClaimsPhase.BOTH if phase == "both" else ClaimsPhase.COMPACT)
    _age_everything(pg_engine, 40)
    # When the purge runs (a consumer's while both are written, every consumer's after)
    consumer = "c" if phase == "both" else None
    purge(pg_engine, NAMING, timedelta(days=30), consumer=consumer)
    # Then the claim is still there, so is its output: a redelivery is the duplicate it
    # is, and sends the stored output again (an output purged under a live claim would
    # leave the duplicate nothing to send, and it would be acked all the same)
    again = inbox.process(delivery, lambda s: None)
    assert again.verdict.decision is Decision.DUPLICATE
    with pg_engine.connect() as conn:
        assert inbox.outputs.load(conn, delivery) == output


def test_purge__takes_a_stored_output_once_its_compact_claim_is_gone(pg_engine):
    # Given compact claims (ids without a time) and their outputs older than the window
    from inbox_middleware._storage.layout import switch_claims

    with pg_engine.begin() as conn:
        switch_claims(conn, NAMING, by="test")
    inbox = Inbox(pg_engine, claims="compact")
    for n in range(3):
        _claim_with_output(inbox, f"old-{n}")
    _age_everything(pg_engine, 40)
    _claim_with_output(inbox, "new-0")
    # When every consumer's purge runs, then the old claims go and their outputs with them
    assert purge(pg_engine, NAMING, timedelta(days=30)) == 3
    with pg_engine.connect() as conn:
        outputs = conn.execute(select(NAMING.tables.outputs.c.message_id)).scalars().all()
    assert outputs == ["new-0"]


@pytest.fixture
def credit(stub_broker, pg_engine, queue):
    def declare(**settings):
        stub_broker.add_middleware(InboxMiddleware(pg_engine, **settings))

        @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
        def add_credit(account_id: int, delta: int) -> None:
            apply_credit(current_session(), "billing", account_id, delta)

        return add_credit

    return declare


def test_retention__a_purge_shorter_than_the_redrive_window_lets_a_redrive_apply_twice(
    stub_broker, pg_engine, queue, credit
):
    # Given an intent processed ten days ago, and a copy of it sitting in a dead-letter
    # store that keeps copies for two weeks (a failed duplicate, kept for a redrive)
    add_credit = credit()
    produced = datetime.now(UTC) - timedelta(days=10)
    copy = identity(producer="orders", message_id="o-1", produced_at=produced)
    with running_worker(stub_broker, threads=1) as worker:
        add_credit.send_with_options(args=(7, 10), **copy)
        drain(stub_broker, queue, worker)
        age_claims(pg_engine, 10)
        # When claims are purged after 7 days, below the policy's 18-day minimum (forced)
        with pg_engine.connect() as conn:
            check_window(conn, NAMING, timedelta(days=7), consumer=None, force=True)
        assert purge(pg_engine, NAMING, timedelta(days=7)) == 1
        # Then the redriven copy is new again: the effect is applied twice
        add_credit.send_with_options(args=(7, 10), **copy)
        drain(stub_broker, queue, worker)
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 2


def test_retention__the_calculated_window_keeps_the_claim_for_the_redrive(
    stub_broker, pg_engine, queue, credit
):
    add_credit = credit()
    with pg_engine.begin() as conn:
        recorded = record_policy(conn, NAMING, DEAD_LETTERS_FOR_TWO_WEEKS, consumer="*", by="ops")
    copy = identity(producer="orders", message_id="o-1")
    with running_worker(stub_broker, threads=1) as worker:
        add_credit.send_with_options(args=(7, 10), **copy)
        drain(stub_broker, queue, worker)
        age_claims(pg_engine, 10)
        # The purge at the policy's minimum leaves a ten-day-old claim alone
        with pg_engine.connect() as conn:
            check_window(conn, NAMING, recorded.minimum, consumer=None, force=False)
        assert purge(pg_engine, NAMING, recorded.minimum) == 0
        add_credit.send_with_options(args=(7, 10), **copy)
        drain(stub_broker, queue, worker)
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 1


@pytest.mark.parametrize(("policy", "applied"), [("reject", 1), ("process", 2)])
def test_retention__a_copy_older_than_the_window_is_rejected_or_counted(
    stub_broker, pg_engine, queue, credit, policy, applied
):
    # Given the window the purge uses, and a claim purged after it
    add_credit = credit(retention_window=timedelta(days=7), expired_redelivery=policy)
    produced = datetime.now(UTC) - timedelta(days=10)
    copy = identity(producer="orders", message_id="o-1", produced_at=produced)
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (7, 10)"))
        conn.execute(
            text(
                "INSERT INTO ledger (consumer, account_id, delta, pid) VALUES ('billing', 7, 10, 0)"
            )
        )
    # When a copy produced ten days ago arrives and finds no claim
    with running_worker(stub_broker, threads=1) as worker:
        add_credit.send_with_options(args=(7, 10), **copy)
        drain(stub_broker, queue, worker)
    # Then it is kept as poison for an operator, or applied (as configured), and counted
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == applied
        reasons = conn.execute(select(NAMING.tables.poison.c.reason_code)).scalars().all()
    assert reasons == (["expired_redelivery"] if policy == "reject" else [])


def test_purge__a_million_old_claims_while_workers_keep_claiming(pg_engine, capsys):
    # Given a million claims older than the window
    with pg_engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO consumer_inbox (consumer_name, producer_name, tenant, message_id, "
                "payload_sha256, hash_scheme, processed_at) SELECT 'old', 'p', '', 'm' || n, "
                "'x', 's', now() - interval '60 days' + n * interval '1 millisecond' "
                "FROM generate_series(1, 1000000) n"
            )
        )
        conn.execute(text("ANALYZE consumer_inbox"))
    inbox = Inbox(pg_engine, lock_timeout=5)
    run = uuid.uuid4().hex
    stop = threading.Event()
    latencies: dict[str, list[float]] = {"baseline": [], "during purge": []}
    errors: list[BaseException] = []
    phase = ["baseline"]

    def claim(worker: int) -> None:
        n = 0
        while not stop.is_set():
            delivery = Delivery(
                "live", MessageIdentity("p", f"{run}-{worker}-{n}"), hash_json(n, "s")
            )
            started = time.perf_counter()
            try:
                assert inbox.process(delivery, lambda s: None).decision is Decision.FIRST
            except BaseException as exc:  # recorded, then the test fails on it
                errors.append(exc)
                return
            latencies[phase[0]].append(time.perf_counter() - started)
            n += 1

    threads = [threading.Thread(target=claim, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(5)
    # When the purge runs, batch by batch, while the workers keep claiming
    phase[0] = "during purge"
    started = time.monotonic()
    deleted = purge(pg_engine, NAMING, timedelta(days=30), batch_size=5000)
    purge_seconds = time.monotonic() - started
    stop.set()
    for thread in threads:
        thread.join()
    # Then every claim succeeded and the purge removed exactly the old ones
    assert errors == []
    assert deleted == 1_000_000
    with pg_engine.connect() as conn:
        assert (
            conn.scalar(text("SELECT count(*) FROM consumer_inbox WHERE consumer_name = 'old'"))
            == 0
        )

    def ms(values: list[float], q: int) -> float:
        return statistics.quantiles(values, n=100)[q - 1] * 1000

    report = " | ".join(
        f"{name}: {len(values)} claims, p50 {ms(values, 50):.1f} ms, p99 {ms(values, 99):.1f} ms"
        for name, values in latencies.items()
    )
    with capsys.disabled():
        print(f"\npurge of {deleted} claims in {purge_seconds:.1f}s; claim latency {report}")
    assert len(latencies["during purge"]) > 100
    assert ms(latencies["during purge"], 99) < 2000
