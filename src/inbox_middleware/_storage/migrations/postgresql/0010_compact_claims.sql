-- The compact claim (``Inbox(..., claims="compact")``): a remembered message in about 120
-- bytes instead of about 290. identity: 16 bytes, the time a UUIDv7 or ULID id carries
-- then a digest of the identity, or the digest alone for other ids; payload_digest: the
-- first 16 bytes of the payload's SHA-256; hash_scheme: two bytes of the scheme name's
-- SHA-256; processed_at: the claim's time, for the purge. Columns in the order that wastes
-- no byte on alignment. The same autovacuum options as the library's claims table
-- (migration 9), for a table the purge empties from the front.
CREATE TABLE IF NOT EXISTS ${inbox_claims} (
    identity        uuid        NOT NULL PRIMARY KEY,
    payload_digest  uuid        NOT NULL,
    processed_at    timestamptz NOT NULL DEFAULT now(),
    hash_scheme     smallint    NOT NULL
) WITH (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.02
);
-- Where the workers claim: the row named 'claims' holds 'compact' once the operator has
-- recorded that every worker claims in the compact table (``inbox-middleware claims
-- switch``); until then workers configured for it claim in both tables.
CREATE TABLE IF NOT EXISTS ${inbox_layout} (
    name        text        NOT NULL PRIMARY KEY,
    value       text        NOT NULL,
    changed_at  timestamptz NOT NULL,
    changed_by  text
);
