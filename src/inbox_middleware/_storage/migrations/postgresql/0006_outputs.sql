-- Outputs: what a handler's delivery produced that something downstream consumes (a
-- FastStream subscriber's result for its publishers or an RPC caller; a Dramatiq actor's
-- result for its Results backend, pipeline step or on_success callback), written in the
-- claim's transaction, so that a duplicate answers exactly as the first delivery did.
-- Insert-only (the hot claim row is never updated) and written only for consumers whose
-- outputs something uses; retention purges a row with its claim. body NULL: the handler
-- returned None. No row: nothing was stored (claims older than this table behave as
-- before: their duplicates are skipped without outputs).
CREATE TABLE IF NOT EXISTS ${inbox_outputs} (
    consumer_name  text        NOT NULL,
    producer_name  text        NOT NULL,
    tenant         text        NOT NULL DEFAULT '',
    message_id     text        NOT NULL,
    body           bytea,
    content_type   text,
    headers        jsonb       NOT NULL DEFAULT '{}',
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, producer_name, tenant, message_id)
);
