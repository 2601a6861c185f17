-- Silences (Alertmanager-style): an alert whose labels match every matcher
-- of a silence that is active (starts_at <= now < ends_at) is still stored
-- and shown, but not paged. Created, listed and expired over HTTP; written
-- only by the writer thread. Expiring sets ends_at to the expiry time, so
-- "active" is always the time test above.
CREATE TABLE silences (
    id            INTEGER PRIMARY KEY,
    matchers_json TEXT    NOT NULL,  -- [{"name","value","isRegex","isEqual"}...], validated by silence.c
    starts_at     REAL    NOT NULL,  -- unix seconds
    ends_at       REAL    NOT NULL,  -- unix seconds, > starts_at
    created_by    TEXT    NOT NULL,
    comment       TEXT    NOT NULL,
    created_at    REAL    NOT NULL,
    updated_at    REAL    NOT NULL   -- last change (creation or expiry)
);
CREATE INDEX silences_by_end ON silences (ends_at, id);
