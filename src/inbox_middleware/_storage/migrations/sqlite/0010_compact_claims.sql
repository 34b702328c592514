-- The compact claim's tables (SQLite). See the PostgreSQL migration of the same number.
-- An embedded inbox claims in the library's table: these exist so that both dialects share
-- their tables and versions.
CREATE TABLE IF NOT EXISTS ${inbox_claims} (
    identity        CHAR(32) NOT NULL PRIMARY KEY,
    payload_digest  CHAR(32) NOT NULL,
    processed_at    DATETIME NOT NULL,
    hash_scheme     SMALLINT NOT NULL
);
CREATE TABLE IF NOT EXISTS ${inbox_layout} (
    name        TEXT     NOT NULL PRIMARY KEY,
    value       TEXT     NOT NULL,
    changed_at  DATETIME NOT NULL,
    changed_by  TEXT
);
