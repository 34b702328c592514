"""Traces of Dramatiq deliveries on the real Redis broker: the span tree of each
settlement, and the producer's trace carried in the message options."""

from __future__ import annotations

from typing import Any

import dramatiq
import pytest
from opentelemetry.trace import StatusCode
from sqlalchemy import text

from inbox_middleware._core.exceptions import PermanentError
from inbox_middleware._observe.tracing import TRACE_OPTION
from inbox_middleware.dramatiq import InboxMiddleware, current_session

from ..apps.domain import apply_credit
from ..support.dramatiq_worker import drain, running_worker
from ..support.traces import Spans, snippet
from ..support.workers import wait_for
from .test_dramatiq import send

FIRST = """\
inbox billing  settlement=processed decision=first attempt=1
├── inbox.claim  decision=first attempt=1
├── inbox.handler
└── inbox.commit"""

DUPLICATE = """\
inbox billing  settlement=duplicate decision=duplicate attempt=1
├── inbox.claim  decision=duplicate attempt=1
└── inbox.commit"""

CONFLICT = """\
inbox billing  settlement=quarantined decision=conflict attempt=1  ERROR: identity conflict: \
quarantined
├── inbox.claim  decision=conflict attempt=1
├── inbox.commit
└── inbox.publish quarantine  reason=identity_conflict"""

HAND_BACK = """\
inbox billing  settlement=handed_back  ERROR: handed back: ValueError: the ledger is locked
├── inbox.claim  decision=first attempt=1
├── inbox.handler  ERROR: ValueError: the ledger is locked
└── inbox.record failure"""

POISON = """\
inbox billing  settlement=poisoned reason=unknown_account  ERROR: poisoned (unknown_account): \
PermanentError: account 7 does not exist
├── inbox.claim  decision=first attempt=1
├── inbox.handler  ERROR: PermanentError: account 7 does not exist
├── inbox.record failure
├── inbox.record poison
└── inbox.publish dead_letter  reason=Poisoned"""

ROUTED = """\
inbox billing  settlement=processed decision=first attempt=1 database=shard-a
├── inbox.route
├── inbox.claim  decision=first attempt=1
├── inbox.handler
└── inbox.commit"""


@pytest.fixture
def spans() -> Spans:
    return Spans()


@pytest.fixture
def inbox(redis_broker, pg_engine, spans) -> InboxMiddleware:
    snippet().trace_worker(redis_broker, pg_engine, spans.provider)  # the monitoring page's snippet
    snippet().trace_producer(redis_broker)
    (middleware,) = (m for m in redis_broker.middleware if isinstance(m, InboxMiddleware))
    return middleware


def delivered(spans: Spans, count: int) -> list[Any]:
    wait_for(lambda: len(spans.deliveries()) >= count, timeout=15, what=f"{count} spans")
    return spans.deliveries()


def test_tracing_dramatiq__first_duplicate_and_conflict(redis_broker, queue, inbox, spans):
    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    with running_worker(redis_broker) as worker:
        send(add_credit, 7, 10)
        drain(redis_broker, queue, worker)
        send(add_credit, 7, 10)
        drain(redis_broker, queue, worker)
        send(add_credit, 7, 99)
        drain(redis_broker, queue, worker)
        first, duplicate, conflict = delivered(spans, 3)

    assert spans.tree(first) == FIRST
    assert spans.tree(duplicate) == DUPLICATE
    assert spans.tree(conflict) == CONFLICT
    assert duplicate.status.status_code is StatusCode.UNSET
    assert (first.attributes or {})["inbox.hash_scheme"] == "dramatiq.v2"


def test_tracing_dramatiq__hand_back_and_poison(redis_broker, queue, inbox, spans):
    calls: list[int] = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", min_backoff=10, max_backoff=50)
    def add_credit(account_id: int, delta: int) -> None:
        calls.append(account_id)
        if account_id == 7 and calls.count(7) == 1:
            raise ValueError("the ledger is locked")
        if account_id == 8:
            raise PermanentError("unknown_account", "account 7 does not exist")
        apply_credit(current_session(), "billing", account_id, delta)

    with running_worker(redis_broker) as worker:
        send(add_credit, 7, 10)
        drain(redis_broker, queue, worker)
        handed_back, retried = delivered(spans, 2)
        assert spans.tree(handed_back) == HAND_BACK
        assert (retried.attributes or {})["inbox.settlement"] == "processed"
        assert retried.parent is None  # no producer trace: each delivery is a trace
        spans.clear()
        send(add_credit, 8, 10, message_id="ord-2")
        drain(redis_broker, queue, worker)
        (poisoned,) = delivered(spans, 1)

    assert spans.tree(poisoned) == POISON
    assert poisoned.status.status_code is StatusCode.ERROR


def test_tracing_dramatiq__joins_the_producers_trace_from_the_options(
    redis_broker, queue, inbox, spans, pg_engine
):
    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    with running_worker(redis_broker) as worker:
        # Given a producer span current at send: StampTraceContext writes it in the options
        with spans.producer() as producer:
            message = send(add_credit, 7, 10)
        assert "traceparent" in message.options[TRACE_OPTION]
        drain(redis_broker, queue, worker)
        (delivery,) = delivered(spans, 1)

    # Then the delivery's span is the producer span's child, and the claim keeps its trace
    assert delivery.parent is not None
    assert delivery.parent.span_id == producer.get_span_context().span_id
    assert delivery.context.trace_id == producer.get_span_context().trace_id
    with pg_engine.connect() as conn:
        stored = conn.scalar(text("SELECT trace_id FROM consumer_inbox"))
    assert stored == format(delivery.context.trace_id, "032x")


def test_tracing_dramatiq__claim_span_shows_the_wait_on_a_concurrent_claim(
    redis_broker, queue, inbox, spans
):
    import threading
    import time

    holding = threading.Event()

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)
        if not holding.is_set():
            holding.set()
            time.sleep(1)  # holds the claim's row: the other delivery's INSERT waits

    with running_worker(redis_broker) as worker:
        # Given a delivery that holds its claim for a second
        send(add_credit, 7, 10)
        assert holding.wait(10)
        # When a second delivery of the same message arrives meanwhile
        send(add_credit, 7, 10)
        drain(redis_broker, queue, worker)
        first, second = delivered(spans, 2)

    # Then its claim waited for the first commit, and it is a duplicate
    (claim,) = (s for s in spans.children(second) if s.name == "inbox.claim")
    assert (claim.attributes or {})["inbox.decision"] == "duplicate"
    assert 0.5 < (claim.attributes or {})["inbox.claim.wait_seconds"] < 5
    (other,) = (s for s in spans.children(first) if s.name == "inbox.claim")
    assert (other.attributes or {})["inbox.claim.wait_seconds"] < 0.5


def test_tracing_dramatiq__async_actor_has_the_same_tree(
    redis_broker, queue, pg_engine, pg_async_url, spans
):
    from sqlalchemy.ext.asyncio import create_async_engine

    from inbox_middleware.dramatiq import current_async_session

    from ..apps.domain import apply_credit_async

    # Given an async actor: its claim, body and commit run on Dramatiq's event loop thread
    async_engine = create_async_engine(pg_async_url)
    middleware = InboxMiddleware(async_engine=async_engine, tracing=spans.provider)
    redis_broker.add_middleware(middleware)

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    async def add_credit(account_id: int, delta: int) -> None:
        await apply_credit_async(current_async_session(), "billing", account_id, delta)

    with running_worker(redis_broker) as worker:
        send(add_credit, 7, 10)
        drain(redis_broker, queue, worker)
        (first,) = delivered(spans, 1)
    # Then the spans made on the loop's thread are the delivery's children all the same
    assert spans.tree(first) == FIRST


def test_tracing_dramatiq__a_routed_delivery_names_its_database_not_its_tenant(
    redis_broker, queue, pg_engine, pg_url, spans
):
    from inbox_middleware import DatabaseMap
    from inbox_middleware.dramatiq import identity

    # Given a worker over a database map whose database shard-a (the run's) serves t1
    routes = DatabaseMap({"shard-a": pg_url}, tenants={"t1": "shard-a"})
    redis_broker.add_middleware(InboxMiddleware(router=routes, tracing=spans.provider))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)

    with running_worker(redis_broker) as worker:
        # When a message of tenant t1 is processed
        add_credit.send_with_options(
            args=(7, 10), **identity(producer="orders", message_id="ord-1", tenant="t1")
        )
        drain(redis_broker, queue, worker)
        (span,) = delivered(spans, 1)
    # Then its delivery span names the map's database (a label per shard, not per tenant)
    assert spans.tree(span) == ROUTED
    assert (span.attributes or {})["inbox.tenant"] == "t1"
