"""OpenTelemetry traces of deliveries: one span per delivery, a child span per phase.

Opt-in (``InboxMiddleware(..., tracing=True)``, ``FastStreamInbox(..., tracing=True)``, or
a ``TracerProvider`` instead of True; extra ``otel``). A delivery's trace::

    inbox billing                  CONSUMER  consumer, producer, tenant, message id, hash
    │                                        scheme, attempt, decision, settlement, and
    │                                        over a database map the database's name
    ├── inbox.route                          (over a database map) the choice of database
    ├── inbox.claim                          decision, wait on a concurrent claim, attempt
    ├── inbox.handler                        (first seen only) the handler's own spans nest here
    ├── inbox.commit
    ├── inbox.publish quarantine   PRODUCER  (a conflict) or ``dead_letter``
    └── inbox.record failure                 a failed attempt counted; ``poison``,
                                             ``hand_back``, ``redelivery`` likewise

The delivery span's parent is the span current when the delivery starts (FastStream's
`TelemetryMiddleware` opens one per message), else the producer's context extracted from
the message: its headers (FastStream), its ``inbox_trace`` option (Dramatiq, stamped by
`inbox_middleware.dramatiq.StampTraceContext`). Its status comes from the settlement, not
from the exceptions an adapter raises to tell its framework: processed and duplicate
deliveries are not errors, nor is a hand-back because another delivery holds the claim;
a conflict (quarantined), a rejection (dead-lettered), a poison and any other hand-back
are.

Switched off (the default), opentelemetry is never imported, and each hook the executors
call costs one context-variable read. The trace id of a sampled delivery is written with
its claim (``consumer_inbox.trace_id``, in the same INSERT) for ``inbox-middleware
explain``, and given to the Prometheus metrics as an exemplar (OpenMetrics exposition).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from time import time_ns
from typing import TYPE_CHECKING, Any, Self, cast

from .._core.consumption import (
    CountFailure,
    CountHandBack,
    CountRedelivery,
    DeadLettered,
    Duplicate,
    HandedBack,
    MarkSent,
    Poisoned,
    Process,
    Processed,
    Publish,
    QuarantineConflict,
    Quarantined,
    RecordPoison,
    ResolveRoute,
    RunUnprotected,
    SendOutputs,
)
from .._core.exceptions import ClaimInProgress, ConfigurationError
from .._core.protocol import Claim, ClaimBatch

if TYPE_CHECKING:
    from .._core.consumption import Settlement

__all__ = [
    "OFF",
    "TRACE_OPTION",
    "NoTracing",
    "Tracing",
    "claim",
    "exemplar",
    "inject",
    "phase",
    "trace_id",
    "tracing_for",
]

TRACE_OPTION = "inbox_trace"
"""The Dramatiq message option carrying the producer's trace context (W3C headers)."""

_SCOPE = "inbox_middleware"
logger = logging.getLogger("inbox_middleware")
_warned_inert: set[str] = set()  # once per process, whichever adapter or consumer finds it

# The trace of the delivery this context is processing; None outside traced deliveries.
_current: contextvars.ContextVar[_Trace | None] = contextvars.ContextVar(
    "inbox_middleware.trace", default=None
)


def tracing_for(option: object) -> Tracing | NoTracing:
    """The adapters' ``tracing`` argument: False/None (off), True (the global tracer
    provider) or a ``TracerProvider``."""
    if option is None or option is False:
        return OFF
    if isinstance(option, Tracing):
        return option
    return Tracing(None if option is True else option)


class Tracing:
    """Spans for deliveries, from ``provider`` (None: the global tracer provider)."""

    def __init__(self, provider: Any = None) -> None:
        try:
            from opentelemetry import trace
        except ImportError:  # pragma: no cover - the extra is installed in development
            raise ConfigurationError(
                "tracing needs the OpenTelemetry API: run `pip install inbox-middleware[otel]`"
            ) from None
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self._trace, self._propagate = trace, propagate
        self._kinds = SpanKind
        self._status, self._codes = Status, StatusCode
        self.provider = provider
        self.tracer = (provider or trace.get_tracer_provider()).get_tracer(_SCOPE)
        self._checked = False

    def inert(self) -> str | None:
        """Why this tracing records nothing, or None: the OpenTelemetry API alone (the
        ``otel`` extra) only drops spans; an SDK ``TracerProvider`` records them."""
        from opentelemetry.trace import NoOpTracerProvider, ProxyTracerProvider

        provider = self.provider or self._trace.get_tracer_provider()
        if not isinstance(provider, ProxyTracerProvider | NoOpTracerProvider):
            return None
        try:
            import opentelemetry.sdk.trace  # noqa: F401
        except ImportError:
            return (
                "tracing is on but records nothing: the OpenTelemetry SDK is not installed "
                "(the otel extra brings only the API, which drops every span). Run `pip "
                "install opentelemetry-sdk` and set a TracerProvider with an exporter, or "
                "run the worker under opentelemetry-instrument"
            )
        where = (
            "the TracerProvider given is OpenTelemetry's no-op one"
            if self.provider
            else "no TracerProvider is set, so OpenTelemetry's global provider is a no-op"
        )
        return (
            f"tracing is on but records nothing: {where}, which drops every span. Set an "
            "SDK TracerProvider with an exporter (opentelemetry.trace.set_tracer_provider) "
            "before the worker starts, run it under opentelemetry-instrument, or pass "
            "tracing=<your TracerProvider>"
        )

    def warn_if_inert(self) -> None:
        """At a worker's start (and at the first traced delivery, where no start-up hook
        runs): warn once per process when `inert`."""
        if self._checked:
            return
        self._checked = True
        problem = self.inert()
        if problem is not None and problem not in _warned_inert:
            _warned_inert.add(problem)
            logger.warning(problem)

    def delivery(self, consumer: str, carrier: Mapping[str, Any] | None) -> _Trace:
        """The span of one delivery to ``consumer``, as a context manager: under the
        current span when there is one, else under the context ``carrier`` holds."""
        if not self._checked:
            self.warn_if_inert()
        parent = None
        if not self._trace.get_current_span().get_span_context().is_valid and carrier:
            try:
                parent = self._propagate.extract(carrier, getter=cast(Any, _GETTER))
            except Exception:  # a malformed carrier: a trace of its own, never a failure
                parent = None
        span = self.tracer.start_span(
            f"inbox {consumer}",
            context=parent,
            kind=self._kinds.CONSUMER,
            attributes={"inbox.consumer": consumer},
        )
        return _Trace(self, span)


class _Trace:
    """One delivery's span while it is processed (see `Tracing.delivery`)."""

    def __init__(self, tracing: Tracing, span: Any) -> None:
        self.tracing = tracing
        self.span = span
        self._tokens: tuple[Any, Any] | None = None
        context = span.get_span_context()
        self.trace_id = format(context.trace_id, "032x") if context.trace_flags.sampled else None

    def __enter__(self) -> _Trace:
        from opentelemetry import context

        attached = context.attach(self.tracing._trace.set_span_in_context(self.span))
        self._tokens = (attached, _current.set(self))
        return self

    def __exit__(self, *exc: object) -> None:
        # The adapters tell their framework with exceptions (SkipMessage, AckMessage, a
        # re-raised failure): the status is the settlement's (`settled`), not theirs.
        from opentelemetry import context

        assert self._tokens is not None
        attached, current = self._tokens
        _current.reset(current)
        context.detach(attached)
        self.span.end()

    @property
    def observer(self) -> _Trace:
        """What the trampoline tells of the consumption core's steps (`consumption.drive`)."""
        return self

    def started(self, op: Any) -> Any:
        """A span around each publish and record."""
        return _quietly(self._op_span, op)

    def ended(self, op: Any, span: Any, answer: Any, error: BaseException | None) -> None:
        if span is not None:
            if error is not None:
                _quietly(_failed, self.tracing, span, error)
            _quietly(span.end)
        if error is None:
            _quietly(self._learn, op, answer)

    def finished(self, result: Any) -> None:
        pass  # the adapter names the settlement (`settled`), once it is final

    def _op_span(self, op: Any) -> Any:
        span_kind: Any = None
        attributes: dict[str, Any] = {}
        match op:
            case Process(delivery=delivery):
                self._identify(delivery)
                return None
            case RunUnprotected():
                self.span.set_attribute("inbox.unprotected", True)
                return None
            case Publish(route=route, details=details):
                name, span_kind = f"inbox.publish {route.value}", self.tracing._kinds.PRODUCER
                attributes = {"inbox.reason": details.get("reason", "")}
            case SendOutputs():
                name, span_kind = "inbox.publish outputs", self.tracing._kinds.PRODUCER
            case ResolveRoute():
                name = "inbox.route"  # the database is the delivery span's (`database`)
            case _:
                name = f"inbox.record {_RECORDS.get(type(op), type(op).__name__)}"
        identified = getattr(op, "delivery", None)
        if identified is not None:
            self._identify(identified)
        return self.tracing.tracer.start_span(
            name, kind=span_kind or self.tracing._kinds.INTERNAL, attributes=attributes
        )

    def _identify(self, delivery: Any) -> None:
        identity = delivery.identity
        self.span.set_attributes(
            {
                "inbox.producer": identity.producer,
                "inbox.tenant": identity.tenant,
                "inbox.message_id": identity.message_id,
                "messaging.message.id": identity.message_id,
                "inbox.hash_scheme": delivery.payload_hash.scheme,
            }
        )

    def _learn(self, op: Any, answer: Any) -> None:
        if isinstance(op, Process):
            self.span.set_attribute("inbox.decision", str(answer.verdict.decision))
            self.span.set_attribute("inbox.attempt", answer.attempts)
        elif isinstance(op, CountFailure) and isinstance(answer, int):
            self.span.set_attribute("inbox.failed_attempts", answer)
        elif isinstance(op, ResolveRoute) and isinstance(answer, str):
            self.database(answer)

    def database(self, name: str) -> None:
        """The delivery went to ``name``, the map's name of its database (over many
        databases; never the tenant, which `_identify` gives as ``inbox.tenant``)."""
        _quietly(self.span.set_attribute, "inbox.database", name)

    def batch(self, size: int) -> None:
        """This delivery is a batch of ``size`` messages, settled as a whole."""
        _quietly(self.span.set_attribute, "inbox.batch_size", size)

    def settled(self, settlement: Settlement) -> None:
        """Name the settlement on the span and set its status from it."""
        name = _SETTLEMENTS.get(type(settlement), type(settlement).__name__)
        attributes: dict[str, Any] = {"inbox.settlement": name}
        span, codes = self.span, self.tracing._codes
        problem: str | None = None
        match settlement:
            case Quarantined(record=record):
                attributes["inbox.quarantine_id"] = record.id
                problem = "identity conflict: quarantined"
            case Poisoned(reason=reason, record=record, error=error):
                attributes |= {"inbox.reason": reason, "inbox.poison_id": record.id}
                problem = f"poisoned ({reason}): {error}"
            case DeadLettered(reason=reason, error=error):
                attributes["inbox.reason"] = reason
                problem = f"dead-lettered ({reason}): {error}"
            case HandedBack(error=error, counted=counted):
                attributes["inbox.counted"] = counted
                span.record_exception(error)
                if not isinstance(error, ClaimInProgress):
                    problem = f"handed back: {type(error).__name__}: {error}"
        span.set_attributes(attributes)
        if problem is not None:
            span.set_status(self.tracing._status(codes.ERROR, problem))


class _Phase:
    """A child span of the current delivery, current while it lasts."""

    __slots__ = ("_scope", "span", "trace")

    def __init__(self, trace: _Trace, name: str, attributes: dict[str, Any]) -> None:
        self.trace = trace
        self.span = trace.tracing.tracer.start_span(name, attributes=attributes)
        self._scope: AbstractContextManager[Any] | None = None

    def __enter__(self) -> Self:
        self._scope = self.trace.tracing._trace.use_span(
            self.span, end_on_exit=False, record_exception=False, set_status_on_exception=False
        )
        self._scope.__enter__()
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        assert self._scope is not None
        self._scope.__exit__(kind, error, tb)
        if error is not None:
            _failed(self.trace.tracing, self.span, error)
        self.span.end()


class _Claim(_Phase):
    """The claim's span: its decision, and how long the INSERT waited."""

    __slots__ = ("_waiting",)

    def __init__(self, trace: _Trace, attempt: int) -> None:
        super().__init__(trace, "inbox.claim", {"inbox.attempt": attempt})
        self._waiting: int | None = None

    @property
    def observer(self) -> _Claim:
        """What the trampoline tells of the claim protocol's steps (`consumption.drive`)."""
        return self

    def started(self, step: Any) -> Any:
        """Time the INSERT: it blocks while a concurrent delivery holds the row (until
        that one commits or rolls back, or lock_timeout)."""
        if isinstance(step, Claim | ClaimBatch):
            self._waiting = time_ns()
        return None

    def ended(self, step: Any, started: Any, answer: Any, error: BaseException | None) -> None:
        _quietly(self._waited)

    def finished(self, verdict: Any) -> None:
        _quietly(self._decided, verdict)

    def _waited(self) -> None:
        if self._waiting is not None:
            seconds = (time_ns() - self._waiting) / 1e9
            self.span.set_attribute("inbox.claim.wait_seconds", round(seconds, 6))
            self._waiting = None

    def _decided(self, verdict: Any) -> None:
        if isinstance(verdict, tuple):
            self.span.set_attribute("inbox.decisions", [str(v.decision) for v in verdict])
        else:
            self.span.set_attribute("inbox.decision", str(verdict.decision))

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        self._waited()  # an INSERT that failed (lock_timeout) waited all along
        super().__exit__(kind, error, tb)


class _NoClaim:
    """`claim` outside a traced delivery: nothing at all."""

    __slots__ = ()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    observer = None


class _NoTrace(_NoClaim):
    """`Tracing.delivery` when tracing is off."""

    __slots__ = ()

    trace_id = None

    def batch(self, size: int) -> None:
        pass

    def database(self, name: str) -> None:
        pass

    def settled(self, settlement: object) -> None:
        return None


class NoTracing:
    """Tracing switched off: every delivery gets the same inert trace."""

    def warn_if_inert(self) -> None:
        """Off on purpose: nothing to warn about."""

    def delivery(self, consumer: str, carrier: object) -> _NoTrace:
        return _NO_TRACE

    def __bool__(self) -> bool:
        return False


OFF = NoTracing()
_NO_TRACE = _NoTrace()
_NO_CLAIM = _NoClaim()
_NOTHING: nullcontext[None] = nullcontext()


# -- hooks for the executors and the metrics ----------------------------------------------


def phase(name: str, **attributes: Any) -> AbstractContextManager[Any]:
    """A child span of the current delivery named ``name`` (``inbox.handler``,
    ``inbox.commit``); a shared no-op outside a traced delivery."""
    trace = _current.get()
    return _NOTHING if trace is None else _Phase(trace, name, attributes)


def claim(attempt: int) -> _Claim | _NoClaim:
    """The claim's span for transaction attempt ``attempt``; wrap its steps with
    ``.steps(...)``. A shared no-op outside a traced delivery."""
    trace = _current.get()
    return _NO_CLAIM if trace is None else _Claim(trace, attempt)


def trace_id() -> str | None:
    """The trace id (32 hex digits) of the delivery being processed, when it is sampled:
    what the claim stores."""
    trace = _current.get()
    return None if trace is None else trace.trace_id


def exemplar() -> dict[str, str] | None:
    """The exemplar for a metric sample recorded while a sampled delivery is traced."""
    trace = _current.get()
    if trace is None or trace.trace_id is None:
        return None
    span_id = format(trace.span.get_span_context().span_id, "016x")
    return {"trace_id": trace.trace_id, "span_id": span_id}


def inject(carrier: dict[str, str]) -> dict[str, str]:
    """Write the current trace context into ``carrier`` (W3C ``traceparent``, through the
    global propagator) and return it."""
    from opentelemetry import propagate

    propagate.inject(carrier)
    return carrier


def _quietly(call: Any, *args: Any) -> Any:
    """Tracing never changes a settlement: a failure of its own is dropped."""
    try:
        return call(*args)
    except Exception:
        return None


def _failed(tracing: Tracing, span: Any, error: BaseException) -> None:
    span.record_exception(error)
    span.set_status(tracing._status(tracing._codes.ERROR, f"{type(error).__name__}: {error}"))


class _Getter:
    """Reads a carrier whose values may be bytes (FastStream headers on some brokers)."""

    def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            return None
        if isinstance(value, bytes | bytearray):
            value = bytes(value).decode("latin-1")
        return [value] if isinstance(value, str) else None

    def keys(self, carrier: Mapping[str, Any]) -> list[str]:
        return [key for key in carrier if isinstance(key, str)]


_GETTER = _Getter()

_RECORDS: dict[type, str] = {
    CountFailure: "failure",
    CountHandBack: "hand_back",
    CountRedelivery: "redelivery",
    RecordPoison: "poison",
    QuarantineConflict: "quarantine",
    MarkSent: "recovered",
}
_SETTLEMENTS: dict[type, str] = {
    Processed: "processed",
    Duplicate: "duplicate",
    Quarantined: "quarantined",
    DeadLettered: "dead_lettered",
    Poisoned: "poisoned",
    HandedBack: "handed_back",
}
