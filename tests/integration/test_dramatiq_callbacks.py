"""What follows an inbox actor keeps its promises (Dramatiq, real workers on Redis and
RabbitMQ): a failed message enqueued again is never acked unless it was; an
``on_success`` callback survives a failed send and is replayed as first sent;
``on_failure`` and ``on_retry_exhausted`` are sent as Dramatiq sends them; a group's
barrier never counts a duplicate; a pipeline step that cannot be sent ends as poison."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.middleware import GroupCallbacks, MiddlewareError
from dramatiq.rate_limits.backends import RedisBackend as RedisLimits
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend
from sqlalchemy import select, text

from inbox_middleware._operate import repair
from inbox_middleware._storage import InboxSchema
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity
from inbox_middleware.dramatiq._middleware import ActorConfigurationError
from inbox_middleware.dramatiq._repair import DramatiqRepublisher

from ..apps.domain import apply_credit, effects
from ..support import services
from ..support.dramatiq_worker import drain, running_worker
from ..support.workers import wait_for

NAMING = InboxSchema()


def ident(message_id: str) -> dict[str, Any]:
    return identity(producer="orders", message_id=message_id)


class Refuse(dramatiq.Middleware):
    """Refuses to enqueue the messages ``when`` picks, ``times`` times (a broker or a
    middleware saying no), as a `MiddlewareError`, which reaches the sender."""

    def __init__(self, when: Callable[[dramatiq.Message[Any]], bool], times: int) -> None:
        self.when, self.left, self.refused = when, times, 0

    def before_enqueue(self, broker: Any, message: dramatiq.Message[Any], delay: Any) -> None:
        if self.left and self.when(message):
            self.left -= 1
            self.refused += 1
            raise MiddlewareError(f"refused {message.actor_name} {message.message_id}")


@pytest.fixture
def limits() -> RedisLimits:
    return RedisLimits(url=services.REDIS)


@pytest.fixture
def results(broker) -> Iterator[RedisBackend]:
    backend = RedisBackend(url=services.REDIS, namespace=f"inbox-test-{uuid.uuid4().hex[:8]}")
    broker.add_middleware(Results(backend=backend))
    yield backend
    for key in backend.client.scan_iter(f"{backend.namespace}*"):
        backend.client.delete(key)


@pytest.fixture
def producer(broker, queue, limits) -> Iterator[dramatiq.Broker]:
    """Another process's broker on the same server, without the inbox: what it sends is
    accepted before any inbox sees it."""
    if hasattr(broker, "client"):
        from dramatiq.brokers.redis import RedisBroker

        other: dramatiq.Broker = RedisBroker(url=services.REDIS, namespace=broker.namespace)
    else:
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        other = RabbitmqBroker(url=services.RABBITMQ, confirm_delivery=True)
    other.add_middleware(GroupCallbacks(limits))
    yield other
    other.close()


def message(queue: str, actor: str, *args: Any, **options: Any) -> dramatiq.Message[Any]:
    return dramatiq.Message(
        queue_name=queue, actor_name=actor, args=args, kwargs={}, options=options
    )


def _effects(engine: Any, account: int) -> int:
    with engine.connect() as conn:
        return effects(conn, account)


def _count(engine: Any, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(text(f"SELECT count(*) FROM {table}")) or 0)


# -- 1. a failed message enqueued again is never lost -----------------------------------------


def test_group__a_member_that_fails_once_is_retried_not_lost(
    broker, queue, pg_engine, producer, limits
):
    # Given a group with a completion callback, sent by a producer without the inbox,
    # whose member is an inbox actor that fails its first attempt
    broker.add_middleware(InboxMiddleware(pg_engine))
    broker.add_middleware(GroupCallbacks(limits))
    attempts: list[int] = []
    completed: list[int] = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="stock", max_retries=3)
    def reserve(account_id: int) -> None:
        attempts.append(1)
        apply_credit(current_session(), "stock", account_id, 10)
        if len(attempts) == 1:
            raise RuntimeError("the first attempt fails")

    @dramatiq.actor(queue_name=queue)
    def done() -> None:
        completed.append(1)

    group = dramatiq.group([message(queue, "reserve", 7, **ident("g-1"))], broker=producer)
    group.add_completion_callback(message(queue, "done"))
    with running_worker(broker) as worker:
        group.run()
        drain(broker, queue, worker)
    # Then Retries' retry was enqueued (not refused as a new group send) and applied once
    assert len(attempts) == 2
    assert _effects(pg_engine, 7) == 1
    assert completed == [1]


def test_retry__a_failed_message_whose_retry_is_refused_is_not_acked(
    broker, queue, pg_engine, monkeypatch
):
    # Given an inbox actor that fails once, and a broker that refuses Retries' enqueue of
    # its retry (Dramatiq logs and swallows that, then acknowledges) and the next one
    # too; the worker tries an acknowledgement again after 0.2 s instead of 5
    monkeypatch.setattr(dramatiq.worker, "POST_PROCESS_MESSAGE_RETRY_DELAY_SECS", 0.2)
    refuse = Refuse(lambda m: m.options.get("retries", 0) >= 1, times=2)
    broker.add_middleware(refuse)
    broker.add_middleware(InboxMiddleware(pg_engine))
    attempts: list[int] = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=3)
    def add_credit(account_id: int) -> None:
        attempts.append(1)
        apply_credit(current_session(), "billing", account_id, 10)
        if len(attempts) == 1:
            raise RuntimeError("the first attempt fails")

    with running_worker(broker) as worker:
        add_credit.send_with_options(args=(7,), **ident("r-1"))
        drain(broker, queue, worker)
    # Then the delivery was not acknowledged before its retry was enqueued: applied once
    assert refuse.refused == 2
    assert len(attempts) == 2
    assert _effects(pg_engine, 7) == 1


def test_hand_back__refused_then_refused_to_retries_is_not_acked(broker, queue, pg_engine):
    # Given an inbox actor whose first attempt is handed back (transient trouble), and a
    # broker that refuses that message's next two enqueues: the hand-back's (no patience)
    # and the one Retries then makes
    from inbox_middleware._core.exceptions import DatabaseUnavailable

    sent: list[str] = []
    refuse = Refuse(lambda m: m.message_id in sent, times=2)
    broker.add_middleware(refuse)
    broker.add_middleware(InboxMiddleware(pg_engine, hand_back_patience=0))
    attempts: list[int] = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=3)
    def add_credit(account_id: int) -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise DatabaseUnavailable("the database went away")
        apply_credit(current_session(), "billing", account_id, 10)

    with running_worker(broker) as worker:
        sent.append(add_credit.send_with_options(args=(7,), **ident("h-1")).message_id)
        drain(broker, queue, worker)
    # Then the delivery was not acknowledged until the message was enqueued again
    assert refuse.refused == 2
    assert len(attempts) == 2
    assert _effects(pg_engine, 7) == 1


# -- 2. and 3. on_success ------------------------------------------------------------------


def test_on_success__a_failed_send_is_sent_again_by_the_retry(broker, queue, pg_engine):
    # Given an inbox actor with an inbox callback, whose first send the broker refuses
    refuse = Refuse(lambda m: m.actor_name == "audited", times=1)
    broker.add_middleware(refuse)
    broker.add_middleware(InboxMiddleware(pg_engine))

    @dramatiq.actor(queue_name=queue, inbox_consumer="stock", max_retries=3)
    def reserve(account_id: int) -> int:
        apply_credit(current_session(), "stock", account_id, 10)
        return 10

    @dramatiq.actor(queue_name=queue, inbox_consumer="audit")
    def audited(message: dict[str, Any], result: int) -> None:
        apply_credit(current_session(), "audit", 99, result)

    with running_worker(broker) as worker:
        reserve.send_with_options(args=(7,), on_success="audited", **ident("s-1"))
        drain(broker, queue, worker)
    # Then the retry (a duplicate) sent the callback: each effect once
    assert refuse.refused == 1
    assert (_effects(pg_engine, 7), _effects(pg_engine, 99)) == (1, 1)


def test_on_success__declared_on_the_actor_is_sent_for_a_message_without_identity(
    broker, queue, pg_engine
):
    # Given an actor declared with on_success, whose messages without identity are
    # processed unprotected by policy
    broker.add_middleware(InboxMiddleware(pg_engine, missing_identity="process"))
    calls: list[tuple[dict[str, Any], int]] = []

    @dramatiq.actor(queue_name=queue)
    def audited(message: dict[str, Any], result: int) -> None:
        calls.append((message, result))

    @dramatiq.actor(queue_name=queue, inbox_consumer="stock", on_success="audited")
    def reserve(account_id: int) -> int:
        apply_credit(current_session(), "stock", account_id, 10)
        return 10

    with running_worker(broker) as worker:
        sent = reserve.send(7)
        drain(broker, queue, worker)
    # Then the callback is sent as Dramatiq sends it: the message as a dict, the result
    [(first, result)] = calls
    assert (first["message_id"], result) == (sent.message_id, 10)


def test_on_success__a_duplicate_replays_the_callback_as_first_sent(broker, queue, pg_engine):
    # Given an inbox actor whose on_success callback is an inbox actor too
    broker.add_middleware(InboxMiddleware(pg_engine))
    seen: list[str] = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="stock")
    def reserve(account_id: int) -> int:
        apply_credit(current_session(), "stock", account_id, 10)
        return 10

    @dramatiq.actor(queue_name=queue, inbox_consumer="audit")
    def audited(message: dict[str, Any], result: int) -> None:
        seen.append(message["message_id"])
        apply_credit(current_session(), "audit", 99, result)

    with running_worker(broker) as worker:
        # When the same intent is sent twice (two Dramatiq messages, new ids)
        first = reserve.send_with_options(args=(7,), on_success="audited", **ident("c-1"))
        drain(broker, queue, worker)
        reserve.send_with_options(args=(7,), on_success="audited", **ident("c-1"))
        drain(broker, queue, worker)
    # Then the duplicate's callback is the first one's bytes: a duplicate downstream,
    # not a conflict, and it names the first message
    assert _count(pg_engine, "inbox_quarantine") == 0
    assert (_effects(pg_engine, 7), _effects(pg_engine, 99)) == (1, 1)
    assert seen == [first.message_id]


def test_on_success__with_no_stored_callback_a_duplicate_builds_its_own(
    broker, queue, pg_engine, results
):
    # Given a first delivery that asked for no callback (its result stored for Results)
    broker.add_middleware(InboxMiddleware(pg_engine))
    seen: list[str] = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="stock", store_results=True)
    def reserve(account_id: int) -> int:
        apply_credit(current_session(), "stock", account_id, 10)
        return 10

    @dramatiq.actor(queue_name=queue)
    def audited(message: dict[str, Any], result: int) -> None:
        seen.append(message["message_id"])

    with running_worker(broker) as worker:
        reserve.send_with_options(args=(7,), **ident("n-1"))
        drain(broker, queue, worker)
        # When a copy asks for one
        second = reserve.send_with_options(args=(7,), on_success="audited", **ident("n-1"))
        drain(broker, queue, worker)
    # Then the duplicate sends it, built from its own message
    assert seen == [second.message_id]
    assert _effects(pg_engine, 7) == 1


# -- 4. on_failure and on_retry_exhausted, as Dramatiq sends them ---------------------------


@pytest.mark.parametrize("inbox", [True, False], ids=["inbox", "plain"])
def test_on_failure__every_failed_attempt_and_retries_exhausted_once(
    broker, queue, pg_engine, inbox
):
    # Given an actor that always fails, with both callbacks, with or without the inbox
    broker.add_middleware(InboxMiddleware(pg_engine))
    failures: list[tuple[int, dict[str, Any]]] = []
    exhausted: list[tuple[int, dict[str, Any]]] = []

    @dramatiq.actor(queue_name=queue)
    def failed(message: dict[str, Any], detail: dict[str, Any]) -> None:
        failures.append((message["options"].get("retries"), detail))

    @dramatiq.actor(queue_name=queue)
    def gave_up(message: dict[str, Any], detail: dict[str, Any]) -> None:
        exhausted.append((message["options"].get("retries"), detail))

    options: dict[str, Any] = {"inbox_consumer": "billing"} if inbox else {}

    @dramatiq.actor(
        queue_name=queue,
        max_retries=2,
        on_failure="failed",
        on_retry_exhausted="gave_up",
        **options,
    )
    def add_credit(account_id: int) -> None:
        raise RuntimeError("always")

    with running_worker(broker) as worker:
        add_credit.send_with_options(args=(7,), **ident("f-1"))
        drain(broker, queue, worker)
        wait_for(lambda: len(failures) == 3 and exhausted, timeout=10, what="the callbacks")
    # Then, the same with the inbox as without: on_failure after each of the three
    # attempts, on_retry_exhausted once, with Dramatiq's arguments
    detail = {"type": "RuntimeError", "message": "always"}
    assert sorted(failures, key=lambda f: f[0]) == [(1, detail), (2, detail), (3, detail)]
    assert exhausted == [(3, {"retries": 2, "max_retries": 2})]


@pytest.mark.parametrize("inbox", [True, False], ids=["inbox", "plain"])
def test_on_failure__a_throws_failure_sends_on_failure_only(broker, queue, pg_engine, inbox):
    broker.add_middleware(InboxMiddleware(pg_engine))
    sent: list[tuple[str, dict[str, Any]]] = []

    @dramatiq.actor(queue_name=queue)
    def failed(message: dict[str, Any], detail: dict[str, Any]) -> None:
        sent.append(("on_failure", detail))

    @dramatiq.actor(queue_name=queue)
    def gave_up(message: dict[str, Any], detail: dict[str, Any]) -> None:
        sent.append(("on_retry_exhausted", detail))

    options: dict[str, Any] = {"inbox_consumer": "billing"} if inbox else {}

    @dramatiq.actor(
        queue_name=queue,
        throws=(KeyError,),
        on_failure="failed",
        on_retry_exhausted="gave_up",
        **options,
    )
    def add_credit(account_id: int) -> None:
        raise KeyError("no such account")

    with running_worker(broker) as worker:
        add_credit.send_with_options(args=(7,), **ident("t-1"))
        drain(broker, queue, worker)
        wait_for(lambda: sent, timeout=10, what="on_failure")
        drain(broker, queue, worker)
    assert sent == [("on_failure", {"type": "KeyError", "message": "'no such account'"})]


# -- 5. groups, results and pipelines under duplicates ---------------------------------------


def test_group__a_pipeline_with_an_inbox_step_is_refused_when_sent(
    broker, queue, pg_engine, limits
):
    broker.add_middleware(InboxMiddleware(pg_engine))
    broker.add_middleware(GroupCallbacks(limits))

    @dramatiq.actor(queue_name=queue)
    def prepare(account_id: int) -> int:
        return account_id

    @dramatiq.actor(queue_name=queue, inbox_consumer="stock")
    def reserve(account_id: int) -> None: ...

    @dramatiq.actor(queue_name=queue)
    def done() -> None: ...

    steps = dramatiq.pipeline([prepare.message(7), reserve.message_with_options(**ident("p-1"))])
    group = dramatiq.group([steps])
    group.add_completion_callback(done.message())
    with pytest.raises(ActorConfigurationError, match="not even as a step of a pipeline"):
        group.run()


def test_group__a_duplicate_member_never_counts_twice(
    broker, queue, pg_engine, producer, limits, results
):
    # Given a group of two inbox members whose results are stored, sent by a producer
    # without the inbox; the second member waits until the test lets it go
    broker.add_middleware(InboxMiddleware(pg_engine))
    broker.add_middleware(GroupCallbacks(limits))
    delivered: list[dramatiq.Message[Any]] = []
    completed: list[int] = []
    release = threading.Event()

    class Keep(dramatiq.Middleware):
        """Keeps the first member's message as delivered, and counts its acks (which
        follow every after_process_message hook, GroupCallbacks' included)."""

        def after_ack(self, broker: Any, message: Any) -> None:
            if message.actor_name == "reserve":
                delivered.append(message._message)

    broker.add_middleware(Keep())

    @dramatiq.actor(queue_name=queue, inbox_consumer="stock", store_results=True)
    def reserve(account_id: int) -> int:
        apply_credit(current_session(), "stock", account_id, 10)
        return account_id * 10

    @dramatiq.actor(queue_name=queue, inbox_consumer="slow", store_results=True)
    def slow(account_id: int) -> int:
        release.wait(10)
        apply_credit(current_session(), "slow", account_id, 1)
        return 0

    @dramatiq.actor(queue_name=queue)
    def done() -> None:
        completed.append(release.is_set())

    members = [
        message(queue, "reserve", 7, **ident("m-1")),
        message(queue, "slow", 8, **ident("m-2")),
    ]
    group = dramatiq.group(members, broker=producer)
    group.add_completion_callback(message(queue, "done"))
    with running_worker(broker) as worker:
        group.run()
        wait_for(lambda: delivered, timeout=10, what="the first member")
        # When the first member comes back (a redelivery: the same message, whose ack
        # was lost after its commit)
        first = delivered[0]
        # (its stored result gone with the crash, to see the duplicate store it again)
        results.client.delete(results.build_message_key(first))
        producer.enqueue(first)  # sent again from outside: the inbox would refuse it
        wait_for(lambda: len(delivered) == 2, timeout=10, what="the duplicate")
        # Then a caller blocked on its result gets the first delivery's, from the duplicate
        assert first.get_result(backend=results, block=True, timeout=10_000) == 70
        release.set()
        drain(broker, queue, worker)
    # and the duplicate did not count: the group completed once, after its last member
    assert completed == [True]
    assert (_effects(pg_engine, 7), _effects(pg_engine, 8)) == (1, 1)


def test_pipeline__a_duplicate_with_pipe_ignore_sends_the_step_without_the_result(
    broker, queue, pg_engine
):
    broker.add_middleware(InboxMiddleware(pg_engine))
    received: list[tuple[Any, ...]] = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="stock")
    def reserve(account_id: int) -> int:
        apply_credit(current_session(), "stock", account_id, 10)
        return 10

    @dramatiq.actor(queue_name=queue, inbox_consumer="shipping")
    def ship(account_id: int) -> None:
        received.append((account_id,))
        apply_credit(current_session(), "shipping", account_id, 1)

    def order() -> Any:
        return dramatiq.pipeline(
            [
                reserve.message_with_options(args=(7,), **ident("i-1")),
                ship.message_with_options(args=(8,), pipe_ignore=True),
            ]
        )

    with running_worker(broker) as worker:
        order().run()
        drain(broker, queue, worker)
        order().run()  # the same intent again: a duplicate
        drain(broker, queue, worker)
    # Then the duplicate sent the step again, without the result, under the same derived
    # identity: the shipping inbox skipped it
    assert received == [(8,)]
    assert (_effects(pg_engine, 7), _effects(pg_engine, 8)) == (1, 1)


def test_pipeline__a_step_that_can_never_be_sent_is_kept_as_poison(broker, queue, pg_engine):
    # Given an inbox actor whose pipeline step the broker always refuses
    refuse = Refuse(lambda m: m.actor_name == "ship", times=1_000)
    broker.add_middleware(refuse)
    broker.add_middleware(InboxMiddleware(pg_engine))

    @dramatiq.actor(queue_name=queue, inbox_consumer="stock", max_retries=1)
    def reserve(account_id: int) -> int:
        apply_credit(current_session(), "stock", account_id, 10)
        return 10

    shipped: list[int] = []

    @dramatiq.actor(queue_name=queue)
    def ship(result: int) -> None:
        shipped.append(result)

    with running_worker(broker) as worker:
        dramatiq.pipeline(
            [reserve.message_with_options(args=(7,), **ident("u-1")), ship.message()]
        ).run()
        drain(broker, queue, worker)
        # Then its effect committed once, and the message is poison with the reason
        assert refuse.refused == 2
        assert _effects(pg_engine, 7) == 1
        with pg_engine.connect() as conn:
            [row] = conn.execute(select(NAMING.tables.poison)).mappings().all()
        assert (row["reason_code"], row["attempts"], row["decision"]) == (
            "outputs_undeliverable",
            2,
            "pending",
        )
        assert "refused ship" in row["error"]
        # which a redrive, once the cause is repaired, finishes: the step is sent, with
        # the stored result, and the effect is not applied again
        refuse.left = 0
        with pg_engine.connect() as conn:
            repair.redrive(
                conn, NAMING, "poison", row["id"], by="test", publisher=DramatiqRepublisher(broker)
            )
        drain(broker, queue, worker)
    assert shipped == [10]
    assert _effects(pg_engine, 7) == 1
    # And its row says the repair is done: the step was sent
    with pg_engine.connect() as conn:
        [row] = conn.execute(select(NAMING.tables.poison)).mappings().all()
    assert (row["decision"], row["recovered_at"] is not None) == ("recovered", True)
