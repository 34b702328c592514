-- Outputs (SQLite). See the PostgreSQL migration of the same number.
CREATE TABLE IF NOT EXISTS ${inbox_outputs} (
    consumer_name  TEXT NOT NULL,
    producer_name  TEXT NOT NULL,
    tenant         TEXT NOT NULL DEFAULT '',
    message_id     TEXT NOT NULL,
    body           BLOB,
    content_type   TEXT,
    headers        TEXT NOT NULL DEFAULT '{}',
    created_at     DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP,
    PRIMARY KEY (consumer_name, producer_name, tenant, message_id)
);
