"""The reason codes the library records are stable: they are stored in
``inbox_poison.reason_code``, used as metric labels and as CLI filters."""

from __future__ import annotations

from inbox_middleware._core.consumption import (
    EXPIRED_REDELIVERY,
    HANDLER_REJECTED,
    HANDLER_TRANSACTION,
    INBOX_ERROR,
    REDELIVERY_LIMIT,
    RETRIES_EXHAUSTED,
)
from inbox_middleware._core.outputs import OUTPUTS_UNDELIVERABLE, RESULT_UNSTORABLE
from inbox_middleware._core.protocol import ReasonCode


def test_reason_codes__values_are_the_stored_strings() -> None:
    assert {code.name: code.value for code in ReasonCode} == {
        "RETRIES_EXHAUSTED": "retries_exhausted",
        "REDELIVERY_LIMIT": "redelivery_limit",
        "EXPIRED_REDELIVERY": "expired_redelivery",
        "HANDLER_REJECTED": "handler_rejected",
        "HANDLER_TRANSACTION": "handler_transaction",
        "INBOX_ERROR": "inbox_error",
        "OUTPUTS_UNDELIVERABLE": "outputs_undeliverable",
        "RESULT_UNSTORABLE": "result_unstorable",
        "IDENTITY_CONFLICT": "identity_conflict",
    }


def test_reason_codes__are_text_wherever_they_go() -> None:
    # Stored, labelled and compared as plain strings.
    assert ReasonCode.INBOX_ERROR == "inbox_error"
    assert f"{ReasonCode.INBOX_ERROR}" == "inbox_error"
    assert type(str(ReasonCode.INBOX_ERROR)) is str


def test_reason_codes__the_older_constants_are_the_same_codes() -> None:
    assert RETRIES_EXHAUSTED is ReasonCode.RETRIES_EXHAUSTED
    assert REDELIVERY_LIMIT is ReasonCode.REDELIVERY_LIMIT
    assert EXPIRED_REDELIVERY is ReasonCode.EXPIRED_REDELIVERY
    assert HANDLER_REJECTED is ReasonCode.HANDLER_REJECTED
    assert HANDLER_TRANSACTION is ReasonCode.HANDLER_TRANSACTION
    assert INBOX_ERROR is ReasonCode.INBOX_ERROR
    assert OUTPUTS_UNDELIVERABLE is ReasonCode.OUTPUTS_UNDELIVERABLE
    assert RESULT_UNSTORABLE is ReasonCode.RESULT_UNSTORABLE
