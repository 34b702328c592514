"""The ways of deduplicating a message that the benchmark and the correctness tests compare.

Each way credits one account by 1 (the benchmark's effect) once per message id, as a team
would write it with that tool, on the same SQLAlchemy engine:

  bare           no deduplication: the update in a transaction
  redis_setnx    SET NX on Redis first, then the transaction (the mark before the effect)
  select_insert  SELECT the id in a dedup table, INSERT it, update: one transaction
  powertools     AWS Lambda Powertools' idempotency utility on Redis, as documented:
                 ``@idempotent_function`` with ``CachePersistenceLayer`` around the
                 transaction (an "in progress" record, the effect, a "completed" record)
  justonce       the justonce library's ``PostgresStore`` (its claim, the effect, its
                 "succeeded" record: three transactions, each on a connection of its own)
  inbox          this library's `Inbox`: the claim in the effect's transaction

``deliver`` returns True when the effect was applied by this call, False when the message
was recognised as a duplicate, and raises what the tool raises otherwise (a Dramatiq
worker retries the message then). ``between`` is called where the effect and the "done"
mark are apart: after the mark and before the effect (redis_setnx), after the effect's
commit and before the "completed" record (powertools, justonce), or inside the one
transaction after the effect's statement (select_insert, inbox). The correctness tests
kill the process there, or cut the database there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from inbox_middleware import Inbox, MessageIdentity
from inbox_middleware._core.identity import hash_json
from inbox_middleware._core.protocol import Delivery

UPDATE = text("UPDATE bench_accounts SET balance = balance + 1 WHERE id = :account")
SEEN = text("SELECT 1 FROM bench_seen WHERE message_id = :m")
MARK = text("INSERT INTO bench_seen VALUES (:m)")
WAYS = ("bare", "redis_setnx", "select_insert", "powertools", "justonce", "inbox")
Between = Callable[[], None]


def _nothing() -> None:
    return None


class Way:
    """One way of deduplicating; `make` builds the one a name stands for."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def deliver(self, message_id: str, account: int, between: Between = _nothing) -> bool:
        raise NotImplementedError

    def _credit(self, account: int, between: Between = _nothing) -> None:
        with Session(self.engine) as session, session.begin():
            session.execute(UPDATE, {"account": account})
        between()


class Bare(Way):
    def deliver(self, message_id: str, account: int, between: Between = _nothing) -> bool:
        self._credit(account, between)
        return True


class RedisSetNx(Way):
    def __init__(self, engine: Engine, redis_url: str, expires: int = 86400) -> None:
        import redis

        super().__init__(engine)
        self.client = redis.Redis.from_url(redis_url)
        self.expires = expires

    def deliver(self, message_id: str, account: int, between: Between = _nothing) -> bool:
        if not self.client.set(f"bench:seen:{message_id}", 1, nx=True, ex=self.expires):
            return False
        between()
        self._credit(account)
        return True


class SelectInsert(Way):
    def deliver(self, message_id: str, account: int, between: Between = _nothing) -> bool:
        with Session(self.engine) as session, session.begin():
            if session.execute(SEEN, {"m": message_id}).first():
                return False
            session.execute(MARK, {"m": message_id})
            session.execute(UPDATE, {"account": account})
            between()
        return True


class Powertools(Way):
    """``expires`` is Powertools' ``expires_after_seconds`` (an hour by default)."""

    def __init__(self, engine: Engine, redis_url: str, expires: int = 3600) -> None:
        import redis
        from aws_lambda_powertools.utilities.idempotency import (
            IdempotencyConfig,
            idempotent_function,
        )
        from aws_lambda_powertools.utilities.idempotency.persistence.cache import (
            CachePersistenceLayer,
        )

        super().__init__(engine)
        # decode_responses=True as Powertools' own example has it: its records are JSON text.
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        config = IdempotencyConfig(
            event_key_jmespath="message_id",
            payload_validation_jmespath="account",
            expires_after_seconds=expires,
        )
        # Whether this thread's last call ran the effect: a duplicate returns the stored
        # result, which is the same as the first call's.
        self._ran = threading.local()

        @idempotent_function(
            data_keyword_argument="message",
            persistence_store=CachePersistenceLayer(client=client),
            config=config,
        )
        def credit(message: dict[str, Any], between: Between) -> None:
            self._credit(message["account"], between)
            self._ran.value = True

        self._function = credit

    def deliver(self, message_id: str, account: int, between: Between = _nothing) -> bool:
        self._ran.value = False
        self._function(message={"message_id": message_id, "account": account}, between=between)
        return bool(self._ran.value)


class JustOnce(Way):
    """``ttl`` is justonce's claim lease (15 minutes by default)."""

    def __init__(self, engine: Engine, dsn: str, ttl: float = 15 * 60) -> None:
        from justonce import Idempotent, operation_key
        from justonce.stores import PostgresStore

        super().__init__(engine)
        self.once = Idempotent(PostgresStore(dsn), ttl_seconds=ttl)
        self._key = operation_key

    def deliver(self, message_id: str, account: int, between: Between = _nothing) -> bool:
        result = self.once.run(
            self._key("credit", message_id),
            lambda: self._credit(account, between),
            payload={"account": account},
        )
        return bool(result.executed)


class InboxWay(Way):
    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.inbox = Inbox(engine)

    def deliver(self, message_id: str, account: int, between: Between = _nothing) -> bool:
        identity = MessageIdentity("bench", message_id)
        delivery = Delivery("bench", identity, hash_json({"account": account}, "json.v1"))

        def handler(session: Session) -> bool:
            session.execute(UPDATE, {"account": account})
            between()
            return True

        return self.inbox.process(delivery, handler).result is True


def make(name: str, engine: Engine, *, redis_url: str, dsn: str, **settings: Any) -> Way:
    """The way called ``name`` on ``engine``; ``settings`` are its expiry or lease."""
    if name == "bare":
        return Bare(engine)
    if name == "redis_setnx":
        return RedisSetNx(engine, redis_url, **settings)
    if name == "select_insert":
        return SelectInsert(engine)
    if name == "powertools":
        return Powertools(engine, redis_url, **settings)
    if name == "justonce":
        return JustOnce(engine, dsn, **settings)
    if name == "inbox":
        return InboxWay(engine)
    raise ValueError(f"no way called {name!r}: one of {', '.join(WAYS)}")
