-- The trace of the first delivery: the OpenTelemetry trace id (32 hex digits) of the
-- delivery whose claim this row is, written by the claim INSERT itself when the delivery
-- was traced and sampled, NULL otherwise. `inbox-middleware explain` prints it. Nullable
-- with no default: adding it rewrites nothing, and an untraced claim stores no bytes.
ALTER TABLE ${consumer_inbox} ADD COLUMN IF NOT EXISTS trace_id text;
