"""A duplicate answers like the first delivery (FastStream): a subscriber's result, stored
with its claim, is published again to its publishers and answers an RPC caller's retry;
the source is acknowledged only after the result is published."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import text

from inbox_middleware.faststream import FastStreamInbox, InboxSession, identity_headers

from ..apps.domain import apply_credit_async, effects
from ..support import services
from ..support.faststream_brokers import KINDS, Harness, Seen, eventually, recorder
from .test_faststream_failures import cli

ORDER = {"account": 7, "delta": 10}


def ident(message_id: str) -> dict[str, str]:
    return identity_headers(producer="orders", message_id=message_id)


@pytest.fixture
def seen() -> Seen:
    return Seen()


@pytest.fixture
def inbox(pg_async_engine: Any) -> FastStreamInbox:
    return FastStreamInbox(pg_async_engine, lock_timeout=10, retry_backoff=(0.05, 0.5))


async def _harness(kind: str, inbox: FastStreamInbox, seen: Seen) -> Harness:
    harness = Harness(kind, [recorder(seen), inbox.middleware])
    inbox.guard(harness.broker)
    return harness


async def _unpublishable(
    pg_async_engine: Any, seen: Seen, stream: str
) -> tuple[Harness, list[int]]:
    """A JetStream subscriber, two attempts allowed, whose result goes to the subject
    ``<source>.nowhere``, published as kept by the stream ``stream`` (``{}``: the harness's
    stream's name), which nothing declares; and the list of its handler's runs."""
    from faststream.nats import JStream

    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.1), max_attempts=2)
    h = await _harness("nats", inbox, seen)
    publisher = h.broker.publisher(
        f"{h.source}.nowhere", stream=JStream(stream.format(h.stream), declare=False)
    )
    runs: list[int] = []

    @publisher
    @h.subscribe(inbox.consumer("billing"))
    async def handle(body: dict[str, Any], session: InboxSession) -> dict[str, Any]:
        runs.append(1)
        await apply_credit_async(session, "billing", body["account"], body["delta"])
        return {"credited": body["delta"]}

    return h, runs


@pytest.mark.parametrize("kind", ["rabbit", "nats"])
async def test_outputs__a_retried_request_gets_the_first_reply(kind, inbox, pg_engine, seen):
    # Given an inbox subscriber that answers requests with the stock it left
    h = await _harness(kind, inbox, seen)
    calls: list[int] = []

    @h.subscribe(inbox.consumer("stock"))
    async def reserve(body: dict[str, Any], session: InboxSession) -> dict[str, Any]:
        calls.append(1)
        await apply_credit_async(session, "stock", body["account"], body["delta"])
        return {"order_id": "rpc-1", "remaining": 100 - len(calls)}

    try:
        async with h.broker:
            await h.broker.start()
            # When the caller sends the request, and then retries it (the same identity)
            first = await h.request(ORDER, ident("rpc-1"))
            second = await h.request(ORDER, ident("rpc-1"))
    finally:
        await h.cleanup()
    # Then the handler ran once, and both replies are the same answer, decoded alike
    assert calls == [1]
    assert first.body == b'{"order_id":"rpc-1","remaining":99}'
    assert second.body == first.body
    assert await second.decode() == {"order_id": "rpc-1", "remaining": 99}
    assert second.content_type == first.content_type == "application/json"
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_outputs__a_duplicate_publishes_the_stored_result_again(
    kind, inbox, pg_engine, seen, recwarn
):
    # Given an inbox subscriber whose result goes to a publisher
    h = await _harness(kind, inbox, seen)
    out = f"{h.source}.out"
    publisher = h.publisher(out)

    @publisher
    @h.subscribe(inbox.consumer("billing"))
    async def handle(body: dict[str, Any], session: InboxSession) -> dict[str, Any]:
        await apply_credit_async(session, "billing", body["account"], body["delta"])
        return {"credited": body["delta"], "note": "é"}

    try:
        await h.prepare_destination(out)
        async with h.broker:
            await h.broker.start()
            # When a message is delivered, and then delivered again (its ack was lost)
            await h.publish(ORDER, ident("o-1"))
            await eventually(lambda: seen.outcomes, what="the first delivery")
            await h.publish(ORDER, ident("o-1"))
            await eventually(lambda: len(seen.outcomes) == 2, what="the duplicate")
            results = await h.read_at_least(out, 2)
        left = await h.leftover()
    finally:
        await h.cleanup()
    # Then the effect is applied once, and both deliveries published the same bytes
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 1
        stored = conn.execute(text("SELECT * FROM inbox_outputs")).mappings().one()
    bodies = [body for body, _ in results]
    assert bodies == [bodies[0], bodies[0]]
    # ... each copy with the same identity, derived from the message's, for the next inbox
    identities = [(h["x-inbox-producer"], h["x-inbox-message-id"]) for _, h in results]
    assert identities[0] == identities[1]
    assert identities[0][0] == "billing" and identities[0][1].startswith("out.result.0.")
    assert json.loads(bodies[0]) == {"credited": 10, "note": "é"}
    assert bytes(stored["body"]) == bodies[0]
    assert stored["content_type"] == "application/json"
    assert left == 0
    # ... and publishing the result after the commit is not a direct publish
    assert not [w for w in recwarn if "inbox consumer" in str(w.message)]


async def test_outputs__a_result_that_cannot_be_published_is_kept_then_poisoned(
    pg_async_engine, pg_engine, seen
):
    # Given a JetStream subscriber whose result goes to a subject no stream captures (every
    # publish there fails: JetStream does not answer), and two attempts allowed
    h, runs = await _unpublishable(pg_async_engine, seen, "{}_NONE")

    try:
        async with h.broker:
            await h.broker.start()
            await h.publish(ORDER, ident("o-9"))
            dead = await h.read_at_least(f"{h.source}.dead-letter", 1, timeout=30)
            left = await h.leftover()
    finally:
        await h.cleanup()
    # Then the effect committed once; the message was not acknowledged after the failed
    # publish: it came back as a duplicate, which tried the stored result again, and when
    # its attempts ran out it was kept as poison, its claim and result still stored
    assert runs == [1]
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 1
        assert conn.scalar(text("SELECT count(*) FROM inbox_outputs")) == 1
        poison = conn.execute(text("SELECT reason_code, attempts FROM inbox_poison")).one()
    assert tuple(poison) == ("outputs_undeliverable", 2)
    ((_, headers),) = dead
    assert json.loads(headers["x-inbox-rejected"])["reason_code"] == "outputs_undeliverable"
    assert left == 0


async def test_outputs__a_redrive_of_a_result_that_could_not_be_published_sends_it_once(
    pg_async_engine, pg_engine, pg_url, seen
):
    # Given a JetStream subscriber whose result could not be published (no stream captured
    # its subject), kept as poison with its claim and result
    h, runs = await _unpublishable(pg_async_engine, seen, "{}_OUT")
    nowhere = f"{h.source}.nowhere"

    def poison() -> list[Any]:
        with pg_engine.connect() as conn:
            return list(conn.execute(text("SELECT id, decision FROM inbox_poison")).all())

    try:
        async with h.broker:
            await h.broker.start()
            await h.publish(ORDER, ident("o-8"))
            await h.read_at_least(f"{h.source}.dead-letter", 1, timeout=30)
            [(row_id, decision)] = poison()
            assert decision == "pending"
            # When the cause is repaired (a stream now keeps the subject) and the operator
            # redrives the row
            js = h.broker.config.connection_state.stream
            await js.add_stream(name=f"{h.stream}_OUT", subjects=[nowhere])
            redrive = cli(pg_url, "poison", "redrive", str(row_id), "--broker-url", services.NATS)
            assert redrive.returncode == 0, redrive.stderr
            # Then its copy, a duplicate, publishes the stored result, and the row says
            # the repair is done
            [(body, _)] = await h.read_at_least(nowhere, 1, timeout=30)
            await eventually(lambda: poison()[0][1] == "recovered", what="the row recovered")
            left = await h.leftover()
    finally:
        await h.cleanup()
    assert runs == [1] and json.loads(body) == {"credited": 10}
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 1
    assert left == 0


@pytest.mark.parametrize("policy", ["warn", "refuse"])
async def test_outputs__a_direct_publish_from_a_handler_is_warned_or_refused(
    pg_async_engine, pg_engine, seen, policy, recwarn
):
    # Given a handler that publishes a follow-up directly, inside its inbox attempt
    from inbox_middleware._core.exceptions import DirectPublishWarning

    inbox = FastStreamInbox(
        pg_async_engine, retry_backoff=(0.05, 0.1), max_attempts=1, direct_publish=policy
    )
    h = await _harness("rabbit", inbox, seen)
    out = f"{h.source}.out"

    @h.subscribe(inbox.consumer("billing"))
    async def handle(body: dict[str, Any], session: InboxSession) -> None:
        await apply_credit_async(session, "billing", body["account"], body["delta"])
        await h.broker.publish({"shipped": True}, out, persist=True)

    try:
        await h.prepare_destination(out)
        async with h.broker:
            await h.broker.start()
            await h.publish(ORDER, ident("d-1"))
            await eventually(lambda: seen.outcomes, what="the delivery")
            sent = await h.read(out)
    finally:
        await h.cleanup()
    # Then: warned, the publish went out and the effect committed; or refused, nothing
    # went out and the attempt was rolled back (kept as poison at once: a refused publish
    # repeats at every attempt)
    with pg_engine.connect() as conn:
        applied = effects(conn, 7)
        poison = conn.scalar(text("SELECT reason_code FROM inbox_poison"))
    warned = [w for w in recwarn if issubclass(w.category, DirectPublishWarning)]
    if policy == "warn":
        assert (applied, len(sent), poison, len(warned)) == (1, 1, None, 1)
    else:
        assert (applied, len(sent), poison) == (0, 0, "handler_transaction")


async def test_outputs__a_batch_subscriber_with_a_publisher_is_refused(inbox, seen):
    # Given a batch inbox subscriber whose result would be published
    h = await _harness("nats", inbox, seen)
    publisher = h.publisher(f"{h.source}.out")

    @publisher
    @h.subscribe(inbox.consumer("billing"), batch=True)
    async def handle(bodies: list[dict[str, Any]], session: InboxSession) -> int:
        return len(bodies)

    # Then the start-up check refuses it, naming the outbox
    from inbox_middleware._core.exceptions import ConfigurationError

    try:
        with pytest.raises(ConfigurationError, match="batch subscriber's result"):
            await inbox.check(h.broker)
    finally:
        await h.cleanup()
