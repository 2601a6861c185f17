/* The monitor stage's restart reads. See store_restart.h. */
#include "store_restart.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fs_grow.h"
#include "fs_limits.h"
#include "schema.h"

struct store_restart {
    sqlite3 *db;
    sqlite3_stmt *scalar; /* store_restart_scalar's, prepared on first use */
};

static int load_fail(sqlite3 *db, struct fs_err *err, const char *what)
{
    return fs_err_set(err, -EIO, "loading monitor state (%s): %s", what, sqlite3_errmsg(db));
}

int store_restart_open(const char *path, struct store_restart **out, struct fs_err *err)
{
    *out = NULL;
    struct store_restart *r = calloc(1, sizeof(*r));
    if (!r)
        return fs_err_set(err, -ENOMEM, "out of memory");
    int rc = store_open_readonly(path, &r->db, err);
    if (rc < 0) {
        free(r);
        return rc;
    }
    *out = r;
    return 0;
}

void store_restart_close(struct store_restart *r)
{
    if (!r)
        return;
    sqlite3_finalize(r->scalar);
    sqlite3_close(r->db);
    free(r);
}

/* The model shape a Hello stored (ingest writes it as JSON): layers and
 * heads within their limits, else 0; the optimizer's class name, else "". */
static void model_from_json(struct store_restart_run *run, const char *text)
{
    if (!text)
        return;
    json_t *o = json_loads(text, 0, NULL);
    if (!o)
        return;
    json_int_t l = json_integer_value(json_object_get(o, "n_layers"));
    json_int_t h = json_integer_value(json_object_get(o, "n_heads"));
    if (l > 0 && l <= FS_MAX_LAYERS)
        run->n_layers = (uint32_t)l;
    if (h > 0 && h <= FS_MAX_HEADS)
        run->n_heads = (uint32_t)h;
    const char *opt = json_string_value(json_object_get(o, "optimizer"));
    if (opt && strlen(opt) <= FS_MAX_OPTIMIZER_LEN)
        snprintf(run->optimizer, sizeof(run->optimizer), "%s", opt);
    json_decref(o);
}

int store_restart_runs(struct store_restart *r,
                       int (*cb)(void *ctx, const struct store_restart_run *run), void *ctx,
                       struct fs_err *err)
{
    sqlite3 *db = r->db;
    sqlite3_stmt *q = NULL;
    /* Runs: shape and detect_from_step; done_step as recorded with the
     * monitor rows (NULL in a database of an older version). */
    if (sqlite3_prepare_v2(db,
                           "SELECT id, name, world_size, detect_from_step, model_json, "
                           "spool_done_step, " SCHEMA_RUN_LOCAL_RANKS_SQL("runs.id") " FROM runs",
                           -1, &q, NULL) != SQLITE_OK)
        return load_fail(db, err, "runs");
    int rc, stop = 0;
    while (!stop && (rc = sqlite3_step(q)) == SQLITE_ROW) {
        struct store_restart_run run = {.id = sqlite3_column_int64(q, 0),
                                        .name = (const char *)sqlite3_column_text(q, 1),
                                        .world_size = (uint32_t)sqlite3_column_int64(q, 2),
                                        .local_ranks = (const char *)sqlite3_column_text(q, 6),
                                        .has_done_step = sqlite3_column_type(q, 5) != SQLITE_NULL,
                                        .done_step = sqlite3_column_int64(q, 5)};
        if (sqlite3_column_int64(q, 3) > 0)
            run.detect_from_step = (uint64_t)sqlite3_column_int64(q, 3);
        model_from_json(&run, (const char *)sqlite3_column_text(q, 4));
        stop = cb(ctx, &run);
    }
    sqlite3_finalize(q);
    if (stop)
        return stop;
    if (rc != SQLITE_DONE)
        return load_fail(db, err, "runs");
    return 0;
}

int store_restart_detected_steps(struct store_restart *r,
                                 int (*cb)(void *ctx, int64_t run_id, int64_t step), void *ctx,
                                 struct fs_err *err)
{
    sqlite3 *db = r->db;
    sqlite3_stmt *q = NULL;
    if (sqlite3_prepare_v2(db,
                           "SELECT s.run_id, max(d.step) FROM detector_state d "
                           "JOIN series s ON s.id = d.series_id WHERE s.rank = -1 "
                           "GROUP BY s.run_id",
                           -1, &q, NULL) != SQLITE_OK)
        return load_fail(db, err, "evaluated steps");
    int rc, stop = 0;
    while (!stop && (rc = sqlite3_step(q)) == SQLITE_ROW)
        stop = cb(ctx, sqlite3_column_int64(q, 0), sqlite3_column_int64(q, 1));
    sqlite3_finalize(q);
    if (stop)
        return stop;
    if (rc != SQLITE_DONE)
        return load_fail(db, err, "evaluated steps");
    return 0;
}

int store_restart_scalar(struct store_restart *r, int64_t run_id, uint32_t rank, const char *name,
                         int (*cb)(void *ctx, uint64_t step, double value), void *ctx,
                         struct fs_err *err)
{
    sqlite3 *db = r->db;
    /* One run at a time, one rank's series only: a 1,024-rank job stores
     * 1,024 learning-rate series and only one of them counts. */
    if (!r->scalar && sqlite3_prepare_v2(db,
                                         "SELECT p.step, p.value FROM points p "
                                         "JOIN series s ON s.id = p.series_id WHERE s.run_id = ?1 "
                                         "AND s.name = ?3 AND s.rank = ?2 AND s.layer = -1 "
                                         "AND s.head = -1 ORDER BY p.step",
                                         -1, &r->scalar, NULL) != SQLITE_OK)
        return load_fail(db, err, name);
    sqlite3_stmt *q = r->scalar;
    sqlite3_bind_int64(q, 1, run_id);
    sqlite3_bind_int64(q, 2, (int64_t)rank);
    sqlite3_bind_text(q, 3, name, -1, SQLITE_STATIC);
    int rc, stop = 0;
    while (!stop && (rc = sqlite3_step(q)) == SQLITE_ROW)
        if (sqlite3_column_type(q, 1) != SQLITE_NULL && sqlite3_column_int64(q, 0) >= 0)
            stop = cb(ctx, (uint64_t)sqlite3_column_int64(q, 0), sqlite3_column_double(q, 1));
    sqlite3_reset(q);
    if (stop)
        return stop;
    if (rc != SQLITE_DONE)
        return load_fail(db, err, name);
    return 0;
}

/* A series key from its columns name, layer, head, window, rank at col..;
 * false for a series without a name. */
static bool key_of(sqlite3_stmt *q, int col, struct store_series_key *k)
{
    const char *name = (const char *)sqlite3_column_text(q, col);
    if (!name)
        return false;
    snprintf(k->name, sizeof(k->name), "%s", name);
    k->layer = sqlite3_column_int(q, col + 1);
    k->head = sqlite3_column_int(q, col + 2);
    k->window = sqlite3_column_int(q, col + 3);
    k->rank = sqlite3_column_int(q, col + 4);
    return true;
}

int store_restart_detectors(struct store_restart *r,
                            int (*cb)(void *ctx, const struct store_restart_detector *d), void *ctx,
                            struct fs_err *err)
{
    sqlite3 *db = r->db;
    sqlite3_stmt *q = NULL;
    if (sqlite3_prepare_v2(db,
                           "SELECT s.run_id, d.step, d.state, s.name, s.layer, s.head, "
                           "s.\"window\", s.rank FROM detector_state d "
                           "JOIN series s ON s.id = d.series_id",
                           -1, &q, NULL) != SQLITE_OK)
        return load_fail(db, err, "detector_state");
    int rc, stop = 0;
    while (!stop && (rc = sqlite3_step(q)) == SQLITE_ROW) {
        struct store_restart_detector d = {.run_id = sqlite3_column_int64(q, 0),
                                           .step = sqlite3_column_int64(q, 1)};
        if (!key_of(q, 3, &d.key))
            continue;
        d.state = sqlite3_column_blob(q, 2);
        d.len = (size_t)sqlite3_column_bytes(q, 2);
        stop = cb(ctx, &d);
    }
    sqlite3_finalize(q);
    if (stop)
        return stop;
    if (rc != SQLITE_DONE)
        return load_fail(db, err, "detector_state");
    return 0;
}

static enum alert_attribution attribution_of(const char *s)
{
    enum alert_attribution a = ALERT_ATTR_NONE;
    if (s && alert_attribution_parse(s, strlen(s), &a) < 0)
        a = ALERT_ATTR_NONE;
    return a;
}

static double col_real(sqlite3_stmt *q, int i)
{
    return sqlite3_column_type(q, i) == SQLITE_NULL ? NAN : sqlite3_column_double(q, i);
}

int store_restart_alerts(struct store_restart *r,
                         int (*cb)(void *ctx, const struct store_restart_alert *a), void *ctx,
                         struct fs_err *err)
{
    sqlite3 *db = r->db;
    sqlite3_stmt *q = NULL;
    if (sqlite3_prepare_v2(db,
                           "SELECT a.run_id, a.state_blob, a.attribution, a.value, a.median, "
                           "a.mad, a.z, s.name, s.layer, s.head, s.\"window\", s.rank "
                           "FROM alerts a JOIN series s ON s.id = a.series_id",
                           -1, &q, NULL) != SQLITE_OK)
        return load_fail(db, err, "alerts");
    int rc, stop = 0;
    while (!stop && (rc = sqlite3_step(q)) == SQLITE_ROW) {
        struct store_restart_alert a = {.run_id = sqlite3_column_int64(q, 0)};
        if (!key_of(q, 7, &a.key))
            continue;
        a.state = sqlite3_column_blob(q, 1);
        a.len = (size_t)sqlite3_column_bytes(q, 1);
        a.attribution = attribution_of((const char *)sqlite3_column_text(q, 2));
        a.value = col_real(q, 3);
        a.median = col_real(q, 4);
        a.mad = col_real(q, 5);
        a.z = col_real(q, 6);
        stop = cb(ctx, &a);
    }
    sqlite3_finalize(q);
    if (stop)
        return stop;
    if (rc != SQLITE_DONE)
        return load_fail(db, err, "alerts");
    return 0;
}

int store_restart_streams(struct store_restart *r,
                          int (*cb)(void *ctx, int64_t stream_id, int64_t run_id, uint32_t attempt),
                          void *ctx, struct fs_err *err)
{
    sqlite3 *db = r->db;
    sqlite3_stmt *q = NULL;
    if (sqlite3_prepare_v2(db, "SELECT id, run_id, attempt FROM streams", -1, &q, NULL) !=
        SQLITE_OK)
        return load_fail(db, err, "streams");
    int rc, stop = 0;
    while (!stop && (rc = sqlite3_step(q)) == SQLITE_ROW)
        stop = cb(ctx, sqlite3_column_int64(q, 0), sqlite3_column_int64(q, 1),
                  (uint32_t)sqlite3_column_int64(q, 2));
    sqlite3_finalize(q);
    if (stop)
        return stop;
    if (rc != SQLITE_DONE)
        return load_fail(db, err, "streams");
    return 0;
}

int store_restart_attempts(struct store_restart *r,
                           int (*cb)(void *ctx, const struct store_restart_attempt *a), void *ctx,
                           struct fs_err *err)
{
    sqlite3 *db = r->db;
    sqlite3_stmt *q = NULL;
    if (sqlite3_prepare_v2(db,
                           "SELECT a.run_id, a.attempt, a.resume_step, a.rebuilt_at, "
                           "(SELECT max(b.attempt) FROM attempts b WHERE b.run_id = a.run_id "
                           "AND b.attempt < a.attempt) FROM attempts a WHERE a.attempt = "
                           "(SELECT max(c.attempt) FROM attempts c WHERE c.run_id = a.run_id)",
                           -1, &q, NULL) != SQLITE_OK)
        return load_fail(db, err, "attempts");
    int rc, stop = 0;
    while (!stop && (rc = sqlite3_step(q)) == SQLITE_ROW) {
        struct store_restart_attempt a = {.run_id = sqlite3_column_int64(q, 0),
                                          .attempt = (uint32_t)sqlite3_column_int64(q, 1),
                                          .has_resume = sqlite3_column_type(q, 2) != SQLITE_NULL,
                                          .rebuilt = sqlite3_column_type(q, 3) != SQLITE_NULL,
                                          .has_previous = sqlite3_column_type(q, 4) != SQLITE_NULL,
                                          .previous = (uint32_t)sqlite3_column_int64(q, 4)};
        a.resume_step = a.has_resume ? (uint64_t)sqlite3_column_int64(q, 2) : 0;
        stop = cb(ctx, &a);
    }
    sqlite3_finalize(q);
    if (stop)
        return stop;
    if (rc != SQLITE_DONE)
        return load_fail(db, err, "attempts");
    return 0;
}

int store_restart_spool_head(struct store_restart *r, struct spool_pos *out, struct fs_err *err)
{
    sqlite3 *db = r->db;
    sqlite3_stmt *q = NULL;
    if (sqlite3_prepare_v2(db, "SELECT segment, byte_offset FROM spool_log WHERE id = 1", -1, &q,
                           NULL) != SQLITE_OK)
        return load_fail(db, err, "spool_log");
    *out = (struct spool_pos){0, 0};
    int rc = sqlite3_step(q);
    if (rc == SQLITE_ROW)
        *out = (struct spool_pos){.seg = (uint64_t)sqlite3_column_int64(q, 0),
                                  .off = (uint64_t)sqlite3_column_int64(q, 1)};
    sqlite3_finalize(q);
    if (rc != SQLITE_ROW && rc != SQLITE_DONE)
        return load_fail(db, err, "spool_log");
    return 0;
}

int store_restart_spool_frames(struct store_restart *r, struct spool_frame **out, size_t *n,
                               struct fs_err *err)
{
    sqlite3 *db = r->db;
    sqlite3_stmt *q = NULL;
    *out = NULL;
    *n = 0;
    if (sqlite3_prepare_v2(db,
                           "SELECT f.segment, f.byte_offset, f.run_id, f.stream_id, f.seq, f.step "
                           "FROM spool_frames f JOIN runs r ON r.id = f.run_id "
                           "WHERE f.step > COALESCE(r.spool_done_step, -1) "
                           "ORDER BY f.segment, f.byte_offset",
                           -1, &q, NULL) != SQLITE_OK)
        return load_fail(db, err, "spool_frames");
    size_t cap = 0;
    int rc;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        struct spool_frame *p = fs_grow(*out, &cap, *n + 1, sizeof(*p), 64);
        if (!p) {
            sqlite3_finalize(q);
            free(*out);
            *out = NULL;
            *n = 0;
            return fs_err_set(err, -ENOMEM, "out of memory reading spool_frames");
        }
        *out = p;
        p[(*n)++] = (struct spool_frame){.seg = (uint64_t)sqlite3_column_int64(q, 0),
                                         .off = (uint64_t)sqlite3_column_int64(q, 1),
                                         .run_id = sqlite3_column_int64(q, 2),
                                         .stream_id = sqlite3_column_int64(q, 3),
                                         .seq = (uint64_t)sqlite3_column_int64(q, 4),
                                         .step = (uint64_t)sqlite3_column_int64(q, 5)};
    }
    sqlite3_finalize(q);
    if (rc != SQLITE_DONE) {
        free(*out);
        *out = NULL;
        *n = 0;
        return load_fail(db, err, "spool_frames");
    }
    return 0;
}
