"""A scripted ``perform`` for the settlement core: answers and exceptions per operation.

The core yields operations and receives their answers (or their exceptions); here a
script stands in for the adapter's I/O, the way h11's tests feed a `Connection` events
with no socket. Each operation type has a queue of answers: an exception instance is
raised, a `Verdict` (or a whole `Committed`) answers `Process` as storage does (calling the
hook that runs after the claim and before the handler), a `BatchCommitted` answers
`ProcessBatch` likewise (raising the refusal of an expired message first seen), anything
else is returned as it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from inbox_middleware._core.consumption import (
    Arrival,
    Op,
    Process,
    ProcessBatch,
    Settlement,
    drive,
    drive_async,
    first_seen_refusal,
)
from inbox_middleware._core.identity import MessageIdentity, PayloadHash
from inbox_middleware._core.policy import ConsumerPolicy
from inbox_middleware._core.protocol import Decision, Delivery, Verdict
from inbox_middleware._storage import Committed
from inbox_middleware._storage.base import BatchCommitted

__all__ = ["Poison", "Script", "delivery", "run", "run_async"]


@dataclass(frozen=True)
class Poison:
    """What storage answers for `RecordPoison` (a `PoisonRecord`'s ``id``, ``attempts``,
    and whether it was written recovered)."""

    id: int
    attempts: int
    recovered: bool = False


def delivery(*, produced_at: datetime | None = None, shadow: bool = False) -> Delivery:
    return Delivery(
        consumer="billing",
        identity=MessageIdentity("orders", "ord-1", produced_at=produced_at),
        payload_hash=PayloadHash("v1", "ab" * 32),
        source="orders.q",
        received_at=datetime(2026, 1, 1, tzinfo=UTC),
        shadow=shadow,
    )


@dataclass
class Script:
    """Answers per operation type, in order; the last answer of a queue repeats."""

    answers: Mapping[type, Sequence[Any]]
    performed: list[Op] = field(default_factory=list)
    raised: list[bool] = field(default_factory=list)
    """Per performed operation: whether it raised (the core received an exception)."""
    result: Any = "handler result"
    attempts: int = 1

    def __call__(self, op: Op) -> Any:
        self.performed.append(op)
        self.raised.append(True)
        queue = self.answers.get(type(op))
        if not queue:
            raise AssertionError(f"the core performed {op!r}, which the script does not answer")
        seen = sum(1 for done in self.performed if type(done) is type(op))
        answer = queue[min(seen, len(queue)) - 1]
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(op, Process) and isinstance(answer, Committed):
            _refuse(op, answer.verdict)
            self.raised[-1] = False
            return answer
        if isinstance(op, ProcessBatch) and isinstance(answer, BatchCommitted):
            refused = first_seen_refusal(op, answer.verdicts)  # as the batch's body does
            if refused is not None:
                raise refused
            self.raised[-1] = False
            return answer
        if isinstance(op, Process) and isinstance(answer, Verdict):
            _refuse(op, answer)  # as storage does, after the claim, in the transaction
            result = self.result if answer.runs_handler else None
            self.raised[-1] = False
            return Committed(answer, result, self.attempts)
        self.raised[-1] = False
        return answer

    @property
    def names(self) -> list[str]:
        return [type(op).__name__ for op in self.performed]


def _refuse(op: Process, verdict: Verdict) -> None:
    if op.refuse_first_seen is not None and verdict.decision is Decision.FIRST:
        raise op.refuse_first_seen


def run(arrival: Arrival, script: Script, policy: ConsumerPolicy | None = None) -> Settlement:
    from inbox_middleware._core.consumption import settle_steps

    return drive(settle_steps(arrival, policy or ConsumerPolicy()), script)


def run_async(arrival: Arrival, script: Script, policy: ConsumerPolicy | None = None) -> Settlement:
    from inbox_middleware._core.consumption import settle_steps

    async def perform(op: Op) -> Any:
        return script(op)

    steps = settle_steps(arrival, policy or ConsumerPolicy())
    return asyncio.run(drive_async(steps, perform))
