"""Failure classification and repair with FastStream on real RabbitMQ, Redis streams,
NATS JetStream and Kafka: permanent errors become poison at once, repeated transient failures after
`max_attempts`, and a poison message redriven after a repair is applied once, by a
subscriber of one message or of a batch, and its row marked recovered."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import select, text

from inbox_middleware._core.exceptions import PermanentError
from inbox_middleware._storage import InboxSchema
from inbox_middleware.faststream import FastStreamInbox, InboxSession

from ..apps.domain import apply_credit_async, balance, effects
from ..support import services
from ..support.faststream_brokers import KINDS, Harness, Seen, eventually, recorder
from .test_faststream import ORDER, applied, ident

TABLES = InboxSchema().tables
URLS = {
    "rabbit": services.RABBITMQ,
    "redis": services.REDIS,
    "nats": services.NATS,
    "kafka": f"kafka://{services.KAFKA}",
}


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def seen() -> Seen:
    return Seen()


@pytest.fixture
def inbox(pg_async_engine: Any) -> FastStreamInbox:
    return FastStreamInbox(
        pg_async_engine,
        retry_backoff=(0.05, 0.2),
        max_attempts=3,
        permanent_errors=(LookupError,),
    )


@pytest.fixture
async def h(kind: str, inbox: FastStreamInbox, seen: Seen) -> Any:
    harness = Harness(kind, [recorder(seen), inbox.middleware])
    inbox.guard(harness.broker)
    yield harness
    await harness.cleanup()


def poison_rows(engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(select(TABLES.poison)).mappings()]


def cli(pg_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "from inbox_middleware.cli import run; run()",
            *args,
            "--database-url",
            pg_url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_faststream_permanent_error__kept_as_poison_and_moved_once(h, inbox, pg_engine):
    attempts = []

    @h.subscribe(inbox.consumer("billing", handler_version="4"))
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        attempts.append(1)
        await apply_credit_async(session, "billing", body["account"], body["delta"])
        raise PermanentError("account_closed", f"account {body['account']} is closed")

    async with h.broker:
        await h.broker.start()
        await h.publish(ORDER, ident(trace="t-9"))
        await eventually(lambda: poison_rows(pg_engine), what="the poison row")
        moved = await eventually(
            lambda: h.read(f"{h.source}.dead-letter"), what="the dead-letter message"
        )
    assert len(attempts) == 1
    with pg_engine.connect() as conn:
        assert effects(conn) == 0
    (row,) = poison_rows(pg_engine)
    assert (row["consumer_name"], row["producer_name"], row["message_id"]) == (
        "billing",
        "orders",
        "ord-1",
    )
    assert (row["reason_code"], row["attempts"], row["handler_version"]) == (
        "account_closed",
        1,
        "4",
    )
    assert (row["payload_format"], row["source"], row["decision"]) == (
        "faststream",
        h.source,
        "pending",
    )
    assert json.loads(bytes(row["payload"])) == ORDER
    assert row["headers"]["trace"] == "t-9"
    assert row["headers"]["content-type"] == "application/json"
    ((body, headers),) = moved
    assert json.loads(body) == ORDER
    assert f"poison message #{row['id']}" in json.loads(headers["x-inbox-rejected"])["detail"]
    assert await h.leftover() == 0


async def test_faststream_transient_error__poison_after_max_attempts(h, inbox, pg_engine):
    attempts = []

    @h.subscribe(inbox.consumer("billing"))
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        attempts.append(1)
        raise RuntimeError("the ledger service is down")

    async with h.broker:
        await h.broker.start()
        await h.publish(ORDER, ident())
        await eventually(lambda: poison_rows(pg_engine), timeout=30, what="the poison row")
    assert len(attempts) == 3
    (row,) = poison_rows(pg_engine)
    assert (row["reason_code"], row["attempts"]) == ("retries_exhausted", 3)
    assert "RuntimeError: the ledger service is down" in row["error"]


async def test_faststream_poison__redrive_after_repair_applies_once(h, inbox, pg_engine, pg_url):
    # Given a handler that refuses accounts that are not open, and a message refused
    with pg_engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS open_accounts (id integer PRIMARY KEY)"))
        conn.execute(text("DELETE FROM open_accounts"))

    @h.subscribe(inbox.consumer("billing"))
    async def handle(body: dict[str, int], session: InboxSession) -> None:
        found = await session.execute(
            text("SELECT 1 FROM open_accounts WHERE id = :a"), {"a": body["account"]}
        )
        if found.first() is None:
            raise PermanentError("account_not_open")
        await apply_credit_async(session, "billing", body["account"], body["delta"])

    async with h.broker:
        await h.broker.start()
        await h.publish(ORDER, ident())
        await eventually(lambda: poison_rows(pg_engine), what="the poison row")
        (row,) = poison_rows(pg_engine)
        # When the cause is repaired and the operator redrives it, twice by mistake
        with pg_engine.begin() as conn:
            conn.execute(text("INSERT INTO open_accounts VALUES (7)"))
        for _ in range(2):
            result = cli(
                pg_url,
                "poison",
                "redrive",
                str(row["id"]),
                "--operation-id",
                "op-7",
                "--broker-url",
                URLS[h.kind],
            )
            if result.returncode:
                assert "is already recovered" in result.stderr
        await eventually(lambda: applied(pg_engine) == 1, what="the repaired effect")
        await eventually(
            lambda: poison_rows(pg_engine)[0]["decision"] == "recovered", what="recovery"
        )
    # Then it was applied once, and the row says so
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
    assert poison_rows(pg_engine)[0]["recovered_at"] is not None


def recovered_total() -> float:
    labels = {"consumer": "billing", "source": "poison"}
    return REGISTRY.get_sample_value("inbox_recovered_total", labels) or 0.0


# RabbitMQ has no batch subscriber.
@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind != "rabbit"])
async def test_faststream_poison__redriven_into_a_batch_marks_the_row_recovered(
    h, inbox, pg_engine, pg_url
):
    # Found by the explorer (seed 3102: NATS, a batch subscriber, an operator redriving
    # poison rows): the redriven message was applied, its row left `redriven`.
    # Given a batch handler that refuses accounts that are not open, and a message refused
    with pg_engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS open_accounts (id integer PRIMARY KEY)"))
        conn.execute(text("DELETE FROM open_accounts"))

    @h.subscribe(inbox.consumer("billing"), batch=True)
    async def handle(bodies: list[dict[str, int]], session: InboxSession) -> None:
        for body in bodies:
            found = await session.execute(
                text("SELECT 1 FROM open_accounts WHERE id = :a"), {"a": body["account"]}
            )
            if found.first() is None:
                raise PermanentError("account_not_open")
            await apply_credit_async(session, "billing", body["account"], body["delta"])

    async with h.broker:
        await h.broker.start()
        await h.publish(ORDER, ident())
        await eventually(lambda: poison_rows(pg_engine), what="the poison row")
        (row,) = poison_rows(pg_engine)
        # When the cause is repaired and the operator redrives it
        with pg_engine.begin() as conn:
            conn.execute(text("INSERT INTO open_accounts VALUES (7)"))
        before = recovered_total()
        result = cli(pg_url, "poison", "redrive", str(row["id"]), "--broker-url", URLS[h.kind])
        assert result.returncode == 0, result.stderr
        await eventually(lambda: applied(pg_engine) == 1, what="the repaired effect")
        # Then the row says the repaired message committed, in its transaction, and the
        # recovery is counted as one message's is
        await eventually(
            lambda: poison_rows(pg_engine)[0]["decision"] == "recovered", what="recovery"
        )
        await eventually(lambda: recovered_total() - before == 1, what="the recovery counted")
    assert poison_rows(pg_engine)[0]["recovered_at"] is not None
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
