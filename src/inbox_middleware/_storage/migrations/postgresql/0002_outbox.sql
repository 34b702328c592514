-- The transactional outbox.
--
-- A handler records an intended external effect (an email, an HTTP call, a message to
-- another service) in the same transaction as its domain writes; a dispatcher delivers
-- it afterwards, outside any transaction, with effect_id as the idempotency key.
--
-- status is 'pending' until a delivery succeeds ('dispatched') or the attempts run out
-- ('failed'). A dispatcher leases a pending effect by setting lease_token, leased_until
-- and next_attempt_at = leased_until, and counting the attempt: an effect whose
-- dispatcher died becomes due again when its lease ends. A result is recorded only
-- while its lease_token still holds.

CREATE TABLE IF NOT EXISTS ${message_outbox} (
    effect_id       text        PRIMARY KEY,
    destination     text        NOT NULL,
    payload         jsonb       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}',
    status          text        NOT NULL DEFAULT 'pending',
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    leased_until    timestamptz,
    lease_token     text,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    dispatched_at   timestamptz,
    remote_result   jsonb,
    CONSTRAINT "${prefix}message_outbox_status_check"
        CHECK (status IN ('pending', 'dispatched', 'failed'))
);

-- The dispatcher's query: due pending effects, oldest first.
CREATE INDEX IF NOT EXISTS "${prefix}message_outbox_due_idx"
    ON ${message_outbox} (next_attempt_at) WHERE status = 'pending';

-- What operators look at: the effects that ran out of attempts.
CREATE INDEX IF NOT EXISTS "${prefix}message_outbox_failed_idx"
    ON ${message_outbox} (created_at) WHERE status = 'failed';
