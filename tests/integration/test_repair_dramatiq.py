"""The operator workflow with Dramatiq on real brokers, through the command line:
poison redrive after a repair, discard, quarantine accept, and idempotent operations."""

from __future__ import annotations

import json
import subprocess
import sys

import dramatiq
import pytest
from sqlalchemy import select, text

from inbox_middleware._core.exceptions import PermanentError
from inbox_middleware._storage import InboxSchema
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity

from ..apps.domain import apply_credit, balance, effects
from ..support import services
from ..support.dramatiq_worker import drain, running_worker

TABLES = InboxSchema().tables


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


def broker_args(broker, queue) -> list[str]:
    if hasattr(broker, "client"):
        return ["--broker-url", services.REDIS, "--redis-namespace", f"inbox-test-{queue}"]
    return ["--broker-url", services.RABBITMQ]


def row(engine, table, row_id=None):
    with engine.connect() as conn:
        query = select(table) if row_id is None else select(table).where(table.c.id == row_id)
        return dict(conn.execute(query).mappings().one())


@pytest.fixture
def app(broker, queue, pg_engine):
    """An actor that refuses credits to accounts that are not open yet."""
    broker.add_middleware(InboxMiddleware(pg_engine))
    with pg_engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS open_accounts (id integer PRIMARY KEY)"))
        conn.execute(text("DELETE FROM open_accounts"))

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None:
        session = current_session()
        if not session.execute(
            text("SELECT 1 FROM open_accounts WHERE id = :a"), {"a": account_id}
        ).first():
            raise PermanentError("account_not_open")
        apply_credit(session, "billing", account_id, delta)

    return add_credit


def test_poison__redrive_after_repair_applies_it_once_and_is_idempotent(
    broker, queue, pg_url, pg_engine, app
):
    # Given a message that failed permanently: its account was not open
    with running_worker(broker) as worker:
        app.send_with_options(args=(7, 10), **identity(producer="orders", message_id="o-1"))
        drain(broker, queue, worker)
        poisoned = row(pg_engine, TABLES.poison)
        assert poisoned["reason_code"] == "account_not_open"
        # When the operator repairs the cause and redrives it
        with pg_engine.begin() as conn:
            conn.execute(text("INSERT INTO open_accounts VALUES (7)"))
        first = cli(
            pg_url,
            "poison",
            "redrive",
            str(poisoned["id"]),
            "--operation-id",
            "op-1",
            "--by",
            "alice",
            *broker_args(broker, queue),
        )
        assert first.returncode == 0, first.stderr
        drain(broker, queue, worker)
        # Then it is applied once and the row says it recovered
        with pg_engine.connect() as conn:
            assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
        recovered = row(pg_engine, TABLES.poison)
        assert (recovered["decision"], recovered["decided_by"]) == ("recovered", "alice")
        assert recovered["operation_id"] == "op-1"
        assert recovered["recovered_at"] is not None
        # And the same operation again publishes a copy that is applied zero more times,
        # while another operation on the same row is refused
        again = cli(
            pg_url,
            "poison",
            "redrive",
            str(poisoned["id"]),
            "--operation-id",
            "op-2",
            *broker_args(broker, queue),
        )
        assert again.returncode == 1
        assert "is already recovered" in again.stderr
        drain(broker, queue, worker)
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 1


def test_poison__discard_records_who_when_and_why(broker, queue, pg_url, pg_engine, app):
    with running_worker(broker) as worker:
        app.send_with_options(args=(8, 10), **identity(producer="orders", message_id="o-2"))
        drain(broker, queue, worker)
    poisoned = row(pg_engine, TABLES.poison)

    result = cli(
        pg_url,
        "poison",
        "discard",
        str(poisoned["id"]),
        "--reason",
        "account 8 was closed for good",
        "--by",
        "bob",
    )

    assert result.returncode == 0, result.stderr
    decided = row(pg_engine, TABLES.poison)
    assert (decided["decision"], decided["decided_by"]) == ("discarded", "bob")
    assert decided["decision_note"] == "account 8 was closed for good"
    assert decided["decided_at"] is not None
    listed = cli(pg_url, "poison", "list", "--decision", "all", "--json")
    assert json.loads(listed.stdout.splitlines()[0])["decision"] == "discarded"
    again = cli(pg_url, "poison", "redrive", str(poisoned["id"]), *broker_args(broker, queue))
    assert "is already discarded" in again.stderr


def test_quarantine__accept_creates_a_new_intent_applied_once(
    broker, queue, pg_url, pg_engine, app
):
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO open_accounts VALUES (7)"))
    # Given an intent applied, and the producer reusing its id for another amount
    with running_worker(broker) as worker:
        app.send_with_options(args=(7, 10), **identity(producer="orders", message_id="o-3"))
        drain(broker, queue, worker)
        app.send_with_options(args=(7, 25), **identity(producer="orders", message_id="o-3"))
        drain(broker, queue, worker)
        conflict = row(pg_engine, TABLES.quarantine)
        assert conflict["payload_format"] == "dramatiq"
        # When the operator decides the second payload was a real, separate intent
        for _ in range(2):  # running the same accept twice changes nothing more
            accepted = cli(
                pg_url, "quarantine", "accept", str(conflict["id"]), *broker_args(broker, queue)
            )
            assert accepted.returncode == 0, accepted.stderr
            drain(broker, queue, worker)
    # Then it was applied once, under the recorded new id
    decided = row(pg_engine, TABLES.quarantine)
    assert decided["decision"] == "accepted"
    assert decided["accepted_message_id"] == "o-3+accepted-" + str(conflict["id"])
    assert decided["recovered_at"] is not None
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (2, 35)
        ids = conn.execute(select(TABLES.inbox.c.message_id)).scalars().all()
    assert sorted(ids) == sorted(["o-3", decided["accepted_message_id"]])


def test_repair__show_includes_the_payload_and_unknown_rows_are_one_clear_line(
    broker, queue, pg_url, pg_engine, app
):
    with running_worker(broker) as worker:
        app.send_with_options(args=(9, 10), **identity(producer="orders", message_id="o-4"))
        drain(broker, queue, worker)
    poisoned = row(pg_engine, TABLES.poison)
    shown = json.loads(cli(pg_url, "poison", "show", str(poisoned["id"])).stdout)
    assert shown["payload"]["args"] == [9, 10]  # the kept message, as a JSON value
    missing = cli(pg_url, "quarantine", "show", "999999")
    assert missing.returncode == 1
    assert missing.stderr.strip() == "error: there is no quarantine row #999999"


def test_poison__bulk_redrive_by_filter_applies_each_once(broker, queue, pg_url, pg_engine, app):
    # Given three messages kept as poison: two for closed accounts, one for another reason
    with running_worker(broker) as worker:
        for n, account in enumerate((21, 22)):
            app.send_with_options(
                args=(account, 5), **identity(producer="orders", message_id=f"b-{n}")
            )
        app.send_with_options(args=(23, 5), **identity(producer="shop", message_id="s-1"))
        drain(broker, queue, worker)
        # When the accounts are opened and the operator redrives the orders ones by filter
        with pg_engine.begin() as conn:
            conn.execute(text("INSERT INTO open_accounts VALUES (21), (22), (23)"))
        selection = ["--consumer", "billing", "--producer", "orders", "--since", "1h"]
        dry = cli(pg_url, "poison", "redrive", *selection, "--dry-run", *broker_args(broker, queue))
        assert "would redrive 2 poison rows (--dry-run)" in dry.stdout, dry.stderr
        done = cli(pg_url, "poison", "redrive", *selection, *broker_args(broker, queue))
        assert done.returncode == 0, done.stderr
        assert "2 of 2 poison rows redriven" in done.stdout
        drain(broker, queue, worker)
    # Then the two are applied once each, and the shop one still waits
    with pg_engine.connect() as conn:
        assert [balance(conn, account) for account in (21, 22, 23)] == [5, 5, 0]
        decisions = dict(
            conn.execute(select(TABLES.poison.c.message_id, TABLES.poison.c.decision)).all()
        )
    assert decisions == {"b-0": "recovered", "b-1": "recovered", "s-1": "pending"}
