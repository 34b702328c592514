-- Counts (SQLite). See the PostgreSQL migration of the same number.
CREATE TABLE IF NOT EXISTS ${inbox_counts} (
    worker         TEXT NOT NULL,
    consumer_name  TEXT NOT NULL,
    outcome        TEXT NOT NULL,
    count          INTEGER NOT NULL,
    since          DATETIME NOT NULL,
    updated_at     DATETIME NOT NULL,
    PRIMARY KEY (worker, consumer_name, outcome)
);
