-- 001: runs, streams, the report ledger, series and points, the sketch spool.
-- Times are unix seconds (REAL). Label columns use -1 for "not applicable"
-- rather than NULL so that UNIQUE constraints dedupe them.

CREATE TABLE runs (
    id               INTEGER PRIMARY KEY,
    name             TEXT    NOT NULL UNIQUE,      -- Hello.run_id
    created_at       REAL    NOT NULL,
    last_seen_at     REAL    NOT NULL,
    world_size       INTEGER NOT NULL,
    detect_from_step INTEGER NOT NULL DEFAULT 0,
    model_json       TEXT,                         -- Hello.model as JSON, or NULL
    last_step        INTEGER,                      -- highest step committed, any stream
    reports          INTEGER NOT NULL DEFAULT 0    -- committed reports, all streams
);

-- One stream per (run, attempt, rank). last_seq is the resume point sent in
-- Welcome: every report of this stream with seq <= last_seq is committed.
CREATE TABLE streams (
    id           INTEGER PRIMARY KEY,
    run_id       INTEGER NOT NULL REFERENCES runs(id),
    attempt      INTEGER NOT NULL,
    rank         INTEGER NOT NULL,
    last_seq     INTEGER NOT NULL DEFAULT 0,
    reports      INTEGER NOT NULL DEFAULT 0,
    created_at   REAL    NOT NULL,
    last_seen_at REAL    NOT NULL,
    UNIQUE (run_id, attempt, rank)
);

-- The ledger of committed reports: (stream, seq) is unique, so a resent
-- report is a no-op.
CREATE TABLE reports (
    stream_id   INTEGER NOT NULL REFERENCES streams(id),
    seq         INTEGER NOT NULL,
    step        INTEGER NOT NULL,
    received_at REAL    NOT NULL,
    bytes       INTEGER NOT NULL,
    PRIMARY KEY (stream_id, seq)
) WITHOUT ROWID;

-- A series is a name plus labels within a run: 'loss' (rank), 'qk.d2.entropy'
-- (layer, head, window), ... Labels that do not apply are -1 (window: 0).
CREATE TABLE series (
    id     INTEGER PRIMARY KEY,
    run_id INTEGER NOT NULL REFERENCES runs(id),
    name   TEXT    NOT NULL,
    layer  INTEGER NOT NULL DEFAULT -1,
    head   INTEGER NOT NULL DEFAULT -1,
    window INTEGER NOT NULL DEFAULT 0,
    rank   INTEGER NOT NULL DEFAULT -1,
    points     INTEGER NOT NULL DEFAULT 0,   -- maintained by the writer
    first_step INTEGER,
    last_step  INTEGER,
    UNIQUE (run_id, name, layer, head, window, rank)
);
CREATE INDEX series_by_name ON series (run_id, name);

-- One value per (series, step). value NULL means "absent" (for example a
-- zero update has no spectrum), never 0. A re-done step (trainer restarted
-- from a checkpoint) replaces the earlier value.
CREATE TABLE points (
    series_id INTEGER NOT NULL REFERENCES series(id),
    step      INTEGER NOT NULL,
    value     REAL,
    time      REAL    NOT NULL,
    PRIMARY KEY (series_id, step)
) WITHOUT ROWID;

-- Raw sketches waiting for the monitor stage. body is the Report frame as it
-- arrived (protobuf). Rows are deleted by the transaction that stores the
-- monitor values derived from them.
CREATE TABLE spool (
    id        INTEGER PRIMARY KEY,
    run_id    INTEGER NOT NULL REFERENCES runs(id),
    stream_id INTEGER NOT NULL REFERENCES streams(id),
    seq       INTEGER NOT NULL,
    step      INTEGER NOT NULL,
    bytes     INTEGER NOT NULL,
    body      BLOB    NOT NULL
);
CREATE INDEX spool_by_run_step ON spool (run_id, step);
