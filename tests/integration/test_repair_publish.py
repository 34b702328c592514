"""Redrive and accept record as done only what the broker confirmed: a publish that fails
leaves its row recorded and unconfirmed, and the same operation run again finishes it;
the repair path publishes to the queue that exists, quorum or classic. A quarantined
message redriven that conflicts again is pending again. A repair marker applies only to
its own row."""

from __future__ import annotations

import dramatiq
import pytest
from sqlalchemy import select, text

from inbox_middleware._core.exceptions import PermanentError
from inbox_middleware._storage import InboxSchema
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity

from ..apps.domain import apply_credit, balance, effects
from ..support import services
from ..support.dramatiq_worker import drain, running_worker
from .test_repair_dramatiq import broker_args, cli

TABLES = InboxSchema().tables

# Nothing listens on port 1: the connection is refused at once.
REFUSING = {"redis": "redis://127.0.0.1:1/0", "amqp": "amqp://guest:guest@127.0.0.1:1/%2F"}


def rows(engine, table) -> list[dict]:
    with engine.connect() as conn:
        return [
            dict(found) for found in conn.execute(select(table).order_by(table.c.id)).mappings()
        ]


def credit_actor(broker, queue, pg_engine, consumer="billing"):
    """An actor that refuses credits to accounts that are not open yet."""
    broker.add_middleware(InboxMiddleware(pg_engine))
    with pg_engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS open_accounts (id integer PRIMARY KEY)"))
        conn.execute(text("DELETE FROM open_accounts"))

    @dramatiq.actor(queue_name=queue, inbox_consumer=consumer, actor_name=f"credit_{consumer}")
    def add_credit(account_id: int, delta: int) -> None:
        session = current_session()
        if not session.execute(
            text("SELECT 1 FROM open_accounts WHERE id = :a"), {"a": account_id}
        ).first():
            raise PermanentError("account_not_open")
        apply_credit(session, consumer, account_id, delta)

    return add_credit


def open_account(engine, account: int) -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO open_accounts VALUES (:a)"), {"a": account})


def test_poison__a_redrive_the_broker_refused_is_not_done_and_its_rerun_finishes_it(
    broker, queue, pg_url, pg_engine
):
    app = credit_actor(broker, queue, pg_engine)
    real = broker_args(broker, queue)
    refusing = [*real]
    refusing[1] = REFUSING["redis" if hasattr(broker, "client") else "amqp"]
    selection = ["--consumer", "billing", "--operation-id", "op-1"]
    with running_worker(broker) as worker:
        # Given a poison message whose cause is repaired
        app.send_with_options(args=(7, 10), **identity(producer="orders", message_id="o-1"))
        drain(broker, queue, worker)
        open_account(pg_engine, 7)
        # When the redrive meets a broker that refuses connections
        failed = cli(pg_url, "poison", "redrive", *selection, *refusing)
        # Then the command fails, and the row says what happened: decided by op-1, its
        # publish not confirmed
        assert failed.returncode == 1, failed.stdout
        assert failed.stderr.startswith("error: "), failed.stderr
        [row] = rows(pg_engine, TABLES.poison)
        assert (row["decision"], row["operation_id"]) == ("redriven", "op-1")
        assert row["published_at"] is None
        # And the documented rerun, by the same filter, picks it up and publishes it
        dry = cli(pg_url, "poison", "redrive", *selection, "--dry-run")
        assert "would redrive 1 poison rows (--dry-run)" in dry.stdout, dry.stderr
        rerun = cli(pg_url, "poison", "redrive", *selection, *real)
        assert rerun.returncode == 0, rerun.stderr
        assert f"poison #{row['id']} redriven to {queue} (operation op-1)" in rerun.stdout
        drain(broker, queue, worker)
        # And once confirmed, a further run finds nothing left to do
        [row] = rows(pg_engine, TABLES.poison)
        assert row["published_at"] is not None
        assert cli(pg_url, "poison", "redrive", *selection, "--dry-run").stdout == (
            "no poison row to redrive\n"
        )
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (1, 10)
    assert (row["decision"], row["recovered_at"] is not None) == ("recovered", True)


def test_poison__a_rerun_that_selects_fewer_rows_keeps_each_rows_operation(
    redis_broker, queue, pg_url, pg_engine
):
    app = credit_actor(redis_broker, queue, pg_engine)
    real = broker_args(redis_broker, queue)
    refusing = ["--broker-url", REFUSING["redis"], *real[2:]]
    selection = ["--consumer", "billing", "--operation-id", "bulk"]
    with running_worker(redis_broker) as worker:
        for n, account in enumerate((21, 22)):
            app.send_with_options(args=(account, 5), **identity(producer="o", message_id=f"b{n}"))
        drain(redis_broker, queue, worker)
        open_account(pg_engine, 21)
        open_account(pg_engine, 22)
        # Given a bulk redrive of two rows whose publishes were both refused
        assert cli(pg_url, "poison", "redrive", *selection, *refusing).returncode == 1
        first = rows(pg_engine, TABLES.poison)[0]
        assert (first["operation_id"], first["published_at"]) == (f"bulk-{first['id']}", None)
        # When the rerun selects the first row alone, by id
        alone = cli(pg_url, "poison", "redrive", str(first["id"]), *selection[2:], *real)
        assert alone.returncode == 0, alone.stderr
        # Then it is that row's operation (bulk-<id>), and the filter finishes the other
        rest = cli(pg_url, "poison", "redrive", *selection, *real)
        assert rest.returncode == 0, rest.stderr
        drain(redis_broker, queue, worker)
    with pg_engine.connect() as conn:
        assert [balance(conn, account) for account in (21, 22)] == [5, 5]
    assert [row["decision"] for row in rows(pg_engine, TABLES.poison)] == ["recovered"] * 2


def test_poison__redrive_on_quorum_queues_publishes_to_the_existing_queue(
    quorum_broker, queue, pg_url, pg_engine
):
    app = credit_actor(quorum_broker, queue, pg_engine)
    with running_worker(quorum_broker) as worker:
        app.send_with_options(args=(8, 10), **identity(producer="orders", message_id="q-1"))
        drain(quorum_broker, queue, worker)
        open_account(pg_engine, 8)
        [row] = rows(pg_engine, TABLES.poison)
        # When the operator redrives it to the quorum queue it came from
        done = cli(pg_url, "poison", "redrive", str(row["id"]), "--broker-url", services.RABBITMQ)
        # Then the queue is not declared again as a classic one (which RabbitMQ refuses):
        # the message is published, confirmed, and applied once
        assert done.returncode == 0, done.stderr
        drain(quorum_broker, queue, worker)
    [row] = rows(pg_engine, TABLES.poison)
    assert (row["decision"], row["published_at"] is not None) == ("recovered", True)
    with pg_engine.connect() as conn:
        assert balance(conn, 8) == 10
    # And a queue that does not exist is an error, never a classic queue created for it
    with pg_engine.begin() as conn:
        conn.execute(
            text("UPDATE inbox_poison SET decision = 'pending', source = 'no-such-queue-x1'")
        )
    missing = cli(pg_url, "poison", "redrive", str(row["id"]), "--broker-url", services.RABBITMQ)
    assert missing.returncode == 1
    assert "no-such-queue-x1" in missing.stderr or "NOT_FOUND" in missing.stderr, missing.stderr


def test_quarantine__a_redriven_copy_that_conflicts_again_is_pending_again(
    redis_broker, queue, pg_url, pg_engine
):
    app = credit_actor(redis_broker, queue, pg_engine)
    open_account(pg_engine, 7)
    real = broker_args(redis_broker, queue)
    with running_worker(redis_broker) as worker:
        # Given a conflict: the producer reused an id for another amount
        app.send_with_options(args=(7, 10), **identity(producer="orders", message_id="o-3"))
        drain(redis_broker, queue, worker)
        app.send_with_options(args=(7, 25), **identity(producer="orders", message_id="o-3"))
        drain(redis_broker, queue, worker)
        [conflict] = rows(pg_engine, TABLES.quarantine)
        # When the operator redrives it without fixing anything: it conflicts again
        redriven = cli(pg_url, "quarantine", "redrive", str(conflict["id"]), *real)
        assert redriven.returncode == 0, redriven.stderr
        drain(redis_broker, queue, worker)
        # Then the row is pending again, counts the second sighting, and is listed
        [row] = rows(pg_engine, TABLES.quarantine)
        assert (row["decision"], row["attempts"], row["operation_id"]) == ("pending", 2, None)
        listed = cli(pg_url, "quarantine", "list", "--json")
        assert '"decision": "pending"' in listed.stdout and "o-3" in listed.stdout
        # And the operator can decide on it: accepted as a separate intent, applied once
        accepted = cli(pg_url, "quarantine", "accept", str(row["id"]), *real)
        assert accepted.returncode == 0, accepted.stderr
        drain(redis_broker, queue, worker)
    with pg_engine.connect() as conn:
        assert (effects(conn, 7), balance(conn, 7)) == (2, 35)
    [row] = rows(pg_engine, TABLES.quarantine)
    assert (row["decision"], row["published_at"] is not None) == ("accepted", True)


def test_repair_marker__on_another_consumers_or_another_messages_delivery_changes_nothing(
    redis_broker, queue, pg_url, pg_engine
):
    billing = credit_actor(redis_broker, queue, pg_engine, "billing")
    shipping = credit_actor(redis_broker, queue, pg_engine, "shipping")
    open_account(pg_engine, 5)
    with running_worker(redis_broker) as worker:
        # Given billing's pending poison row N
        billing.send_with_options(args=(9, 10), **identity(producer="orders", message_id="o-9"))
        drain(redis_broker, queue, worker)
        [row] = rows(pg_engine, TABLES.poison)
        marker = f"poison:{row['id']}"
        # When first-seen messages carry its marker (copied headers, or a forged one):
        # shipping's, billing's for another message, and billing's own message without any
        # redrive of it
        shipping.send_with_options(
            args=(5, 1), inbox_repair=marker, **identity(producer="orders", message_id="o-9")
        )
        billing.send_with_options(
            args=(5, 1), inbox_repair=marker, **identity(producer="orders", message_id="o-10")
        )
        drain(redis_broker, queue, worker)
        # Then each is processed, and billing's row N stays pending
        [row] = rows(pg_engine, TABLES.poison)
        assert (row["decision"], row["recovered_at"]) == ("pending", None)
        open_account(pg_engine, 9)
        billing.send_with_options(
            args=(9, 10),
            inbox_repair=f"{marker}:op-forged",
            **identity(producer="orders", message_id="o-9"),
        )
        drain(redis_broker, queue, worker)
    # (that last one is a later copy of o-9 itself: its commit applies the intent and so
    # marks the row recovered, as any later copy of a poisoned message does, but the forged
    # operation is not written as the row's decision)
    [row] = rows(pg_engine, TABLES.poison)
    assert (row["decision"], row["operation_id"], row["decided_by"]) == ("recovered", None, None)
    with pg_engine.connect() as conn:
        assert [balance(conn, account) for account in (5, 9)] == [2, 10]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_repair_marker__applies_to_its_own_row_only(pg_engine, pg_async_url, asynchronous):
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from inbox_middleware._core.identity import MessageIdentity, hash_json
    from inbox_middleware._core.protocol import Delivery
    from inbox_middleware._storage import AsyncInbox, Inbox
    from inbox_middleware._storage.failures import FailureRecorder

    def delivery(consumer: str, message_id: str, tenant: str = "", payload: int = 1) -> Delivery:
        return Delivery(
            consumer, MessageIdentity("orders", message_id, tenant), hash_json(payload, "json.v1")
        )

    recorder = FailureRecorder(InboxSchema(), "postgresql")
    with pg_engine.begin() as conn:
        record, other = (
            recorder.record_poison(
                conn, delivery("billing", name), reason_code="x", error="E", attempts=1
            )
            for name in ("m-1", "m-3")
        )
        conn.execute(text("UPDATE inbox_poison SET decision = 'redriven', operation_id = 'op-1'"))

    def process(target: Delivery, marker: str) -> str | None:
        if asynchronous:

            async def handler(session):
                return None

            async def run():
                engine = create_async_engine(pg_async_url)
                try:
                    outcome = await AsyncInbox(engine).process(
                        target, handler, repair_marker=marker
                    )
                finally:
                    await engine.dispose()
                return outcome.recovered

            return asyncio.run(run())
        return Inbox(pg_engine).process(target, lambda s: None, repair_marker=marker).recovered

    marker = f"poison:{record.id}:op-1"
    # Another consumer, another message, another tenant, another operation: nothing (the
    # last with another payload: a copy of m-3's own that commits marks its row recovered
    # whatever it carries, `test_poison_later_copy`)
    assert process(delivery("shipping", "m-1"), marker) is None
    assert process(delivery("billing", "m-2"), marker) is None
    assert process(delivery("billing", "m-1", tenant="t"), marker) is None
    assert process(delivery("billing", "m-3", payload=2), f"poison:{other.id}:op-2") is None
    assert [(row["decision"], row["recovered_at"]) for row in rows(pg_engine, TABLES.poison)] == [
        ("redriven", None),
        ("redriven", None),
    ]
    # Its own repair: recovered, in the same transaction
    assert process(delivery("billing", "m-1"), marker) == "poison"
    row = rows(pg_engine, TABLES.poison)[0]
    assert row["decision"] == "recovered" and row["recovered_at"] is not None


def test_repair_rows__decisions_and_confirmations_on_both_databases(engine):
    from inbox_middleware._core.identity import MessageIdentity, hash_json
    from inbox_middleware._core.protocol import Decision, Delivery
    from inbox_middleware._storage import Inbox, repairs

    table = TABLES.quarantine
    inbox = Inbox(engine)
    identity = MessageIdentity("orders", "o-1")

    def conflict(amount: int) -> Decision:
        delivery = Delivery("billing", identity, hash_json({"amount": amount}, "json.v1"))
        return inbox.process(delivery, lambda session: None).verdict.decision

    assert conflict(10) is Decision.FIRST
    assert conflict(25) is Decision.CONFLICT
    [row] = rows(engine, table)
    with engine.begin() as conn:
        # Given the row redriven by op-1, its publish confirmed
        decided = repairs.decide(conn, table, row["id"], "redriven", operation="op-1", values={})
        assert decided is not None and decided["published_at"] is None
        assert repairs.confirm(conn, table, row["id"], "op-1")
        # And the same operation again keeps the confirmation; another one is refused
        again = repairs.decide(conn, table, row["id"], "redriven", operation="op-1", values={})
        assert again is not None and again["published_at"] is not None
        assert (
            repairs.decide(conn, table, row["id"], "redriven", operation="op-2", values={}) is None
        )
    # When the redriven copy conflicts again
    assert conflict(25) is Decision.CONFLICT
    # Then the row is pending again, its last decision cleared
    [row] = rows(engine, table)
    assert (row["decision"], row["attempts"], row["operation_id"], row["published_at"]) == (
        "pending",
        2,
        None,
        None,
    )
    # And a discarded row stays discarded when the same payload comes again
    with engine.begin() as conn:
        repairs.decide(conn, table, row["id"], "discarded", operation=None, values={})
    assert conflict(25) is Decision.CONFLICT
    [row] = rows(engine, table)
    assert (row["decision"], row["attempts"]) == ("discarded", 3)
