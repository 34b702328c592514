-- The transactional outbox (SQLite: effects are recorded here, dispatched from
-- PostgreSQL only). See the PostgreSQL migration of the same number for the columns.

CREATE TABLE IF NOT EXISTS ${message_outbox} (
    effect_id       TEXT     NOT NULL PRIMARY KEY,
    destination     TEXT     NOT NULL,
    payload         JSON     NOT NULL,
    headers         JSON     NOT NULL DEFAULT '{}',
    status          TEXT     NOT NULL DEFAULT 'pending'
        CHECK (status IN ('pending', 'dispatched', 'failed')),
    attempts        INTEGER  NOT NULL DEFAULT 0,
    next_attempt_at DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP,
    leased_until    DATETIME,
    lease_token     TEXT,
    last_error      TEXT,
    created_at      DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP,
    dispatched_at   DATETIME,
    remote_result   JSON
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS "${prefix}message_outbox_due_idx"
    ON ${message_outbox} (next_attempt_at) WHERE status = 'pending';

CREATE INDEX IF NOT EXISTS "${prefix}message_outbox_failed_idx"
    ON ${message_outbox} (created_at) WHERE status = 'failed';
