-- Autovacuum for a table the purge empties from the front: the claims table grows by one
-- row a message and loses a retention window's oldest rows at each purge, so the default
-- thresholds (a vacuum once a fifth of the rows are dead) leave a purge of a few percent
-- unvacuumed for ever, or make the vacuum it finally triggers read and rewrite the
-- whole primary key at once. Here a vacuum follows every purge of a hundredth of the table
-- (10,000 rows at least), inserts alone trigger one at a twentieth (the pages claims fill are
-- marked all-visible and frozen while still in memory), and the statistics the planner
-- uses follow at a fiftieth. The vacuum's own cost limit is left to the server: it paces the
-- vacuum's I/O against the claims'.
ALTER TABLE ${consumer_inbox} SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.02
);
