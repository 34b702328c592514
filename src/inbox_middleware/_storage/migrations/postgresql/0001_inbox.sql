-- The inbox and its quarantine.
--
-- consumer_inbox holds one row per (consumer, producer intent) whose processing
-- committed: the row is inserted by the claim and commits together with the handler's
-- writes, so its existence means "processed". processed_at is the start time of that
-- transaction; received_at is when the worker received the delivery.

CREATE TABLE IF NOT EXISTS ${consumer_inbox} (
    consumer_name   text        NOT NULL,
    producer_name   text        NOT NULL,
    tenant          text        NOT NULL DEFAULT '',
    message_id      text        NOT NULL,
    payload_sha256  text        NOT NULL,
    hash_scheme     text        NOT NULL,
    handler_version text        NOT NULL DEFAULT '',
    produced_at     timestamptz,
    received_at     timestamptz NOT NULL DEFAULT now(),
    processed_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, producer_name, tenant, message_id)
);

-- One row per identity and conflicting payload hash; a repeated conflict increments
-- attempts. The table is the source of truth, the quarantine queue a notification.
CREATE TABLE IF NOT EXISTS ${inbox_quarantine} (
    id                 bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_name      text        NOT NULL,
    producer_name      text        NOT NULL,
    tenant             text        NOT NULL DEFAULT '',
    message_id         text        NOT NULL,
    stored_sha256      text        NOT NULL,
    conflicting_sha256 text        NOT NULL,
    hash_scheme        text        NOT NULL,
    source             text        NOT NULL DEFAULT '',
    payload            bytea,
    headers            jsonb       NOT NULL DEFAULT '{}',
    reason_code        text        NOT NULL DEFAULT 'identity_conflict',
    attempts           integer     NOT NULL DEFAULT 1,
    first_seen_at      timestamptz NOT NULL DEFAULT now(),
    last_seen_at       timestamptz NOT NULL DEFAULT now(),
    handler_version    text        NOT NULL DEFAULT '',
    decision           text        NOT NULL DEFAULT 'pending',
    decided_by         text,
    decided_at         timestamptz,
    decision_note      text,
    CONSTRAINT "${prefix}inbox_quarantine_decision_check"
        CHECK (decision IN ('pending', 'accepted', 'discarded', 'redriven')),
    CONSTRAINT "${prefix}inbox_quarantine_identity_hash_key"
        UNIQUE (consumer_name, producer_name, tenant, message_id, conflicting_sha256)
);

CREATE INDEX IF NOT EXISTS "${prefix}inbox_quarantine_pending_idx"
    ON ${inbox_quarantine} (last_seen_at) WHERE decision = 'pending';
