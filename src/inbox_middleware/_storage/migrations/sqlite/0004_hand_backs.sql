-- Hand-backs (SQLite). See the PostgreSQL migration of the same number.
ALTER TABLE ${inbox_attempts} ADD COLUMN hand_backs INTEGER NOT NULL DEFAULT 0;
