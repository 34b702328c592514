"""Hostile identity options and payloads through the Dramatiq adapter on real RabbitMQ.

Each example sends a batch of messages whose identity options and argument are drawn
from `strategies` (empty, huge, not text, control characters, lone surrogates, SQL
metacharacters, nested and deeply nested JSON, keys that collide once normalised, odd
producer timestamps), with an extra option of the same kind, through a worker of four
threads; each message waits a drawn few milliseconds before the inbox, so copies of one
intent reach their claim in any order. Then every message must have exactly one fate,
the one the rules say:

* unusable identity or payload: dead-lettered, with a log line that names the message
  and says what is wrong (the option, or the JSON path);
* usable: of an intent's copies exactly one is applied, whichever claimed first; the
  others with an equal canonical payload are skipped, with another payload quarantined
  (table row and queue);
* nothing else: no message lost, none failing with an unhandled error.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import dramatiq
import pytest
from dramatiq import Message
from dramatiq.middleware import CurrentMessage, Middleware
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from inbox_middleware._core.canonical import canonical_json
from inbox_middleware.dramatiq import InboxMiddleware, current_session

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
ORDER = {"inbox_producer": "orders", "inbox_message_id": "o-1"}
CONFLICT_WITH_NUL = [  # found by this test: jsonb refused the quarantined message's headers
    (ORDER, {"delta": 1}),
    (ORDER | {"note": "nul\x00inside"}, {"delta": 2}),
]
OPTION_LIMITS = {
    "inbox_producer": s.NAME_LIMIT,
    "inbox_message_id": s.MESSAGE_ID_LIMIT,
    "inbox_tenant": s.NAME_LIMIT,
}


@st.composite
def messages(draw: st.DrawFn) -> tuple[dict[str, Any], Any]:
    """Identity options and the actor's argument, with (usually) one thing wrong: a field
    with a hostile value, a field missing, or a hostile extra option that must not matter.
    Hostile values can be usable too (SQL metacharacters, exotic text): the rules decide."""
    fault = draw(st.sampled_from(s.FAULTS))
    options: dict[str, Any] = {
        "inbox_producer": draw(
            s.identity_value(s.NAME_LIMIT) if fault == "producer" else s.usable_producer()
        ),
        "inbox_message_id": draw(
            s.identity_value(s.MESSAGE_ID_LIMIT) if fault == "message_id" else s.usable_id()
        ),
    }
    if fault == "missing":
        del options[draw(st.sampled_from(["inbox_producer", "inbox_message_id"]))]
    if fault == "tenant":
        options["inbox_tenant"] = draw(s.identity_value(s.NAME_LIMIT))
    elif draw(st.integers(0, 3)) == 0:
        options["inbox_tenant"] = draw(st.sampled_from(["", "acme"]))
    if fault == "produced_at":
        options["inbox_produced_at"] = draw(s.produced_at())
    if fault == "extra":  # kept with a quarantined message's headers
        options["note"] = draw(s.identity_value(64))
    return options, draw(s.payload() if fault == "payload" else s.small_payload())


def usable(options: dict[str, Any], payload: Any) -> bool:
    for name, limit in OPTION_LIMITS.items():
        value = options.get(name)
        if value is None:  # absent: fine for the tenant only
            if name != "inbox_tenant":
                return False
        elif not s.usable_name(value, limit, allow_empty=name == "inbox_tenant"):
            return False
    # The argument sits two levels deep in the canonical form: {"args": {"payload": ...}}
    return s.usable_timestamp(options.get("inbox_produced_at")) and s.usable_payload(
        payload, depth=2
    )


def intent(options: dict[str, Any]) -> tuple[str, str, str]:
    return (
        options["inbox_producer"],
        options.get("inbox_tenant") or "",
        options["inbox_message_id"],
    )


LAG = "fuzz_lag"
"""The option holding the milliseconds a message waits before the inbox (`Lag`)."""


class Lag(Middleware):
    """Holds each message back its drawn milliseconds, before the inbox's hook runs."""

    def before_process_message(self, broker: Any, message: Any) -> None:
        time.sleep(message.options.get(LAG, 0) / 1000)


class Outcomes(Middleware):
    """What the worker did with each message (each ends in exactly one of these calls)."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.skipped: list[str] = []
        self.failed: list[tuple[str, BaseException]] = []

    def clear(self) -> None:
        self.seen.clear()
        self.skipped.clear()
        self.failed.clear()

    def after_process_message(self, broker, message, *, result=None, exception=None):
        if exception is not None:
            self.failed.append((message.message_id, exception))
        self.seen.append(message.message_id)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        self.skipped.append(message.message_id)
        self.seen.append(message.message_id)


def _take(broker: Any, name: str) -> set[str]:
    """The ids of the messages in queue ``name``, consumed; none if it does not exist."""
    import pika

    found = set()
    try:
        while True:
            method, _, body = broker.channel.basic_get(name, auto_ack=True)
            if method is None:
                return found
            found.add(Message.decode(body).message_id)
    except pika.exceptions.ChannelClosedByBroker:  # 404: nothing was ever published there
        del broker.channel
        return found


def _until(check: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_fuzz_dramatiq__every_message_is_applied_skipped_quarantined_or_dead_lettered(
    rabbitmq_broker, queue, pg_engine, caplog
):
    from ..support.dramatiq_worker import running_worker

    broker = rabbitmq_broker
    outcomes = Outcomes()
    broker.add_middleware(outcomes)
    broker.add_middleware(Lag())
    broker.add_middleware(CurrentMessage())
    broker.add_middleware(InboxMiddleware(pg_engine))
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE IF NOT EXISTS fuzz_effects (message_id text NOT NULL, intent text)"
        )

    @dramatiq.actor(queue_name=queue, inbox_consumer="fuzz", max_retries=0)
    def record(payload: Any) -> None:
        message = CurrentMessage.get_current_message()
        current_session().execute(
            text("INSERT INTO fuzz_effects VALUES (:m, :i)"),
            {"m": message.message_id, "i": message.options.get("inbox_message_id")},
        )

    caplog.set_level(logging.ERROR, logger="inbox_middleware")

    with running_worker(broker, threads=4):

        @SETTINGS
        @given(batch=st.lists(messages(), min_size=1, max_size=16), lags=s.lags())
        @example(batch=CONFLICT_WITH_NUL, lags=[0] * 16)
        @example(batch=CONFLICT_WITH_NUL, lags=[12, 0])  # the second copy claims first
        def check(batch: list[tuple[dict[str, Any], Any]], lags: list[int]) -> None:
            with pg_engine.begin() as conn:
                conn.exec_driver_sql(
                    "TRUNCATE consumer_inbox, inbox_quarantine, inbox_attempts, inbox_poison, "
                    "fuzz_effects"
                )
            caplog.clear()
            outcomes.clear()
            sent = [
                (
                    record.send_with_options(args=(payload,), **options, **{LAG: lag}),
                    options,
                    payload,
                )
                for (options, payload), lag in zip(batch, lags, strict=False)
            ]
            _until(lambda: len(outcomes.seen) >= len(sent), "every message to be handled")
            _check_fates(sent, pg_engine, caplog, outcomes, broker, queue)

        check()


def expected_fates(
    sent: list[tuple[Any, dict[str, Any], Any]], applied: set[str]
) -> dict[str, str]:
    """What must happen to each message (by Dramatiq message id), by the rules and by
    which copy of each intent was applied (whichever claimed first): exactly one."""
    fates: dict[str, str] = {}
    usable_sent = []
    for message, options, payload in sent:
        if usable(options, payload):
            usable_sent.append((message.message_id, intent(options), canonical_json(payload)))
        else:
            fates[message.message_id] = "dead"
    named = {"applied": "applied", "duplicate": "skipped", "conflict": "quarantined"}
    for mid, fate in s.fates_by_claim(usable_sent, applied).items():
        fates[mid] = named[fate]
    return fates


def _check_fates(sent, pg_engine, caplog, outcomes, broker, queue) -> None:
    with pg_engine.connect() as conn:
        committed = {m for (m,) in conn.execute(text("SELECT message_id FROM fuzz_effects"))}
    expected = expected_fates(sent, committed)
    # A skipped message is settled (acked, or nacked to the dead-letter queue) just after
    # the worker reports it: read the destinations until what should be there is.
    dead: set[str] = set()
    quarantined: set[str] = set()

    def arrived() -> bool:
        dead.update(_take(broker, f"{queue}.XQ"))
        quarantined.update(_take(broker, f"{queue}.quarantine"))
        return all(
            m in (dead if fate == "dead" else quarantined)
            for m, fate in expected.items()
            if fate in ("dead", "quarantined")
        )

    with contextlib.suppress(AssertionError):  # the comparison below says what is missing
        _until(arrived, "the dead letters and the quarantined messages", timeout=10)
    with pg_engine.connect() as conn:
        applied = [m for (m,) in conn.execute(text("SELECT message_id FROM fuzz_effects"))]
        quarantine_rows = conn.execute(
            text("SELECT message_id, conflicting_sha256 FROM inbox_quarantine")
        ).all()
    assert not outcomes.failed, f"unhandled failures: {outcomes.failed}"
    assert len(applied) == len(set(applied)), "a message was applied twice"
    actual = {}
    for message, options, _ in sent:
        mid = message.message_id
        fates = [
            name
            for name, found in (
                ("applied", mid in applied),
                ("skipped", mid in outcomes.skipped and mid not in dead | quarantined),
                ("quarantined", mid in quarantined),
                ("dead", mid in dead),
            )
            if found
        ]
        assert len(fates) == 1, f"message {options!r} has fates {fates}"
        actual[mid] = fates[0]
    mismatches = [
        (
            options,
            payload if len(repr(payload)) < 200 else "...",
            expected[m.message_id],
            actual[m.message_id],
        )
        for m, options, payload in sent
        if expected[m.message_id] != actual[m.message_id]
    ]
    assert not mismatches, f"(options, payload, expected, actual): {mismatches}"

    # Every dead letter has a log line naming it and what is wrong with it.
    rejections = [
        r.getMessage() for r in caplog.records if getattr(r, "inbox_event", None) == "rejected"
    ]
    for mid in dead:
        [line] = [line for line in rejections if mid in line]
        reasons = (*OPTION_LIMITS, "inbox_produced_at", "$", "payload")
        assert any(reason in line for reason in reasons), line
    # One quarantine row per intent and conflicting payload, however often it came.
    conflicts = {
        (intent(options), canonical_json(payload))
        for m, options, payload in sent
        if expected[m.message_id] == "quarantined"
    }
    assert len(quarantine_rows) == len(conflicts)
    assert {m for m, _ in quarantine_rows} == {key[2] for key, _ in conflicts}
