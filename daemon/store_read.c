/* Read-only queries over a Foreshock database for offline tools (see
 * store_read.h). The daemon's own reads live in the writer's files
 * (store_*.c), store_restart.c (restart), pager_outbox.c (the pager) and
 * http_sql.c (HTTP); this file is the one place offline tools read from. */
#include "store_read.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>
#include <sqlite3.h>

#include "fs_grow.h"
#include "schema.h"

/* A backtest reads while a daemon may be writing: wait this long for a
 * lock (only a checkpoint can hold one against a reader) before failing. */
#define STORE_READ_BUSY_MS 5000

struct store_reader {
    sqlite3 *db;
    int version; /* PRAGMA user_version */
    char path[FS_CONFIG_MAX_PATH];
};

static int fail(struct store_reader *r, int rc, struct fs_err *err, const char *what)
{
    return fs_err_set(err, rc, "%s: %s: %s", r->path, what, sqlite3_errmsg(r->db));
}

int store_reader_open(const char *path, struct store_reader **out, struct fs_err *err)
{
    struct store_reader *r = calloc(1, sizeof(*r));
    sqlite3_stmt *q = NULL;
    int rc = -EIO;

    *out = NULL;
    if (!r)
        return fs_err_set(err, -ENOMEM, "out of memory");
    snprintf(r->path, sizeof(r->path), "%s", path);
    if (sqlite3_open_v2(path, &r->db, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK) {
        rc = fail(r, -ENOENT, err, "cannot open");
        goto out;
    }
    sqlite3_busy_timeout(r->db, STORE_READ_BUSY_MS);
    if (sqlite3_prepare_v2(r->db, "PRAGMA user_version", -1, &q, NULL) != SQLITE_OK ||
        sqlite3_step(q) != SQLITE_ROW) {
        rc = fail(r, -EIO, err, "not a readable SQLite database");
        goto out;
    }
    int version = r->version = sqlite3_column_int(q, 0);
    if (version < 1 || version > schema_migration_count) {
        rc = fs_err_set(err, -EPROTO,
                        "%s: schema version %d: not a Foreshock database this build reads "
                        "(1..%d)",
                        path, version, schema_migration_count);
        goto out;
    }
    rc = 0;
out:
    sqlite3_finalize(q);
    if (rc < 0) {
        store_reader_close(r);
        return rc;
    }
    *out = r;
    return 0;
}

int store_reader_version(const struct store_reader *r)
{
    return r->version;
}

void store_reader_close(struct store_reader *r)
{
    if (!r)
        return;
    sqlite3_close(r->db);
    free(r);
}

/* The lowest rank named in a range list ("4-7,0-3" -> 0); 0 for NULL. */
static uint32_t lowest_rank(const char *ranges)
{
    uint64_t low = UINT64_MAX;
    for (const char *c = ranges; c && *c;) {
        char *end;
        unsigned long long v = strtoull(c, &end, 10);
        if (end == c)
            break;
        if (v < low)
            low = v;
        c = strchr(end, ',');
        c = c ? c + 1 : NULL;
    }
    return low <= UINT32_MAX ? (uint32_t)low : 0;
}

/* The optimizer's class name in a stored model shape (JSON), else "". */
static void optimizer_of(const char *model_json, char *out, size_t len)
{
    out[0] = '\0';
    json_t *o = model_json ? json_loads(model_json, 0, NULL) : NULL;
    const char *name = json_string_value(json_object_get(o, "optimizer"));
    if (name && strlen(name) < len)
        snprintf(out, len, "%s", name);
    json_decref(o);
}

int store_reader_runs(struct store_reader *r,
                      int (*cb)(void *ctx, const struct store_run_info *run), void *ctx,
                      struct fs_err *err)
{
    sqlite3_stmt *q = NULL;
    int rc, out = 0;

    /* The lowest rank of a declared local group, without parsing it: the
     * first number of the comma-joined ranges is not always the lowest
     * ("4-7,0-3"), so every range's start is compared below. */
    const char *sql =
        r->version >= SCHEMA_LOCAL_GROUP_VERSION
            ? "SELECT id, name, detect_from_step, last_step, " SCHEMA_RUN_LOCAL_RANKS_SQL(
                  "runs.id") ", model_json FROM runs ORDER BY id"
            : "SELECT id, name, detect_from_step, last_step, NULL, model_json FROM runs "
              "ORDER BY id";
    if (sqlite3_prepare_v2(r->db, sql, -1, &q, NULL) != SQLITE_OK)
        return fail(r, -EIO, err, "reading runs");
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        struct store_run_info run = {.id = sqlite3_column_int64(q, 0)};
        const char *name = (const char *)sqlite3_column_text(q, 1);
        snprintf(run.name, sizeof(run.name), "%s", name ? name : "");
        int64_t from = sqlite3_column_int64(q, 2);
        run.detect_from_step = from > 0 ? (uint64_t)from : 0;
        run.last_step = sqlite3_column_type(q, 3) == SQLITE_NULL ? -1 : sqlite3_column_int64(q, 3);
        run.lead_rank = lowest_rank((const char *)sqlite3_column_text(q, 4));
        optimizer_of((const char *)sqlite3_column_text(q, 5), run.optimizer, sizeof(run.optimizer));
        if ((out = cb(ctx, &run)) != 0)
            break;
    }
    if (out == 0 && rc != SQLITE_DONE)
        out = fail(r, -EIO, err, "reading runs");
    sqlite3_finalize(q);
    return out;
}

int store_reader_points(struct store_reader *r, int64_t run_id,
                        bool (*want)(void *ctx, const struct store_series_key *k),
                        int (*cb)(void *ctx, const struct store_series_key *k, uint64_t step,
                                  double value, bool present),
                        void *ctx, struct fs_err *err)
{
    return store_reader_points_upto(r, run_id, INT64_MAX, want, cb, ctx, err);
}

int store_reader_points_upto(struct store_reader *r, int64_t run_id, int64_t max_step,
                             bool (*want)(void *ctx, const struct store_series_key *k),
                             int (*cb)(void *ctx, const struct store_series_key *k, uint64_t step,
                                       double value, bool present),
                             void *ctx, struct fs_err *err)
{
    sqlite3_stmt *s = NULL, *q = NULL;
    struct store_series_key *keys = NULL;
    int64_t *ids = NULL;
    size_t n = 0, cap_keys = 0, cap_ids = 0;
    int rc, out = 0;

    /* The run's series first: the caller picks which it wants, and only
     * their points are read. */
    if (sqlite3_prepare_v2(r->db,
                           "SELECT id, name, layer, head, \"window\", rank FROM series "
                           "WHERE run_id = ?1 ORDER BY id",
                           -1, &s, NULL) != SQLITE_OK)
        return fail(r, -EIO, err, "reading series");
    sqlite3_bind_int64(s, 1, run_id);
    while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
        struct store_series_key k = {0};
        const char *name = (const char *)sqlite3_column_text(s, 1);
        snprintf(k.name, sizeof(k.name), "%s", name ? name : "");
        k.layer = sqlite3_column_int(s, 2);
        k.head = sqlite3_column_int(s, 3);
        k.window = sqlite3_column_int(s, 4);
        k.rank = sqlite3_column_int(s, 5);
        if (want && !want(ctx, &k))
            continue;
        struct store_series_key *nk = fs_grow(keys, &cap_keys, n + 1, sizeof(*nk), 64);
        int64_t *ni = nk ? fs_grow(ids, &cap_ids, n + 1, sizeof(*ni), 64) : NULL;
        if (nk)
            keys = nk;
        if (!ni) {
            out = fs_err_set(err, -ENOMEM, "out of memory reading series");
            goto done;
        }
        ids = ni;
        keys[n] = k;
        ids[n++] = sqlite3_column_int64(s, 0);
    }
    if (rc != SQLITE_DONE) {
        out = fail(r, -EIO, err, "reading series");
        goto done;
    }
    if (n == 0)
        goto done;
    /* Points of the run in (step, series id) order, a step's learning
     * rates first: as the live stage feeds a report (its LR before the
     * series judged against it, evaluate.h). The wanted series are looked
     * up by id in the sorted ids[] (series ids ascend). */
    if (sqlite3_prepare_v2(r->db,
                           "SELECT p.series_id, p.step, p.value FROM points p "
                           "JOIN series s ON s.id = p.series_id WHERE s.run_id = ?1 "
                           "AND p.step <= ?2 ORDER BY p.step, s.name <> 'lr', p.series_id",
                           -1, &q, NULL) != SQLITE_OK) {
        out = fail(r, -EIO, err, "reading points");
        goto done;
    }
    sqlite3_bind_int64(q, 1, run_id);
    sqlite3_bind_int64(q, 2, max_step);
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        int64_t id = sqlite3_column_int64(q, 0);
        size_t lo = 0, hi = n;
        while (lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            if (ids[mid] < id)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo == n || ids[lo] != id)
            continue;
        int64_t step = sqlite3_column_int64(q, 1);
        bool present = sqlite3_column_type(q, 2) != SQLITE_NULL;
        double v = present ? sqlite3_column_double(q, 2) : NAN;
        if (step < 0)
            continue;
        if ((out = cb(ctx, &keys[lo], (uint64_t)step, v, present)) != 0)
            goto done;
    }
    if (rc != SQLITE_DONE)
        out = fail(r, -EIO, err, "reading points");
done:
    sqlite3_finalize(q);
    sqlite3_finalize(s);
    free(keys);
    free(ids);
    return out;
}
