-- Failure handling, operator decisions and retention.
--
-- inbox_attempts counts the failed attempts of a message, and the broker redeliveries of
-- it. The failed attempt itself rolls back, so each is counted in a short transaction of
-- its own; a row exists only for messages that failed or were redelivered. Redeliveries
-- that no counted failure explains are deliveries that ended without any outcome (the
-- worker died): the crash loops a redelivery limit stops.
CREATE TABLE IF NOT EXISTS ${inbox_attempts} (
    consumer_name    text        NOT NULL,
    producer_name    text        NOT NULL,
    tenant           text        NOT NULL DEFAULT '',
    message_id       text        NOT NULL,
    attempts         integer     NOT NULL DEFAULT 0,
    redeliveries     integer     NOT NULL DEFAULT 0,
    first_failure_at timestamptz NOT NULL DEFAULT now(),
    last_failure_at  timestamptz NOT NULL DEFAULT now(),
    last_error       text,
    PRIMARY KEY (consumer_name, producer_name, tenant, message_id)
);

-- Messages that failed permanently, kept with their payload: a broker's dead-letter store
-- expires, or does not exist. One row per message identity; a redriven message that fails
-- again updates it. decision: pending (an operator must look), redriven, discarded, and
-- recovered (a redrive was later processed).
CREATE TABLE IF NOT EXISTS ${inbox_poison} (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_name    text        NOT NULL,
    producer_name    text        NOT NULL,
    tenant           text        NOT NULL DEFAULT '',
    message_id       text        NOT NULL,
    payload_sha256   text        NOT NULL,
    hash_scheme      text        NOT NULL,
    payload          bytea,
    payload_format   text        NOT NULL DEFAULT '',
    headers          jsonb       NOT NULL DEFAULT '{}',
    source           text        NOT NULL DEFAULT '',
    reason_code      text        NOT NULL,
    error            text,
    attempts         integer     NOT NULL DEFAULT 1,
    first_failure_at timestamptz NOT NULL DEFAULT now(),
    last_failure_at  timestamptz NOT NULL DEFAULT now(),
    handler_version  text        NOT NULL DEFAULT '',
    decision         text        NOT NULL DEFAULT 'pending',
    decided_by       text,
    decided_at       timestamptz,
    decision_note    text,
    operation_id     text,
    recovered_at     timestamptz,
    CONSTRAINT "${prefix}inbox_poison_decision_check"
        CHECK (decision IN ('pending', 'redriven', 'discarded', 'recovered')),
    CONSTRAINT "${prefix}inbox_poison_identity_key"
        UNIQUE (consumer_name, producer_name, tenant, message_id)
);

CREATE INDEX IF NOT EXISTS "${prefix}inbox_poison_pending_idx"
    ON ${inbox_poison} (last_failure_at) WHERE decision = 'pending';

-- Quarantine decisions: how to republish a row, the operation that did, and the new id
-- an accepted payload was given.
ALTER TABLE ${inbox_quarantine} ADD COLUMN IF NOT EXISTS payload_format text NOT NULL DEFAULT '';
ALTER TABLE ${inbox_quarantine} ADD COLUMN IF NOT EXISTS operation_id text;
ALTER TABLE ${inbox_quarantine} ADD COLUMN IF NOT EXISTS accepted_message_id text;
ALTER TABLE ${inbox_quarantine} ADD COLUMN IF NOT EXISTS recovered_at timestamptz;

-- The retention policy the purge enforces, per consumer ('*': every consumer): the
-- failure scenarios it was derived from, and the minimum window they give.
CREATE TABLE IF NOT EXISTS ${inbox_retention} (
    consumer_name     text        PRIMARY KEY,
    scenarios         jsonb       NOT NULL,
    minimum_seconds   bigint      NOT NULL,
    dominant_scenario text        NOT NULL,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    updated_by        text
);

-- The purge finds processed rows older than its cutoff. Rows arrive in processed_at order,
-- so a BRIN index (a few pages, summarising ranges of the table) finds them at a fraction
-- of a btree's cost on every claim. On a large existing inbox, create it CONCURRENTLY
-- beforehand under the same name: this statement then does nothing.
CREATE INDEX IF NOT EXISTS "${prefix}consumer_inbox_processed_at_brin"
    ON ${consumer_inbox} USING brin (processed_at);
