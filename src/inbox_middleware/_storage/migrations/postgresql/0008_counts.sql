-- Counts: how many deliveries each worker process settled, by consumer and outcome
-- (processed, duplicate, quarantined, no_identity, ...), so that `inbox-middleware
-- status` shows duplicates and messages without identity from the database alone. One
-- row per worker process, consumer and outcome: each worker counts in memory and upserts
-- its own cumulative counts every few seconds, so no two workers ever write one row (a
-- single shared counter row would be a lock every delivery waits on). worker: host, pid
-- and a random tag, new at each start; since: when it started counting; updated_at: its
-- last flush. Counts of the last interval before a SIGKILL are lost: the figures are
-- approximate. `inbox-middleware purge` deletes the rows of workers not heard from for
-- longer than its window.
CREATE TABLE IF NOT EXISTS ${inbox_counts} (
    worker         text        NOT NULL,
    consumer_name  text        NOT NULL,
    outcome        text        NOT NULL,
    count          bigint      NOT NULL,
    since          timestamptz NOT NULL,
    updated_at     timestamptz NOT NULL,
    PRIMARY KEY (worker, consumer_name, outcome)
);
