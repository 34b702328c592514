-- The compact claim (``claims="compact"``): a remembered message in about 120 bytes
-- instead of about 290. identity: 16 bytes, the time a UUIDv7 or ULID id carries (6 bytes
-- of milliseconds; zeros for other ids) then 10 bytes of a digest of the identity;
-- payload_digest: the first 16 bytes of the payload's SHA-256; hash_scheme: two bytes of
-- the scheme name's SHA-256; processed_at: the claim's time, for the purge. Columns in the
-- order that wastes no byte on alignment.
--
-- Partitioned by range of the key, that is by the time the id carries: an hour a partition
-- (``${prefix}inbox_claims_YYYYMMDDHH``, made ahead by ``inbox-middleware claims prepare``
-- and by the purge, which empties those past the retention window); the ids without a
-- time in ``${prefix}inbox_claims_untimed``; any other key (an id whose hour has no
-- partition) in the default partition, ``${prefix}inbox_claims_other``. The key is the
-- partition key, so the primary key is unique across every partition: no message is
-- claimed twice, whatever partitions exist. The two lasting partitions are purged row by
-- row, with the library's claims table's autovacuum options (migration 9).
CREATE TABLE IF NOT EXISTS ${inbox_claims} (
    identity        uuid        NOT NULL,
    payload_digest  uuid        NOT NULL,
    processed_at    timestamptz NOT NULL DEFAULT now(),
    hash_scheme     smallint    NOT NULL,
    PRIMARY KEY (identity)
) PARTITION BY RANGE (identity);
CREATE TABLE IF NOT EXISTS ${inbox_claims_untimed} PARTITION OF ${inbox_claims}
    FOR VALUES FROM (MINVALUE) TO ('00000000-0001-0000-0000-000000000000')
    WITH (
        autovacuum_vacuum_scale_factor = 0.01,
        autovacuum_vacuum_threshold = 10000,
        autovacuum_vacuum_insert_scale_factor = 0.05,
        autovacuum_vacuum_insert_threshold = 10000,
        autovacuum_analyze_scale_factor = 0.02
    );
CREATE TABLE IF NOT EXISTS ${inbox_claims_other} PARTITION OF ${inbox_claims} DEFAULT
    WITH (
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
