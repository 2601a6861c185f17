-- 006: advice to trainers (daemon/advice.h). The writer inserts an advice
-- row for an alert transition the [advice] policy advises on, in the
-- transaction that commits the transition; what each stream is owed is
-- derived from these rows and its deliveries, so it survives reconnects and
-- restarts. Action numbers are pinned in daemon/advice.h.
CREATE TABLE advice (
    id                INTEGER PRIMARY KEY,
    run_id            INTEGER NOT NULL REFERENCES runs(id),
    alert_id          INTEGER NOT NULL REFERENCES alerts(id),
    event_id          INTEGER NOT NULL REFERENCES alert_events(id),
    action            INTEGER NOT NULL,  -- 1 checkpoint, 2 checkpoint_and_stop,
                                         -- 3 resolved, 4 superseded
    fire_id           INTEGER REFERENCES advice(id), -- resolved/superseded: the firing advice answered
    rule              TEXT    NOT NULL,
    label             TEXT    NOT NULL,  -- the incident's attribution when advised
    severity          TEXT    NOT NULL,
    step              INTEGER NOT NULL,  -- step of the transition
    first_breach_step INTEGER,
    fired_step        INTEGER,
    rollback_step     INTEGER,           -- advice_rollback_step(); NULL: none
    created_at        REAL    NOT NULL,
    closed_at         REAL               -- no longer owed to streams that lack it
);
-- What a Hello looks up: the run's advice still owed to someone.
CREATE INDEX advice_open ON advice (run_id, id) WHERE closed_at IS NULL;
CREATE INDEX advice_by_alert ON advice (alert_id, id);

-- Per advice and stream (run, attempt, rank): when it was sent (first and
-- latest send, how many sends) and when the trainer acknowledged it.
CREATE TABLE advice_deliveries (
    advice_id     INTEGER NOT NULL REFERENCES advice(id),
    stream_id     INTEGER NOT NULL REFERENCES streams(id),
    first_sent_at REAL,
    last_sent_at  REAL,
    sends         INTEGER NOT NULL DEFAULT 0,
    acked_at      REAL,
    PRIMARY KEY (advice_id, stream_id)
) WITHOUT ROWID;
