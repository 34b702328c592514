"""Failure classification with Dramatiq on real brokers: permanent errors become poison
at once, transient ones are retried up to the bound and then kept as poison too."""

from __future__ import annotations

import json

import dramatiq
import pytest
from sqlalchemy import select

from inbox_middleware._core.exceptions import PermanentError
from inbox_middleware._storage import InboxSchema
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity

from ..apps.domain import apply_credit, effects
from ..support.dramatiq_worker import drain, running_worker
from ..support.workers import wait_for
from .test_dramatiq import dead_letters


def poison_rows(engine) -> list[dict]:
    with engine.connect() as conn:
        rows = conn.execute(select(InboxSchema().tables.poison)).mappings().all()
    return [dict(row) for row in rows]


def send(actor, *args, message_id="ord-1"):
    return actor.send_with_options(args=args, **identity(producer="orders", message_id=message_id))


@pytest.fixture
def inbox(broker, pg_engine):
    middleware = InboxMiddleware(pg_engine, permanent_errors=(LookupError,))
    broker.add_middleware(middleware)
    return middleware


def test_permanent_error__lands_in_poison_with_every_field_and_is_not_retried(
    broker, queue, pg_engine, inbox, caplog
):
    attempts = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", inbox_handler_version="7")
    def add_credit(account_id: int, delta: int) -> None:
        attempts.append(1)
        apply_credit(current_session(), "billing", account_id, delta)
        raise PermanentError("unknown_account", f"account {account_id} does not exist")

    with running_worker(broker) as worker:
        message = send(add_credit, 404, 10)
        drain(broker, queue, worker)

    # Then it ran once, its writes rolled back with the attempt, and it is kept as poison
    assert len(attempts) == 1
    with pg_engine.connect() as conn:
        assert effects(conn) == 0
    [row] = poison_rows(pg_engine)
    assert (row["consumer_name"], row["producer_name"], row["tenant"], row["message_id"]) == (
        "billing",
        "orders",
        "",
        "ord-1",
    )
    assert row["reason_code"] == "unknown_account"
    assert "account 404 does not exist" in row["error"]
    assert (row["attempts"], row["handler_version"], row["decision"]) == (1, "7", "pending")
    assert row["first_failure_at"] == row["last_failure_at"]
    assert (row["hash_scheme"], len(row["payload_sha256"])) == ("dramatiq.v2", 64)
    assert row["payload_format"] == "dramatiq"
    assert b'"args":[404,10]' in bytes(row["payload"])
    assert row["source"] == queue
    assert message.message_id.encode() in bytes(row["payload"])
    # and moved to the dead-letter queue: a change of ownership, logged as such
    wait_for(lambda: dead_letters(broker, queue) == 1, timeout=10, what="the dead letter")
    assert "kept in the poison table as #" in caplog.text


def test_configured_permanent_type__is_poison_named_by_its_type(broker, queue, pg_engine, inbox):
    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None:
        {}["missing"]  # a KeyError: a LookupError, configured as permanent

    with running_worker(broker) as worker:
        send(add_credit, 7, 10)
        drain(broker, queue, worker)

    [row] = poison_rows(pg_engine)
    assert (row["reason_code"], row["attempts"]) == ("KeyError", 1)


def test_transient_error__retried_up_to_the_bound_then_kept_as_poison(
    broker, queue, pg_engine, inbox
):
    attempts = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=2)
    def add_credit(account_id: int, delta: int) -> None:
        attempts.append(1)
        apply_credit(current_session(), "billing", account_id, delta)
        raise TimeoutError("the ledger service timed out")

    with running_worker(broker) as worker:
        send(add_credit, 7, 10)
        drain(broker, queue, worker)

    assert len(attempts) == 3  # the first attempt and two retries
    [row] = poison_rows(pg_engine)
    assert (row["reason_code"], row["attempts"]) == ("retries_exhausted", 3)
    assert "TimeoutError: the ledger service timed out" in row["error"]
    # The kept message is the message, without the traceback Dramatiq's Retries adds
    kept = json.loads(bytes(row["payload"]))
    assert kept["args"] == [7, 10] and "traceback" not in kept["options"]
    wait_for(lambda: dead_letters(broker, queue) == 1, timeout=10, what="the dead letter")
    with pg_engine.connect() as conn:
        assert effects(conn) == 0


def test_transient_error__that_recovers_leaves_no_poison(broker, queue, pg_engine, inbox):
    attempts = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=5)
    def add_credit(account_id: int, delta: int) -> None:
        attempts.append(1)
        apply_credit(current_session(), "billing", account_id, delta)
        if len(attempts) < 3:
            raise ConnectionResetError("the ledger service dropped the connection")

    with running_worker(broker) as worker:
        send(add_credit, 7, 10)
        drain(broker, queue, worker)

    assert len(attempts) == 3
    assert poison_rows(pg_engine) == []
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 1
        failures = conn.execute(select(InboxSchema().tables.attempts)).mappings().one()
    assert failures["attempts"] == 2
