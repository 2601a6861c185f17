-- 012: each alert event keeps the severity its alert had at that event. An
-- alert's severity can rise while it is open (a non-finite value makes it
-- critical), and remote write labels an event's sample with its severity:
-- read from the alert row, a resend of the older events (a cursor moved
-- back, a crash between a 2xx and the cursor's commit) labelled them with
-- the later severity, a different series from the one first sent. NULL in
-- rows written before this migration: their alert's severity stands in.
ALTER TABLE alert_events ADD COLUMN severity TEXT;
