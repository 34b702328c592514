"""Every metric moves as the protocol decides, on the real PostgreSQL and real brokers,
read back by scraping the metrics endpoint over HTTP on 127.0.0.1.

The Prometheus registry is process-wide and other tests record into it too: each test
uses consumer names of its own and compares its own series, before and after.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import dramatiq
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from inbox_middleware import outbox
from inbox_middleware._core.exceptions import PermanentError
from inbox_middleware._operate.metrics import TableCollector, serve
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity
from inbox_middleware.faststream import FastStreamInbox, InboxSession, identity_headers
from inbox_middleware.outbox import Dispatcher

from ..apps.domain import apply_credit, apply_credit_async
from ..support.dramatiq_worker import drain, running_worker
from ..support.faststream_brokers import Harness, Seen, eventually, recorder
from ..support.workers import wait_for


class Scrape:
    """One scrape of a metrics endpoint: sample values by name and labels."""

    def __init__(self, url: str) -> None:
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            body = response.read().decode()
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels``."""
        wanted = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and wanted <= ls)

    def has(self, name: str, **labels: str) -> bool:
        wanted = set(labels.items())
        return any(n == name and wanted <= ls for (n, ls) in self.samples)


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def endpoint(pg_engine):
    """This process's metrics and the table gauges, on a free port of 127.0.0.1."""
    with serve(0, engine=pg_engine, cache_seconds=0) as server:
        assert server.url.startswith("http://127.0.0.1:")
        yield server.url


# -- Dramatiq -----------------------------------------------------------------------------


def test_metrics__dramatiq_decisions_failures_and_tables_move(
    rabbitmq_broker, queue, pg_engine, endpoint
):
    consumer = name("billing")
    broker = rabbitmq_broker
    broker.add_middleware(
        InboxMiddleware(pg_engine, lock_timeout=10, retention_window=timedelta(days=1))
    )

    @dramatiq.actor(queue_name=queue, inbox_consumer=consumer, max_retries=0)
    def credit(account_id: int, delta: int) -> None:
        if delta < 0:
            raise PermanentError("negative_credit")
        apply_credit(current_session(), consumer, account_id, delta)

    def send(message_id: str, *args: int, **extra: Any) -> None:
        credit.send_with_options(
            args=args, **identity(producer="orders", message_id=message_id, **extra)
        )

    started = time.time()
    before = Scrape(endpoint)
    with running_worker(broker) as worker:
        send("ord-1", 7, 10)
        send("ord-2", 8, 5)
        drain(broker, queue, worker)
        send("ord-1", 7, 10)  # duplicate
        send("ord-1", 7, 99)  # conflict
        credit.send_with_options(args=(7, 1))  # no identity
        send("ord-3", 9, -1)  # permanent failure
        send("ord-4", 9, 1, produced_at=datetime.now(UTC) - timedelta(days=3))  # expired
        drain(broker, queue, worker)
    after = Scrape(endpoint)

    def moved(metric: str, **labels: str) -> float:
        return after.value(metric, consumer=consumer, **labels) - before.value(
            metric, consumer=consumer, **labels
        )

    assert moved("inbox_messages_total", producer="orders", decision="first") == 2
    assert moved("inbox_messages_total", producer="orders", decision="duplicate") == 1
    assert moved("inbox_messages_total", producer="orders", decision="conflict") == 1
    assert moved("inbox_missing_identity_total", reason="missing", outcome="rejected") == 1
    assert moved("inbox_handler_failures_total", reason_code="negative_credit") == 1
    assert moved("inbox_handler_failures_total", reason_code="expired_redelivery") == 1
    assert moved("inbox_expired_redeliveries_total", outcome="rejected") == 1
    assert moved("inbox_moved_total", destination="quarantine") == 1
    assert moved("inbox_moved_total", destination="poison") == 2
    assert moved("inbox_claim_seconds_count") == 6  # 2 first, 1 duplicate, 1 conflict, 2 failed
    assert moved("inbox_commit_seconds_count") == 4  # the two failures rolled back
    assert moved("inbox_shadow_would_skip_total") == 0
    identified = after.value(
        "inbox_producer_last_identified_timestamp_seconds", consumer=consumer, producer="orders"
    )
    assert started <= identified <= time.time()
    # The table gauges, from the same endpoint
    assert after.value("inbox_table_stats_up") == 1
    assert after.value("inbox_table_rows", table="consumer_inbox") == 2
    assert after.value("inbox_table_bytes", table="consumer_inbox") > 0
    assert after.value("inbox_repair_pending", consumer=consumer, kind="quarantine") == 1
    assert after.value("inbox_repair_pending", consumer=consumer, kind="poison") == 2
    assert after.has("inbox_repair_oldest_pending_age_seconds", consumer=consumer, kind="poison")
    assert 0 <= after.value("inbox_oldest_claim_age_seconds") < 120


def test_metrics__lock_wait_and_claim_in_progress_are_measured(
    rabbitmq_broker, queue, pg_engine, endpoint
):
    # Given a handler that holds its claim for 1.5 s and a lock_timeout of 0.5 s
    consumer = name("slow")
    broker = rabbitmq_broker
    broker.add_middleware(InboxMiddleware(pg_engine, lock_timeout=0.5, in_progress_delay=200))

    @dramatiq.actor(queue_name=queue, inbox_consumer=consumer)
    def hold(n: int) -> None:
        apply_credit(current_session(), consumer, n, 1)
        time.sleep(1.5)

    before = Scrape(endpoint)
    # When two deliveries of one message arrive together
    with running_worker(broker, threads=4) as worker:
        for _ in range(2):
            hold.send_with_options(args=(1,), **identity(producer="p", message_id="m-1"))
        drain(broker, queue, worker)
    after = Scrape(endpoint)

    def moved(metric: str, **labels: str) -> float:
        return after.value(metric, consumer=consumer, **labels) - before.value(
            metric, consumer=consumer, **labels
        )

    # Then the second claim waited on the first for lock_timeout, was handed back, and came
    # back a duplicate; its wait is in the claim histogram, above the 0.25 s bucket
    assert moved("inbox_claim_in_progress_total") >= 1
    assert moved("inbox_messages_total", decision="first") == 1
    assert moved("inbox_messages_total", decision="duplicate") == 1
    waited = moved("inbox_claim_seconds_count") - moved("inbox_claim_seconds_bucket", le="0.25")
    assert waited >= 1
    assert moved("inbox_claim_seconds_sum") >= 0.45


def test_metrics__deadlock_retry_is_counted(rabbitmq_broker, queue, pg_engine, endpoint):
    # Given two handlers that lock two accounts in opposite orders, at the same moment
    consumer = name("transfer")
    broker = rabbitmq_broker
    broker.add_middleware(InboxMiddleware(pg_engine, lock_timeout=10))
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (1, 0), (2, 0)"))
    barrier = threading.Barrier(2, timeout=10)
    met = threading.Event()

    @dramatiq.actor(queue_name=queue, inbox_consumer=consumer, max_retries=0)
    def transfer(first: int, second: int) -> None:
        session = current_session()
        session.execute(
            text("UPDATE accounts SET balance = balance - 1 WHERE id = :a"), {"a": first}
        )
        if not met.is_set():  # the first attempts only: the retry runs alone
            barrier.wait()
            met.set()
        session.execute(
            text("UPDATE accounts SET balance = balance + 1 WHERE id = :a"), {"a": second}
        )

    before = Scrape(endpoint)
    with running_worker(broker, threads=2) as worker:
        transfer.send_with_options(args=(1, 2), **identity(producer="bank", message_id="t-1"))
        transfer.send_with_options(args=(2, 1), **identity(producer="bank", message_id="t-2"))
        drain(broker, queue, worker)
    after = Scrape(endpoint)

    # Then PostgreSQL broke the deadlock, the victim ran again in-process, and both committed
    assert (
        after.value("inbox_transaction_retries_total", consumer=consumer)
        - before.value("inbox_transaction_retries_total", consumer=consumer)
        == 1
    )
    assert after.value("inbox_messages_total", consumer=consumer, decision="first") == 2


def test_metrics__outbox_attempts_and_backlog(pg_engine, endpoint):
    class Flaky:
        def __init__(self) -> None:
            self.calls = 0

        async def deliver(self, effect: Any, timeout: float) -> Any:
            self.calls += 1
            if self.calls == 1:
                raise ConnectionError("the remote is down")
            return {"ok": True}

    destination = name("mail")
    with pg_engine.begin() as conn:
        from sqlalchemy.orm import Session

        with Session(bind=conn) as session:
            outbox.add(session, destination=destination, payload={"n": 1}, effect_id="fx-1")
    pending = Scrape(endpoint)
    assert pending.value("inbox_outbox_pending", destination=destination) == 1
    assert pending.has("inbox_outbox_oldest_pending_age_seconds", destination=destination)

    dispatcher = Dispatcher(
        pg_engine,
        {destination: Flaky()},
        backoff=outbox.Backoff(base=0.01, cap=0.01, jitter=0),
        delivery_timeout=5,
    )

    async def until_delivered() -> None:
        for _ in range(50):  # bursts: the failed attempt is due again 10 ms later
            await dispatcher.run(burst=True)
            if dispatcher.stats.dispatched:
                return
            await asyncio.sleep(0.02)

    asyncio.run(until_delivered())
    done = Scrape(endpoint)
    assert done.value("inbox_outbox_attempts_total", destination=destination, outcome="retry") == 1
    assert (
        done.value("inbox_outbox_attempts_total", destination=destination, outcome="delivered") == 1
    )
    assert done.value("inbox_outbox_pending", destination=destination) == 0


def test_metrics__table_gauges_are_cached_between_scrapes(pg_engine):
    collector = TableCollector(pg_engine, cache_seconds=60)
    with serve(0, engine=None) as server:
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry()
        registry.register(collector)
        for _ in range(5):
            generate_latest(registry)
        assert collector.reads == 1
        Scrape(server.url)  # the endpoint without an engine serves no table gauges
        assert not Scrape(server.url).has("inbox_table_stats_up")


# -- FastStream ---------------------------------------------------------------------------


async def test_metrics__faststream_decisions_and_missing_identity_move(
    pg_async_engine, pg_engine, endpoint
):
    consumer = name("ledger")
    inbox = FastStreamInbox(pg_async_engine, lock_timeout=10, retry_backoff=(0.05, 0.5))
    seen = Seen()
    h = Harness("rabbit", [recorder(seen), inbox.middleware])
    inbox.guard(h.broker)

    @h.subscribe(inbox.consumer(consumer))
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        await apply_credit_async(session, consumer, body["account"], body["delta"])

    before = Scrape(endpoint)
    try:
        async with h.broker:
            await h.broker.start()
            ident = identity_headers(producer="shop", message_id="o-1")
            # One at a time: a subscriber runs its prefetch window's deliveries at once,
            # and the copy that claims first is the one applied.
            for number, delta in enumerate([5, 5, 6]):  # first, duplicate, conflict
                await h.publish({"account": 1, "delta": delta}, ident)
                await eventually(lambda n=number: len(seen.outcomes) > n, what="its outcome")
            await h.publish({"account": 1, "delta": 5}, {"x-inbox-producer": "shop"})  # no id

            def settled() -> bool:
                now = Scrape(endpoint)
                return (
                    now.value("inbox_moved_total", consumer=consumer, destination="quarantine") == 1
                    and now.value("inbox_missing_identity_total", consumer=consumer) == 1
                    and now.value("inbox_messages_total", consumer=consumer) == 3
                )

            await eventually(settled, what="every decision counted")
    finally:
        await h.cleanup()
    after = Scrape(endpoint)
    for decision in ("first", "duplicate", "conflict"):
        assert after.value("inbox_messages_total", consumer=consumer, decision=decision) == 1
    assert after.value(
        "inbox_missing_identity_total", consumer=consumer, reason="missing", outcome="rejected"
    ) == 1 + before.value("inbox_missing_identity_total", consumer=consumer)
    assert after.value("inbox_commit_seconds_count", consumer=consumer) == 3
    assert after.value("inbox_repair_pending", consumer=consumer, kind="quarantine") == 1


# -- several worker processes ---------------------------------------------------------------


def test_metrics__dramatiq_worker_processes_are_aggregated(queue, pg_url, pg_engine, tmp_path):
    """``dramatiq --processes 2`` with PROMETHEUS_MULTIPROC_DIR: one endpoint serves the sum."""
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    from ..support import services
    from ..support.workers import WorkerProcess

    folder = tmp_path / "prometheus"
    folder.mkdir()
    env = {
        "INBOX_TEST_DATABASE_URL": pg_url,
        "INBOX_TEST_BROKER": "rabbitmq",
        "INBOX_TEST_BROKER_URL": services.RABBITMQ,
        "INBOX_TEST_QUEUE": queue,
        "INBOX_TEST_SLEEP": "0.05",
        "PROMETHEUS_MULTIPROC_DIR": str(folder),
    }
    producer = RabbitmqBroker(url=services.RABBITMQ, confirm_delivery=True)
    add_credit = dramatiq.actor(
        lambda account_id, delta: None, actor_name="add_credit", queue_name=queue, broker=producer
    )
    worker = WorkerProcess(
        "tests.apps.dramatiq_app", env, tmp_path / "worker.log", processes=2, threads=2
    )
    try:
        for n in range(40):  # 30 intents, 10 of them sent twice
            add_credit.send_with_options(
                args=(n % 30, 1), **identity(producer="orders", message_id=f"o-{n % 30}")
            )
        with serve(0, multiprocess_dir=str(folder), engine=pg_engine, cache_seconds=0) as server:

            def counted() -> Scrape | None:
                scrape = Scrape(server.url)
                total = scrape.value("inbox_messages_total", consumer="billing")
                return scrape if total == 40 else None

            scrape = wait_for(counted, timeout=60, interval=0.2, what="40 decisions counted")
        files = {p.name.split("_")[-1] for p in folder.glob("*.db")}
        assert len(files) >= 2, files  # samples from more than one worker process
        assert scrape.value("inbox_messages_total", consumer="billing", decision="first") == 30
        assert scrape.value("inbox_messages_total", consumer="billing", decision="duplicate") == 10
        assert scrape.value("inbox_claim_seconds_count", consumer="billing") == 40
        assert scrape.value("inbox_table_rows", table="consumer_inbox") == 30
    finally:
        worker.stop()
        producer.close()
        from contextlib import suppress

        with suppress(Exception):
            import pika

            connection = pika.BlockingConnection(pika.URLParameters(services.RABBITMQ))
            channel = connection.channel()
            for queue_name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
                channel.queue_delete(queue_name)
            connection.close()


async def test_metrics__faststream_worker_processes_are_aggregated(
    pg_async_url, pg_engine, tmp_path
):
    """Two ``faststream run`` processes on one RabbitMQ queue: one endpoint serves the sum."""
    from ..support import services
    from ..support.faststream_worker import FastStreamWorker

    folder = tmp_path / "prometheus"
    folder.mkdir()
    producer = Harness("rabbit", [])
    env = {
        "INBOX_TEST_DATABASE_URL": pg_async_url,
        "INBOX_TEST_BROKER": "rabbit",
        "INBOX_TEST_BROKER_URL": services.RABBITMQ,
        "INBOX_TEST_SOURCE": producer.source,
        "PROMETHEUS_MULTIPROC_DIR": str(folder),
    }
    workers = [
        FastStreamWorker("tests.apps.faststream_app:app", env, tmp_path / f"w{n}.log")
        for n in range(2)
    ]
    try:
        for worker in workers:
            await eventually(worker.ready, timeout=60, what="the worker to start")
        async with producer.broker:
            await producer.broker.start()
            for n in range(25):  # 20 intents, 5 of them sent twice
                headers = identity_headers(producer="shop", message_id=f"o-{n % 20}")
                await producer.publish({"account": n % 20, "delta": 1}, headers)
        with serve(0, multiprocess_dir=str(folder)) as server:

            def counted() -> Scrape | None:
                # The collector reads each process's files one after another, so a scrape
                # taken while the last commit is recorded may hold one of its series and
                # not the other: wait for both. A file a worker has just made may still be
                # empty, which the collector fails to read (HTTP 500): scrape again.
                try:
                    scrape = Scrape(server.url)
                except urllib.error.HTTPError:
                    return None
                total = scrape.value("inbox_messages_total", consumer="billing")
                commits = scrape.value("inbox_commit_seconds_count", consumer="billing")
                return scrape if (total, commits) == (25, 25) else None

            scrape = await eventually(counted, timeout=60, what="25 decisions and commits counted")
        assert scrape.value("inbox_messages_total", consumer="billing", decision="first") == 20
        assert scrape.value("inbox_messages_total", consumer="billing", decision="duplicate") == 5
        processes = {p.name.split("_")[-1] for p in folder.glob("*.db")}
        assert len(processes) == 2, processes
    finally:
        for worker in workers:
            worker.stop()
        await producer.cleanup()
