-- 005: the local group a stream declared (Hello.local_ranks) when its daemon
-- hears only part of the job (a daemon per node): ranges like "4-7", NULL for
-- a daemon that hears every rank. Latest Hello of the stream wins. The run's
-- group is the union over the streams of its latest attempt; the monitor
-- stage reloads it at start so that spooled router tokens re-fed before the
-- ranks reconnect reduce over the ranks they were sent for.
ALTER TABLE streams ADD COLUMN local_ranks TEXT;
