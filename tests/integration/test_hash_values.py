"""Where values JSON has no form for reach the hasher, each tested there: a Dramatiq
worker whose encoder delivers them (pickle), a canonical-form hook, the hash command."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from uuid import UUID

import dramatiq
import pytest
from click.testing import CliRunner
from dramatiq.encoder import PickleEncoder
from sqlalchemy import text

from inbox_middleware._core.canonical import digest
from inbox_middleware.cli import main
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity
from inbox_middleware.faststream._payload import CanonicalForm, payload_hash

from ..apps.domain import apply_credit, effects
from ..support.dramatiq_worker import drain, running_worker
from .test_dramatiq import Recorder

REF = UUID("0f8fad5b-d9cb-469f-a165-70867728950e")
AT = datetime(2026, 12, 1, 10, 30, tzinfo=timezone(timedelta(hours=1)))


@pytest.fixture
def pickle_encoder():
    previous = dramatiq.get_encoder()
    dramatiq.set_encoder(PickleEncoder())
    yield
    dramatiq.set_encoder(previous)


def test_custom_encoder__decimals_datetimes_and_uuids_are_hashed_by_their_forms(
    redis_broker, queue, pg_engine, pickle_encoder
):
    recorder = Recorder()
    redis_broker.add_middleware(recorder)
    redis_broker.add_middleware(InboxMiddleware(pg_engine, lock_timeout=10))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def charge(amount: Decimal, at: datetime, ref: UUID) -> None:
        apply_credit(current_session(), "billing", 7, 1)

    def send(amount: Decimal, at: datetime, message_id: str = "ch-1"):
        return charge.send_with_options(
            args=(amount, at, REF), **identity(producer="shop", message_id=message_id)
        )

    with running_worker(redis_broker) as worker:
        send(Decimal("100.00"), AT)
        drain(redis_broker, queue, worker)
        # the same amount and instant, spelled otherwise: a duplicate
        same = send(Decimal("100"), AT.astimezone(UTC))
        # an amount a float would round to 100: a conflict
        other = send(Decimal("100.00000000000000001"), AT)
        drain(redis_broker, queue, worker)

    expected = {
        "actor": "charge",
        "args": {"amount": "100", "at": "2026-12-01T09:30:00Z", "ref": str(REF)},
    }
    with pg_engine.connect() as conn:
        stored = conn.execute(text("SELECT payload_sha256 FROM consumer_inbox")).scalar_one()
        conflicts = conn.execute(text("SELECT count(*) FROM inbox_quarantine")).scalar_one()
        assert effects(conn, 7) == 1
    assert stored == digest(expected)
    assert {same.message_id, other.message_id} <= set(recorder.skipped)
    assert conflicts == 1


def test_canonical_form_hook__its_values_get_their_documented_forms():
    def amounts(body: bytes, headers: object) -> object:
        order = json.loads(body)
        return {"amount": Decimal(order["amount"]), "ref": UUID(order["ref"])}

    form = CanonicalForm("amounts.v1", amounts)
    body = json.dumps({"amount": "9.90", "ref": str(REF), "sent": 1}).encode()
    hashed, _ = payload_hash(body, {}, form)
    assert hashed.scheme == "custom.v2:amounts.v1"
    assert hashed.sha256 == digest({"amount": "9.9", "ref": str(REF)})


def test_hash_command__integers_exact_numbers_with_a_fraction_as_doubles():
    body = b'{"id": 12345678901234567890, "amount": 100.00000000000000001, "e": "e\\u0301"}'
    result = CliRunner().invoke(main, ["hash"], input=body)
    assert result.exit_code == 0, result.output
    canonical, sha256 = result.output.splitlines()
    assert canonical == '{"amount":100,"e":"e\u0301","id":12345678901234567890}'
    assert sha256 == digest(json.loads(body))
    actor = CliRunner().invoke(main, ["hash", "--actor", "add"], input=b'{"n": 1}')
    assert actor.output.splitlines()[0] == '{"actor":"add","args":{"n":1}}'
    refused = CliRunner().invoke(main, ["hash"], input=b'{"a": NaN}')
    assert refused.exit_code == 1
    assert "no canonical form: NaN is not a JSON number" in refused.output
    not_json = CliRunner().invoke(main, ["hash"], input=b"\xff")
    assert (not_json.exit_code, "not JSON text" in not_json.output) == (1, True)
