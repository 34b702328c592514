"""An upgrade of the hash scheme during traffic: claims written by workers on the v1
schemes, redeliveries reaching workers on v2. A redelivery stays a (verified) duplicate,
a changed payload stays a conflict, for payloads whose v1 and v2 forms differ."""

from __future__ import annotations

import hashlib
import logging

import dramatiq
from sqlalchemy import text

from inbox_middleware._core.canonical_v1 import canonical_json as canonical_v1
from inbox_middleware._core.identity import MessageIdentity, PayloadHash
from inbox_middleware._core.protocol import Decision, Delivery
from inbox_middleware._storage import Inbox
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity
from inbox_middleware.faststream import _payload as faststream_payload

from ..apps.domain import apply_credit, effects
from ..support.dramatiq_worker import drain, running_worker
from .test_dramatiq import Recorder, quarantined

# Payloads the v1 form wrote otherwise: an integral double past 2**53, text not in NFC.
AMOUNT, NOTE = 2.0**60, "cafe\u0301"


def v1_claim(pg_engine, consumer: str, message_id: str, scheme: str, form: object) -> None:
    """The claim a worker on the v1 scheme committed for this message."""
    digest = hashlib.sha256(canonical_v1(form)).hexdigest()
    delivery = Delivery(
        consumer, MessageIdentity("orders", message_id), PayloadHash(scheme, digest)
    )
    outcome = Inbox(pg_engine).process(delivery, lambda session: None)
    assert outcome.decision is Decision.FIRST


def test_upgrade__dramatiq_v1_claims_redelivered_to_a_v2_worker_are_duplicates(
    broker, queue, pg_engine, caplog
):
    recorder = Recorder()
    broker.add_middleware(recorder)
    broker.add_middleware(InboxMiddleware(pg_engine, lock_timeout=10))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, amount: float, note: str) -> None:
        apply_credit(current_session(), "billing", account_id, 1)

    # Given claims written under dramatiq.v1 (the frozen form) for two messages
    args = {"account_id": 7, "amount": AMOUNT, "note": NOTE}
    for message_id in ("ord-1", "ord-2"):
        v1_claim(
            pg_engine, "billing", message_id, "dramatiq.v1", {"actor": "add_credit", "args": args}
        )
    caplog.set_level(logging.INFO)
    with running_worker(broker) as worker:
        # When a worker on dramatiq.v2 receives their redeliveries, one with another payload
        duplicate = add_credit.send_with_options(
            args=(7, AMOUNT, NOTE), **identity(producer="orders", message_id="ord-1")
        )
        conflict = add_credit.send_with_options(
            args=(7, AMOUNT, "other"), **identity(producer="orders", message_id="ord-2")
        )
        drain(broker, queue, worker)

    # Then the redelivery is a duplicate compared under v1, the other payload a conflict
    assert {duplicate.message_id, conflict.message_id} <= set(recorder.skipped)
    assert "payload not compared" not in caplog.text
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 0
        schemes = conn.execute(text("SELECT DISTINCT hash_scheme FROM consumer_inbox")).all()
        rows = conn.execute(text("SELECT message_id FROM inbox_quarantine")).scalars().all()
    assert schemes == [("dramatiq.v1",)]
    assert rows == ["ord-2"]
    assert quarantined(broker, queue) == 1


def test_upgrade__faststream_v1_claims_compare_under_v1(pg_engine):
    body = f'{{"amount": {AMOUNT!r}, "note": "{NOTE}"}}'.encode()
    # The v1 and v2 forms of this body differ, so only a comparison under v1 can match
    assert (
        faststream_payload.builtin_hash(body).sha256
        != hashlib.sha256(canonical_v1(faststream_payload.loads(body))).hexdigest()
    )
    form = {"amount": AMOUNT, "note": NOTE}
    v1_claim(pg_engine, "ledger", "ord-1", "faststream-json.v1", form)
    inbox = Inbox(pg_engine)

    def delivered(raw: bytes) -> Delivery:
        return faststream_payload.delivery(
            consumer="ledger",
            identity=MessageIdentity("orders", "ord-1"),
            body=raw,
            headers={},
            handler_version="",
            source="orders",
            canonical=None,
        )

    again = inbox.process(delivered(body), lambda session: None)
    respelled = inbox.process(
        delivered(b'{"note":"cafe\\u0301","amount":1.152921504606847e18}'), lambda s: None
    )
    other = inbox.process(delivered(b'{"amount": 1, "note": "cafe\\u0301"}'), lambda s: None)
    assert (again.decision, again.verdict.verified) == (Decision.DUPLICATE, True)
    assert (respelled.decision, respelled.verdict.verified) == (Decision.DUPLICATE, True)
    assert (other.decision, other.verdict.verified) == (Decision.CONFLICT, True)
