-- 009: the run lifecycle (daemon/store_runs.c). A run is live from its
-- first report until it ends (no report for run_idle_end_s, or ended over
-- the API); max_runs counts live runs only. An ended run is deleted with
-- every row of it run_retention_s later; a run that never sent a report
-- after run_hello_grace_s; a run marked for deletion (the API) at once.

ALTER TABLE runs ADD COLUMN ended_at REAL;                     -- NULL: not ended
ALTER TABLE runs ADD COLUMN owner TEXT NOT NULL DEFAULT '';    -- [run "PATTERN"] that admitted it, '' global
ALTER TABLE runs ADD COLUMN deleting INTEGER NOT NULL DEFAULT 0; -- 1: marked for deletion

-- The live runs (what max_runs and max_runs_per_token count), by owner.
CREATE INDEX runs_live ON runs (owner) WHERE reports > 0 AND ended_at IS NULL AND deleting = 0;

-- Ids are never handed out twice: deleting the row with the highest id of
-- one of these tables would let SQLite give that id to the next row, and
-- the daemon keeps ids in memory (connections, the monitor stage, the
-- pager's watermark). New rows take max(highest id, floor) + 1.
CREATE TABLE id_floor (
    tbl TEXT PRIMARY KEY,   -- 'runs' | 'streams' | 'outbox'
    id  INTEGER NOT NULL
) WITHOUT ROWID;
