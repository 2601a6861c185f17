/* The run lifecycle (schema/010_run_lifecycle.sql): runs end, are kept for
 * run_retention_s, then deleted with every row of them; runs that never
 * sent a report are deleted run_hello_grace_s after their last Hello; the
 * HTTP API ends or deletes a run (STORE_ITEM_RUN). Deletions run on the
 * writer in transactions of their own, between item batches, like
 * retention (store_prune.c), at most FS_STORE_RUN_DELETE_BATCH runs each;
 * after COMMIT the spool may drop the run's records and the loop thread is
 * told (STORE_RESULT_RUN_GONE) to close its connections and forget it. See
 * store.h. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "fs_clock.h"
#include "log.h"
#include "store_internal.h"

/* Before rows are deleted: the highest ids of the tables whose ids live on
 * in memory become floors that new rows stay above (STORE_NEXT_ID_SQL). */
static const char floor_sql[] =
    "INSERT INTO id_floor (tbl, id) "
    "SELECT 'runs', COALESCE((SELECT max(id) FROM runs), 0) UNION ALL "
    "SELECT 'streams', COALESCE((SELECT max(id) FROM streams), 0) UNION ALL "
    "SELECT 'outbox', COALESCE((SELECT max(id) FROM outbox), 0) "
    "WHERE true ON CONFLICT (tbl) DO UPDATE SET id = max(id_floor.id, excluded.id)";

/* Every table that holds rows of a run (the schema/ migrations), children first so
 * that no statement leaves a dangling reference (foreign_keys is on). */
static const char *const delete_sql[] = {
    "DELETE FROM advice_deliveries WHERE advice_id IN (SELECT id FROM advice WHERE run_id = ?1) "
    "OR stream_id IN (SELECT id FROM streams WHERE run_id = ?1)",
    "DELETE FROM outbox WHERE alert_id IN (SELECT id FROM alerts WHERE run_id = ?1)",
    "DELETE FROM advice WHERE run_id = ?1",
    "DELETE FROM alert_events WHERE alert_id IN (SELECT id FROM alerts WHERE run_id = ?1)",
    "DELETE FROM alerts WHERE run_id = ?1",
    "DELETE FROM detector_state WHERE series_id IN (SELECT id FROM series WHERE run_id = ?1)",
    "DELETE FROM points WHERE series_id IN (SELECT id FROM series WHERE run_id = ?1)",
    "DELETE FROM series WHERE run_id = ?1",
    "DELETE FROM incomplete WHERE run_id = ?1",
    "DELETE FROM reports WHERE stream_id IN (SELECT id FROM streams WHERE run_id = ?1)",
    "DELETE FROM spool WHERE run_id = ?1",        /* the table 008 stopped writing */
    "DELETE FROM spool_frames WHERE run_id = ?1", /* 009: where its acked frames lie */
    "DELETE FROM attempts WHERE run_id = ?1",
    "DELETE FROM remote_write_cursor WHERE kind = 0 AND run_id = ?1", /* 011: its sent cursor */
    "DELETE FROM streams WHERE run_id = ?1",
    "DELETE FROM runs WHERE id = ?1",
};

/* A run every remote-write target (?5, a JSON array of names) has sent:
 * its points up to its last step, and its alert transitions. */
#define RW_TARGETS_SQL "(SELECT value FROM json_each(?5))"
#define RW_SENT_SQL                                                                                \
    "(runs.last_step IS NULL OR (SELECT count(*) FROM remote_write_cursor c WHERE c.kind = 0 "     \
    "AND c.run_id = runs.id AND c.pos >= runs.last_step AND c.target IN " RW_TARGETS_SQL           \
    ") = json_array_length(?5)) AND (NOT EXISTS (SELECT 1 FROM alerts a JOIN alert_events e ON "   \
    "e.alert_id = a.id WHERE a.run_id = runs.id) OR (SELECT count(*) FROM remote_write_cursor c "  \
    "WHERE c.kind = 1 AND c.target IN " RW_TARGETS_SQL " AND c.pos >= (SELECT max(e.id) FROM "     \
    "alerts a JOIN alert_events e ON e.alert_id = a.id WHERE a.run_id = runs.id)) = "              \
    "json_array_length(?5))"

static int run_sql(sqlite3 *db, const char *sql, int64_t id, bool bind)
{
    sqlite3_stmt *st;
    int rc = sqlite3_prepare_v2(db, sql, -1, &st, NULL);
    if (rc != SQLITE_OK)
        return rc;
    if (bind)
        sqlite3_bind_int64(st, 1, id);
    rc = sqlite3_step(st);
    sqlite3_finalize(st);
    return rc == SQLITE_DONE || rc == SQLITE_ROW ? SQLITE_OK : rc;
}

int store_run_delete_rows(sqlite3 *db, int64_t run_id)
{
    int rc = run_sql(db, floor_sql, 0, false);
    for (size_t i = 0; rc == SQLITE_OK && i < sizeof(delete_sql) / sizeof(delete_sql[0]); i++)
        rc = run_sql(db, delete_sql[i], run_id, true);
    return rc;
}

/* --- admission: max_runs and max_runs_per_token count live runs ------------------- */

int store_run_quota(struct store *s, const char *owner, char *why, size_t len)
{
    why[0] = '\0';
    int64_t n = 0;
    int rc = exec1(s->st[ST_RUN_COUNT], &n, 1);
    if (!ok(rc))
        return rc;
    if ((uint64_t)n >= s->opts.max_runs) {
        snprintf(why, len,
                 "run limit reached: max_runs = %llu runs are live (ended runs do not count)",
                 (unsigned long long)s->opts.max_runs);
        return SQLITE_OK;
    }
    if (!s->opts.max_runs_per_token)
        return SQLITE_OK;
    sqlite3_bind_text(s->st[ST_RUN_COUNT], 1, owner ? owner : "", -1, SQLITE_STATIC);
    rc = exec1(s->st[ST_RUN_COUNT], &n, 1);
    if (!ok(rc))
        return rc;
    if ((uint64_t)n >= s->opts.max_runs_per_token)
        snprintf(why, len,
                 "run limit reached: max_runs_per_token = %llu runs of this token are live",
                 (unsigned long long)s->opts.max_runs_per_token);
    return SQLITE_OK;
}

/* --- the API: STORE_ITEM_RUN ----------------------------------------------------- */

int store_apply_run(struct store *s, struct store_item *it, double now)
{
    struct store_run_req *q = &it->run;
    const char *sql = q->op == STORE_RUN_DELETE
                          ? "UPDATE runs SET deleting = 1, ended_at = COALESCE(ended_at, ?2) "
                            "WHERE name = ?1 RETURNING id"
                          : "UPDATE runs SET ended_at = COALESCE(ended_at, ?2) "
                            "WHERE name = ?1 AND deleting = 0 RETURNING id";
    sqlite3_stmt *st;
    int rc = sqlite3_prepare_v2(s->db, sql, -1, &st, NULL);
    if (rc != SQLITE_OK)
        return rc;
    sqlite3_bind_text(st, 1, q->run, -1, SQLITE_STATIC);
    sqlite3_bind_double(st, 2, now);
    rc = sqlite3_step(st);
    q->status = rc == SQLITE_ROW ? 0 : -ENOENT;
    q->out_id = rc == SQLITE_ROW ? sqlite3_column_int64(st, 0) : 0;
    if (rc == SQLITE_ROW)
        rc = sqlite3_step(st);
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE)
        return rc;
    if (q->op == STORE_RUN_DELETE && q->status == 0)
        s->w_runs_due = 1;
    return SQLITE_OK;
}

void store_runs_settle(struct store *s, struct store_item **batch, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        struct store_item *it = batch[i];
        if (it->kind == STORE_ITEM_RUN && it->run.waiter)
            store_waiter_settle(it->run.waiter, s->refused[i] ? -EIO : it->run.status,
                                it->run.out_id);
    }
}

/* --- the lifecycle pass ------------------------------------------------------------- */

static double runs_interval(const struct store_opts *o)
{
    double iv = o->prune_interval_s;
    const double t[3] = {o->run_idle_end_s, o->run_retention_s, o->run_hello_grace_s};
    for (int i = 0; i < 3; i++)
        if (t[i] > 0 && t[i] / 4 < iv)
            iv = t[i] / 4;
    return iv < FS_STORE_RUN_CHECK_MIN_S ? FS_STORE_RUN_CHECK_MIN_S : iv;
}

/* Ends idle runs and collects up to max runs due for deletion into ids;
 * inside the open transaction. */
static int runs_due(struct store *s, double now, int64_t *ids, size_t max, size_t *n,
                    uint64_t *ended)
{
    const struct store_opts *o = &s->opts;
    sqlite3_stmt *st;
    int rc;
    *n = 0;
    *ended = 0;
    if (o->run_idle_end_s > 0) {
        rc = sqlite3_prepare_v2(s->db,
                                "UPDATE runs SET ended_at = ?1 WHERE ended_at IS NULL AND "
                                "reports > 0 AND deleting = 0 AND last_seen_at < ?1 - ?2",
                                -1, &st, NULL);
        if (rc != SQLITE_OK)
            return rc;
        sqlite3_bind_double(st, 1, now);
        sqlite3_bind_double(st, 2, o->run_idle_end_s);
        rc = sqlite3_step(st);
        sqlite3_finalize(st);
        if (rc != SQLITE_DONE)
            return rc;
        *ended = (uint64_t)sqlite3_changes(s->db);
    }
    rc = sqlite3_prepare_v2(s->db,
                            "SELECT id FROM runs WHERE deleting = 1 "
                            "OR (?2 > 0 AND ended_at < ?1 - ?2 AND " RW_SENT_SQL ") "
                            "OR (?3 > 0 AND reports = 0 AND last_seen_at < ?1 - ?3) "
                            "ORDER BY id LIMIT ?4",
                            -1, &st, NULL);
    if (rc != SQLITE_OK)
        return rc;
    sqlite3_bind_double(st, 1, now);
    sqlite3_bind_double(st, 2, o->run_retention_s);
    sqlite3_bind_double(st, 3, o->run_hello_grace_s);
    sqlite3_bind_int64(st, 4, (int64_t)max);
    sqlite3_bind_text(st, 5, s->opts.rw_targets_json ? s->opts.rw_targets_json : "[]", -1,
                      SQLITE_STATIC);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW && *n < max)
        ids[(*n)++] = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    return rc == SQLITE_DONE || rc == SQLITE_ROW ? SQLITE_OK : rc;
}

void store_runs_if_due(struct store *s, double *next)
{
    double mono = fs_clock_mono();
    if (mono < *next && !s->w_runs_due)
        return;
    s->w_runs_due = 0;
    *next = mono + runs_interval(&s->opts);
    int64_t ids[FS_STORE_RUN_DELETE_BATCH];
    size_t n = 0;
    uint64_t ended = 0;
    int rc = sqlite3_exec(s->db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    if (rc == SQLITE_OK)
        rc = runs_due(s, fs_clock_unix(), ids, FS_STORE_RUN_DELETE_BATCH, &n, &ended);
    for (size_t i = 0; rc == SQLITE_OK && i < n; i++)
        rc = store_run_delete_rows(s->db, ids[i]);
    if (rc == SQLITE_OK)
        rc = sqlite3_exec(s->db, "COMMIT", NULL, NULL, NULL);
    if (rc != SQLITE_OK) {
        log_limited(&s->rl_fail, LOG_LEVEL_WARN, "store", "run lifecycle: %s; retrying in %.1f s",
                    sqlite3_errmsg(s->db), *next - mono);
        if (!sqlite3_get_autocommit(s->db))
            sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
        return;
    }
    if (ended)
        log_info("store", "run lifecycle: %llu runs ended (no report for run_idle_end_s = %.0f s)",
                 (unsigned long long)ended, s->opts.run_idle_end_s);
    if (!n)
        return;
    /* The series cache may hold ids of deleted series: start it afresh. */
    store_cache_clear(&s->cache);
    int oom = 0;
    for (size_t i = 0; i < n; i++)
        oom |= spool_set_done(s->spool, ids[i], INT64_MAX) < 0;
    if (oom)
        log_limited(&s->rl_fail, LOG_LEVEL_ERROR, "store",
                    "spool: out of memory noting deleted runs; their records stay on disk");
    spool_release(s->spool, &s->committed);
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < n; i++) {
        struct store_result r = {.kind = STORE_RESULT_RUN_GONE, .run_id = ids[i]};
        if (store_res_push(s, &r) < 0)
            log_error("store", "out of memory announcing deleted run %lld", (long long)ids[i]);
    }
    s->spool_bytes = spool_bytes(s->spool);
    atomic_store(&s->stats->spool_bytes, s->spool_bytes);
    if (s->notify)
        s->notify(s->notify_ctx);
    pthread_mutex_unlock(&s->mu);
    log_info("store", "run lifecycle: deleted %zu runs with every row of them", n);
    if (n >= FS_STORE_RUN_DELETE_BATCH)
        *next = mono; /* more are due: again after the next item batch */
}
