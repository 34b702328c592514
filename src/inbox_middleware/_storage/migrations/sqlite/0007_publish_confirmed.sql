-- Redrive and accept: the publish each decision made, confirmed (SQLite). See the
-- PostgreSQL migration of the same number.
ALTER TABLE ${inbox_poison} ADD COLUMN published_at DATETIME;
ALTER TABLE ${inbox_quarantine} ADD COLUMN published_at DATETIME;
