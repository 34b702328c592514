"""Publish each effect through a FastStream broker (``pip install inbox-middleware[faststream]``).

The message carries the effect id as its inbox identity in the ``x-inbox-*`` headers, so
a subscriber using this library downstream processes a re-published effect once.

An effect is ``dispatched`` only once the broker has the message; anything else is a
failed attempt, retried with the dispatcher's backoff and ``failed`` when the attempts
run out:

- RabbitMQ: persistent, ``mandatory``, and the publisher confirm awaited. A message
  RabbitMQ returns (no queue is bound to its routing key: a queue that does not exist
  yet) or does not confirm is a failed attempt, whatever the channel's
  ``on_return_raises``.
- NATS: through JetStream, the stream's acknowledgement awaited (``stream=`` names the
  stream; else the one that captures the subject). A subject no stream captures is a
  failed attempt: core NATS would deliver it to nobody.
- Redis: ``XADD`` to a stream (``stream=``); a pub/sub channel forgets a message nobody
  listens to, and a list cannot hand one back, so both are refused.
- Kafka: the producer's acknowledgement awaited (``no_confirm=True`` is refused; with
  ``acks=0`` there is none, and every attempt fails).
"""

from __future__ import annotations

from typing import Any

from ..._core.optional import require

require(
    "faststream", "faststream-rabbit", "faststream-redis", "faststream-nats", "faststream-kafka"
)

from ..._core.exceptions import ConfigurationError  # noqa: E402
from ..._core.headers import MESSAGE_ID, PRODUCER, TENANT  # noqa: E402
from ..._core.identity import MessageIdentity  # noqa: E402
from .._confirms import unconfirmed  # noqa: E402
from .._destination import Effect  # noqa: E402
from .._errors import DeliveryError  # noqa: E402

__all__ = ["FastStreamDestination"]

_KINDS = {
    "faststream.rabbit": "rabbit",
    "faststream.redis": "redis",
    "faststream.nats": "nats",
    "faststream.kafka": "kafka",
}
# Options that would make the broker keep less than the destination reports.
_REFUSED = {
    "rabbit": {
        "persist": (False, "a transient message is lost when RabbitMQ restarts"),
        "mandatory": (False, "RabbitMQ drops a message it cannot route without telling"),
        "immediate": (True, "RabbitMQ refuses immediate publishes"),
    },
    "kafka": {"no_confirm": (True, "the publish would return before Kafka has the record")},
}


class FastStreamDestination:
    """``await broker.publish(payload, **publish_options, headers=...)`` per effect,
    counted ``dispatched`` only once the broker has the message (see the module).

    Parameters:
      broker: a FastStream ``RabbitBroker``, ``RedisBroker``, ``NatsBroker`` or
        ``KafkaBroker``. If it is not connected yet, the destination connects it and
        stops it again when the dispatcher stops; a broker your app already runs is left
        running.
      producer: the producer name recorded in the message's inbox identity.
      tenant: the tenant of that identity, if any.
      publish_options: where and how to publish, as for the broker's ``publish``
        (``queue="emails"``, ``exchange=...``, ``subject="..."``, ``stream="..."``,
        ``topic="..."``, ...). RabbitMQ messages are persistent and ``mandatory``.

    The effect's headers are sent along; the effect id is also the correlation id. The
    recorded result: the JetStream stream and sequence (NATS), the stream entry id
    (Redis), the topic, partition and offset (Kafka).
    """

    def __init__(
        self, broker: Any, *, producer: str, tenant: str | None = None, **publish_options: Any
    ) -> None:
        MessageIdentity.parse(producer=producer, message_id="check", tenant=tenant)
        self.kind = _kind(broker)
        _check_options(self.kind, publish_options)
        self.broker = broker
        self.producer = producer
        self.tenant = tenant
        self.publish_options = publish_options
        self._connected_here = False
        self._streams: dict[str, str] = {}  # NATS: the stream that captures a subject

    async def deliver(self, effect: Effect, timeout: float) -> dict[str, Any]:
        if not self._connected_here and not _is_connected(self.broker):
            await self.broker.connect()
            self._connected_here = True
        headers = {**effect.headers, PRODUCER: self.producer, MESSAGE_ID: effect.effect_id}
        if self.tenant:
            headers[TENANT] = self.tenant
        options = {"correlation_id": effect.effect_id, **self.publish_options}
        if self.kind == "rabbit":
            return await self._rabbit(effect, headers, options, timeout)
        if self.kind == "nats":
            return await self._nats(effect, headers, options, timeout)
        result = await self.broker.publish(effect.payload, headers=headers, **options)
        if self.kind == "redis":
            return {"stream": options["stream"], "id": _text(result)}
        offset = getattr(result, "offset", -1)
        if offset is None or offset < 0:
            raise DeliveryError(
                "Kafka did not acknowledge the record (a producer with acks=0 gets no "
                "acknowledgement): nothing says the broker has it"
            )
        return {"topic": result.topic, "partition": result.partition, "offset": offset}

    async def _rabbit(
        self, effect: Effect, headers: dict[str, Any], options: dict[str, Any], timeout: float
    ) -> dict[str, Any]:
        options = {"persist": True, "mandatory": True, "timeout": timeout, **options}
        result = await self.broker.publish(effect.payload, headers=headers, **options)
        if problem := unconfirmed(result, self.broker):
            raise DeliveryError(problem)
        return {"published": True}

    async def _nats(
        self, effect: Effect, headers: dict[str, Any], options: dict[str, Any], timeout: float
    ) -> dict[str, Any]:
        options = {"timeout": timeout, **options}
        subject = str(options.get("subject", ""))
        if not options.get("stream"):
            options["stream"] = self._streams.get(subject) or await self._find_stream(subject)
        try:
            ack = await self.broker.publish(effect.payload, headers=headers, **options)
        except Exception:
            self._streams.pop(subject, None)  # deleted or replaced: found again next time
            raise
        if getattr(ack, "stream", None) is None:
            raise DeliveryError(f"JetStream did not acknowledge the publish to {subject!r}")
        return {"stream": ack.stream, "seq": ack.seq}

    async def _find_stream(self, subject: str) -> str:
        from nats.js.errors import NotFoundError

        jetstream = self.broker.config.connection_state.stream
        try:
            stream = str(await jetstream.find_stream_name_by_subject(subject))
        except NotFoundError:
            raise DeliveryError(
                f"no JetStream stream captures subject {subject!r}: core NATS would deliver "
                "the message to nobody and keep nothing; add the subject to a stream"
            ) from None
        self._streams[subject] = stream
        return stream

    async def aclose(self) -> None:
        if self._connected_here:
            self._connected_here = False
            await self.broker.stop()


def _kind(broker: Any) -> str:
    module = type(broker).__module__
    for package, kind in _KINDS.items():
        if module == package or module.startswith(package + "."):
            return kind
    raise ConfigurationError(
        "FastStreamDestination publishes through a RabbitBroker, RedisBroker, NatsBroker or "
        f"KafkaBroker (each tells when it has the message), not {type(broker).__name__}"
    )


def _check_options(kind: str, options: dict[str, Any]) -> None:
    for option, (value, why) in _REFUSED.get(kind, {}).items():
        if option in options and bool(options[option]) is value:
            raise ConfigurationError(f"FastStreamDestination refuses {option}={value}: {why}")
    if kind == "redis":
        if not options.get("stream") or options.get("channel") or options.get("list"):
            raise ConfigurationError(
                "FastStreamDestination on Redis publishes to a stream: pass stream=... (a "
                "pub/sub channel keeps nothing for a consumer that is away, and a list "
                "cannot hand a message back)"
            )
        if options.get("pipeline") is not None:
            raise ConfigurationError(
                "FastStreamDestination refuses pipeline=: the publish would return before "
                "Redis has the entry"
            )
    if kind == "nats" and not options.get("subject"):
        raise ConfigurationError("FastStreamDestination on NATS needs subject=...")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)


def _is_connected(broker: Any) -> bool:
    return bool(getattr(broker, "running", False) or getattr(broker, "_connection", None))
