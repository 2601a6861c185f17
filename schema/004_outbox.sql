-- 004: the pager's outbox. The writer inserts one row per configured target
-- for every to_firing / to_resolved transition, in the transaction that
-- commits the transition, so a committed transition always has its pages and
-- an uncommitted one never does. The pager thread delivers them and records
-- each outcome through the writer; retry state (attempts, next_attempt_at)
-- lives here, so it survives restarts. Pinned numbers are in daemon/pager.h.
CREATE TABLE outbox (
    id              INTEGER PRIMARY KEY,
    alert_id        INTEGER NOT NULL REFERENCES alerts(id),
    event_id        INTEGER NOT NULL REFERENCES alert_events(id),
    target          TEXT    NOT NULL,           -- [target "NAME"] at insertion time
    kind            INTEGER NOT NULL,           -- 1 trigger (to_firing), 2 resolve (to_resolved)
    severity        TEXT    NOT NULL,           -- the incident's, as paged
    attribution     TEXT    NOT NULL,           -- the incident's diagnosis (signature label)
    created_at      REAL    NOT NULL,           -- unix seconds; give_up_after counts from here
    state           INTEGER NOT NULL DEFAULT 0, -- 0 pending, 1 delivered, 2 given up,
                                                -- 3 silenced (held), 4 skipped (never sent)
    attempts        INTEGER NOT NULL DEFAULT 0, -- failed attempts so far
    next_attempt_at REAL,                       -- retry time (unix seconds), NULL = now
    last_status     INTEGER,                    -- HTTP status of the last attempt, NULL if none
    last_error      TEXT,                       -- why the last attempt failed
    updated_at      REAL    NOT NULL,
    done_at         REAL                        -- when it reached 1, 2 or 4
);
-- What the pager loads: undone rows (pending or held by a silence).
CREATE INDEX outbox_undone ON outbox (id) WHERE state IN (0, 3);
CREATE INDEX outbox_by_alert ON outbox (alert_id, target, id);
