/* The remote-write sender's SQL, on its own read-only connection. See
 * store_rw.h. */
#include "store_rw.h"

#include <stddef.h>

#include "store_stmt.h"

/* attempt: the run's latest attempt started at or before the point's time. */
#define RW_ATTEMPT_OF(t)                                                                           \
    "(SELECT max(a.attempt) FROM attempts a WHERE a.run_id = ?1 AND a.started_at <= " t ")"

static const char *const rw_sql[RW_Q__COUNT] = {
    [RW_Q_RUNS] = "SELECT id, name, last_step FROM runs WHERE last_step IS NOT NULL ORDER BY id",
    [RW_Q_CURSORS] = "SELECT kind, run_id, pos FROM remote_write_cursor WHERE target = ?1",
    /* The step of the last report of every stream heard since ?2. */
    /* The step of the last report of every live stream: heard within
     * RW_LIVE_S (?3), or within RW_LIVE_INTERVALS of its own mean report
     * interval, whichever is longer (a 70B rank may report once a minute). */
    [RW_Q_LIVE_MIN] = "SELECT min(r.step) FROM streams s JOIN reports r ON r.stream_id = s.id AND "
                      "r.seq = s.last_seq WHERE s.run_id = ?1 AND ?2 - s.last_seen_at < max(?3, "
                      "?4 * (s.last_seen_at - s.created_at) / max(s.reports, 1))",
    [RW_Q_SPOOL_MIN] = "SELECT min(step) FROM spool_frames WHERE run_id = ?1",
    [RW_Q_POINTS] =
        "SELECT s.name, s.layer, s.window, s.rank, p.step, p.value, p.time, " RW_ATTEMPT_OF(
            "p.time") " FROM series s JOIN points p ON p.series_id = s.id "
                      "WHERE s.run_id = ?1 AND s.head < 0 AND p.step > ?2 AND p.step <= ?3 AND "
                      "p.value IS NOT NULL ORDER BY s.id, p.step",
    [RW_Q_HEADS] =
        "SELECT s.name, s.layer, s.window, s.head, p.step, p.value, p.time, " RW_ATTEMPT_OF(
            "p.time") " FROM series s JOIN points p ON p.series_id = s.id "
                      "WHERE s.run_id = ?1 AND s.head >= 0 AND p.step > ?2 AND p.step <= ?3 AND "
                      "p.value IS NOT NULL ORDER BY s.id, p.step",
    /* An event's severity is the one it had (schema/012_event_severity.sql). */
    [RW_Q_ALERTS] = "SELECT e.id, e.to_state, e.at, a.rule, COALESCE(e.severity, a.severity), "
                    "a.family, a.layer, a.head, "
                    "a.window, a.rank, r.name, e.attempt FROM alert_events e JOIN alerts a ON "
                    "a.id = e.alert_id JOIN runs r ON r.id = a.run_id WHERE e.id > ?1 ORDER BY "
                    "e.id LIMIT ?2",
    [RW_Q_ALERT_MAX] = "SELECT max(id) FROM alert_events",
};

int store_rw_prepare(sqlite3 *db, sqlite3_stmt *st[RW_Q__COUNT])
{
    return store_prepare_all(db, rw_sql, RW_Q__COUNT, st) == RW_Q__COUNT ? SQLITE_OK
                                                                         : sqlite3_errcode(db);
}

int store_rw_begin(sqlite3 *db)
{
    return sqlite3_exec(db, "BEGIN", NULL, NULL, NULL);
}

void store_rw_end(sqlite3 *db)
{
    sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
}
