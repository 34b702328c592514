"""Nothing settles an inbox message behind the inbox, on the real brokers and PostgreSQL.

Every settling method of every message object FastStream hands the handler is refused
(NATS's ``ack_sync`` too, a batch's message from FastStream's context too); a driver's
own message (``msg.raw_message``) is refused where it can be (NATS), and a settlement it
already made is detected where the driver tells it (RabbitMQ): the attempt rolls back and
the message is kept as poison, with its payload, instead of being acked with no effect.
"""

from __future__ import annotations

from typing import Any

import pytest
from faststream import Context
from sqlalchemy import select

from inbox_middleware._storage import InboxSchema
from inbox_middleware.faststream import FastStreamInbox, InboxSession

from ..apps.domain import apply_credit_async
from ..support.faststream_brokers import Harness, Seen, eventually, recorder
from .test_faststream import ORDER, applied, claims, ident

MESSAGE = Context("message")
TABLES = InboxSchema().tables


def poison_rows(engine: Any) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(select(TABLES.poison)).mappings()]


async def settle_then_fail(
    kind: str, pg_async_engine: Any, pg_engine: Any, settle: Any, *, batch: bool = False
) -> list[dict[str, Any]]:
    """A handler that applies its effect, settles the message itself with ``settle``,
    then fails: the message must be kept as poison, never lost."""
    seen = Seen()
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.2), max_attempts=3)
    h = Harness(kind, [recorder(seen), inbox.middleware])
    inbox.guard(h.broker)
    try:

        @h.subscribe(inbox.consumer("billing"), batch=batch)
        async def handle(body: Any, session: InboxSession, message: Any = MESSAGE) -> None:
            for one in body if batch else [body]:
                await apply_credit_async(session, "billing", one["account"], one["delta"])
            await settle(message)
            raise RuntimeError("fails after settling the message itself")

        await h.prepare_source()
        async with h.broker:
            await h.publish(ORDER, ident())
            await h.broker.start()
            await eventually(lambda: poison_rows(pg_engine), timeout=20, what="the poison row")
    finally:
        await h.cleanup()
    assert (applied(pg_engine), claims(pg_engine)) == (0, [])
    return poison_rows(pg_engine)


async def ack_sync(message: Any) -> None:
    await message.ack_sync()


async def ack(message: Any) -> None:
    await message.ack()


async def raw_ack(message: Any) -> None:
    await message.raw_message.ack()


async def raw_term(message: Any) -> None:
    await message.raw_message.term()


async def delete(message: Any) -> None:
    await message.delete()


async def consumer_commit(message: Any) -> None:
    await message.consumer.commit()


@pytest.mark.parametrize(
    ("kind", "settle", "named"),
    [
        ("nats", ack_sync, "ack_sync()"),
        ("nats", raw_ack, "ack()"),
        ("nats", raw_term, "term()"),
        ("redis", delete, "delete()"),
        ("kafka", ack, "ack()"),
        ("kafka", consumer_commit, "commit()"),
    ],
)
async def test_settling__refused_on_every_message_object(
    kind, settle, named, pg_async_engine, pg_engine
):
    (row,) = await settle_then_fail(kind, pg_async_engine, pg_engine, settle)
    # Then the settlement was refused, the attempt rolled back, and the message kept as
    # poison at once (a mistake that repeats at every attempt)
    assert (row["reason_code"], row["attempts"]) == ("handler_transaction", 1)
    assert named in row["error"]


@pytest.mark.parametrize("kind", ["nats", "redis"])
async def test_settling__a_batch_message_from_the_context_is_refused(
    kind, pg_async_engine, pg_engine
):
    (row,) = await settle_then_fail(kind, pg_async_engine, pg_engine, ack, batch=True)
    assert (row["reason_code"], row["attempts"]) == ("handler_transaction", 1)
    assert "ack()" in row["error"]


async def test_settling__a_raw_rabbitmq_ack_is_detected_and_kept_as_poison(
    pg_async_engine, pg_engine
):
    # Given a handler that acks the driver's own message (aio-pika's), which the inbox
    # cannot refuse, then fails: RabbitMQ has forgotten the message already
    (row,) = await settle_then_fail("rabbit", pg_async_engine, pg_engine, raw_ack)
    # Then the inbox saw the driver's settlement: the message is kept as poison, with its
    # payload and the reason, rather than handed back to a broker that dropped it
    assert (row["reason_code"], row["attempts"]) == ("handler_transaction", 1)
    assert "raw_message" in row["error"]
    assert row["payload"]
