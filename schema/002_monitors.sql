-- 002: the monitor stage. Incomplete reductions, persisted detector and alert
-- state (so a restart neither re-fires nor forgets), alerts and their
-- append-only history. State numbers are pinned in daemon/alert.h.

-- Listing a run's series in id order (keyset pagination) without a sort.
CREATE INDEX series_by_run ON series (run_id, id);

-- A (run, step, group) whose shards or ranks did not all arrive before the
-- timeout: recorded, never computed from part of the data.
CREATE TABLE incomplete (
    run_id      INTEGER NOT NULL REFERENCES runs(id),
    step        INTEGER NOT NULL,
    kind        TEXT    NOT NULL,              -- 'attention' | 'router_gram' | 'router_tokens'
    layer       INTEGER NOT NULL,
    head        INTEGER NOT NULL DEFAULT -1,
    window      INTEGER NOT NULL DEFAULT 0,
    have        INTEGER NOT NULL,              -- shards / ranks received
    want        INTEGER NOT NULL,              -- shards / ranks expected
    recorded_at REAL    NOT NULL,
    PRIMARY KEY (run_id, step, kind, layer, head, window)
) WITHOUT ROWID;

-- Detector state per series (detect_state_encode blob), written in the same
-- transaction as the points it has seen.
CREATE TABLE detector_state (
    series_id INTEGER PRIMARY KEY REFERENCES series(id),
    step      INTEGER NOT NULL,                -- last step fed to the detector
    state     BLOB    NOT NULL
);

-- Current state of every alert identity (run, rule, scope).
CREATE TABLE alerts (
    id                INTEGER PRIMARY KEY,
    run_id            INTEGER NOT NULL REFERENCES runs(id),
    rule              TEXT    NOT NULL,        -- detector rule / series name, e.g. 'qk.d2.erank'
    alert_key         TEXT    NOT NULL UNIQUE, -- alert_key(): run, rule, labels
    dedup_key         TEXT    NOT NULL,        -- alert_dedup_key(): 'fs-' + 16 hex
    layer             INTEGER NOT NULL DEFAULT -1,
    head              INTEGER NOT NULL DEFAULT -1,
    window            INTEGER NOT NULL DEFAULT 0,
    rank              INTEGER NOT NULL DEFAULT -1,
    series_id         INTEGER REFERENCES series(id),
    state             INTEGER NOT NULL,        -- 0 inactive, 1 pending, 2 firing, 3 resolved
    severity          TEXT    NOT NULL,        -- 'warning' | 'critical'
    family            TEXT    NOT NULL,        -- detector family of the rule
    attribution       TEXT    NOT NULL,        -- 'attention-numerics', 'combined', ...
    value             REAL,                    -- evidence of the latest transition
    median            REAL,
    mad               REAL,
    z                 REAL,
    first_breach_step INTEGER,
    fired_step        INTEGER,
    resolved_step     INTEGER,
    last_step         INTEGER NOT NULL,
    incidents         INTEGER NOT NULL DEFAULT 0,
    created_at        REAL    NOT NULL,
    updated_at        REAL    NOT NULL,
    state_blob        BLOB                     -- alert_state_encode(), for restart
);
CREATE INDEX alerts_by_run ON alerts (run_id, id);
CREATE INDEX alerts_by_state ON alerts (state, id);
CREATE INDEX alerts_by_run_state ON alerts (run_id, state, id);

-- Append-only history of transitions, with the evidence at that moment.
CREATE TABLE alert_events (
    id            INTEGER PRIMARY KEY,
    alert_id      INTEGER NOT NULL REFERENCES alerts(id),
    change        TEXT    NOT NULL,            -- 'to_pending' | 'to_firing' | 'to_resolved' | 'to_inactive'
    from_state    INTEGER NOT NULL,
    to_state      INTEGER NOT NULL,
    step          INTEGER NOT NULL,
    at            REAL    NOT NULL,
    attribution   TEXT    NOT NULL,
    evidence_json TEXT    NOT NULL             -- value, median, mad, z, steps, labels
);
CREATE INDEX alert_events_by_alert ON alert_events (alert_id, id);
