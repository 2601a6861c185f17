-- 011: remote write (daemon/remote_write.h). The queue is the stored data
-- itself; this table holds how far each target's sender got ([remote_write
-- "NAME"]; plain [remote_write] is "default"): per run (kind 0) the
-- last step whose points a receiver acknowledged, and (kind 1, run_id 0)
-- the last alert_events id. Written by the writer thread only after a 2xx.
CREATE TABLE remote_write_cursor (
    target     TEXT    NOT NULL,   -- the section's name
    kind       INTEGER NOT NULL,   -- 0: a run's points, 1: alert events
    run_id     INTEGER NOT NULL,   -- runs.id (kind 0), 0 (kind 1)
    pos        INTEGER NOT NULL,   -- step (kind 0) or alert_events.id (kind 1)
    updated_at REAL    NOT NULL,
    PRIMARY KEY (target, kind, run_id)
) WITHOUT ROWID;
