"""Traces of FastStream deliveries on the real RabbitMQ: the span tree of each settlement,
and the producer's trace joined, from the headers or under FastStream's own middleware.
The docs' snippet (docs/snippets/monitoring_tracing.py) is loaded through `snippet()`."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from opentelemetry import propagate
from opentelemetry.trace import StatusCode
from prometheus_client import REGISTRY
from prometheus_client.openmetrics.exposition import generate_latest

from inbox_middleware._core.exceptions import PermanentError
from inbox_middleware._operate import explain as explaining
from inbox_middleware._operate.metrics import metrics
from inbox_middleware.faststream import FastStreamInbox, InboxSession

from ..apps.domain import apply_credit_async
from ..support.faststream_brokers import Harness, eventually
from ..support.traces import DOCS, Spans, snippet
from .test_faststream import ORDER, applied, claims, ident
from .test_status import cli

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
inbox billing  settlement=poisoned reason=account_closed  ERROR: poisoned (account_closed): \
PermanentError: account 7 is closed
├── inbox.claim  decision=first attempt=1
├── inbox.handler  ERROR: PermanentError: account 7 is closed
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
def inbox(pg_async_engine: Any, spans: Spans) -> FastStreamInbox:
    return FastStreamInbox(
        pg_async_engine, lock_timeout=10, retry_backoff=(0.05, 0.5), tracing=spans.provider
    )


@pytest.fixture
async def h(inbox: FastStreamInbox) -> Any:
    harness = Harness("rabbit", [inbox.middleware])
    yield harness
    await harness.cleanup()


def credit(h: Harness, inbox: FastStreamInbox) -> None:
    @h.subscribe(inbox.consumer("billing", handler_version="3"))
    async def handle(body: dict[str, Any], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])


async def delivered(spans: Spans, count: int) -> list[Any]:
    await eventually(lambda: len(spans.deliveries()) >= count, what=f"{count} delivery spans")
    return spans.deliveries()


async def test_tracing_faststream__first_duplicate_and_conflict(h, inbox, spans, pg_engine):
    credit(h, inbox)
    async with h.broker:
        await h.broker.start()
        await h.publish(ORDER, ident())
        (first,) = await delivered(spans, 1)
        await h.publish(ORDER, ident())
        await delivered(spans, 2)
        await h.publish({"account": 7, "delta": 99}, ident())
        first, duplicate, conflict = await delivered(spans, 3)

    assert spans.tree(first) == FIRST
    assert spans.tree(duplicate) == DUPLICATE
    assert spans.tree(conflict) == CONFLICT
    # A duplicate is not an error; the delivery names its identity and hash scheme
    assert duplicate.status.status_code is StatusCode.UNSET
    assert conflict.status.status_code is StatusCode.ERROR
    attributes = dict(first.attributes or {})
    assert {k: attributes[k] for k in ("inbox.consumer", "inbox.producer", "inbox.tenant")} == {
        "inbox.consumer": "billing",
        "inbox.producer": "orders",
        "inbox.tenant": "",
    }
    assert (attributes["inbox.message_id"], attributes["inbox.hash_scheme"]) == (
        "ord-1",
        "faststream-json.v2",
    )
    (claim,) = (s for s in spans.children(first) if s.name == "inbox.claim")
    assert 0 < (claim.attributes or {})["inbox.claim.wait_seconds"] < 5
    # The claim keeps the trace of the first delivery, and the metrics point to it
    trace_id = format(first.context.trace_id, "032x")
    assert [row["trace_id"] for row in claims(pg_engine)] == [trace_id]
    assert metrics.enabled
    exposed = generate_latest(REGISTRY).decode()
    assert f'trace_id="{trace_id}"' in exposed  # OpenMetrics exemplars


async def test_tracing_faststream__hand_back_then_processed(h, inbox, spans, pg_engine):
    attempts: list[int] = []

    @h.subscribe(inbox.consumer("billing"))
    async def handle(body: dict[str, Any], session: InboxSession) -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise ValueError("the ledger is locked")
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    async with h.broker:
        await h.broker.start()
        await h.publish(ORDER, ident())
        handed_back, processed = await delivered(spans, 2)
    assert spans.tree(handed_back) == HAND_BACK
    assert (processed.attributes or {})["inbox.settlement"] == "processed"
    assert handed_back.context.trace_id != processed.context.trace_id  # no producer trace
    assert applied(pg_engine) == 1


async def test_tracing_faststream__poison(h, inbox, spans):
    @h.subscribe(inbox.consumer("billing"))
    async def handle(body: dict[str, Any], session: InboxSession) -> None:
        raise PermanentError("account_closed", f"account {body['account']} is closed")

    async with h.broker:
        await h.broker.start()
        await h.publish(ORDER, ident())
        (poisoned,) = await delivered(spans, 1)
    assert spans.tree(poisoned) == POISON


async def test_tracing_faststream__joins_the_producers_trace_from_the_headers(
    h, inbox, spans, pg_engine, pg_url
):
    credit(h, inbox)
    async with h.broker:
        await h.broker.start()
        # Given a producer that propagates its trace in the headers (W3C traceparent)
        with spans.producer() as producer:
            headers = ident()
            propagate.inject(headers)
            await h.publish(ORDER, headers)
        (delivery,) = await delivered(spans, 1)
    # Then the delivery's span is the producer span's child, in its trace
    assert delivery.parent is not None
    assert delivery.parent.span_id == producer.get_span_context().span_id
    assert delivery.context.trace_id == producer.get_span_context().trace_id
    trace_id = format(delivery.context.trace_id, "032x")
    assert claims(pg_engine)[0]["trace_id"] == trace_id
    # And explain names the trace of the first delivery, in text and in JSON
    text = cli(pg_url, "explain", "billing", "orders", "ord-1")
    assert f"trace of the first delivery: {trace_id}" in text
    data = json.loads(cli(pg_url, "explain", "billing", "orders", "ord-1", "--json"))
    jsonschema.Draft202012Validator(explaining.SCHEMA).validate(data)
    assert data["claim"]["trace_id"] == trace_id


async def test_tracing_faststream__nests_under_the_telemetry_middleware(inbox, spans, pg_engine):
    # Given FastStream's telemetry before the inbox (the monitoring page's snippet)
    h = Harness("rabbit", snippet().traced_middlewares(inbox, spans.provider))
    try:
        credit(h, inbox)
        async with h.broker:
            await h.broker.start()
            with spans.producer() as producer:
                await h.publish(ORDER, ident())  # FastStream's publish injects the context
            (delivery,) = await delivered(spans, 1)
    finally:
        await h.cleanup()
    # Then the inbox's span is a child of FastStream's process span, in the producer's trace
    by_id = {span.context.span_id: span for span in spans.finished}
    assert delivery.parent is not None
    parent = by_id[delivery.parent.span_id]
    assert parent.name.endswith("process"), parent.name
    assert delivery.context.trace_id == producer.get_span_context().trace_id
    assert spans.tree(delivery) == FIRST


def test_tracing__the_monitoring_page_shows_the_trees_these_tests_produce():
    page = (DOCS / "how-to" / "monitoring.md").read_text()
    for tree in (FIRST, DUPLICATE, CONFLICT, HAND_BACK, POISON, ROUTED):
        assert f"\n{tree}\n" in page, tree


async def test_tracing__a_batch_is_one_delivery_span_with_its_claim_and_commit(
    pg_async_engine, pg_engine, spans
):
    # Given a batch subscriber on NATS JetStream with tracing on
    from ..support.faststream_brokers import Seen, recorder

    seen = Seen()
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.5), tracing=spans.provider)
    harness = Harness("nats", [recorder(seen), inbox.middleware])
    inbox.guard(harness.broker)

    @harness.subscribe(inbox.consumer("billing"), batch=True)
    async def handle(bodies: list[dict[str, Any]], session: InboxSession) -> None:
        for body in bodies:
            await apply_credit_async(session, "billing", body["account"], body["delta"])

    try:
        await harness.prepare_source()
        async with harness.broker:
            # When three messages arrive in one batch
            for number in range(3):
                await harness.publish(ORDER, ident(f"ord-{number}"))
            await harness.broker.start()
            await eventually(lambda: applied(pg_engine) == 3, what="the batch's effects")
            await eventually(spans.deliveries, what="the batch's span")
    finally:
        await harness.cleanup()
    # Then the batch is one delivery span, settled as processed, with its claim and commit
    deliveries = spans.deliveries()
    sizes = sum((span.attributes or {}).get("inbox.batch_size", 0) for span in deliveries)
    assert sizes == 3
    root = deliveries[0]
    assert (root.attributes or {})["inbox.settlement"] == "processed"
    names = [span.name for span in spans.children(root)]
    assert "inbox.claim" in names
    assert "inbox.commit" in names


# -- over a database map ----------------------------------------------------------------------


def routed(pg_async_url: str, spans: Spans, **options: Any) -> FastStreamInbox:
    """An inbox over a map whose database ``shard-a`` (the run's database) serves t1."""
    from inbox_middleware import DatabaseMap

    return FastStreamInbox(
        router=DatabaseMap({"shard-a": pg_async_url}, tenants={"t1": "shard-a"}),
        retry_backoff=(0.05, 0.5),
        tracing=spans.provider,
        **options,
    )


async def test_tracing__a_routed_delivery_names_its_database_not_its_tenant(
    pg_engine, pg_async_url, spans
):
    # Given a subscriber over a database map, tracing on
    inbox = routed(pg_async_url, spans)
    harness = Harness("rabbit", [inbox.middleware])
    credit(harness, inbox)
    try:
        await harness.prepare_source()
        async with harness.broker:
            await harness.broker.start()
            # When a message of tenant t1 is processed
            await harness.publish(ORDER, ident("ord-1", **{"x-inbox-tenant": "t1"}))
            (span,) = await delivered(spans, 1)
    finally:
        await harness.cleanup()
    # Then its delivery span names the map's database (a label per shard, not per tenant)
    assert spans.tree(span) == ROUTED
    assert (span.attributes or {})["inbox.tenant"] == "t1"


async def test_tracing__a_routed_batch_names_its_database_in_its_span_and_its_counts(
    pg_engine, pg_async_url, spans
):
    from inbox_middleware._operate.tally import tally

    from ..support.faststream_brokers import Seen, recorder

    # Given a batch subscriber on NATS JetStream over a database map, tracing on
    seen = Seen()
    inbox = routed(pg_async_url, spans)
    harness = Harness("nats", [recorder(seen), inbox.middleware])
    inbox.guard(harness.broker)
    consumer = f"batch-{harness.name[-8:]}"

    @harness.subscribe(inbox.consumer(consumer), batch=True)
    async def handle(bodies: list[dict[str, Any]], session: InboxSession) -> None:
        for body in bodies:
            await apply_credit_async(session, consumer, body["account"], body["delta"])

    try:
        await harness.prepare_source()
        async with harness.broker:
            # When three messages of tenant t1 arrive in one batch
            for number in range(3):
                await harness.publish(ORDER, ident(f"ord-{number}", **{"x-inbox-tenant": "t1"}))
            await harness.broker.start()
            await eventually(lambda: applied(pg_engine) == 3, what="the batch's effects")
            await eventually(lambda: spans.deliveries(consumer), what="the batch's span")
    finally:
        await harness.cleanup()
    # Then its messages are counted under the map's database (for that database's
    # inbox_counts rows), not under no database, and its span names that database
    assert tally.totals("shard-a").get((consumer, "processed")) == 3
    assert (consumer, "processed") not in tally.totals()
    for span in spans.deliveries(consumer):
        assert (span.attributes or {})["inbox.database"] == "shard-a"
