"""Identities stamped on what a Dramatiq producer sends: `StampIdentity`.

The counterpart of FastStream's `StampIdentity`: call sites keep their plain
``add_credit.send(order_id, 7, 10)``, and the middleware writes ``inbox_producer`` and
``inbox_message_id`` into the message's options at ``before_enqueue``, from

1. the options themselves, when the sender put an identity there (never overwritten:
   Retries re-enqueues every retry through this middleware);
2. the argument the actor declares with ``inbox_message_id_from`` (``inbox_producer``
   beside it names the producer);
3. the argument named by, or the value computed by, the middleware's ``message_id``,
   for messages of the chosen ``actors`` or ``queues``.

A chosen message for which none gives an id is refused there, in the producer's
``send``, with `IdentityRefused`: a `MiddlewareError`, because Dramatiq's broker logs any
other exception raised by a middleware and sends the message anyway, unstamped. So is
an id that contains Dramatiq's own ``message_id``, which is new on every send and would
let a producer's second send of one intent through.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from typing import Any

import dramatiq
from dramatiq import Broker, Message
from dramatiq.common import q_name
from dramatiq.errors import ActorNotFound
from dramatiq.middleware import MiddlewareError

from .._core.exceptions import (
    ConfigurationError,
    IdentityError,
    InboxError,
    InvalidIdentity,
    MissingIdentity,
)
from .._core.identity import MAX_NAME_LENGTH, MessageIdentity, validate_name
from ._payload import (
    OPTION_MESSAGE_ID,
    OPTION_MESSAGE_ID_FROM,
    OPTION_PRODUCER,
    OPTION_TENANT,
    ActorIdentity,
    ActorPayload,
    actor_identity,
    id_text,
    identity_options,
)

__all__ = ["IdentityRefused", "StampIdentity"]

MessageIdFunction = Callable[[Message[Any]], object]
"""Computes a message's intent id from the message (its ``args``, ``kwargs``)."""


class IdentityRefused(IdentityError, MiddlewareError):
    """The producer refused to send a message without a usable identity."""


class StampConfigurationError(ConfigurationError, MiddlewareError):
    """`StampIdentity` or an actor's identity options are declared in a way that cannot work."""


class StampIdentity(dramatiq.Middleware):
    """Stamps producer-assigned identities on the messages a Dramatiq producer sends.

    Parameters:
      producer: the producer name for stamped messages (an actor's ``inbox_producer``
        and a sender's ``inbox_producer`` option take precedence).
      message_id: the name of the argument holding the intent id, or a function of the
        message returning it (``lambda m: f"order-{m.kwargs['order']['id']}"``); it must
        give the same id whenever the same intent is sent again.
      actors: the names of the actors whose messages to stamp. Actors declared with
        ``inbox_message_id_from`` are stamped whatever ``actors`` and ``queues`` say.
      queues: the names of the queues whose messages to stamp.
      tenant: a tenant stamped on messages that carry none.

    ::

        broker.add_middleware(StampIdentity("orders", "order_id", actors={"add_credit"}))
        add_credit.send("ord-42", 7, 10)   # sent with inbox_message_id="ord-42"
    """

    def __init__(
        self,
        producer: str,
        message_id: str | MessageIdFunction | None = None,
        *,
        actors: Collection[str] = (),
        queues: Collection[str] = (),
        tenant: str | None = None,
    ) -> None:
        for names, what in ((actors, "actors"), (queues, "queues")):
            if isinstance(names, str):
                raise TypeError(f"{what} is a collection of names, not one string")
        try:
            validate_name(producer, OPTION_PRODUCER, max_length=MAX_NAME_LENGTH)
            if tenant is not None:
                validate_name(tenant, OPTION_TENANT, max_length=MAX_NAME_LENGTH, allow_empty=True)
        except InvalidIdentity as exc:
            raise ConfigurationError(f"StampIdentity: {exc}") from None
        if isinstance(message_id, str) and not message_id.isidentifier():
            raise ConfigurationError(f"StampIdentity: {message_id!r} is not an argument name")
        self.producer = producer
        self.message_id = message_id
        self.actors = frozenset(actors)
        self.queues = frozenset(queues)
        self.tenant = tenant
        self._payloads: dict[str, ActorPayload | None] = {}

    @property
    def actor_options(self) -> set[str]:
        return {OPTION_PRODUCER, OPTION_MESSAGE_ID_FROM}

    # -- declaration ----------------------------------------------------------------------

    def before_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        try:
            self._payloads[actor.actor_name] = self._declare(actor)
        except ConfigurationError as exc:
            raise StampConfigurationError(str(exc)) from None

    def after_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        # Reached directly when the middleware is added after the actors were declared.
        if actor.actor_name not in self._payloads:
            self.before_declare_actor(broker, actor)

    def _declare(self, actor: dramatiq.Actor[Any, Any]) -> ActorPayload | None:
        fn = getattr(actor.fn, "__wrapped__", actor.fn)
        declared = actor_identity(actor.actor_name, fn, actor.options)
        if declared is not None and declared.parameter is not None:
            return ActorPayload(actor.actor_name, fn, None, declared)
        if not self._chosen(actor.actor_name, actor.queue_name):
            return None
        producer = declared.producer if declared is not None else None
        if isinstance(self.message_id, str):
            chosen = ActorIdentity(actor.actor_name, producer or self.producer, self.message_id)
            if self.message_id not in inspect.signature(fn).parameters:
                raise ConfigurationError(
                    f"StampIdentity takes message ids from the argument {self.message_id!r}, "
                    f"which actor {actor.actor_name!r} does not have"
                )
            return ActorPayload(actor.actor_name, fn, None, chosen)
        by_function = ActorIdentity(actor.actor_name, producer, None)
        return ActorPayload(actor.actor_name, fn, None, by_function)

    # -- sending --------------------------------------------------------------------------

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        payload = self._payload(broker, message)
        if payload is None:
            return
        try:
            identity = self._identity(payload, message)
        except Exception as exc:  # any other exception: Dramatiq would send it unstamped
            reason = str(exc) if isinstance(exc, InboxError) else f"{type(exc).__name__}: {exc}"
            raise IdentityRefused(
                f"refusing to send {message.actor_name} message {message.message_id}: "
                f"{reason}; pass the id as its argument, or send it with "
                "send_with_options(..., **identity(producer=..., message_id=...))",
                field=getattr(exc, "field", None),
            ) from exc
        if message.message_id in identity.message_id:
            raise IdentityRefused(
                f"refusing to send {message.actor_name} message {message.message_id}: its "
                f"inbox_message_id {identity.message_id!r} holds Dramatiq's own message_id, "
                "which is new on every send; derive the id from the producer's intent",
                field=OPTION_MESSAGE_ID,
            )
        options = message.options
        options[OPTION_PRODUCER] = identity.producer
        options[OPTION_MESSAGE_ID] = identity.message_id
        if identity.tenant:
            options[OPTION_TENANT] = identity.tenant

    def _payload(self, broker: Broker, message: Message[Any]) -> ActorPayload | None:
        name = message.actor_name
        if name in self._payloads:
            return self._payloads[name]
        try:
            broker.get_actor(name)
        except ActorNotFound:  # sent by name to an actor declared elsewhere: no signature
            if not self._chosen(name, message.queue_name):
                return None
            by_name = isinstance(self.message_id, str)
            parameter = self.message_id if isinstance(self.message_id, str) else None
            return _Undeclared(name, ActorIdentity(name, None, parameter) if by_name else None)
        return None

    def _identity(self, payload: ActorPayload, message: Message[Any]) -> MessageIdentity:
        # Precedence: what the sender put in the options, then the actor's declaration,
        # then this middleware's settings.
        source = payload.identity
        options = dict(message.options)
        if options.get(OPTION_PRODUCER) is None:
            declared = source.producer if source is not None else None
            options[OPTION_PRODUCER] = declared or self.producer
        if options.get(OPTION_TENANT) is None and self.tenant is not None:
            options[OPTION_TENANT] = self.tenant
        if options.get(OPTION_MESSAGE_ID) is None:
            if source is not None and source.parameter is not None:
                return source.read(options, lambda: payload.arguments(message))
            if not callable(self.message_id):
                raise MissingIdentity(
                    f"the message has no {OPTION_MESSAGE_ID} and StampIdentity has no "
                    f"message_id for actor {message.actor_name!r}",
                    field=OPTION_MESSAGE_ID,
                )
            value = self.message_id(message)
            if value is None:
                raise MissingIdentity(
                    "the message_id function found no id in the message", field=OPTION_MESSAGE_ID
                )
            options[OPTION_MESSAGE_ID] = id_text(value, "the message_id function's result")
        return identity_options(options)

    def _chosen(self, actor_name: str, queue_name: str) -> bool:
        return actor_name in self.actors or q_name(queue_name) in self.queues


class _Undeclared(ActorPayload):
    """An actor this producer only knows by name: its id can come from a keyword argument."""

    def __init__(self, actor_name: str, identity: ActorIdentity | None) -> None:
        self.actor_name = actor_name
        self.canonical = None
        self.identity = identity

    def arguments(self, message: Any) -> dict[str, Any]:
        return dict(message.kwargs)
