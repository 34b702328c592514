-- Redrive and accept: the publish each decision made, confirmed. An operator's redrive
-- (or accept) commits its decision, then publishes the kept message, then sets
-- published_at once the broker confirmed that publish. A row decided (redriven or
-- accepted) without published_at was recorded and not confirmed: the publish failed, or
-- the command died before confirming it. The same operation run again, by row id or by
-- filter, picks the row up and publishes it again; the copy keeps its identity, so a
-- publish that happened twice is a duplicate downstream. Rows decided before this
-- migration have none either, so their operation run again publishes them once more.
-- A row that goes back to pending (its redrive failed, or conflicted, again) loses it.
ALTER TABLE ${inbox_poison} ADD COLUMN IF NOT EXISTS published_at timestamptz;
ALTER TABLE ${inbox_quarantine} ADD COLUMN IF NOT EXISTS published_at timestamptz;
