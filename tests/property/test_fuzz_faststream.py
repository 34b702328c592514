"""Hostile identity headers and bodies through the FastStream adapter on real RabbitMQ.

Each example publishes a batch of messages whose identity headers hold values drawn from
`strategies` (text that is empty, huge, with control characters, SQL metacharacters; and
other AMQP types: bytes, invalid UTF-8, numbers, booleans, void, arrays, tables) and whose
body is hostile too (empty, huge, not UTF-8, not JSON, NaN, nested JSON, SQL), through one
subscriber. A header that tags each message lets the test follow it. Then every message
must have exactly one fate, the one the rules say (applied once, skipped as a duplicate,
quarantined, or dead-lettered with a reason naming the header), and be where that fate
puts it; no message lost, none failing unhandled. The subscriber runs the deliveries in
its prefetch window at once, as FastStream's RabbitMQ subscriber does by default, and
each message is held back a drawn few milliseconds, so copies of one intent reach the
inbox in any order: of each intent's copies exactly one is applied, and the rest are
duplicates or conflicts of that one.

The rules read the headers as the subscriber received them, after AMQP's encoding.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest
from faststream import BaseMiddleware
from faststream.exceptions import AckMessage
from faststream.rabbit import RabbitBroker, RabbitQueue
from faststream.rabbit.annotations import RabbitMessage
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from inbox_middleware._core.headers import MESSAGE_ID, PRODUCED_AT, PRODUCER, TENANT
from inbox_middleware.faststream import FastStreamInbox, InboxSession
from inbox_middleware.faststream._payload import builtin_hash

from ..support import services
from ..support.faststream_brokers import eventually
from . import strategies as s

pytestmark = pytest.mark.slow

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
TAG = "x-fuzz-seq"
LAG = "x-fuzz-lag"  # milliseconds the test holds a delivery back before the inbox
LIMITS = {PRODUCER: s.NAME_LIMIT, MESSAGE_ID: s.MESSAGE_ID_LIMIT, TENANT: s.NAME_LIMIT}
INT64 = 2**63 - 1

# The types AMQP headers carry; text may also come as a byte array (here: not UTF-8, or
# UTF-8). RabbitMQ closes the connection on an infinite float: not sent.
amqp_value = st.one_of(
    st.binary(max_size=12).map(bytearray),
    st.sampled_from([b"\xff\xfe not utf-8", "caf\u00e9".encode(), b""]).map(bytearray),
    st.integers(-INT64, INT64),
    st.booleans(),
    st.none(),
    st.floats(width=32, allow_nan=False, allow_infinity=False),  # pamqp packs 32 bits
    st.lists(st.text(max_size=3), max_size=2),
    st.dictionaries(st.text(min_size=1, max_size=3), st.integers(0, 9), max_size=2),
)

# An AMQP header's integer is at most 64 bits: pamqp refuses a larger one when publishing.
amqp_produced_at = s.produced_at().filter(lambda v: not isinstance(v, int) or -INT64 <= v <= INT64)


def hostile(limit: int) -> st.SearchStrategy[Any]:
    text_only = s.identity_value(limit).filter(
        lambda v: isinstance(v, str) and "\udc80" not in v  # AMQP text is UTF-8
    )
    return st.one_of(text_only, amqp_value)


def body() -> st.SearchStrategy[bytes]:
    """Bodies as bytes on the wire: JSON (small, nested, huge, NaN), text, not UTF-8."""
    return st.one_of(
        st.sampled_from([b'{"delta":1}', b'{"delta": 1.0}', b'{"delta":2}', b'{"Delta":1}']),
        st.sampled_from([b"", b"\xff\xfe\xfd", b"NaN", b'{"a":NaN}', b'{"k":1,"k":2}', b"[]"]),
        st.sampled_from(s.SQL).map(str.encode),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=8),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(st.text(max_size=5), inner, max_size=3)
            ),
            max_leaves=10,
        ).map(lambda value: json.dumps(value).encode()),
        st.integers(50_000, 400_000).map(lambda n: b'{"blob":"' + b"z" * n + b'"}'),
        st.binary(max_size=64),
    )


@st.composite
def messages(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    fault = draw(st.sampled_from(s.FAULTS))
    headers: dict[str, Any] = {
        PRODUCER: draw(hostile(s.NAME_LIMIT) if fault == "producer" else s.usable_producer()),
        MESSAGE_ID: draw(hostile(s.MESSAGE_ID_LIMIT) if fault == "message_id" else s.usable_id()),
    }
    if fault == "missing":
        del headers[draw(st.sampled_from([PRODUCER, MESSAGE_ID]))]
    if fault == "tenant":
        headers[TENANT] = draw(hostile(s.NAME_LIMIT))
    elif draw(st.integers(0, 3)) == 0:
        headers[TENANT] = draw(st.sampled_from(["", "acme"]))
    if fault == "produced_at":
        headers[PRODUCED_AT] = draw(amqp_produced_at)
    if fault == "extra":  # kept with a quarantined or rejected message's headers
        headers["x-note"] = draw(hostile(64))
    raw = draw(body() if fault == "payload" else st.sampled_from([b'{"delta":1}', b'{"delta":2}']))
    return headers, raw


# aio-pika (aiormq) runs the deliveries of a prefetch window at once, so which copy of
# an intent claims first is not the order they were sent in. Each message waits a drawn
# number of milliseconds before the inbox (`strategies.lags`), so that the examples try
# many orders.

# A CI run's failure: the third copy of ("o'brien", "o-2") claimed before the second, which
# the rules, reading the batch in the order sent, had expected to be applied.
LATER_COPY_FIRST = [
    ({PRODUCER: "o'brien", MESSAGE_ID: "o-2", TENANT: "", PRODUCED_AT: 616}, b'{"delta":2}'),
    ({PRODUCER: "orders", MESSAGE_ID: "emoji-\U0001f642", TENANT: ""}, b'{"delta":1}'),
    ({PRODUCER: "orders", MESSAGE_ID: "o-2"}, b'{"delta":2}'),
    ({PRODUCER: "o'brien", MESSAGE_ID: "o-2"}, b'{"delta":1}'),
    ({PRODUCER: "orders", MESSAGE_ID: "emoji-\U0001f642", TENANT: ""}, b'{"delta":1}'),
    ({PRODUCER: "o'brien", MESSAGE_ID: "o-2"}, b'{"delta":1}'),
    ({PRODUCER: "orders", MESSAGE_ID: "o-1", PRODUCED_AT: 97}, b'{"delta":2}'),
]

# A copy whose body is not JSON met a claim hashed as JSON: a conflict (it failed with
# NotJSON at every redelivery before).
NOT_JSON_AFTER_JSON = [
    ({PRODUCER: "orders", MESSAGE_ID: "o-1"}, b'{"delta":2}'),
    ({PRODUCER: "orders", MESSAGE_ID: "o-1"}, b""),
]


def usable(received: dict[str, Any]) -> bool:
    """The rules, on the headers as received."""
    for name, limit in LIMITS.items():
        value = received.get(name)
        if isinstance(value, bytes | bytearray):
            try:
                value = bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                return False
        if value is None:
            if name != TENANT:
                return False
        elif not s.usable_name(value, limit, allow_empty=name == TENANT):
            return False
    produced_at = received.get(PRODUCED_AT)
    if isinstance(produced_at, bytes | bytearray):
        return False
    return s.usable_timestamp(produced_at)


class _Refused(Exception):
    pass


def _refuse(*_: Any) -> Any:
    raise _Refused


def usable_body(raw: bytes) -> bool:
    """Whether the body can be hashed: bytes that are not JSON text are hashed as they are;
    JSON text must have a canonical form (no NaN or Infinity, no repeated key, ...)."""
    try:
        text_body = raw.decode("utf-8")
    except UnicodeDecodeError:
        return True

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        if len({key for key, _ in pairs}) != len(pairs):
            raise _Refused
        return dict(pairs)

    try:
        value = json.loads(text_body, parse_constant=_refuse, object_pairs_hook=unique)
    except json.JSONDecodeError:
        return True
    except _Refused:
        return False
    return s.usable_payload(value)


def intent(received: dict[str, Any]) -> tuple[str, str, str]:
    def text_of(value: Any) -> str:
        return bytes(value).decode() if isinstance(value, bytes | bytearray) else value or ""

    return text_of(received[PRODUCER]), text_of(received.get(TENANT)), text_of(received[MESSAGE_ID])


class Follow:
    """Outside the inbox: each tagged delivery's received headers and outcome."""

    def __init__(self) -> None:
        self.received: dict[str, dict[str, Any]] = {}
        self.outcomes: dict[str, list[str]] = {}

    def middleware(self) -> Any:
        follow = self

        class Recorder(BaseMiddleware):
            async def consume_scope(self, call_next: Any, msg: Any) -> Any:
                tag = (msg.headers or {}).get(TAG)
                if tag is None:
                    return await call_next(msg)
                follow.received[tag] = dict(msg.headers)
                await asyncio.sleep(int(msg.headers[LAG]) / 1000)
                try:
                    result = await call_next(msg)
                except AckMessage as exc:
                    follow.outcomes.setdefault(tag, []).append(f"skipped: {exc}")
                    raise
                except BaseException as exc:
                    follow.outcomes.setdefault(tag, []).append(f"failed: {exc!r}")
                    raise
                follow.outcomes.setdefault(tag, []).append("processed")
                return result

        return Recorder


def test_fuzz_faststream__every_message_is_applied_skipped_quarantined_or_dead_lettered(
    pg_async_url, pg_engine
):
    services.require(services.RABBITMQ, "RabbitMQ")
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE IF NOT EXISTS fuzz_effects (message_id text, intent text)"
        )
    loop = asyncio.new_event_loop()
    engine = create_async_engine(pg_async_url, pool_size=4)
    inbox = FastStreamInbox(engine, retry_backoff=(0.05, 0.2))
    follow = Follow()
    broker = RabbitBroker(services.RABBITMQ, middlewares=[follow.middleware(), inbox.middleware])
    source = f"fuzz{id(follow):x}"
    numbers = itertools.count()

    @broker.subscriber(RabbitQueue(source, durable=True), dependencies=[inbox.consumer("fuzz")])
    async def record(payload: Any, session: InboxSession, message: RabbitMessage) -> None:
        await session.execute(
            text("INSERT INTO fuzz_effects VALUES (:t, :i)"),
            {"t": message.headers[TAG], "i": str(message.headers.get(MESSAGE_ID))},
        )

    async def start() -> None:
        await inbox.check(broker)
        await broker.start()

    async def publish_batch(
        batch: list[tuple[dict[str, Any], bytes]], lags: list[int]
    ) -> list[str]:
        tags = []
        for (headers, raw), lag in zip(batch, lags, strict=False):
            tag = str(next(numbers))
            tags.append(tag)
            marks = {TAG: tag, LAG: str(lag)}
            await broker.publish(raw, source, headers={**headers, **marks}, persist=True)
        await eventually(
            lambda: all(t in follow.outcomes for t in tags), timeout=30, what="every outcome"
        )
        return tags

    loop.run_until_complete(start())
    try:

        @SETTINGS
        @given(batch=st.lists(messages(), min_size=1, max_size=16), lags=s.lags())
        @example(
            batch=[
                ({PRODUCER: "orders", MESSAGE_ID: "o-1"}, b'{"delta":1}'),
                (
                    {PRODUCER: "orders", MESSAGE_ID: "o-1", "x-note": "nul\x00inside"},
                    b'{"delta":2}',
                ),
            ],
            lags=[0] * 16,
        )
        @example(batch=NOT_JSON_AFTER_JSON, lags=[0, 10])
        @example(batch=LATER_COPY_FIRST, lags=[8, 8, 8, 12, 8, 0, 8])
        def check(batch: list[tuple[dict[str, Any], bytes]], lags: list[int]) -> None:
            # In a thread, with the loop running: a delivery an earlier example left in
            # flight (one that failed it, or a copy Hypothesis's shrinking abandoned) holds
            # its claim's lock until the loop lets it finish; the TRUNCATE waits for that.
            loop.run_until_complete(asyncio.to_thread(_truncate, pg_engine))
            tags = loop.run_until_complete(publish_batch(batch, lags))
            dead, quarantined = loop.run_until_complete(_destinations(broker, source))
            _check_fates(tags, batch, follow, pg_engine, dead, quarantined)

        check()
    finally:

        async def stop() -> None:
            await broker.stop()
            await _delete(source)
            await engine.dispose()

        loop.run_until_complete(stop())
        loop.close()


def _truncate(pg_engine: Any) -> None:
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(
            "TRUNCATE consumer_inbox, inbox_quarantine, inbox_attempts, inbox_poison, fuzz_effects"
        )


async def _destinations(broker: Any, source: str) -> tuple[dict[str, dict], dict[str, dict]]:
    """What reached the dead-letter and quarantine queues, by tag (consumed)."""
    found = []
    for name in (f"{source}.dead-letter", f"{source}.quarantine"):
        queue = await broker.declare_queue(RabbitQueue(name, durable=True))
        messages = {}
        while (message := await queue.get(no_ack=True, fail=False)) is not None:
            messages[message.headers[TAG]] = dict(message.headers)
        found.append(messages)
    return found[0], found[1]


async def _delete(source: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(services.RABBITMQ)
    async with connection:
        channel = await connection.channel()
        for name in (source, f"{source}.quarantine", f"{source}.dead-letter"):
            await channel.queue_delete(name)


def _check_fates(tags, batch, follow, pg_engine, dead, quarantined) -> None:
    with pg_engine.connect() as conn:
        applied = [tag for (tag,) in conn.execute(text("SELECT message_id FROM fuzz_effects"))]
        rows = conn.execute(text("SELECT message_id FROM inbox_quarantine")).all()
    assert len(applied) == len(set(applied)), "a message was applied twice"
    usable_tags: list[tuple[str, tuple[str, str, str], str]] = []
    for tag, (sent, raw) in zip(tags, batch, strict=True):
        outcomes = follow.outcomes[tag]
        assert len(outcomes) == 1, f"{sent!r}: delivered {len(outcomes)} times: {outcomes}"
        (outcome,) = outcomes
        assert not outcome.startswith("failed"), f"{sent!r}: {outcome}"
        received = follow.received[tag]
        if not usable(received) or not usable_body(raw):
            assert outcome.startswith("skipped: rejected"), f"{received!r}: {outcome}"
            assert tag in dead, f"{received!r} was rejected but is not in the dead letters"
            reason = json.loads(dead[tag]["x-inbox-rejected"])
            if usable(received):  # the body is JSON without a canonical form
                assert reason["reason"] == "PayloadNotHashable", reason
            else:
                assert any(name in reason["detail"] for name in (*LIMITS, PRODUCED_AT)), reason
            continue
        usable_tags.append((tag, intent(received), builtin_hash(raw).sha256))
    # Of each intent's copies exactly one is applied, whichever claimed first; the others
    # are duplicates if they carry its payload, conflicts if not.
    processed = {tag for tag, _, _ in usable_tags if follow.outcomes[tag][0] == "processed"}
    fates = s.fates_by_claim(usable_tags, processed)
    named = {"applied": "processed", "duplicate": "skipped: duplicate"}
    conflicts = set()
    for tag, key, form in usable_tags:
        expected = named.get(fates[tag], "skipped: conflict")
        if expected == "skipped: conflict":
            conflicts.add((key, form))
        (outcome,) = follow.outcomes[tag]
        assert outcome.startswith(expected), f"{follow.received[tag]!r}: {outcome}"
        assert (tag in applied) == (expected == "processed")
        assert (tag in quarantined) == (expected == "skipped: conflict")
        assert tag not in dead
    assert len(rows) == len(conflicts)
