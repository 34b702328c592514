"""A duplicate answers like the first delivery (Dramatiq): the stored result reaches the
Results backend, the pipeline's next step and the on_success callback again, with
identities derived from the message's, so an inbox actor downstream deduplicates them."""

from __future__ import annotations

import uuid
from typing import Any

import dramatiq
import pytest
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend
from sqlalchemy import text

from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity
from inbox_middleware.dramatiq._middleware import ActorConfigurationError

from ..apps.domain import apply_credit, effects
from ..support import services
from ..support.dramatiq_worker import drain, running_worker
from ..support.workers import wait_for


def ident(message_id: str) -> dict[str, Any]:
    return identity(producer="orders", message_id=message_id)


@pytest.fixture
def results(broker) -> Any:
    backend = RedisBackend(url=services.REDIS, namespace=f"inbox-test-{uuid.uuid4().hex[:8]}")
    broker.add_middleware(Results(backend=backend))
    yield backend
    for key in backend.client.scan_iter(f"{backend.namespace}*"):
        backend.client.delete(key)


@pytest.fixture
def inbox(broker, pg_engine, results) -> InboxMiddleware:
    middleware = InboxMiddleware(pg_engine, lock_timeout=10)
    broker.add_middleware(middleware)
    return middleware


def test_outputs__a_duplicate_stores_the_first_result(broker, queue, pg_engine, inbox, results):
    # Given an inbox actor whose results are stored
    calls: list[int] = []

    @dramatiq.actor(queue_name=queue, inbox_consumer="stock", store_results=True)
    def reserve(account_id: int, delta: int) -> dict[str, int]:
        calls.append(1)
        apply_credit(current_session(), "stock", account_id, delta)
        return {"reserved": delta, "remaining": 100 - len(calls)}

    with running_worker(broker) as worker:
        # When the same intent is sent twice (a producer's retry)
        first = reserve.send_with_options(args=(7, 10), **ident("r-1"))
        drain(broker, queue, worker)
        second = reserve.send_with_options(args=(7, 10), **ident("r-1"))
        drain(broker, queue, worker)
        # Then both messages' results are the first delivery's, not None for the duplicate
        assert first.get_result(backend=results, block=True, timeout=10_000) == {
            "reserved": 10,
            "remaining": 99,
        }
        assert second.get_result(backend=results, block=True, timeout=10_000) == {
            "reserved": 10,
            "remaining": 99,
        }
    assert calls == [1]
    with pg_engine.connect() as conn:
        assert effects(conn, 7) == 1
        assert conn.scalar(text("SELECT count(*) FROM inbox_outputs")) == 1


def test_outputs__pipeline_and_callback_follow_a_duplicate_once_downstream(
    broker, queue, pg_engine, inbox
):
    # Given a pipeline of two inbox actors, and an inbox actor as on_success callback
    @dramatiq.actor(queue_name=queue, inbox_consumer="stock")
    def reserve(account_id: int, delta: int) -> dict[str, int]:
        apply_credit(current_session(), "stock", account_id, delta)
        return {"account_id": account_id + 1, "delta": delta * 2}

    @dramatiq.actor(queue_name=queue, inbox_consumer="shipping")
    def ship(order: dict[str, int]) -> None:
        apply_credit(current_session(), "shipping", order["account_id"], order["delta"])

    @dramatiq.actor(queue_name=queue, inbox_consumer="audit")
    def audited(message: dict[str, Any], result: dict[str, int]) -> None:
        apply_credit(current_session(), "audit", 99, result["delta"])

    def order() -> Any:
        step = reserve.message_with_options(args=(7, 10), on_success="audited", **ident("p-1"))
        return dramatiq.pipeline([step, ship.message()])

    with running_worker(broker) as worker:
        # When the pipeline runs, and its first message is delivered again (a redelivery
        # after a lost ack, or the producer's retry)
        order().run()
        drain(broker, queue, worker)
        order().run()
        drain(broker, queue, worker)
        wait_for(lambda: _effects(pg_engine, 99) == 1, timeout=10, what="the callback")
    # Then each step's effect exists once: the duplicate sent the next step and the
    # callback again, with the same derived identities, and their inboxes skipped them
    assert (_effects(pg_engine, 7), _effects(pg_engine, 8), _effects(pg_engine, 99)) == (1, 1, 1)
    with pg_engine.connect() as conn:
        rows = conn.execute(
            text("SELECT consumer_name, producer_name, message_id FROM consumer_inbox")
        ).all()
    derived = {consumer: (producer, mid) for consumer, producer, mid in rows}
    assert derived["shipping"][0] == derived["audit"][0] == "stock"
    assert derived["shipping"][1].startswith("out.pipe.0.")
    assert derived["audit"][1].startswith("out.on_success.0.")


def test_outputs__a_group_with_completion_callbacks_refuses_an_inbox_actor(broker, queue, inbox):
    from dramatiq.middleware import GroupCallbacks
    from dramatiq.rate_limits.backends import RedisBackend as RedisLimits

    broker.add_middleware(GroupCallbacks(RedisLimits(url=services.REDIS)))

    @dramatiq.actor(queue_name=queue, inbox_consumer="stock")
    def reserve(account_id: int) -> None: ...

    @dramatiq.actor(queue_name=queue)
    def done() -> None: ...

    group = dramatiq.group([reserve.message_with_options(args=(1,), **ident("g-1"))])
    group.add_completion_callback(done.message())
    with pytest.raises(ActorConfigurationError, match="group with completion callbacks"):
        group.run()


def _effects(engine: Any, account: int) -> int:
    with engine.connect() as conn:
        return effects(conn, account)


def test_outputs__a_direct_send_from_an_actor_is_warned(broker, queue, pg_engine, inbox, recwarn):
    # Given an inbox actor that sends a follow-up directly from its body
    from inbox_middleware._core.exceptions import DirectPublishWarning

    @dramatiq.actor(queue_name=queue)
    def notify(account_id: int) -> None: ...

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing")
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)
        notify.send(account_id)

    # When it runs, then one warning names the outbox, and the message is sent
    with running_worker(broker) as worker:
        add_credit.send_with_options(args=(7, 10), **ident("w-1"))
        drain(broker, queue, worker)
    (warning,) = [w for w in recwarn if issubclass(w.category, DirectPublishWarning)]
    assert "a send to 'notify' from inside inbox consumer 'billing'" in str(warning.message)
    assert "outbox.add" in str(warning.message)
    assert _effects(pg_engine, 7) == 1


def test_outputs__a_refused_direct_send_rolls_the_attempt_back(broker, queue, pg_engine, pg_url):
    from inbox_middleware.dramatiq._middleware import DirectSendRefused

    broker.add_middleware(InboxMiddleware(pg_engine, direct_publish="refuse"))
    raised: list[BaseException] = []

    @dramatiq.actor(queue_name=queue)
    def notify(account_id: int) -> None: ...

    @dramatiq.actor(queue_name=queue, inbox_consumer="billing", max_retries=0)
    def add_credit(account_id: int, delta: int) -> None:
        apply_credit(current_session(), "billing", account_id, delta)
        try:
            notify.send(account_id)
        except DirectSendRefused as exc:
            raised.append(exc)
            raise

    with running_worker(broker) as worker:
        add_credit.send_with_options(args=(7, 10), **ident("w-2"))
        drain(broker, queue, worker)
    assert len(raised) == 1 and "outbox.add" in str(raised[0])
    assert _effects(pg_engine, 7) == 0


def test_outputs__an_async_actor_stores_its_result_too(
    broker, queue, pg_engine, pg_async_engine, results
):
    # Given an async inbox actor whose results are stored
    from inbox_middleware.dramatiq import current_async_session

    broker.add_middleware(InboxMiddleware(pg_async_engine, lock_timeout=10))

    @dramatiq.actor(queue_name=queue, inbox_consumer="stock", store_results=True)
    async def reserve(account_id: int, delta: int) -> dict[str, int]:
        session = current_async_session()
        await session.run_sync(apply_credit, "stock", account_id, delta)
        return {"reserved": delta}

    with running_worker(broker) as worker:
        first = reserve.send_with_options(args=(7, 10), **ident("a-1"))
        second = reserve.send_with_options(args=(7, 10), **ident("a-1"))
        drain(broker, queue, worker)
        answers = [
            m.get_result(backend=results, block=True, timeout=10_000) for m in (first, second)
        ]
    assert answers == [{"reserved": 10}, {"reserved": 10}]
    assert _effects(pg_engine, 7) == 1
