-- The inbox and its quarantine (SQLite: the embedded, single-writer variant).
-- See the PostgreSQL migration of the same number for what each column means.

CREATE TABLE IF NOT EXISTS ${consumer_inbox} (
    consumer_name   TEXT NOT NULL,
    producer_name   TEXT NOT NULL,
    tenant          TEXT NOT NULL DEFAULT '',
    message_id      TEXT NOT NULL,
    payload_sha256  TEXT NOT NULL,
    hash_scheme     TEXT NOT NULL,
    handler_version TEXT NOT NULL DEFAULT '',
    produced_at     DATETIME,
    received_at     DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP,
    processed_at    DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP,
    PRIMARY KEY (consumer_name, producer_name, tenant, message_id)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS ${inbox_quarantine} (
    id                 INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer_name      TEXT NOT NULL,
    producer_name      TEXT NOT NULL,
    tenant             TEXT NOT NULL DEFAULT '',
    message_id         TEXT NOT NULL,
    stored_sha256      TEXT NOT NULL,
    conflicting_sha256 TEXT NOT NULL,
    hash_scheme        TEXT NOT NULL,
    source             TEXT NOT NULL DEFAULT '',
    payload            BLOB,
    headers            JSON NOT NULL DEFAULT '{}',
    reason_code        TEXT NOT NULL DEFAULT 'identity_conflict',
    attempts           INTEGER NOT NULL DEFAULT 1,
    first_seen_at      DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP,
    last_seen_at       DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP,
    handler_version    TEXT NOT NULL DEFAULT '',
    decision           TEXT NOT NULL DEFAULT 'pending'
        CHECK (decision IN ('pending', 'accepted', 'discarded', 'redriven')),
    decided_by         TEXT,
    decided_at         DATETIME,
    decision_note      TEXT,
    UNIQUE (consumer_name, producer_name, tenant, message_id, conflicting_sha256)
);

CREATE INDEX IF NOT EXISTS "${prefix}inbox_quarantine_pending_idx"
    ON ${inbox_quarantine} (last_seen_at) WHERE decision = 'pending';
