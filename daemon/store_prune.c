/* Retention: store_prune deletes finished outbox rows and ended silences
 * in bounded transactions; the writer runs it every prune_interval_s
 * between item batches. See store.h. */
#include <errno.h>
#include <string.h>

#include "fs_clock.h"
#include "log.h"
#include "store_internal.h"

static const char prune_outbox_sql[] =
    "DELETE FROM outbox WHERE id IN (SELECT o.id FROM outbox o "
    "WHERE o.state IN " STORE_OUTBOX_SQL_FINISHED " AND o.done_at < ?1 "
    "AND o.id < (SELECT max(id) FROM outbox) "
    /* the trigger of an incident still open at its target stays (pager_load_open) */
    "AND NOT (o.kind = " STORE_OUTBOX_SQL_TRIGGER " AND o.state IN " STORE_OUTBOX_SQL_SENT
    " AND NOT EXISTS (SELECT 1 FROM outbox x "
    "WHERE x.alert_id = o.alert_id AND x.target = o.target AND x.id > o.id "
    "AND x.state IN " STORE_OUTBOX_SQL_FINISHED ")) "
    "ORDER BY o.id LIMIT ?2)";
static const char prune_silences_sql[] =
    "DELETE FROM silences WHERE id IN (SELECT id FROM silences WHERE ends_at < ?1 "
    "ORDER BY ends_at, id LIMIT ?2)";

static int prune_one(sqlite3 *db, const char *sql, double cutoff, unsigned max_rows,
                     uint64_t *count)
{
    sqlite3_stmt *st;
    int rc = sqlite3_prepare_v2(db, sql, -1, &st, NULL);
    if (rc != SQLITE_OK)
        return rc;
    sqlite3_bind_double(st, 1, cutoff);
    sqlite3_bind_int64(st, 2, max_rows);
    rc = sqlite3_step(st);
    if (rc == SQLITE_DONE)
        *count = (uint64_t)sqlite3_changes(db);
    sqlite3_finalize(st);
    return rc == SQLITE_DONE ? SQLITE_OK : rc;
}

int store_prune(sqlite3 *db, double now, double outbox_retention_s, double silence_retention_s,
                unsigned max_rows, struct store_prune_counts *out)
{
    memset(out, 0, sizeof(*out));
    if (!(outbox_retention_s > 0) && !(silence_retention_s > 0))
        return 0;
    int rc = sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    if (rc == SQLITE_OK && outbox_retention_s > 0)
        rc = prune_one(db, prune_outbox_sql, now - outbox_retention_s, max_rows, &out->outbox);
    if (rc == SQLITE_OK && silence_retention_s > 0)
        rc = prune_one(db, prune_silences_sql, now - silence_retention_s, max_rows, &out->silences);
    if (rc == SQLITE_OK)
        rc = sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    if (rc != SQLITE_OK) {
        if (!sqlite3_get_autocommit(db))
            sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
        memset(out, 0, sizeof(*out));
        return -EIO;
    }
    return 0;
}

/* Runs one retention transaction when it is due; a full batch makes the
 * next one due at once (between the item batches, so retention never holds
 * the queue for longer than one bounded transaction). Writer thread. */
void store_prune_if_due(struct store *s, double *next)
{
    double now = fs_clock_mono();
    if (now < *next)
        return;
    *next = now + s->opts.prune_interval_s;
    struct store_prune_counts c;
    if (store_prune(s->db, fs_clock_unix(), s->opts.outbox_retention_s, s->opts.silence_retention_s,
                    FS_STORE_PRUNE_BATCH, &c) < 0) {
        log_limited(&s->rl_fail, LOG_LEVEL_WARN, "store", "retention: %s; retrying in %.0f s",
                    sqlite3_errmsg(s->db), s->opts.prune_interval_s);
        return;
    }
    if (c.outbox || c.silences)
        log_debug("store", "retention: deleted %llu outbox rows, %llu silences",
                  (unsigned long long)c.outbox, (unsigned long long)c.silences);
    if (c.outbox >= FS_STORE_PRUNE_BATCH || c.silences >= FS_STORE_PRUNE_BATCH)
        *next = now;
}
