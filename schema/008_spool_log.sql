-- 008: raw sketches leave the database. The spool table of 001 is no longer
-- written: report frames that the monitors still need go to an append-only
-- log of segment files beside the database ("<db>.spool/", daemon/spool.h).
-- As BLOBs they made every commit copy megabytes through the WAL and left
-- the file full of free pages once deleted. The database keeps only where
-- that log ends and how far each run is evaluated; foreshockd moves rows an
-- older version left in the spool table into the log when it opens.

-- Where the spool log ends, as of the last commit: records after it belong
-- to a transaction that never committed and are cut off at startup.
CREATE TABLE spool_log (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    segment     INTEGER NOT NULL,   -- segment file number
    byte_offset INTEGER NOT NULL    -- bytes of that segment that are committed
);

-- The monitors of every step <= spool_done_step are stored (NULL: none known);
-- spool records of those steps are no longer needed. Raised in the
-- transaction that stores the monitor rows.
ALTER TABLE runs ADD COLUMN spool_done_step INTEGER;

-- The spool table's rows said the same: rows of evaluated steps were deleted
-- with their monitor rows, so a run is evaluated up to its first spooled step.
UPDATE runs SET spool_done_step = (SELECT min(step) - 1 FROM spool WHERE spool.run_id = runs.id)
WHERE EXISTS (SELECT 1 FROM spool WHERE spool.run_id = runs.id);
