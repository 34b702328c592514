"""Scripts of answers drawn at random: every one ends in exactly one settlement, and no
settlement claims what its operations did not do.

The table (`test_settlement_table`) says what each arrow decides; this says what holds
for every path through the core, whatever the database and the broker answer:

- the core never lets an `Exception` out (settlement is total) and performs a bounded
  number of operations;
- an acknowledging settlement (processed, duplicate) follows a `Process` that answered,
  and a quarantine follows its confirmed publish;
- a dead letter or a poison settlement follows a confirmed dead-letter publish, and a
  poison settlement follows its recorded row: nothing leaves the broker without a record
  of why.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from inbox_middleware._core.consumption import (
    Arrival,
    CountFailure,
    CountHandBack,
    CountRedelivery,
    DeadLettered,
    Duplicate,
    HandBackRequested,
    HandedBack,
    LoadOutputs,
    Poisoned,
    Process,
    Processed,
    Publish,
    Quarantined,
    RecordPoison,
    RedeliveryCount,
    RejectRequested,
    RetryBudget,
    Route,
    RunUnprotected,
    Unfit,
)
from inbox_middleware._core.exceptions import (
    DatabaseUnavailable,
    HandlerTransactionError,
    InboxError,
    InvalidIdentity,
    MissingIdentity,
    PayloadNotHashable,
    PermanentError,
    SchemaError,
    TransientError,
)
from inbox_middleware._core.outputs import Output
from inbox_middleware._core.policy import ConsumerPolicy
from inbox_middleware._core.protocol import Decision, QuarantineRecord, StoredClaim, Verdict

from .script import Poison, Script, delivery, run

STORED = StoredClaim("ab" * 32, "v1", "", datetime(2026, 1, 1, tzinfo=UTC))

FAILURES = st.sampled_from(
    [
        ValueError("boom"),
        ConnectionError("refused"),
        TransientError(),
        DatabaseUnavailable(),
        SchemaError(),
        InboxError(),
        PermanentError("bad"),
        HandlerTransactionError(),
    ]
)
HANDLER_FAILURES = FAILURES | st.sampled_from(
    [Unfit("bad body"), RejectRequested(), HandBackRequested(1.0), KeyError("k")]
)
VERDICTS = st.sampled_from(
    [
        Verdict(Decision.FIRST),
        Verdict(Decision.DUPLICATE, STORED),
        Verdict(Decision.DUPLICATE, STORED, shadow=True),
        Verdict(Decision.CONFLICT, STORED, quarantine=QuarantineRecord(7, 1)),
    ]
)


def _answers(ok: st.SearchStrategy[Any], failures: st.SearchStrategy[Any] = FAILURES) -> Any:
    return st.lists(ok | failures, min_size=1, max_size=3)


SCRIPTS = st.fixed_dictionaries(
    {
        Process: _answers(VERDICTS, HANDLER_FAILURES),
        RunUnprotected: _answers(st.just("raw"), HANDLER_FAILURES),
        CountRedelivery: _answers(
            st.builds(
                RedeliveryCount,
                st.integers(0, 30),
                st.integers(0, 10),
                st.integers(0, 10),
                st.booleans(),
            )
        ),
        CountFailure: _answers(st.integers(1, 12)),
        CountHandBack: _answers(st.none()),
        RecordPoison: _answers(st.builds(Poison, st.integers(1, 99), st.integers(1, 12))),
        LoadOutputs: _answers(st.none() | st.just(Output(b"1", "json"))),
        Publish: _answers(st.none()),
    }
)

OLD = datetime.now(UTC) - timedelta(days=30)


@st.composite
def arrivals(draw: st.DrawFn) -> Arrival:
    problem = draw(
        st.none() | st.sampled_from([MissingIdentity(), InvalidIdentity("x"), PayloadNotHashable()])
    )
    produced = draw(st.sampled_from([None, OLD, datetime.now(UTC)]))
    return Arrival(
        delivery=None if problem else delivery(produced_at=produced),
        problem=problem,
        deliveries=draw(st.none() | st.integers(1, 30)),
        redelivered=draw(st.booleans()),
        repair_marker=draw(st.sampled_from([None, "poison:3", "quarantine:x"])),
        retry_budget=draw(st.sampled_from([None, RetryBudget(0, 0), RetryBudget(0, None)])),
        outcomes_redeliver=draw(st.booleans()),
        keeps_outputs=draw(st.booleans()),
    )


@st.composite
def policies(draw: st.DrawFn) -> ConsumerPolicy:
    return ConsumerPolicy(
        missing_identity=draw(st.sampled_from(["reject", "process"])),
        permanent_errors=draw(st.sampled_from([(), (KeyError,)])),
        max_attempts=draw(st.none() | st.integers(1, 12)),
        redelivery_limit=draw(st.none() | st.integers(0, 12)),
        retention_window=draw(st.sampled_from([None, timedelta(days=7)])),
        expired_redelivery=draw(st.sampled_from(["reject", "process"])),
    )


def _answered(script: Script, kind: type, **attrs: Any) -> bool:
    return any(
        isinstance(op, kind)
        and not raised
        and all(getattr(op, name) == value for name, value in attrs.items())
        for op, raised in zip(script.performed, script.raised, strict=True)
    )


@settings(max_examples=500, deadline=None)
@given(arrival=arrivals(), policy=policies(), answers=SCRIPTS)
def test_core__every_script_ends_in_one_settlement_that_its_operations_support(
    arrival: Arrival, policy: ConsumerPolicy, answers: dict[type, list[Any]]
) -> None:
    script = Script(answers)
    settled = run(arrival, script, policy)

    assert isinstance(
        settled, Processed | Duplicate | Quarantined | DeadLettered | Poisoned | HandedBack
    )
    assert len(script.performed) <= 6
    match settled:
        case Processed(verdict=None):
            assert _answered(script, RunUnprotected)
        case Processed():
            assert _answered(script, Process)
            assert settled.verdict is not None and settled.verdict.runs_handler
        case Duplicate():
            assert _answered(script, Process)
            if arrival.keeps_outputs:
                assert _answered(script, LoadOutputs)
        case Quarantined():
            assert _answered(script, Publish, route=Route.QUARANTINE)
        case DeadLettered() | Poisoned():
            assert _answered(script, Publish, route=Route.DEAD_LETTER)
            last = script.performed[-1]
            assert isinstance(last, Publish) and not script.raised[-1]
            if isinstance(settled, Poisoned):
                assert _answered(script, RecordPoison)
        case HandedBack():
            pass
