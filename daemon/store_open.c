/* Opening and closing the store: the statement table the writer prepares,
 * the connection's configuration, the schema migrations under PRAGMA
 * user_version, the spool log at open (legacy spool table moved into it)
 * and the read-only connections of other threads. See store.h. */
#include "store.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "schema.h"
#include "spool.h"
#include "store_internal.h"
#include "store_stmt.h"

/* A Hello's model shape replaces the stored one, but a shape that names no
 * optimizer keeps the one an earlier Hello named (a rank whose client does
 * not send it), as the live run does (run.c run_hello): the restart must
 * judge the run as the daemon that heard it did. No shape: the stored one. */
#define STORE_MODEL_JSON_MERGE_SQL                                                                 \
    "CASE WHEN excluded.model_json IS NULL THEN runs.model_json "                                  \
    "WHEN json_valid(runs.model_json) AND json_valid(excluded.model_json) "                        \
    "AND json_extract(excluded.model_json, '$.optimizer') IS NULL "                                \
    "AND json_extract(runs.model_json, '$.optimizer') IS NOT NULL "                                \
    "THEN json_set(excluded.model_json, '$.optimizer', "                                           \
    "json_extract(runs.model_json, '$.optimizer')) "                                               \
    "ELSE excluded.model_json END"

static const char *const stmt_sql[ST_COUNT] = {
    [ST_BEGIN] = "BEGIN IMMEDIATE",
    [ST_COMMIT] = "COMMIT",
    [ST_ROLLBACK] = "ROLLBACK",
    /* id, live (store_runs.c), marked for deletion */
    [ST_RUN_FIND] = "SELECT id, " STORE_RUN_LIVE_SQL ", deleting FROM runs WHERE name = ?1",
    /* live runs, all of them (?1 NULL) or one owner's */
    [ST_RUN_COUNT] =
        "SELECT count(*) FROM runs WHERE " STORE_RUN_LIVE_SQL " AND (?1 IS NULL OR owner = ?1)",
    [ST_RUN_UPSERT] =
        "INSERT INTO runs (id, name, created_at, last_seen_at, world_size, detect_from_step, "
        "model_json, owner) VALUES (" STORE_NEXT_ID_SQL(
            "runs") ", ?1, ?2, ?2, ?3, "
                    "COALESCE(?4, 0), ?5, COALESCE(?6, '')) "
                    "ON CONFLICT (name) DO UPDATE SET last_seen_at = excluded.last_seen_at, "
                    "ended_at = NULL, "
                    "world_size = excluded.world_size, "
                    "detect_from_step = COALESCE(?4, runs.detect_from_step), "
                    "model_json = " STORE_MODEL_JSON_MERGE_SQL " RETURNING id",
    [ST_STREAM_UPSERT] =
        "INSERT INTO streams (id, run_id, attempt, rank, created_at, last_seen_at, local_ranks) "
        "VALUES (" STORE_NEXT_ID_SQL(
            "streams") ", ?1, ?2, ?3, ?4, ?4, ?5) ON CONFLICT (run_id, attempt, rank) DO UPDATE "
                       "SET "
                       "last_seen_at = excluded.last_seen_at, local_ranks = excluded.local_ranks "
                       "RETURNING id, last_seq",
    [ST_REPORT_INSERT] = "INSERT OR IGNORE INTO reports (stream_id, seq, step, received_at, "
                         "bytes) VALUES (?1, ?2, ?3, ?4, ?5)",
    [ST_SERIES_FIND] = "SELECT id FROM series WHERE run_id = ?1 AND name = ?2 AND layer = ?3 "
                       "AND head = ?4 AND window = ?5 AND rank = ?6",
    [ST_SERIES_INSERT] = "INSERT INTO series (run_id, name, layer, head, window, rank) "
                         "VALUES (?1, ?2, ?3, ?4, ?5, ?6) RETURNING id",
    [ST_SERIES_BUMP] = "UPDATE series SET points = points + ?2, "
                       "first_step = MIN(COALESCE(first_step, ?3), ?3), "
                       "last_step = MAX(COALESCE(last_step, ?4), ?4) WHERE id = ?1",
    [ST_POINT_INSERT] =
        "INSERT OR IGNORE INTO points (series_id, step, value, time) VALUES (?1, ?2, ?3, ?4)",
    [ST_POINT_UPDATE] =
        "UPDATE points SET value = ?3, time = ?4 WHERE series_id = ?1 AND step = ?2",
    [ST_SPOOL_HEAD] = "INSERT INTO spool_log (id, segment, byte_offset) VALUES (1, ?1, ?2) "
                      "ON CONFLICT (id) DO UPDATE SET segment = excluded.segment, "
                      "byte_offset = excluded.byte_offset",
    [ST_RUN_DONE] = "UPDATE runs SET spool_done_step = MAX(COALESCE(spool_done_step, -1), ?2) "
                    "WHERE id = ?1",
    [ST_RUN_UNDONE] = "UPDATE runs SET spool_done_step = ?2 WHERE id = ?1 AND spool_done_step > ?2",
    [ST_STREAM_BUMP] = "UPDATE streams SET last_seq = MAX(last_seq, ?2), reports = reports + 1, "
                       "last_seen_at = ?3 WHERE id = ?1",
    /* a report of an ended run (its connection outlived run_idle_end_s) makes it live again */
    [ST_RUN_BUMP] = "UPDATE runs SET last_step = MAX(COALESCE(last_step, ?2), ?2), "
                    "reports = reports + 1, last_seen_at = ?3, ended_at = NULL WHERE id = ?1",
    [ST_STREAM_EXISTS] = "SELECT 1 FROM streams WHERE id = ?1",
    [ST_RUN_EXISTS] = "SELECT 1 FROM runs WHERE id = ?1",
    [ST_STATE_PUT] = "INSERT INTO detector_state (series_id, step, state) VALUES (?1, ?2, ?3) "
                     "ON CONFLICT (series_id) DO UPDATE SET step = excluded.step, "
                     "state = excluded.state",
    [ST_ALERT_UPSERT] =
        "INSERT INTO alerts (run_id, rule, alert_key, dedup_key, layer, head, \"window\", rank, "
        "series_id, state, severity, family, attribution, value, median, mad, z, "
        "first_breach_step, fired_step, resolved_step, last_step, incidents, created_at, "
        "updated_at, state_blob) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, "
        "?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23, ?23, ?24) "
        "ON CONFLICT (alert_key) DO UPDATE SET series_id = excluded.series_id, "
        /* A superseded incident (a rewind) stays the row's state until the
         * alert opens a new one: samples that only move its counters do not
         * turn it into inactive or an older resolve. */
        "state = CASE WHEN alerts.state = 4 AND excluded.state IN (0, 3) THEN 4 "
        "ELSE excluded.state END, severity = excluded.severity, family = excluded.family, "
        "attribution = excluded.attribution, value = excluded.value, median = excluded.median, "
        "mad = excluded.mad, z = excluded.z, first_breach_step = excluded.first_breach_step, "
        "fired_step = excluded.fired_step, resolved_step = excluded.resolved_step, "
        "last_step = excluded.last_step, incidents = excluded.incidents, "
        "updated_at = excluded.updated_at, state_blob = excluded.state_blob RETURNING id",
    [ST_EVENT_INSERT] = "INSERT INTO alert_events (alert_id, change, from_state, to_state, step, "
                        "at, attribution, evidence_json, attempt, severity) "
                        "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
    [ST_INCOMPLETE_PUT] = "INSERT OR REPLACE INTO incomplete (run_id, step, kind, layer, head, "
                          "\"window\", have, want, recorded_at) "
                          "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
    [ST_OUTBOX_INSERT] = "INSERT INTO outbox (id, alert_id, event_id, target, kind, severity, "
                         "attribution, created_at, updated_at) "
                         "VALUES (" STORE_NEXT_ID_SQL("outbox") ", ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7)",
    [ST_OUTBOX_OUTCOME] =
        "UPDATE outbox SET state = ?2, attempts = ?3, next_attempt_at = ?4, last_status = ?5, "
        "last_error = ?6, updated_at = ?7, "
        "done_at = CASE WHEN ?2 IN " STORE_OUTBOX_SQL_FINISHED " THEN ?7 ELSE NULL END "
        "WHERE id = ?1",
    [ST_FRAME_INSERT] = "INSERT OR REPLACE INTO spool_frames (segment, byte_offset, run_id, "
                        "stream_id, seq, step) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    [ST_FRAME_DONE] = "DELETE FROM spool_frames WHERE run_id = ?1 AND step <= ?2",
};

/* --- open, migrate, close -------------------------------------------------------------- */

static int exec_sql(sqlite3 *db, const char *sql, struct fs_err *err, const char *what)
{
    char *msg = NULL;
    int rc = sqlite3_exec(db, sql, NULL, NULL, &msg);
    if (rc != SQLITE_OK)
        fs_err_set(err, rc, "%s: %s", what, msg ? msg : sqlite3_errstr(rc));
    sqlite3_free(msg);
    return rc;
}

static int pragma_int(sqlite3 *db, const char *sql, int64_t *out)
{
    sqlite3_stmt *st;
    int rc = sqlite3_prepare_v2(db, sql, -1, &st, NULL);
    if (rc != SQLITE_OK)
        return rc;
    rc = exec1(st, out, 1);
    sqlite3_finalize(st);
    return rc == SQLITE_ROW ? SQLITE_OK : (ok(rc) ? SQLITE_ERROR : rc);
}

static int migrate(sqlite3 *db, const char *path, struct fs_err *err)
{
    int64_t version = 0;
    if (pragma_int(db, "PRAGMA user_version", &version) != SQLITE_OK)
        return fs_err_set(err, -EIO, "%s: cannot read user_version: %s", path, sqlite3_errmsg(db));
    if (version > schema_migration_count)
        return fs_err_set(err, -EPROTO,
                          "%s: database schema version %lld is newer than this foreshockd "
                          "knows (%d); refusing to open it",
                          path, (long long)version, schema_migration_count);
    for (int i = (int)version; i < schema_migration_count; i++) {
        const struct schema_migration *m = &schema_migrations[i];
        char what[256], sql[64];
        snprintf(what, sizeof(what), "%s: migration %s", path, m->name);
        snprintf(sql, sizeof(sql), "PRAGMA user_version = %d", m->version);
        if (exec_sql(db, "BEGIN IMMEDIATE", err, what) != SQLITE_OK)
            return -EIO;
        if (exec_sql(db, m->sql, err, what) != SQLITE_OK ||
            exec_sql(db, sql, err, what) != SQLITE_OK ||
            exec_sql(db, "COMMIT", err, what) != SQLITE_OK) {
            sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
            return -EIO;
        }
        log_info("store", "applied migration %s", m->name);
    }
    return 0;
}

/* The spool log beside the database (spool.h): opened at the end the
 * database recorded, told how far each run is evaluated, cleared of what
 * that covers. Rows an older foreshockd left in the spool table are moved
 * into the log first. Main thread, before the writer starts. */
static int read_spool_head(sqlite3 *db, struct spool_pos *head)
{
    sqlite3_stmt *q;
    int rc = sqlite3_prepare_v2(db, "SELECT segment, byte_offset FROM spool_log WHERE id = 1", -1,
                                &q, NULL);
    if (rc != SQLITE_OK)
        return rc;
    *head = (struct spool_pos){0, 0};
    rc = sqlite3_step(q);
    if (rc == SQLITE_ROW)
        *head = (struct spool_pos){.seg = (uint64_t)sqlite3_column_int64(q, 0),
                                   .off = (uint64_t)sqlite3_column_int64(q, 1)};
    sqlite3_finalize(q);
    return ok(rc) ? SQLITE_OK : rc;
}

static int import_legacy_spool(struct store *s, const char *path, struct fs_err *err)
{
    int64_t rows = 0;
    if (pragma_int(s->db, "SELECT count(*) FROM spool", &rows) != SQLITE_OK)
        return fs_err_set(err, -EIO, "%s: reading the spool table: %s", path,
                          sqlite3_errmsg(s->db));
    if (rows == 0)
        return 0;
    sqlite3_stmt *q;
    if (sqlite3_prepare_v2(s->db,
                           "SELECT sp.run_id, sp.stream_id, st.rank, sp.seq, sp.step, sp.body "
                           "FROM spool sp JOIN streams st ON st.id = sp.stream_id ORDER BY sp.id",
                           -1, &q, NULL) != SQLITE_OK) {
        return fs_err_set(err, -EIO, "%s: reading the spool table: %s", path,
                          sqlite3_errmsg(s->db));
    }
    int rc, e = 0;
    uint64_t moved = 0, bytes = 0;
    while (e == 0 && (rc = sqlite3_step(q)) == SQLITE_ROW) {
        int len = sqlite3_column_bytes(q, 5);
        const uint8_t *body = sqlite3_column_blob(q, 5);
        if (!body || len <= 0)
            continue;
        struct spool_rec rec = {.run_id = sqlite3_column_int64(q, 0),
                                .stream_id = sqlite3_column_int64(q, 1),
                                .rank = (uint32_t)sqlite3_column_int64(q, 2),
                                .seq = (uint64_t)sqlite3_column_int64(q, 3),
                                .step = (uint64_t)sqlite3_column_int64(q, 4),
                                .len = (uint32_t)len};
        e = spool_append(s->spool, &rec, body);
        moved++;
        bytes += (uint64_t)len;
    }
    sqlite3_finalize(q);
    if (e == 0 && rc != SQLITE_DONE)
        e = -EIO;
    struct spool_pos head = spool_head(s->spool);
    /* Durable before the rows go, whatever the synchronous setting. */
    if (e == 0)
        e = spool_sync(s->spool);
    if (e == 0 && (exec_sql(s->db, "BEGIN IMMEDIATE", err, path) != SQLITE_OK ||
                   exec_sql(s->db, "DELETE FROM spool", err, path) != SQLITE_OK))
        e = -EIO;
    if (e == 0) {
        sqlite3_stmt *st = s->st[ST_SPOOL_HEAD];
        sqlite3_bind_int64(st, 1, (int64_t)head.seg);
        sqlite3_bind_int64(st, 2, (int64_t)head.off);
        if (!ok(exec1(st, NULL, 0)) || exec_sql(s->db, "COMMIT", err, path) != SQLITE_OK)
            e = -EIO;
    }
    if (e < 0) {
        if (!sqlite3_get_autocommit(s->db))
            sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
        spool_rewind(s->spool, &s->committed);
        if (e != -EIO || !err->msg[0])
            fs_err_set(err, e, "%s: moving the spool table into the spool log: %s", path,
                       e == -EIO ? sqlite3_errmsg(s->db) : strerror(-e));
        return e;
    }
    s->committed = head;
    log_info("store",
             "moved %llu spooled reports (%llu bytes) from the database into the spool "
             "log; the database keeps their free pages until a VACUUM",
             (unsigned long long)moved, (unsigned long long)bytes);
    return 0;
}

/* spool_forget_runs' question: is there a runs row of run_id? (ctx: the
 * prepared "SELECT 1 FROM runs WHERE id = ?1"; an error answers yes: the
 * records stay.) */
static bool run_known(void *ctx, int64_t run_id)
{
    sqlite3_stmt *q = ctx;
    sqlite3_bind_int64(q, 1, run_id);
    int rc = sqlite3_step(q);
    sqlite3_reset(q);
    return rc != SQLITE_DONE;
}

static int open_spool(struct store *s, const char *path, struct fs_err *err)
{
    char dir[SPOOL_PATH_MAX];
    if (spool_dir_of(path, dir, sizeof(dir)) < 0)
        return fs_err_set(err, -ENAMETOOLONG, "%s: path too long for its spool directory", path);
    if (read_spool_head(s->db, &s->committed) != SQLITE_OK)
        return fs_err_set(err, -EIO, "%s: reading spool_log: %s", path, sqlite3_errmsg(s->db));
    struct spool_opts so = {.sync_full = s->opts.synchronous_full};
    int rc = spool_open(dir, &s->committed, &so, &s->spool, err);
    if (rc < 0)
        return rc;
    spool_set_yield(s->spool, store_hello_interlude, s);
    err->msg[0] = '\0';
    if ((rc = import_legacy_spool(s, path, err)) < 0)
        return rc;
    sqlite3_stmt *q;
    if (sqlite3_prepare_v2(s->db,
                           "SELECT id, spool_done_step FROM runs WHERE spool_done_step IS NOT NULL",
                           -1, &q, NULL) != SQLITE_OK) {
        return fs_err_set(err, -EIO, "%s: reading evaluated steps: %s", path,
                          sqlite3_errmsg(s->db));
    }
    while ((rc = sqlite3_step(q)) == SQLITE_ROW)
        if (spool_set_done(s->spool, sqlite3_column_int64(q, 0), sqlite3_column_int64(q, 1)) < 0)
            break;
    sqlite3_finalize(q);
    if (rc != SQLITE_DONE)
        return fs_err_set(err, -EIO, "%s: reading evaluated steps: %s", path,
                          rc == SQLITE_ROW ? "out of memory" : sqlite3_errmsg(s->db));
    /* Records of runs deleted (store_runs.c) before their segments went. */
    if (sqlite3_prepare_v2(s->db, "SELECT 1 FROM runs WHERE id = ?1", -1, &q, NULL) != SQLITE_OK)
        return fs_err_set(err, -EIO, "%s: %s", path, sqlite3_errmsg(s->db));
    rc = spool_forget_runs(s->spool, run_known, q);
    sqlite3_finalize(q);
    if (rc < 0)
        return fs_err_set(err, rc, "%s: spool: out of memory", path);
    size_t freed = spool_release(s->spool, &s->committed);
    if (freed)
        log_info("store", "spool: deleted %zu segments of evaluated steps", freed);
    return 0;
}

static int configure(sqlite3 *db, const char *path, int full, struct fs_err *err)
{
    sqlite3_extended_result_codes(db, 1);
    sqlite3_busy_timeout(db, FS_STORE_BUSY_TIMEOUT_MS);
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "PRAGMA journal_mode = WAL", -1, &st, NULL) != SQLITE_OK)
        return fs_err_set(err, -EIO, "%s: %s", path, sqlite3_errmsg(db));
    int rc = sqlite3_step(st);
    const char *mode = rc == SQLITE_ROW ? (const char *)sqlite3_column_text(st, 0) : NULL;
    int wal = mode && (strcmp(mode, "wal") == 0 || strcmp(mode, "memory") == 0);
    char got[32];
    snprintf(got, sizeof(got), "%s", mode ? mode : "?");
    sqlite3_finalize(st);
    if (!wal)
        return fs_err_set(err, -EIO, "%s: cannot enable WAL (journal_mode is %s): %s", path, got,
                          sqlite3_errmsg(db));
    if (exec_sql(db, full ? "PRAGMA synchronous = FULL" : "PRAGMA synchronous = NORMAL", err,
                 path) != SQLITE_OK ||
        exec_sql(db, "PRAGMA foreign_keys = ON", err, path) != SQLITE_OK)
        return -EIO;
    return 0;
}

int store_open(const char *path, const struct store_opts *opts, struct store **out,
               struct fs_err *err)
{
    int rc = -ENOMEM;
    struct store *s = calloc(1, sizeof(*s));
    if (!s)
        return fs_err_set(err, -ENOMEM, "out of memory");
    s->opts = *opts;
    s->stats = opts->stats ? opts->stats : &s->own_stats;
    s->notify = opts->notify;
    s->notify_ctx = opts->notify_ctx;
    int mu = 0, cv = 0, done = 0;
    if (s->opts.batch_max_items < 1)
        s->opts.batch_max_items = 1;
    s->batch = calloc(s->opts.batch_max_items, sizeof(*s->batch));
    s->refused = calloc(s->opts.batch_max_items, 1);
    if (!s->batch || !s->refused) {
        fs_err_set(err, rc, "out of memory");
        goto fail;
    }
    int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX;
    if (sqlite3_open_v2(path, &s->db, flags, NULL) != SQLITE_OK) {
        rc = fs_err_set(err, -EIO, "cannot open database %s: %s", path,
                        s->db ? sqlite3_errmsg(s->db) : "out of memory");
        goto fail;
    }
    if ((rc = configure(s->db, path, opts->synchronous_full, err)) < 0 ||
        (rc = migrate(s->db, path, err)) < 0)
        goto fail;
    int bad = store_prepare_all(s->db, stmt_sql, ST_COUNT, s->st);
    if (bad < ST_COUNT) {
        rc = fs_err_set(err, -EIO, "%s: preparing statement %d: %s", path, bad,
                        sqlite3_errmsg(s->db));
        goto fail;
    }
    if ((rc = open_spool(s, path, err)) < 0)
        goto fail;
    s->spool_bytes = spool_bytes(s->spool);
    atomic_store(&s->stats->spool_bytes, s->spool_bytes);
    if ((rc = advice_store_open(s->db, &s->advice)) < 0 ||
        (rc = attempts_store_open(s->db, &s->attempts)) < 0) {
        fs_err_set(err, rc, "%s: preparing the advice and attempt statements: %s", path,
                   sqlite3_errmsg(s->db));
        goto fail;
    }
    rc = -ENOMEM;
    if (!(s->opts.prune_interval_s > 0))
        s->opts.prune_interval_s = FS_STORE_PRUNE_INTERVAL_S;
    /* The writer's timed wait (retention) is on the monotonic clock. */
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0) {
        fs_err_set(err, rc, "cannot create writer locks");
        goto fail;
    }
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    mu = !pthread_mutex_init(&s->mu, NULL);
    cv = mu && !pthread_cond_init(&s->cv, &ca);
    done = cv && !pthread_cond_init(&s->done_cv, NULL);
    pthread_condattr_destroy(&ca);
    if (!done) {
        fs_err_set(err, rc, "cannot create writer locks");
        goto fail;
    }
    if (pthread_create(&s->thread, NULL, store_writer_main, s) != 0) {
        rc = fs_err_set(err, -EAGAIN, "cannot start the writer thread");
        goto fail;
    }
    s->thread_started = 1;
    *out = s;
    return 0;
fail:
    if (done)
        pthread_cond_destroy(&s->done_cv);
    if (cv)
        pthread_cond_destroy(&s->cv);
    if (mu)
        pthread_mutex_destroy(&s->mu);
    store_finalize_all(s->st, ST_COUNT);
    advice_store_close(s->advice);
    attempts_store_close(s->attempts);
    sqlite3_close(s->db);
    spool_close(s->spool);
    free(s->w_done);
    free(s->batch);
    free(s->refused);
    free(s);
    return rc;
}

int store_close(struct store *s)
{
    if (!s)
        return 0;
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (s->thread_started)
        pthread_join(s->thread, NULL);
    store_finalize_all(s->st, ST_COUNT);
    for (int i = 0; i < SIL_COUNT; i++)
        sqlite3_finalize(s->sil_st[i]);
    advice_store_close(s->advice);
    attempts_store_close(s->attempts);
    /* Closing the last connection checkpoints the WAL into the database. */
    if (sqlite3_close(s->db) != SQLITE_OK)
        log_warn("store", "closing the database: %s", sqlite3_errmsg(s->db));
    pthread_cond_destroy(&s->done_cv);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    store_cache_free(&s->cache);
    spool_close(s->spool);
    free(s->w_done);
    free(s->batch);
    free(s->refused);
    free(s->res);
    free(s->wres);
    int rc = s->abandoned ? -EIO : 0;
    free(s);
    return rc;
}

int store_open_readonly(const char *path, sqlite3 **out, struct fs_err *err)
{
    sqlite3 *db = NULL;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK) {
        fs_err_set(err, -EIO, "cannot open database %s read-only: %s", path,
                   db ? sqlite3_errmsg(db) : "out of memory");
        sqlite3_close(db);
        return -EIO;
    }
    sqlite3_busy_timeout(db, FS_STORE_BUSY_TIMEOUT_MS);
    if (exec_sql(db, "PRAGMA query_only = 1", err, path) != SQLITE_OK) {
        sqlite3_close(db);
        return -EIO;
    }
    *out = db;
    return 0;
}
