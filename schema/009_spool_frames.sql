-- 009: where each acknowledged spooled frame lies, so that a start can tell
-- a spool log that lost or damaged acknowledged frames (a segment deleted,
-- a byte flipped) from one that holds them all. One row per report whose
-- frame went to the spool log (daemon/spool.h), written in the transaction
-- that acknowledges the report; the rows of a run's evaluated steps go in
-- the transaction that raises runs.spool_done_step, so the table holds only
-- the frames the log must still hold. A deleted run takes its rows along.
-- Frames spooled by a foreshockd before this migration have no row: their
-- records are replayed, but cannot be missed.
CREATE TABLE spool_frames (
    segment     INTEGER NOT NULL,   -- segment file number
    byte_offset INTEGER NOT NULL,   -- where the record starts in it
    run_id      INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    stream_id   INTEGER NOT NULL,
    seq         INTEGER NOT NULL,
    step        INTEGER NOT NULL,
    PRIMARY KEY (segment, byte_offset)
) WITHOUT ROWID;

CREATE INDEX spool_frames_run_step ON spool_frames (run_id, step);
