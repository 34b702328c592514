-- Failure handling, operator decisions and retention (SQLite). See the PostgreSQL
-- migration of the same number for what each table and column means.
CREATE TABLE IF NOT EXISTS ${inbox_attempts} (
    consumer_name    TEXT NOT NULL,
    producer_name    TEXT NOT NULL,
    tenant           TEXT NOT NULL DEFAULT '',
    message_id       TEXT NOT NULL,
    attempts         INTEGER NOT NULL DEFAULT 0,
    redeliveries     INTEGER NOT NULL DEFAULT 0,
    first_failure_at DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP,
    last_failure_at  DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP,
    last_error       TEXT,
    PRIMARY KEY (consumer_name, producer_name, tenant, message_id)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS ${inbox_poison} (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer_name    TEXT NOT NULL,
    producer_name    TEXT NOT NULL,
    tenant           TEXT NOT NULL DEFAULT '',
    message_id       TEXT NOT NULL,
    payload_sha256   TEXT NOT NULL,
    hash_scheme      TEXT NOT NULL,
    payload          BLOB,
    payload_format   TEXT NOT NULL DEFAULT '',
    headers          JSON NOT NULL DEFAULT '{}',
    source           TEXT NOT NULL DEFAULT '',
    reason_code      TEXT NOT NULL,
    error            TEXT,
    attempts         INTEGER NOT NULL DEFAULT 1,
    first_failure_at DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP,
    last_failure_at  DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP,
    handler_version  TEXT NOT NULL DEFAULT '',
    decision         TEXT NOT NULL DEFAULT 'pending'
        CHECK (decision IN ('pending', 'redriven', 'discarded', 'recovered')),
    decided_by       TEXT,
    decided_at       DATETIME,
    decision_note    TEXT,
    operation_id     TEXT,
    recovered_at     DATETIME,
    UNIQUE (consumer_name, producer_name, tenant, message_id)
);

CREATE INDEX IF NOT EXISTS "${prefix}inbox_poison_pending_idx"
    ON ${inbox_poison} (last_failure_at) WHERE decision = 'pending';

ALTER TABLE ${inbox_quarantine} ADD COLUMN payload_format TEXT NOT NULL DEFAULT '';
ALTER TABLE ${inbox_quarantine} ADD COLUMN operation_id TEXT;
ALTER TABLE ${inbox_quarantine} ADD COLUMN accepted_message_id TEXT;
ALTER TABLE ${inbox_quarantine} ADD COLUMN recovered_at DATETIME;

CREATE TABLE IF NOT EXISTS ${inbox_retention} (
    consumer_name     TEXT PRIMARY KEY,
    scenarios         JSON NOT NULL,
    minimum_seconds   INTEGER NOT NULL,
    dominant_scenario TEXT NOT NULL,
    updated_at        DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP,
    updated_by        TEXT
);

CREATE INDEX IF NOT EXISTS "${prefix}consumer_inbox_processed_at_idx"
    ON ${consumer_inbox} (processed_at);  -- SQLite has no BRIN: a plain index
