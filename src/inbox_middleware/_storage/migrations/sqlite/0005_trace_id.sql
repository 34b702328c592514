-- The trace of the first delivery (SQLite). See the PostgreSQL migration of the same number.
ALTER TABLE ${consumer_inbox} ADD COLUMN trace_id TEXT;
