-- 007: attempts of a run (a trainer restarted, maybe from a checkpoint).
-- A Hello of an attempt above every earlier one of its run starts it; with
-- Hello.resume_step it is a rewind: the steps after resume_step are
-- re-done, detection continues from the run's state at resume_step, and
-- incidents that opened after it end as superseded (daemon/stage.h).
CREATE TABLE attempts (
    run_id      INTEGER NOT NULL REFERENCES runs(id),
    attempt     INTEGER NOT NULL,
    resume_step INTEGER,           -- NULL: a plain restart (the attempt goes on)
    started_at  REAL    NOT NULL,  -- its first Hello
    rebuilt_at  REAL,              -- rewind: when detection was rebuilt at resume_step
    PRIMARY KEY (run_id, attempt)
) WITHOUT ROWID;

-- Runs that existed before: one attempt row per attempt their streams used.
INSERT INTO attempts (run_id, attempt, started_at)
    SELECT run_id, attempt, min(created_at) FROM streams GROUP BY run_id, attempt;

-- The attempt an alert transition happened in (for a to_superseded event,
-- the attempt whose incident it ended). NULL for events from before.
ALTER TABLE alert_events ADD COLUMN attempt INTEGER;
