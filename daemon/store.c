/* The writer thread: bounded queue in, batched transactions, results out
 * after COMMIT. See store.h for the contract. */
#include "store.h"
#include "fs_clock.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "alert.h" /* pinned state numbers only */
#include "foreshock.pb-c.h"
#include "log.h"
#include "schema.h"
#include "spool.h"

/* Upper bounds of the commit latency histogram, seconds. Counters are
 * cumulative (Prometheus style): bucket i counts commits <= le[i], and
 * bucket STATS_COMMIT_BUCKETS counts all of them (+Inf). */
const double stats_commit_bucket_le[STATS_COMMIT_BUCKETS] = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 5.0};

enum stmt_id {
    ST_BEGIN,
    ST_COMMIT,
    ST_ROLLBACK,
    ST_RUN_FIND,
    ST_RUN_COUNT,
    ST_RUN_UPSERT,
    ST_STREAM_UPSERT,
    ST_REPORT_INSERT,
    ST_SERIES_FIND,
    ST_SERIES_INSERT,
    ST_SERIES_BUMP,
    ST_POINT_INSERT,
    ST_POINT_UPDATE,
    ST_SPOOL_HEAD,
    ST_RUN_DONE,
    ST_STREAM_BUMP,
    ST_RUN_BUMP,
    ST_STATE_PUT,
    ST_ALERT_UPSERT,
    ST_EVENT_INSERT,
    ST_INCOMPLETE_PUT,
    ST_OUTBOX_INSERT,
    ST_OUTBOX_OUTCOME,
    ST_COUNT
};

static const char *const stmt_sql[ST_COUNT] = {
    [ST_BEGIN] = "BEGIN IMMEDIATE",
    [ST_COMMIT] = "COMMIT",
    [ST_ROLLBACK] = "ROLLBACK",
    [ST_RUN_FIND] = "SELECT id FROM runs WHERE name = ?1",
    [ST_RUN_COUNT] = "SELECT count(*) FROM runs",
    [ST_RUN_UPSERT] =
        "INSERT INTO runs (name, created_at, last_seen_at, world_size, detect_from_step, "
        "model_json) VALUES (?1, ?2, ?2, ?3, COALESCE(?4, 0), ?5) "
        "ON CONFLICT (name) DO UPDATE SET last_seen_at = excluded.last_seen_at, "
        "world_size = excluded.world_size, "
        "detect_from_step = COALESCE(?4, runs.detect_from_step), "
        "model_json = COALESCE(excluded.model_json, runs.model_json) RETURNING id",
    [ST_STREAM_UPSERT] =
        "INSERT INTO streams (run_id, attempt, rank, created_at, last_seen_at, local_ranks) "
        "VALUES (?1, ?2, ?3, ?4, ?4, ?5) ON CONFLICT (run_id, attempt, rank) DO UPDATE SET "
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
    [ST_POINT_UPDATE] = "UPDATE points SET value = ?3, time = ?4 WHERE series_id = ?1 AND step = ?2",
    [ST_SPOOL_HEAD] = "INSERT INTO spool_log (id, segment, byte_offset) VALUES (1, ?1, ?2) "
                      "ON CONFLICT (id) DO UPDATE SET segment = excluded.segment, "
                      "byte_offset = excluded.byte_offset",
    [ST_RUN_DONE] = "UPDATE runs SET spool_done_step = MAX(COALESCE(spool_done_step, -1), ?2) "
                    "WHERE id = ?1",
    [ST_STREAM_BUMP] = "UPDATE streams SET last_seq = MAX(last_seq, ?2), reports = reports + 1, "
                       "last_seen_at = ?3 WHERE id = ?1",
    [ST_RUN_BUMP] = "UPDATE runs SET last_step = MAX(COALESCE(last_step, ?2), ?2), "
                    "reports = reports + 1, last_seen_at = ?3 WHERE id = ?1",
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
                        "at, attribution, evidence_json, attempt) "
                        "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
    [ST_INCOMPLETE_PUT] = "INSERT OR REPLACE INTO incomplete (run_id, step, kind, layer, head, "
                          "\"window\", have, want, recorded_at) "
                          "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
    [ST_OUTBOX_INSERT] = "INSERT INTO outbox (alert_id, event_id, target, kind, severity, "
                         "attribution, created_at, updated_at) "
                         "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7)",
    [ST_OUTBOX_OUTCOME] =
        "UPDATE outbox SET state = ?2, attempts = ?3, next_attempt_at = ?4, last_status = ?5, "
        "last_error = ?6, updated_at = ?7, "
        "done_at = CASE WHEN ?2 IN (1, 2, 4) THEN ?7 ELSE NULL END WHERE id = ?1",
};

static const char *const scalar_series[STORE_NSCALARS] = {
    [STORE_LOSS] = "loss",       [STORE_GRAD_NORM] = "grad_norm", [STORE_LR] = "lr",
    [STORE_LOSS_SCALE] = "loss_scale", [STORE_TOKENS] = "tokens", [STORE_STEP_TIME] = "step_time",
};

/* Stream keys of queued reports, as bits (take_hellos). A false positive
 * only leaves a Hello in its place. */
#define STORE_HELLO_FILTER_BITS 65536u

/* --- series id cache (writer thread only) --------------------------------------
 * Entries live in a dense array (indices are stable while a batch runs);
 * an open-addressing index maps keys to entry indices. Each entry also
 * accumulates the batch's new points so that series.points/first_step/
 * last_step are written once per series per transaction. */
#define SERIES_NAME_MAX 48

struct series_entry {
    int64_t run_id, id;
    int32_t layer, head, window, rank;
    uint64_t hash;
    char name[SERIES_NAME_MAX];
    int64_t add_points, min_step, max_step;
    int dirty;
};

struct series_cache {
    struct series_entry *ents;
    size_t n, cap;
    uint32_t *slots; /* entry index + 1; 0 = empty */
    size_t nslots;   /* power of two */
    uint32_t *dirty; /* entry indices with add_points > 0 */
    size_t ndirty, capdirty;
};

struct store {
    sqlite3 *db;
    sqlite3_stmt *st[ST_COUNT];
    struct store_opts opts;
    struct fs_stats *stats;
    struct fs_stats own_stats; /* when opts.stats is NULL */

    pthread_t thread;
    int thread_started;
    pthread_mutex_t mu; /* guards everything down to `serving` */
    pthread_cond_t cv;      /* writer waits for items / stop */
    pthread_cond_t done_cv; /* store_flush waits for batches */
    struct store_item *head, *tail;
    uint64_t q_items, q_bytes;   /* queued + in the open transaction */
    uint64_t q_hellos;           /* HELLO items queued (not yet taken) */
    uint8_t w_reported[STORE_HELLO_FILTER_BITS / 8]; /* writer: take_hellos' scratch */
    uint64_t submitted, settled; /* item counts, for store_flush */
    uint64_t spool_bytes;        /* bytes in the spool's segment files */
    int refusing, stopping;
    double stop_deadline;     /* monotonic; > 0: failing writes are given up past it */
    uint64_t abandoned;       /* items given up at the stop deadline */
    struct store_result *res; /* announced, not yet taken */
    size_t nres, capres;
    void (*notify)(void *ctx);
    void *notify_ctx;
    atomic_int serving;
    /* outbox targets and the pager's announce hook (store_set_pager) */
    char pager_targets[STATS_MAX_TARGETS][STATS_TARGET_NAME_MAX];
    size_t n_pager_targets;
    void (*announce)(void *ctx, int64_t max_id);
    void *announce_ctx;

    /* writer thread only (the main thread at open and close) */
    struct spool *spool;
    struct spool_pos committed; /* the spool's end as the database records it */
    struct spool_done_step {
        int64_t run_id, step;
    } *w_done;                  /* runs.spool_done_step raised by the open transaction */
    size_t nw_done, capw_done;
    char w_spool_err[160];      /* why the open transaction's spool work failed ("": it did not) */
    /* The batch whose records spool_batch is appending, before its
     * transaction begins: hello_interlude may commit Hellos meanwhile. */
    struct store_item *const *w_spooling;
    size_t nw_spooling;
    struct series_cache cache;
    struct store_item **batch;   /* batch_max_items */
    unsigned char *refused;      /* batch_max_items flags */
    struct store_result *wres; /* results of the batch being written */
    size_t nwres, capwres;
    int64_t w_outbox_max;      /* highest outbox id inserted by the open transaction */
    char w_targets[STATS_MAX_TARGETS][STATS_TARGET_NAME_MAX]; /* copy taken per batch */
    size_t w_ntargets;
    struct log_ratelimit rl_fail, rl_hello;
    sqlite3_stmt *sil_st[4]; /* silence statements, prepared on first use (writer thread) */
    /* advice (advice.h): the policy (read-only; NULL: none) and the writer's
     * statements */
    const struct advice_policy *advice_policy; /* under mu */
    const struct advice_policy *w_advice_policy; /* copy taken per batch */
    struct advice_store *advice;
    struct attempts_store *attempts;
};

/* Storage trouble that may pass (disk full, I/O, locks, memory): retry the
 * whole batch. Anything else is a problem with one item: refuse that item. */
static int transient(int rc)
{
    switch (rc & 0xff) {
    case SQLITE_CONSTRAINT:
    case SQLITE_MISMATCH:
    case SQLITE_TOOBIG:
    case SQLITE_RANGE:
    case SQLITE_ERROR:
        return 0;
    default:
        return 1;
    }
}

/* Steps st once, reading ncols int64 columns of a row into cols; resets
 * it and clears its bindings. Returns SQLITE_ROW, SQLITE_DONE or an error. */
static int exec1(sqlite3_stmt *st, int64_t *cols, int ncols)
{
    int rc = sqlite3_step(st);
    if (rc == SQLITE_ROW)
        for (int i = 0; i < ncols; i++)
            cols[i] = sqlite3_column_int64(st, i);
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    return rc;
}

static int ok(int rc) { return rc == SQLITE_ROW || rc == SQLITE_DONE || rc == SQLITE_OK; }

/* --- series cache ------------------------------------------------------------ */

static uint64_t series_hash(int64_t run_id, const char *name, int32_t l, int32_t h, int32_t w,
                            int32_t r)
{
    uint64_t x = 1469598103934665603ull;
    int64_t nums[5] = {run_id, l, h, w, r};
    const unsigned char *p = (const unsigned char *)nums;
    for (size_t i = 0; i < sizeof(nums); i++)
        x = (x ^ p[i]) * 1099511628211ull;
    for (; *name; name++)
        x = (x ^ (unsigned char)*name) * 1099511628211ull;
    return x;
}

static void cache_clear(struct series_cache *c)
{
    c->n = 0;
    c->ndirty = 0;
    if (c->slots)
        memset(c->slots, 0, c->nslots * sizeof(*c->slots));
}

static void cache_free(struct series_cache *c)
{
    free(c->ents);
    free(c->slots);
    free(c->dirty);
    memset(c, 0, sizeof(*c));
}

static int cache_reindex(struct series_cache *c, size_t nslots)
{
    uint32_t *slots = calloc(nslots, sizeof(*slots));
    if (!slots)
        return -ENOMEM;
    for (size_t i = 0; i < c->n; i++) {
        size_t j = c->ents[i].hash & (nslots - 1);
        while (slots[j])
            j = (j + 1) & (nslots - 1);
        slots[j] = (uint32_t)i + 1;
    }
    free(c->slots);
    c->slots = slots;
    c->nslots = nslots;
    return 0;
}

/* Returns the index of the cached entry, or -1. */
static long cache_find(const struct series_cache *c, uint64_t hash, int64_t run_id,
                       const char *name, int32_t l, int32_t h, int32_t w, int32_t r)
{
    if (!c->nslots)
        return -1;
    for (size_t j = hash & (c->nslots - 1); c->slots[j]; j = (j + 1) & (c->nslots - 1)) {
        const struct series_entry *e = &c->ents[c->slots[j] - 1];
        if (e->hash == hash && e->run_id == run_id && e->layer == l && e->head == h &&
            e->window == w && e->rank == r && strcmp(e->name, name) == 0)
            return (long)(c->slots[j] - 1);
    }
    return -1;
}

static long cache_add(struct series_cache *c, const struct series_entry *e)
{
    if ((c->n + 1) * 10 > c->nslots * 7 &&
        cache_reindex(c, c->nslots ? c->nslots * 2 : 1024) < 0)
        return -1;
    if (c->n == c->cap) {
        size_t cap = c->cap ? c->cap * 2 : 256;
        struct series_entry *ents = realloc(c->ents, cap * sizeof(*ents));
        if (!ents)
            return -1;
        c->ents = ents;
        c->cap = cap;
    }
    c->ents[c->n] = *e;
    size_t j = e->hash & (c->nslots - 1);
    while (c->slots[j])
        j = (j + 1) & (c->nslots - 1);
    c->slots[j] = (uint32_t)c->n + 1;
    return (long)c->n++;
}

static int bind_series_key(sqlite3_stmt *st, int64_t run_id, const char *name, int32_t l,
                           int32_t h, int32_t w, int32_t r)
{
    int rc = sqlite3_bind_int64(st, 1, run_id);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_text(st, 2, name, -1, SQLITE_STATIC);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_int(st, 3, l);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_int(st, 4, h);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_int(st, 5, w);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_int(st, 6, r);
    return rc;
}

/* Finds or creates the series; *idx is its cache entry. SQLite rc. */
static int series_get(struct store *s, int64_t run_id, const char *name, int32_t l, int32_t h,
                      int32_t w, int32_t r, long *idx)
{
    uint64_t hash = series_hash(run_id, name, l, h, w, r);
    *idx = cache_find(&s->cache, hash, run_id, name, l, h, w, r);
    if (*idx >= 0)
        return SQLITE_OK;
    int64_t id = 0;
    int rc = bind_series_key(s->st[ST_SERIES_FIND], run_id, name, l, h, w, r);
    if (rc != SQLITE_OK)
        return rc;
    rc = exec1(s->st[ST_SERIES_FIND], &id, 1);
    if (rc == SQLITE_DONE) {
        rc = bind_series_key(s->st[ST_SERIES_INSERT], run_id, name, l, h, w, r);
        if (rc != SQLITE_OK)
            return rc;
        rc = exec1(s->st[ST_SERIES_INSERT], &id, 1);
        if (rc == SQLITE_DONE)
            return SQLITE_ERROR; /* RETURNING gave no row */
    }
    if (rc != SQLITE_ROW)
        return rc;
    struct series_entry e = {.run_id = run_id, .id = id, .layer = l, .head = h, .window = w,
                             .rank = r, .hash = hash};
    snprintf(e.name, sizeof(e.name), "%s", name);
    *idx = cache_add(&s->cache, &e);
    return *idx < 0 ? SQLITE_NOMEM : SQLITE_OK;
}

static int bind_value(sqlite3_stmt *st, int i, double v)
{
    /* SQLite stores NaN as NULL anyway; say so explicitly. NULL in points
     * means "absent", so a NaN loss is not distinguishable from no loss in
     * the database; the live value still reaches the detectors. */
    return isnan(v) ? sqlite3_bind_null(st, i) : sqlite3_bind_double(st, i, v);
}

/* Stores value at step in the series of cache entry idx; a re-done step
 * replaces its value without adding a point. */
static int point_put(struct store *s, long idx, uint64_t step, double value, double t,
                     uint64_t *points)
{
    int64_t id = s->cache.ents[idx].id;
    sqlite3_stmt *st = s->st[ST_POINT_INSERT];
    sqlite3_bind_int64(st, 1, id);
    sqlite3_bind_int64(st, 2, (int64_t)step);
    bind_value(st, 3, value);
    sqlite3_bind_double(st, 4, t);
    int rc = exec1(st, NULL, 0);
    if (!ok(rc))
        return rc;
    if (sqlite3_changes(s->db) == 0) {
        st = s->st[ST_POINT_UPDATE];
        sqlite3_bind_int64(st, 1, id);
        sqlite3_bind_int64(st, 2, (int64_t)step);
        bind_value(st, 3, value);
        sqlite3_bind_double(st, 4, t);
        rc = exec1(st, NULL, 0);
        return ok(rc) ? SQLITE_OK : rc;
    }
    struct series_cache *c = &s->cache;
    struct series_entry *e = &c->ents[idx];
    if (!e->dirty) {
        if (c->ndirty == c->capdirty) {
            size_t cap = c->capdirty ? c->capdirty * 2 : 256;
            uint32_t *d = realloc(c->dirty, cap * sizeof(*d));
            if (!d)
                return SQLITE_NOMEM;
            c->dirty = d;
            c->capdirty = cap;
        }
        c->dirty[c->ndirty++] = (uint32_t)idx;
        e->dirty = 1;
        e->add_points = 0;
        e->min_step = e->max_step = (int64_t)step;
    }
    e->add_points++;
    if ((int64_t)step < e->min_step)
        e->min_step = (int64_t)step;
    if ((int64_t)step > e->max_step)
        e->max_step = (int64_t)step;
    (*points)++;
    return SQLITE_OK;
}

/* Writes the batch's point counts and step ranges into series rows. */
static int series_flush(struct store *s)
{
    struct series_cache *c = &s->cache;
    for (size_t i = 0; i < c->ndirty; i++) {
        struct series_entry *e = &c->ents[c->dirty[i]];
        sqlite3_stmt *st = s->st[ST_SERIES_BUMP];
        sqlite3_bind_int64(st, 1, e->id);
        sqlite3_bind_int64(st, 2, e->add_points);
        sqlite3_bind_int64(st, 3, e->min_step);
        sqlite3_bind_int64(st, 4, e->max_step);
        int rc = exec1(st, NULL, 0);
        if (!ok(rc))
            return rc;
    }
    for (size_t i = 0; i < c->ndirty; i++)
        c->ents[c->dirty[i]].dirty = 0;
    c->ndirty = 0;
    return SQLITE_OK;
}

/* --- results of the batch being written ----------------------------------------- */

static struct store_result *wres_add(struct store *s)
{
    if (s->nwres == s->capwres) {
        size_t cap = s->capwres ? s->capwres * 2 : 64;
        struct store_result *r = realloc(s->wres, cap * sizeof(*r));
        if (!r)
            return NULL;
        s->wres = r;
        s->capwres = cap;
    }
    struct store_result *r = &s->wres[s->nwres++];
    memset(r, 0, sizeof(*r));
    return r;
}

/* One Ack per connection per batch: merges into that connection's latest
 * result when it is an Ack, else appends. */
static int wres_ack(struct store *s, const struct store_item *it)
{
    if (!it->conn_id)
        return 0;
    for (size_t i = s->nwres; i-- > 0;) {
        struct store_result *r = &s->wres[i];
        if (r->conn_id != it->conn_id)
            continue;
        if (r->kind == STORE_RESULT_ACK && !r->error_code) {
            r->items++;
            if (it->report.seq > r->seq)
                r->seq = it->report.seq;
            return 0;
        }
        break;
    }
    struct store_result *r = wres_add(s);
    if (!r)
        return -ENOMEM;
    r->kind = STORE_RESULT_ACK;
    r->conn_id = it->conn_id;
    r->items = 1;
    r->run_id = it->report.run_id;
    r->stream_id = it->report.stream_id;
    r->seq = it->report.seq;
    return 0;
}

/* --- applying items (inside the open transaction) ------------------------------ */

struct batch_counts {
    uint64_t reports, duplicates, points;
};

struct owed_ctx {
    struct store *s;
    uint64_t conn_id;
};

static int owed_one(void *ctx, const struct advice_msg *m)
{
    struct owed_ctx *o = ctx;
    struct store_result *r = wres_add(o->s);
    if (!r)
        return SQLITE_NOMEM;
    r->kind = STORE_RESULT_ADVICE;
    r->conn_id = o->conn_id;
    r->run_id = m->run_id;
    r->advice = *m;
    return 0;
}

/* The advices a stream is owed (advice.h), as results that follow its
 * HELLO result: the Welcome goes out first. */
static int owed_advice(struct store *s, uint64_t conn_id, int64_t run_id, int64_t stream_id)
{
    struct owed_ctx o = {.s = s, .conn_id = conn_id};
    bool more = false;
    int rc = advice_store_owed(s->advice, run_id, stream_id, ADVICE_MAX_OWED_PER_HELLO, owed_one,
                               &o, &more);
    if (rc == SQLITE_OK && more)
        log_limited(&s->rl_fail, LOG_LEVEL_WARN, "store",
                    "stream %lld is owed more than %u advices: the rest follow at its next "
                    "connection",
                    (long long)stream_id, ADVICE_MAX_OWED_PER_HELLO);
    return rc;
}

/* A committed advice for the connections of its run: a firing one for
 * every stream of the run, an answer only for the streams that were sent
 * the firing it answers (advice.h). */
struct announce_ctx {
    struct store *s;
    const struct advice_msg *m;
};

static int announce_to(void *ctx, int64_t stream_id)
{
    struct announce_ctx *a = ctx;
    struct store_result *r = wres_add(a->s);
    if (!r)
        return SQLITE_NOMEM;
    r->kind = STORE_RESULT_ADVICE;
    r->run_id = a->m->run_id;
    r->stream_id = stream_id;
    r->advice = *a->m;
    return 0;
}

static int announce_advice(void *ctx, const struct advice_msg *m)
{
    struct announce_ctx a = {.s = ctx, .m = m};
    if (m->fire_id <= 0)
        return announce_to(&a, 0);
    return advice_store_fire_streams(a.s->advice, m->fire_id, announce_to, &a);
}

static int rewind_advice(struct store *s, int64_t run_id, uint64_t resume_step, double now)
{
    return advice_store_rewind(s->advice, run_id, resume_step, now, announce_advice, s);
}

/* A spool failure inside the transaction: SQLite's code for it (I/O and
 * disk full are transient: the batch is retried with backoff) and the
 * reason for the log. */
static int spool_failed(struct store *s, const char *what, int err)
{
    snprintf(s->w_spool_err, sizeof(s->w_spool_err), "spool: %s: %s", what, strerror(-err));
    return err == -ENOSPC ? SQLITE_FULL : err == -ENOMEM ? SQLITE_NOMEM : SQLITE_IOERR;
}

static int apply_hello(struct store *s, const struct store_item *it, double now,
                       struct store_result *r)
{
    const struct store_hello *h = &it->hello;
    r->kind = STORE_RESULT_HELLO;
    r->conn_id = it->conn_id;
    r->items = 1;
    int64_t id = 0;
    sqlite3_bind_text(s->st[ST_RUN_FIND], 1, h->run, -1, SQLITE_STATIC);
    int rc = exec1(s->st[ST_RUN_FIND], &id, 1);
    if (!ok(rc))
        return rc;
    if (rc == SQLITE_DONE) {
        int64_t count = 0;
        rc = exec1(s->st[ST_RUN_COUNT], &count, 1);
        if (!ok(rc))
            return rc;
        if ((uint64_t)count >= s->opts.max_runs) {
            r->error_code = FORESHOCK__ERROR_CODE__ERROR_LIMIT;
            snprintf(r->message, sizeof(r->message),
                     "run limit reached: the database holds max_runs = %llu runs",
                     (unsigned long long)s->opts.max_runs);
            return SQLITE_OK;
        }
    }
    sqlite3_stmt *st = s->st[ST_RUN_UPSERT];
    sqlite3_bind_text(st, 1, h->run, -1, SQLITE_STATIC);
    sqlite3_bind_double(st, 2, now);
    sqlite3_bind_int64(st, 3, h->world_size);
    if (h->has_detect_from_step)
        sqlite3_bind_int64(st, 4, (int64_t)h->detect_from_step);
    if (h->model_json)
        sqlite3_bind_text(st, 5, h->model_json, -1, SQLITE_STATIC);
    rc = exec1(st, &r->run_id, 1);
    if (rc != SQLITE_ROW)
        return ok(rc) ? SQLITE_ERROR : rc;
    st = s->st[ST_STREAM_UPSERT];
    sqlite3_bind_int64(st, 1, r->run_id);
    sqlite3_bind_int64(st, 2, h->attempt);
    sqlite3_bind_int64(st, 3, h->rank);
    sqlite3_bind_double(st, 4, now);
    if (h->local_ranks)
        sqlite3_bind_text(st, 5, h->local_ranks, -1, SQLITE_STATIC);
    int64_t cols[2] = {0, 0};
    rc = exec1(st, cols, 2);
    if (rc != SQLITE_ROW)
        return ok(rc) ? SQLITE_ERROR : rc;
    r->stream_id = cols[0];
    r->seq = (uint64_t)cols[1];
    r->attempt = h->attempt;
    rc = attempts_store_hello(s->attempts, r->run_id, h->attempt, h->has_resume_step,
                              h->resume_step, now, &r->run_attempt);
    if (rc != SQLITE_OK)
        return rc;
    int64_t run_id = r->run_id, stream_id = r->stream_id;
    /* A rewind supersedes the advice about incidents that opened after its
     * step before this stream's owed advice is looked up: the new attempt
     * is never told to act on what it is re-doing. */
    if (r->run_attempt.rewind && s->advice &&
        (rc = rewind_advice(s, run_id, r->run_attempt.resume_step, now)) != SQLITE_OK)
        return rc;
    if (!h->advice || !s->advice)
        return SQLITE_OK;
    /* r is not touched below: owed advices append results (wres may move). */
    return owed_advice(s, it->conn_id, run_id, stream_id);
}

static int apply_report(struct store *s, const struct store_item *it, struct batch_counts *bc)
{
    const struct store_report *rp = &it->report;
    sqlite3_stmt *st = s->st[ST_REPORT_INSERT];
    sqlite3_bind_int64(st, 1, rp->stream_id);
    sqlite3_bind_int64(st, 2, (int64_t)rp->seq);
    sqlite3_bind_int64(st, 3, (int64_t)rp->step);
    sqlite3_bind_double(st, 4, rp->received_at);
    sqlite3_bind_int64(st, 5, rp->frame_bytes);
    int rc = exec1(st, NULL, 0);
    if (!ok(rc))
        return rc;
    if (sqlite3_changes(s->db) == 0) {
        /* (stream, seq) is already committed: a resend. Store nothing. */
        bc->duplicates++;
        return SQLITE_OK;
    }
    long idx;
    int32_t rank = (int32_t)rp->rank;
    for (int i = 0; i < STORE_NSCALARS; i++) {
        if (!(rp->present & (1u << i)))
            continue;
        if ((rc = series_get(s, rp->run_id, scalar_series[i], -1, -1, 0, rank, &idx)) != SQLITE_OK ||
            (rc = point_put(s, idx, rp->step, rp->scalars[i], rp->time, &bc->points)) != SQLITE_OK)
            return rc;
    }
    const float *arr[2] = {rp->weight_norm, rp->update_ratio};
    const uint32_t len[2] = {rp->n_weight_norm, rp->n_update_ratio};
    const char *names[2] = {"weight_norm", "update_ratio"};
    for (int k = 0; k < 2; k++) {
        for (uint32_t l = 0; l < len[k]; l++) {
            if ((rc = series_get(s, rp->run_id, names[k], (int32_t)l, -1, 0, rank, &idx)) != SQLITE_OK ||
                (rc = point_put(s, idx, rp->step, arr[k][l], rp->time, &bc->points)) != SQLITE_OK)
                return rc;
        }
    }
    /* Its frame, if it has one, is in the spool log already (spool_batch). */
    st = s->st[ST_STREAM_BUMP];
    sqlite3_bind_int64(st, 1, rp->stream_id);
    sqlite3_bind_int64(st, 2, (int64_t)rp->seq);
    sqlite3_bind_double(st, 3, rp->received_at);
    if (!ok(rc = exec1(st, NULL, 0)))
        return rc;
    st = s->st[ST_RUN_BUMP];
    sqlite3_bind_int64(st, 1, rp->run_id);
    sqlite3_bind_int64(st, 2, (int64_t)rp->step);
    sqlite3_bind_double(st, 3, rp->received_at);
    if (!ok(rc = exec1(st, NULL, 0)))
        return rc;
    bc->reports++;
    return SQLITE_OK;
}

/* The monitors of the run's steps <= step are stored (in this same
 * transaction): the spool may let those steps' records go once it commits
 * (writer_main calls spool_release after COMMIT, never before). */
static int apply_spool_done(struct store *s, int64_t run_id, uint64_t step)
{
    sqlite3_stmt *st = s->st[ST_RUN_DONE];
    sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_int64(st, 2, (int64_t)step);
    int rc = exec1(st, NULL, 0);
    if (!ok(rc))
        return rc;
    if (s->nw_done == s->capw_done) {
        size_t cap = s->capw_done ? s->capw_done * 2 : 16;
        struct spool_done_step *d = realloc(s->w_done, cap * sizeof(*d));
        if (!d)
            return SQLITE_NOMEM;
        s->w_done = d;
        s->capw_done = cap;
    }
    s->w_done[s->nw_done++] = (struct spool_done_step){.run_id = run_id, .step = (int64_t)step};
    return SQLITE_OK;
}

static int series_of(struct store *s, int64_t run_id, const struct store_series_key *k, long *idx)
{
    return series_get(s, run_id, k->name, k->layer, k->head, k->window, k->rank, idx);
}

static int bind_opt_step(sqlite3_stmt *st, int i, int64_t v)
{
    return v < 0 ? sqlite3_bind_null(st, i) : sqlite3_bind_int64(st, i, v);
}

/* The pages of a firing or resolving transition: one outbox row per
 * target, in the transaction that commits the transition. */
static int outbox_rows(struct store *s, int64_t alert_id, int64_t event_id,
                       const struct store_alert_row *a, double now)
{
    int kind = a->to_state == ALERT_FIRING     ? STORE_OUTBOX_TRIGGER
               : a->to_state == ALERT_RESOLVED || a->to_state == ALERT_SUPERSEDED
                   ? STORE_OUTBOX_RESOLVE /* a superseded incident ends at the target too */
                                                            : 0;
    for (size_t i = 0; kind && i < s->w_ntargets; i++) {
        sqlite3_stmt *st = s->st[ST_OUTBOX_INSERT];
        sqlite3_bind_int64(st, 1, alert_id);
        sqlite3_bind_int64(st, 2, event_id);
        sqlite3_bind_text(st, 3, s->w_targets[i], -1, SQLITE_STATIC);
        sqlite3_bind_int(st, 4, kind);
        sqlite3_bind_text(st, 5, a->severity ? a->severity : "warning", -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 6, a->attribution ? a->attribution : "none", -1, SQLITE_STATIC);
        sqlite3_bind_double(st, 7, now);
        int rc = exec1(st, NULL, 0);
        if (!ok(rc))
            return rc;
        s->w_outbox_max = sqlite3_last_insert_rowid(s->db);
    }
    return SQLITE_OK;
}

/* The advice of a transition (advice.h), in its transaction; announced as a
 * result for every connection of the run once committed. */
static int advice_row(struct store *s, int64_t run_id, int64_t alert_id, int64_t event_id,
                      const struct store_alert_row *a, double now)
{
    if (!s->advice || !s->w_advice_policy)
        return SQLITE_OK;
    struct advice_event ev = {
        .run_id = run_id, .alert_id = alert_id, .event_id = event_id, .to_state = a->to_state,
        .rule = a->rule, .label = a->attribution, .severity = a->severity,
        .step = a->event_step, .first_breach_step = a->first_breach_step,
        .fired_step = a->fired_step, .layer = a->series.layer, .head = a->series.head,
        .window = a->series.window, .rank = a->series.rank};
    struct advice_msg m;
    bool made = false;
    int rc = advice_store_event(s->advice, s->w_advice_policy, &ev, now, &m, &made);
    if (rc != SQLITE_OK || !made)
        return rc;
    return announce_advice(s, &m);
}

static int apply_alert(struct store *s, int64_t run_id, const struct store_alert_row *a,
                       double now)
{
    long idx;
    int rc = series_of(s, run_id, &a->series, &idx);
    if (rc != SQLITE_OK)
        return rc;
    sqlite3_stmt *st = s->st[ST_ALERT_UPSERT];
    sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_text(st, 2, a->rule, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 3, a->alert_key, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 4, a->dedup_key, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 5, a->series.layer);
    sqlite3_bind_int(st, 6, a->series.head);
    sqlite3_bind_int(st, 7, a->series.window);
    sqlite3_bind_int(st, 8, a->series.rank);
    sqlite3_bind_int64(st, 9, s->cache.ents[idx].id);
    sqlite3_bind_int(st, 10, a->state);
    sqlite3_bind_text(st, 11, a->severity, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 12, a->family, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 13, a->attribution, -1, SQLITE_STATIC);
    bind_value(st, 14, a->value);
    bind_value(st, 15, a->median);
    bind_value(st, 16, a->mad);
    bind_value(st, 17, a->z);
    bind_opt_step(st, 18, a->first_breach_step);
    bind_opt_step(st, 19, a->fired_step);
    bind_opt_step(st, 20, a->resolved_step);
    sqlite3_bind_int64(st, 21, a->last_step);
    sqlite3_bind_int64(st, 22, (int64_t)a->incidents);
    sqlite3_bind_double(st, 23, now);
    sqlite3_bind_blob(st, 24, a->blob, (int)a->blob_len, SQLITE_STATIC);
    int64_t alert_id = 0;
    rc = exec1(st, &alert_id, 1);
    if (rc != SQLITE_ROW)
        return ok(rc) ? SQLITE_ERROR : rc;
    if (!a->has_event)
        return SQLITE_OK;
    st = s->st[ST_EVENT_INSERT];
    sqlite3_bind_int64(st, 1, alert_id);
    sqlite3_bind_text(st, 2, a->change, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 3, a->from_state);
    sqlite3_bind_int(st, 4, a->to_state);
    sqlite3_bind_int64(st, 5, a->event_step);
    sqlite3_bind_double(st, 6, now);
    sqlite3_bind_text(st, 7, a->event_attribution ? a->event_attribution : a->attribution, -1,
                      SQLITE_STATIC);
    sqlite3_bind_text(st, 8, a->evidence_json ? a->evidence_json : "{}", -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 9, a->attempt);
    rc = exec1(st, NULL, 0);
    if (!ok(rc))
        return rc;
    int64_t event_id = sqlite3_last_insert_rowid(s->db);
    if ((rc = outbox_rows(s, alert_id, event_id, a, now)) != SQLITE_OK)
        return rc;
    return advice_row(s, run_id, alert_id, event_id, a, now);
}

/* The monitor stage's output for one run, inside the batch's transaction. */
static int apply_monitor(struct store *s, const struct store_item *it, double now,
                         struct batch_counts *bc)
{
    const struct store_monitor *m = &it->monitor;
    long idx;
    int rc;
    for (size_t i = 0; i < m->n_points; i++) {
        const struct store_point *p = &m->points[i];
        if ((rc = series_of(s, m->run_id, &p->key, &idx)) != SQLITE_OK ||
            (rc = point_put(s, idx, p->step, p->value, m->time, &bc->points)) != SQLITE_OK)
            return rc;
    }
    for (size_t i = 0; i < m->n_states; i++) {
        const struct store_detector_row *d = &m->states[i];
        if ((rc = series_of(s, m->run_id, &d->key, &idx)) != SQLITE_OK)
            return rc;
        sqlite3_stmt *st = s->st[ST_STATE_PUT];
        sqlite3_bind_int64(st, 1, s->cache.ents[idx].id);
        sqlite3_bind_int64(st, 2, (int64_t)d->step);
        sqlite3_bind_blob(st, 3, d->blob, (int)d->len, SQLITE_STATIC);
        if (!ok(rc = exec1(st, NULL, 0)))
            return rc;
    }
    for (size_t i = 0; i < m->n_alerts; i++)
        if ((rc = apply_alert(s, m->run_id, &m->alerts[i], now)) != SQLITE_OK)
            return rc;
    for (size_t i = 0; i < m->n_incomplete; i++) {
        const struct store_incomplete_row *r = &m->incomplete[i];
        sqlite3_stmt *st = s->st[ST_INCOMPLETE_PUT];
        sqlite3_bind_int64(st, 1, m->run_id);
        sqlite3_bind_int64(st, 2, (int64_t)r->step);
        sqlite3_bind_text(st, 3, r->kind, -1, SQLITE_STATIC);
        sqlite3_bind_int(st, 4, r->layer);
        sqlite3_bind_int(st, 5, r->head);
        sqlite3_bind_int(st, 6, r->window);
        sqlite3_bind_int64(st, 7, r->have);
        sqlite3_bind_int64(st, 8, r->want);
        sqlite3_bind_double(st, 9, now);
        if (!ok(rc = exec1(st, NULL, 0)))
            return rc;
    }
    if (m->has_rebuilt &&
        (rc = attempts_store_rebuilt(s->attempts, m->run_id, m->rebuilt_attempt, now)) != SQLITE_OK)
        return rc;
    if (m->has_spool_done && (rc = apply_spool_done(s, m->run_id, m->spool_done_step)) != SQLITE_OK)
        return rc;
    return SQLITE_OK;
}

/* --- silences (STORE_ITEM_SILENCE) ---------------------------------------------------
 * The HTTP API's writes. The outcome is kept in the item and published to
 * its waiter by silence_settle() once the batch has committed, so an
 * answer never reflects a rolled-back attempt. */
enum { SIL_INSERT, SIL_EXPIRE, SIL_EXISTS, SIL_LIVE, SIL_COUNT };
static const char *const sil_sql[SIL_COUNT] = {
    [SIL_INSERT] = "INSERT INTO silences (matchers_json, starts_at, ends_at, created_by, "
                   "comment, created_at, updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6) "
                   "RETURNING id",
    /* a pending silence expires with starts_at = ends_at = now */
    [SIL_EXPIRE] = "UPDATE silences SET starts_at = MIN(starts_at, ?2), ends_at = ?2, "
                   "updated_at = ?2 WHERE id = ?1 AND ends_at > ?2",
    [SIL_EXISTS] = "SELECT 1 FROM silences WHERE id = ?1",
    /* what the pager loads (PAGER_MAX_SILENCES): active or future */
    [SIL_LIVE] = "SELECT count(*) FROM silences WHERE ends_at > ?1",
};
_Static_assert(SIL_COUNT == sizeof(((struct store *)0)->sil_st) / sizeof(sqlite3_stmt *),
               "one prepared statement slot per silence statement");

struct store_waiter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    int done;
    int status;
    int64_t id;
};

static sqlite3_stmt *sil_stmt(struct store *s, int which)
{
    if (!s->sil_st[which] &&
        sqlite3_prepare_v3(s->db, sil_sql[which], -1, SQLITE_PREPARE_PERSISTENT,
                           &s->sil_st[which], NULL) != SQLITE_OK)
        return NULL;
    return s->sil_st[which];
}

static int apply_silence(struct store *s, struct store_item *it, double now)
{
    struct store_silence *q = &it->silence;
    int64_t cols[1] = {0};
    int rc;
    sqlite3_stmt *st = sil_stmt(s, q->op == STORE_SILENCE_INSERT ? SIL_INSERT : SIL_EXPIRE);
    if (!st)
        return sqlite3_errcode(s->db) != SQLITE_OK ? sqlite3_errcode(s->db) : SQLITE_ERROR;
    if (q->op == STORE_SILENCE_INSERT) {
        /* The pager matches at most FS_STORE_MAX_LIVE_SILENCES: one more
         * would be stored and listed but hold nothing. Refuse it. */
        sqlite3_stmt *live = sil_stmt(s, SIL_LIVE);
        int64_t n = 0;
        if (!live)
            return sqlite3_errcode(s->db) != SQLITE_OK ? sqlite3_errcode(s->db) : SQLITE_ERROR;
        sqlite3_bind_double(live, 1, now);
        if ((rc = exec1(live, &n, 1)) != SQLITE_ROW)
            return ok(rc) ? SQLITE_ERROR : rc;
        if (q->ends_at > now && n >= (int64_t)FS_STORE_MAX_LIVE_SILENCES) {
            log_limited(&s->rl_fail, LOG_LEVEL_WARN, "store",
                        "refusing a silence: %lld are active or pending (at most %u)",
                        (long long)n, FS_STORE_MAX_LIVE_SILENCES);
            q->status = -ENOSPC;
            q->out_id = 0;
            return SQLITE_OK;
        }
        sqlite3_bind_text(st, 1, q->matchers_json ? q->matchers_json : "", -1, SQLITE_STATIC);
        sqlite3_bind_double(st, 2, q->starts_at);
        sqlite3_bind_double(st, 3, q->ends_at);
        sqlite3_bind_text(st, 4, q->created_by ? q->created_by : "", -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 5, q->comment ? q->comment : "", -1, SQLITE_STATIC);
        sqlite3_bind_double(st, 6, now);
        if ((rc = exec1(st, cols, 1)) != SQLITE_ROW)
            return ok(rc) ? SQLITE_ERROR : rc;
        q->status = 0;
        q->out_id = cols[0];
        return SQLITE_OK;
    }
    sqlite3_bind_int64(st, 1, q->id);
    sqlite3_bind_double(st, 2, now);
    if (!ok(rc = exec1(st, NULL, 0)))
        return rc;
    q->out_id = q->id;
    if (sqlite3_changes(s->db) == 1) {
        q->status = 0;
        return SQLITE_OK;
    }
    if (!(st = sil_stmt(s, SIL_EXISTS)))
        return SQLITE_ERROR;
    sqlite3_bind_int64(st, 1, q->id);
    rc = exec1(st, NULL, 0);
    if (!ok(rc))
        return rc;
    q->status = rc == SQLITE_ROW ? -EALREADY : -ENOENT;
    return SQLITE_OK;
}

static void waiter_settle(struct store_waiter *w, int status, int64_t id)
{
    pthread_mutex_lock(&w->mu);
    if (!w->done) {
        w->done = 1;
        w->status = status;
        w->id = id;
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
}

/* After write_batch: the batch is committed, or refused[i] is set. */
static void silence_settle(struct store *s, struct store_item **batch, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        struct store_item *it = batch[i];
        if (it->kind == STORE_ITEM_SILENCE && it->silence.waiter)
            waiter_settle(it->silence.waiter, s->refused[i] ? -EIO : it->silence.status,
                          it->silence.out_id);
    }
}

struct store_waiter *store_waiter_new(void)
{
    struct store_waiter *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    pthread_condattr_t ca;
    int ok_attr = pthread_condattr_init(&ca) == 0;
    if (ok_attr)
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (!ok_attr || pthread_mutex_init(&w->mu, NULL) != 0) {
        if (ok_attr)
            pthread_condattr_destroy(&ca);
        free(w);
        return NULL;
    }
    if (pthread_cond_init(&w->cv, &ca) != 0) {
        pthread_condattr_destroy(&ca);
        pthread_mutex_destroy(&w->mu);
        free(w);
        return NULL;
    }
    pthread_condattr_destroy(&ca);
    w->refs = 1;
    return w;
}

struct store_waiter *store_waiter_ref(struct store_waiter *w)
{
    pthread_mutex_lock(&w->mu);
    w->refs++;
    pthread_mutex_unlock(&w->mu);
    return w;
}

void store_waiter_put(struct store_waiter *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    int last = --w->refs == 0;
    pthread_mutex_unlock(&w->mu);
    if (last) {
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
        free(w);
    }
}

int store_waiter_wait(struct store_waiter *w, unsigned timeout_ms, int64_t *id)
{
    struct timespec dl = fs_clock_mono_after(timeout_ms / 1000.0);
    pthread_mutex_lock(&w->mu);
    while (!w->done)
        if (pthread_cond_timedwait(&w->cv, &w->mu, &dl) == ETIMEDOUT)
            break;
    int rc = w->done ? w->status : -ETIMEDOUT;
    if (w->done && id)
        *id = w->id;
    pthread_mutex_unlock(&w->mu);
    return rc;
}

/* The pager's outcome of one delivery. */
static int apply_outbox(struct store *s, const struct store_outbox_outcome *o, double now)
{
    sqlite3_stmt *st = s->st[ST_OUTBOX_OUTCOME];
    sqlite3_bind_int64(st, 1, o->outbox_id);
    sqlite3_bind_int(st, 2, o->state);
    sqlite3_bind_int64(st, 3, o->attempts);
    bind_value(st, 4, o->next_attempt_at);
    if (o->http_status)
        sqlite3_bind_int(st, 5, o->http_status);
    if (o->last_error[0])
        sqlite3_bind_text(st, 6, o->last_error, -1, SQLITE_STATIC);
    sqlite3_bind_double(st, 7, now);
    int rc = exec1(st, NULL, 0);
    return ok(rc) ? SQLITE_OK : rc;
}

/* Applies one item; SQLite rc. A HELLO refused by a limit is not an error:
 * its result carries the refusal. */
static int apply_item(struct store *s, const struct store_item *it, double now,
                      struct batch_counts *bc)
{
    switch (it->kind) {
    case STORE_ITEM_HELLO: {
        struct store_result *r = wres_add(s);
        return r ? apply_hello(s, it, now, r) : SQLITE_NOMEM;
    }
    case STORE_ITEM_REPORT: {
        int rc = apply_report(s, it, bc);
        if (rc == SQLITE_OK && wres_ack(s, it) < 0)
            rc = SQLITE_NOMEM;
        return rc;
    }
    case STORE_ITEM_SPOOL_DONE:
        return apply_spool_done(s, it->spool_done.run_id, it->spool_done.step);
    case STORE_ITEM_MONITOR:
        return apply_monitor(s, it, now, bc);
    case STORE_ITEM_SILENCE:
        return apply_silence(s, (struct store_item *)it, now);
    case STORE_ITEM_OUTBOX:
        return apply_outbox(s, &it->outbox, now);
    case STORE_ITEM_ADVICE:
        return s->advice ? advice_store_delivery(s->advice, it->advice.advice_id,
                                                 it->advice.stream_id, it->advice.acked, now)
                         : SQLITE_OK;
    }
    return SQLITE_MISUSE;
}

/* --- the writer thread ------------------------------------------------------------- */

static void rollback(struct store *s)
{
    if (!sqlite3_get_autocommit(s->db))
        exec1(s->st[ST_ROLLBACK], NULL, 0);
    /* Cached ids may name rows that no longer exist, and the batch's point
     * counts are void. */
    cache_clear(&s->cache);
    s->nwres = 0;
    s->w_outbox_max = 0;
    s->nw_done = 0;
    /* Records appended for the rolled-back reports must not stay in the
     * log (a retry appends them again). A failure here is logged; the next
     * attempt rewinds again before it appends. */
    int e = spool_rewind(s->spool, &s->committed);
    if (e < 0)
        log_limited(&s->rl_fail, LOG_LEVEL_ERROR, "store", "spool: cutting back a failed batch: %s",
                    strerror(-e));
}

/* Appends the frames of the batch's reports to the spool log before its
 * transaction begins (the frame goes to the log, not into the database;
 * the transaction records only where the log ends): a 59 MB frame can take
 * seconds to write on a busy disk, and between its pieces the spool calls
 * hello_interlude, which can commit queued Hellos only while no
 * transaction is open. SQLite rc; *bad names a report the spool refuses
 * (too large: that item's problem, refused, not retried). Writer thread. */
static int spool_batch(struct store *s, struct store_item **batch, size_t n,
                       const unsigned char *refused, long *bad)
{
    int rc = SQLITE_OK;
    s->w_spooling = batch;
    s->nw_spooling = n;
    for (size_t i = 0; i < n && rc == SQLITE_OK; i++) {
        const struct store_report *rp = &batch[i]->report;
        if (refused[i] || batch[i]->kind != STORE_ITEM_REPORT || !rp->sketch_body ||
            !rp->sketch_len)
            continue;
        struct spool_rec rec = {.run_id = rp->run_id, .stream_id = rp->stream_id,
                                .rank = rp->rank, .seq = rp->seq, .step = rp->step,
                                .len = (uint32_t)rp->sketch_len};
        int e = rp->sketch_len > FS_SPOOL_MAX_RECORD_BYTES
                    ? -EINVAL
                    : spool_append(s->spool, &rec, rp->sketch_body);
        if (e == -EINVAL) {
            *bad = (long)i;
            rc = SQLITE_TOOBIG;
        } else if (e < 0) {
            rc = spool_failed(s, "appending a report", e);
        }
    }
    s->w_spooling = NULL;
    s->nw_spooling = 0;
    return rc;
}

/* One attempt at the batch in one transaction. Returns SQLITE_OK, or the
 * error with *bad set to the failing item's index (-1 for BEGIN/COMMIT). */
static int write_once(struct store *s, struct store_item **batch, size_t n,
                      const unsigned char *refused, struct batch_counts *bc, long *bad)
{
    *bad = -1;
    memset(bc, 0, sizeof(*bc));
    s->nwres = 0;
    s->w_outbox_max = 0;
    s->nw_done = 0;
    s->w_spool_err[0] = '\0';
    struct spool_pos at = spool_head(s->spool);
    if (at.seg != s->committed.seg || at.off != s->committed.off) {
        int e = spool_rewind(s->spool, &s->committed);
        if (e < 0)
            return spool_failed(s, "cutting back a failed batch", e);
    }
    int rc = spool_batch(s, batch, n, refused, bad);
    if (rc != SQLITE_OK)
        return rc;
    rc = exec1(s->st[ST_BEGIN], NULL, 0);
    if (!ok(rc))
        return rc;
    double now = fs_clock_unix();
    for (size_t i = 0; i < n; i++) {
        if (refused[i])
            continue;
        rc = apply_item(s, batch[i], now, bc);
        if (rc != SQLITE_OK) {
            *bad = (long)i;
            return rc;
        }
    }
    if ((rc = series_flush(s)) != SQLITE_OK)
        return rc;
    /* Spooled frames are durable (by the database's own sync policy)
     * before the commit that acks their reports records where they end. */
    struct spool_pos head = spool_head(s->spool);
    if (head.seg != s->committed.seg || head.off != s->committed.off) {
        int e = spool_sync(s->spool);
        if (e < 0)
            return spool_failed(s, "syncing", e);
        sqlite3_stmt *st = s->st[ST_SPOOL_HEAD];
        sqlite3_bind_int64(st, 1, (int64_t)head.seg);
        sqlite3_bind_int64(st, 2, (int64_t)head.off);
        if (!ok(rc = exec1(st, NULL, 0)))
            return rc;
    }
    rc = exec1(s->st[ST_COMMIT], NULL, 0);
    if (!ok(rc))
        return rc;
    s->committed = head;
    return SQLITE_OK;
}

/* After COMMIT: the evaluated steps the batch recorded let the spool drop
 * what they cover. Writer thread. */
static void spool_after_commit(struct store *s)
{
    int oom = 0;
    for (size_t i = 0; i < s->nw_done; i++)
        oom |= spool_set_done(s->spool, s->w_done[i].run_id, s->w_done[i].step) < 0;
    s->nw_done = 0;
    if (oom) /* the segments stay until the next release that remembers them, or a restart */
        log_limited(&s->rl_fail, LOG_LEVEL_ERROR, "store",
                    "spool: out of memory noting evaluated steps; their records stay on disk");
    spool_release(s->spool, &s->committed);
}

/* failing: 0, or the SQLite primary result code the commits fail with. */
static void set_failing(struct store *s, int failing)
{
    atomic_store(&s->stats->storage_failing, failing);
    if (failing)
        atomic_store(&s->stats->ready, 0);
    else if (atomic_load(&s->serving))
        atomic_store(&s->stats->ready, 1);
}

/* Under mu: appends an announced result (not tied to the open transaction). */
static int res_push(struct store *s, const struct store_result *r)
{
    if (s->nres == s->capres) {
        size_t cap = s->capres ? s->capres * 2 : 64;
        struct store_result *p = realloc(s->res, cap * sizeof(*p));
        if (!p)
            return -ENOMEM;
        s->res = p;
        s->capres = cap;
    }
    s->res[s->nres++] = *r;
    return 0;
}

/* While commits fail nothing can be written for a Hello (its Welcome names
 * a stream row), and a Hello queued behind the failing batch would wait as
 * long as the failure lasts: the trainer would get no answer at all. Every
 * Hello of the batch and of the queue is answered now with ERROR_INTERNAL
 * naming the failure; the trainer retries later, and the next Hello that
 * commits is the first to be welcomed again. Writer thread. */
static void refuse_hellos(struct store *s, struct store_item **batch, size_t n,
                          unsigned char *refused, int code)
{
    struct store_result r = {.kind = STORE_RESULT_HELLO,
                             .items = 1,
                             .error_code = FORESHOCK__ERROR_CODE__ERROR_INTERNAL};
    snprintf(r.message, sizeof(r.message), "storage is failing (%s); retry later",
             store_failure_text(code));
    struct store_item *gone = NULL;
    size_t answered = 0;
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < n; i++) {
        if (refused[i] || batch[i]->kind != STORE_ITEM_HELLO)
            continue;
        refused[i] = 1; /* freed with the batch */
        r.conn_id = batch[i]->conn_id;
        if (r.conn_id && res_push(s, &r) == 0)
            answered++;
    }
    for (struct store_item *prev = NULL, *it = s->head, *next; it && s->q_hellos; it = next) {
        next = it->next;
        if (it->kind != STORE_ITEM_HELLO) {
            prev = it;
            continue;
        }
        if (prev)
            prev->next = next;
        else
            s->head = next;
        if (s->tail == it)
            s->tail = prev;
        s->q_hellos--;
        s->q_items--;
        s->q_bytes -= it->bytes;
        s->settled++;
        r.conn_id = it->conn_id;
        if (r.conn_id && res_push(s, &r) == 0)
            answered++;
        it->next = gone;
        gone = it;
    }
    atomic_store(&s->stats->writer_queue_items, s->q_items);
    atomic_store(&s->stats->writer_queue_bytes, s->q_bytes);
    if (answered && s->notify)
        s->notify(s->notify_ctx);
    pthread_cond_broadcast(&s->done_cv);
    pthread_mutex_unlock(&s->mu);
    while (gone) {
        struct store_item *it = gone;
        gone = it->next;
        store_item_free(it);
    }
    if (answered)
        log_limited(&s->rl_hello, LOG_LEVEL_WARN, "store",
                    "storage is failing (%s): %zu Hello(s) answered with an error",
                    store_failure_text(code), answered);
}

/* Has the stop deadline (store_set_stop_deadline) passed? Any thread. */
static int past_stop_deadline(struct store *s)
{
    pthread_mutex_lock(&s->mu);
    double d = s->stop_deadline;
    pthread_mutex_unlock(&s->mu);
    return d > 0 && fs_clock_mono() >= d;
}

/* Waits ms between attempts at a failing batch, answering Hellos queued
 * meanwhile (refuse_hellos) and returning early at the stop deadline. */
static void failing_wait(struct store *s, unsigned ms, struct store_item **batch, size_t n,
                         unsigned char *refused, int code)
{
    double until = fs_clock_mono() + ms / 1000.0;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        double end = s->stop_deadline > 0 && s->stop_deadline < until ? s->stop_deadline : until;
        double now = fs_clock_mono();
        if (now >= end)
            break;
        if (s->q_hellos) {
            pthread_mutex_unlock(&s->mu);
            refuse_hellos(s, batch, n, refused, code);
            pthread_mutex_lock(&s->mu);
            continue;
        }
        struct timespec ts = fs_clock_mono_after(end - now);
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
    pthread_mutex_unlock(&s->mu);
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
    }
}

static void record_commit(struct store *s, double seconds)
{
    struct fs_stats *st = s->stats;
    atomic_fetch_add(&st->commits, 1);
    atomic_fetch_add(&st->commit_seconds_sum_us, (uint64_t)(seconds * 1e6));
    for (int i = 0; i < STATS_COMMIT_BUCKETS; i++)
        if (seconds <= stats_commit_bucket_le[i])
            atomic_fetch_add(&st->commit_seconds_bucket[i], 1);
    atomic_fetch_add(&st->commit_seconds_bucket[STATS_COMMIT_BUCKETS], 1);
}

/* Marks every item of the batch not yet refused as given up, with one
 * ERROR_SHUTTING_DOWN result per item that has a submitter (so that ingest
 * can close the connection instead of waiting for an Ack). Returns the
 * count. Writer thread. */
static size_t give_up(struct store *s, struct store_item **batch, size_t n,
                      unsigned char *refused, struct store_result **errs, size_t *nerrs, int code)
{
    size_t lost = 0;
    for (size_t i = 0; i < n; i++) {
        if (refused[i])
            continue;
        refused[i] = 1;
        lost++;
        struct store_item *it = batch[i];
        if (!it->conn_id)
            continue;
        struct store_result *e = realloc(*errs, (*nerrs + 1) * sizeof(*e));
        if (!e)
            continue; /* the connection closes at ingest's own stop anyway */
        *errs = e;
        e = &e[(*nerrs)++];
        memset(e, 0, sizeof(*e));
        e->kind = it->kind == STORE_ITEM_HELLO ? STORE_RESULT_HELLO : STORE_RESULT_ACK;
        e->conn_id = it->conn_id;
        e->items = 1;
        e->error_code = FORESHOCK__ERROR_CODE__ERROR_SHUTTING_DOWN;
        snprintf(e->message, sizeof(e->message),
                 "daemon is stopping and storage is failing (%s): not stored; resend later",
                 store_failure_text(code));
    }
    s->abandoned += lost;
    return lost;
}

/* Writes the batch until it commits: transient failures are retried with
 * backoff; an item that fails on its own (a constraint, a bug) is refused
 * together with the later items of its connection in this batch, whose
 * submitter gets one ERROR_INTERNAL result, and the rest is retried at once.
 * Acks never cover a refused item. */
static void write_batch(struct store *s, struct store_item **batch, size_t n,
                        struct batch_counts *bc)
{
    unsigned char *refused = s->refused;
    memset(refused, 0, n);
    unsigned backoff = FS_STORE_RETRY_MIN_MS;
    struct store_result *errs = NULL;
    size_t nerrs = 0;
    for (;;) {
        long bad;
        size_t left = 0;
        for (size_t i = 0; i < n; i++)
            left += !refused[i];
        if (!left) { /* every item answered already: a commit of nothing proves nothing */
            memset(bc, 0, sizeof(*bc));
            break;
        }
        double t0 = fs_clock_mono();
        int rc = write_once(s, batch, n, refused, bc, &bad);
        if (rc == SQLITE_OK) {
            record_commit(s, fs_clock_mono() - t0);
            spool_after_commit(s);
            if (atomic_load(&s->stats->storage_failing)) {
                log_info("store", "commits succeed again");
                set_failing(s, 0);
            }
            break;
        }
        char msg[192];
        snprintf(msg, sizeof(msg), "%s", s->w_spool_err[0] ? s->w_spool_err : sqlite3_errmsg(s->db));
        atomic_fetch_add(&s->stats->commit_errors, 1);
        rollback(s);
        if (!transient(rc) && bad >= 0) {
            struct store_item *it = batch[bad];
            log_error("store", "refusing a %s item of conn %llu: %s",
                      it->kind == STORE_ITEM_HELLO    ? "hello"
                      : it->kind == STORE_ITEM_REPORT ? "report"
                      : it->kind == STORE_ITEM_OUTBOX  ? "outbox"
                      : it->kind == STORE_ITEM_SILENCE ? "silence"
                      : it->kind == STORE_ITEM_ADVICE  ? "advice"
                                                       : "monitor",
                      (unsigned long long)it->conn_id, msg);
            struct store_result *e = realloc(errs, (nerrs + 1) * sizeof(*e));
            if (!e) { /* cannot tell the submitter: retry as if transient */
                sleep_ms(backoff);
                continue;
            }
            errs = e;
            e = &errs[nerrs++];
            memset(e, 0, sizeof(*e));
            e->kind = it->kind == STORE_ITEM_HELLO ? STORE_RESULT_HELLO : STORE_RESULT_ACK;
            e->conn_id = it->conn_id;
            e->error_code = FORESHOCK__ERROR_CODE__ERROR_INTERNAL;
            snprintf(e->message, sizeof(e->message), "storage refused the frame: %.130s", msg);
            for (size_t i = (size_t)bad; i < n; i++) {
                if (!refused[i] && (i == (size_t)bad ||
                                    (it->conn_id && batch[i]->conn_id == it->conn_id))) {
                    refused[i] = 1;
                    e->items++;
                }
            }
            continue;
        }
        int code = rc & 0xff ? rc & 0xff : SQLITE_ERROR;
        set_failing(s, code);
        refuse_hellos(s, batch, n, refused, code);
        if (past_stop_deadline(s)) {
            /* Stopping, and the disk does not take the batch: give it up,
             * as a crash at this point would. Nothing of it was acked;
             * clients resend it to the next start. */
            size_t lost = give_up(s, batch, n, refused, &errs, &nerrs, code);
            log_error("store",
                      "stopping: commit failed (%s) past the shutdown deadline; %zu items not "
                      "written (none was acknowledged; clients resend them)",
                      msg, lost);
            break;
        }
        log_limited(&s->rl_fail, LOG_LEVEL_ERROR, "store",
                    "commit of %zu items failed (%s); retrying in %u ms, nothing is acked until "
                    "it succeeds",
                    n, msg, backoff);
        failing_wait(s, backoff, batch, n, refused, code);
        backoff = backoff * 2 > FS_STORE_RETRY_MAX_MS ? FS_STORE_RETRY_MAX_MS : backoff * 2;
    }
    for (size_t i = 0; i < nerrs; i++) {
        struct store_result *r = wres_add(s);
        if (r)
            *r = errs[i];
    }
    free(errs);
}

static void announce(struct store *s)
{
    if (s->nwres) {
        if (s->nres + s->nwres > s->capres) {
            size_t cap = s->capres ? s->capres : 64;
            while (cap < s->nres + s->nwres)
                cap *= 2;
            struct store_result *r = realloc(s->res, cap * sizeof(*r));
            if (!r) {
                log_error("store", "out of memory announcing %zu results", s->nwres);
                s->nwres = 0;
                return;
            }
            s->res = r;
            s->capres = cap;
        }
        memcpy(s->res + s->nres, s->wres, s->nwres * sizeof(*s->wres));
        s->nres += s->nwres;
        s->nwres = 0;
    }
}

/* --- retention ------------------------------------------------------------------------- */

static const char prune_outbox_sql[] =
    "DELETE FROM outbox WHERE id IN (SELECT o.id FROM outbox o "
    "WHERE o.state IN (1, 2, 4) AND o.done_at < ?1 "
    "AND o.id < (SELECT max(id) FROM outbox) "
    /* the trigger of an incident still open at its target stays (pager.c load_open) */
    "AND NOT (o.kind = 1 AND o.state IN (1, 2) AND NOT EXISTS (SELECT 1 FROM outbox x "
    "WHERE x.alert_id = o.alert_id AND x.target = o.target AND x.id > o.id "
    "AND x.state IN (1, 2, 4))) "
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
        rc = prune_one(db, prune_silences_sql, now - silence_retention_s, max_rows,
                       &out->silences);
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
static void prune_if_due(struct store *s, double *next)
{
    double now = fs_clock_mono();
    if (now < *next)
        return;
    *next = now + s->opts.prune_interval_s;
    struct store_prune_counts c;
    if (store_prune(s->db, fs_clock_unix(), s->opts.outbox_retention_s, s->opts.silence_retention_s,
                    FS_STORE_PRUNE_BATCH, &c) < 0) {
        log_limited(&s->rl_fail, LOG_LEVEL_WARN, "store",
                    "retention: %s; retrying in %.0f s", sqlite3_errmsg(s->db),
                    s->opts.prune_interval_s);
        return;
    }
    if (c.outbox || c.silences)
        log_debug("store", "retention: deleted %llu outbox rows, %llu silences",
                  (unsigned long long)c.outbox, (unsigned long long)c.silences);
    if (c.outbox >= FS_STORE_PRUNE_BATCH || c.silences >= FS_STORE_PRUNE_BATCH)
        *next = now;
}

uint64_t store_stream_key(const char *run, uint32_t attempt, uint32_t rank)
{
    uint64_t x = 1469598103934665603ull;
    for (; *run; run++)
        x = (x ^ (unsigned char)*run) * 1099511628211ull;
    uint32_t nums[2] = {attempt, rank};
    const unsigned char *p = (const unsigned char *)nums;
    for (size_t i = 0; i < sizeof(nums); i++)
        x = (x ^ p[i]) * 1099511628211ull;
    return x | 1;
}

/* Moves the queued HELLO items that may go first into batch (see store.h:
 * not one whose stream has a REPORT queued ahead of it). Returns how many;
 * adds their bytes. The reports of ahead (a batch being written) count as
 * queued ahead. Writer thread, under mu. */
static size_t take_hellos(struct store *s, struct store_item *const *ahead, size_t nahead,
                          struct store_item **out, size_t max, uint64_t *bytes)
{
    size_t n = 0;
    memset(s->w_reported, 0, sizeof(s->w_reported));
    for (size_t i = 0; i < nahead; i++) {
        if (ahead[i]->kind == STORE_ITEM_REPORT) {
            uint64_t bit = ahead[i]->report.stream_key % STORE_HELLO_FILTER_BITS;
            s->w_reported[bit / 8] |= (uint8_t)(1u << (bit % 8));
        }
    }
    struct store_item **pp = &s->head, *prev = NULL;
    while (*pp && n < max) {
        struct store_item *it = *pp;
        uint64_t bit;
        if (it->kind == STORE_ITEM_REPORT) {
            bit = it->report.stream_key % STORE_HELLO_FILTER_BITS;
            s->w_reported[bit / 8] |= (uint8_t)(1u << (bit % 8));
        } else if (it->kind == STORE_ITEM_HELLO && it->hello.stream_key) {
            bit = it->hello.stream_key % STORE_HELLO_FILTER_BITS;
            if (!(s->w_reported[bit / 8] & (1u << (bit % 8)))) {
                *pp = it->next;
                if (s->tail == it)
                    s->tail = prev;
                it->next = NULL;
                *bytes += it->bytes;
                s->q_hellos--;
                out[n++] = it;
                continue;
            }
        }
        prev = it;
        pp = &it->next;
    }
    return n;
}

/* After a batch of n items (bytes) was written: its results go to the
 * submitters, the queue shrinks, RESUME once it drained. Writer thread. */
static void settle(struct store *s, size_t n, uint64_t bytes)
{
    pthread_mutex_lock(&s->mu);
    announce(s);
    s->q_items -= n;
    s->q_bytes -= bytes;
    s->spool_bytes = spool_bytes(s->spool);
    s->settled += n;
    atomic_store(&s->stats->writer_queue_items, s->q_items);
    atomic_store(&s->stats->writer_queue_bytes, s->q_bytes);
    atomic_store(&s->stats->spool_bytes, s->spool_bytes);
    if (s->refusing && s->q_items <= s->opts.queue_max_items / 2 &&
        s->q_bytes <= s->opts.queue_max_bytes / 2) {
        s->refusing = 0;
        struct store_result *r = wres_add(s);
        if (r) {
            r->kind = STORE_RESULT_RESUME;
            announce(s);
        }
    }
    if (s->nres && s->notify)
        s->notify(s->notify_ctx);
    /* Persist first, then announce: the pager sees committed rows only. */
    if (s->w_outbox_max > 0 && s->announce)
        s->announce(s->announce_ctx, s->w_outbox_max);
    pthread_cond_broadcast(&s->done_cv);
    pthread_mutex_unlock(&s->mu);
}

/* The spool's yield hook (spool_set_yield), between the pieces of a record
 * that spool_batch writes before its batch's transaction begins: queued
 * Hellos commit now, in a transaction of their own, instead of after the
 * batch (writing 59 MB frames to a busy disk took seconds; a new trainer
 * waited that long for its Welcome). Not a Hello whose stream has reports
 * in the batch or queued (take_hellos). The spool's uncommitted tail is
 * left alone: this transaction neither records nor cuts it. On failure the
 * Hellos go back to the head of the queue, for the usual path (retries,
 * refuse_hellos while storage fails), and no interlude runs again until
 * the next batch. Writer thread. */
static void hello_interlude(void *ctx)
{
    struct store *s = ctx;
    struct store_item *h[FS_STORE_INTERLUDE_HELLOS];
    uint64_t bytes = 0;
    if (!s->w_spooling)
        return;
    pthread_mutex_lock(&s->mu);
    size_t n = s->q_hellos ? take_hellos(s, s->w_spooling, s->nw_spooling, h,
                                         FS_STORE_INTERLUDE_HELLOS, &bytes)
                           : 0;
    pthread_mutex_unlock(&s->mu);
    if (!n)
        return;
    double t0 = fs_clock_mono(), now = fs_clock_unix();
    struct batch_counts bc;
    memset(&bc, 0, sizeof(bc));
    int rc = exec1(s->st[ST_BEGIN], NULL, 0);
    for (size_t i = 0; i < n && ok(rc); i++)
        rc = apply_item(s, h[i], now, &bc);
    if (ok(rc))
        rc = exec1(s->st[ST_COMMIT], NULL, 0);
    if (!ok(rc)) {
        if (!sqlite3_get_autocommit(s->db))
            exec1(s->st[ST_ROLLBACK], NULL, 0);
        cache_clear(&s->cache);
        s->nwres = 0;
        s->w_spooling = NULL;
        pthread_mutex_lock(&s->mu);
        for (size_t i = n; i-- > 0;) {
            h[i]->next = s->head;
            s->head = h[i];
            if (!s->tail)
                s->tail = h[i];
        }
        s->q_hellos += n;
        pthread_mutex_unlock(&s->mu);
        return;
    }
    record_commit(s, fs_clock_mono() - t0);
    settle(s, n, bytes);
    for (size_t i = 0; i < n; i++)
        store_item_free(h[i]);
}

static void *writer_main(void *arg)
{
    struct store *s = arg;
    uint64_t max = s->opts.batch_max_items;
    int prune = s->opts.outbox_retention_s > 0 || s->opts.silence_retention_s > 0;
    double next_prune = fs_clock_mono(); /* once at start, then every prune_interval_s */
    for (;;) {
        if (prune)
            prune_if_due(s, &next_prune);
        pthread_mutex_lock(&s->mu);
        while (!s->head && !s->stopping) {
            if (!prune) {
                pthread_cond_wait(&s->cv, &s->mu);
                continue;
            }
            double wait = next_prune - fs_clock_mono();
            if (wait <= 0)
                break;
            struct timespec ts = fs_clock_mono_after(wait);
            if (pthread_cond_timedwait(&s->cv, &s->mu, &ts) == ETIMEDOUT)
                break;
        }
        if (!s->head) {
            int stop = s->stopping;
            pthread_mutex_unlock(&s->mu);
            if (stop)
                break;
            continue; /* retention is due */
        }
        size_t n = 0;
        uint64_t bytes = 0;
        /* Hellos first, in a transaction of their own: a new trainer's
         * Welcome waits for at most the commit in progress, not for
         * everything queued ahead of it (with 59 MB reports that was many
         * seconds). Safe to reorder: a connection sends reports only after
         * its Welcome, and a Hello whose stream has reports queued keeps its
         * place (take_hellos). */
        if (s->q_hellos)
            n = take_hellos(s, NULL, 0, s->batch, max, &bytes);
        /* Otherwise the queue in order (a Hello at its head alone).
         * FS_STORE_BATCH_MAX_BYTES keeps each commit, and so the wait of a
         * Hello behind it, short whatever the frame sizes. */
        while (s->head && n < max && (n == 0 || (bytes < FS_STORE_BATCH_MAX_BYTES &&
                                                 s->batch[0]->kind != STORE_ITEM_HELLO))) {
            struct store_item *it = s->head;
            s->head = it->next;
            it->next = NULL;
            bytes += it->bytes;
            s->q_hellos -= it->kind == STORE_ITEM_HELLO;
            s->batch[n++] = it;
        }
        if (!s->head)
            s->tail = NULL;
        s->w_ntargets = s->n_pager_targets;
        memcpy(s->w_targets, s->pager_targets, sizeof(s->w_targets));
        s->w_advice_policy = s->advice_policy;
        pthread_mutex_unlock(&s->mu);

        if (s->cache.n > FS_STORE_SERIES_CACHE_MAX)
            cache_clear(&s->cache);
        struct batch_counts bc;
        write_batch(s, s->batch, n, &bc);
        silence_settle(s, s->batch, n);
        atomic_fetch_add(&s->stats->reports_committed, bc.reports);
        atomic_fetch_add(&s->stats->reports_duplicate, bc.duplicates);
        atomic_fetch_add(&s->stats->points_committed, bc.points);

        settle(s, n, bytes);

        for (size_t i = 0; i < n; i++)
            store_item_free(s->batch[i]);
    }
    return NULL;
}

/* --- public API ---------------------------------------------------------------------- */

struct store_item *store_item_new(enum store_item_kind kind)
{
    struct store_item *it = calloc(1, sizeof(*it));
    if (it)
        it->kind = kind;
    return it;
}

void store_item_free(struct store_item *it)
{
    if (!it)
        return;
    if (it->kind == STORE_ITEM_HELLO) {
        free(it->hello.model_json);
        free(it->hello.local_ranks);
    } else if (it->kind == STORE_ITEM_REPORT) {
        free(it->report.weight_norm);
        free(it->report.update_ratio);
        free(it->report.sketch_alloc ? it->report.sketch_alloc : it->report.sketch_body);
    } else if (it->kind == STORE_ITEM_MONITOR) {
        struct store_monitor *m = &it->monitor;
        for (size_t i = 0; i < m->n_alerts; i++)
            free(m->alerts[i].evidence_json);
        free(m->points);
        free(m->states);
        free(m->blobs);
        free(m->alerts);
        free(m->incomplete);
    } else if (it->kind == STORE_ITEM_SILENCE) {
        /* never written (refused at submit, or shutdown): tell the waiter */
        if (it->silence.waiter) {
            waiter_settle(it->silence.waiter, -ECANCELED, 0);
            store_waiter_put(it->silence.waiter);
        }
        free(it->silence.matchers_json);
        free(it->silence.created_by);
        free(it->silence.comment);
    }
    free(it);
}

static size_t item_bytes(const struct store_item *it)
{
    size_t b = sizeof(*it);
    if (it->kind == STORE_ITEM_HELLO && it->hello.model_json)
        b += strlen(it->hello.model_json) + 1;
    if (it->kind == STORE_ITEM_HELLO && it->hello.local_ranks)
        b += strlen(it->hello.local_ranks) + 1;
    if (it->kind == STORE_ITEM_REPORT)
        b += it->report.sketch_len +
             sizeof(float) * ((size_t)it->report.n_weight_norm + it->report.n_update_ratio);
    if (it->kind == STORE_ITEM_MONITOR) {
        const struct store_monitor *m = &it->monitor;
        b += m->n_points * sizeof(*m->points) + m->n_states * sizeof(*m->states) +
             m->n_alerts * sizeof(*m->alerts) + m->n_incomplete * sizeof(*m->incomplete);
        for (size_t i = 0; i < m->n_states; i++)
            b += m->states[i].len;
    }
    return b;
}

int store_submit(struct store *s, struct store_item *it)
{
    size_t b = item_bytes(it);
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        rc = -ESHUTDOWN;
        goto out;
    }
    /* A Hello is never refused: a new trainer must be answered while the
     * queue is full (ingest reads Hellos of paused connections too). It is
     * bounded: one per connection (max_connections), each at most
     * FS_MAX_HELLO_FRAME_BYTES on the wire. */
    if (it->kind == STORE_ITEM_REPORT) {
        /* An item larger than the byte bound still goes into an empty
         * queue: max_frame_bytes may exceed writer_queue_max_bytes. */
        int full = s->q_items >= s->opts.queue_max_items ||
                   (s->q_items > 0 && s->q_bytes + b > s->opts.queue_max_bytes);
        if (s->refusing || full) {
            s->refusing = 1;
            rc = -EAGAIN;
            goto out;
        }
    }
    it->bytes = b;
    it->next = NULL;
    if (s->tail)
        s->tail->next = it;
    else
        s->head = it;
    s->tail = it;
    s->q_items++;
    s->q_bytes += b;
    s->q_hellos += it->kind == STORE_ITEM_HELLO;
    s->submitted++;
    atomic_store(&s->stats->writer_queue_items, s->q_items);
    atomic_store(&s->stats->writer_queue_bytes, s->q_bytes);
    pthread_cond_signal(&s->cv);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

size_t store_take_results(struct store *s, struct store_result **out)
{
    pthread_mutex_lock(&s->mu);
    size_t n = s->nres;
    *out = n ? s->res : NULL;
    if (n) {
        s->res = NULL;
        s->nres = s->capres = 0;
    }
    pthread_mutex_unlock(&s->mu);
    return n;
}

void store_set_notify(struct store *s, void (*notify)(void *ctx), void *ctx)
{
    /* The writer calls notify under mu, so after this returns the old
     * callback is neither running nor going to run. */
    pthread_mutex_lock(&s->mu);
    s->notify = notify;
    s->notify_ctx = ctx;
    pthread_mutex_unlock(&s->mu);
}

void store_set_pager(struct store *s, const char *const *targets, size_t n,
                     void (*announce_fn)(void *ctx, int64_t max_id), void *ctx)
{
    pthread_mutex_lock(&s->mu);
    if (n > STATS_MAX_TARGETS)
        n = STATS_MAX_TARGETS;
    memset(s->pager_targets, 0, sizeof(s->pager_targets));
    for (size_t i = 0; i < n; i++)
        snprintf(s->pager_targets[i], sizeof(s->pager_targets[i]), "%s", targets[i]);
    s->n_pager_targets = n;
    s->announce = announce_fn;
    s->announce_ctx = ctx;
    pthread_mutex_unlock(&s->mu);
}

void store_set_advice(struct store *s, const struct advice_policy *p)
{
    pthread_mutex_lock(&s->mu);
    s->advice_policy = p;
    pthread_mutex_unlock(&s->mu);
}

void store_set_serving(struct store *s, int serving)
{
    atomic_store(&s->serving, serving);
}

void store_set_stop_deadline(struct store *s, double timeout_s)
{
    pthread_mutex_lock(&s->mu);
    s->stop_deadline = timeout_s > 0 ? fs_clock_mono() + timeout_s : 0;
    pthread_cond_signal(&s->cv); /* a failing_wait ends at the deadline */
    pthread_mutex_unlock(&s->mu);
}

const char *store_failure_text(int code)
{
    return sqlite3_errstr(code);
}

void store_flush(struct store *s)
{
    pthread_mutex_lock(&s->mu);
    uint64_t target = s->submitted;
    while (s->settled < target)
        pthread_cond_wait(&s->done_cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

uint64_t store_spool_bytes(struct store *s)
{
    pthread_mutex_lock(&s->mu);
    uint64_t b = s->spool_bytes;
    pthread_mutex_unlock(&s->mu);
    return b;
}

/* --- open, migrate, close -------------------------------------------------------------- */

static int exec_sql(sqlite3 *db, const char *sql, char *err, size_t errlen, const char *what)
{
    char *msg = NULL;
    int rc = sqlite3_exec(db, sql, NULL, NULL, &msg);
    if (rc != SQLITE_OK)
        snprintf(err, errlen, "%s: %s", what, msg ? msg : sqlite3_errstr(rc));
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

static int migrate(sqlite3 *db, const char *path, char *err, size_t errlen)
{
    int64_t version = 0;
    if (pragma_int(db, "PRAGMA user_version", &version) != SQLITE_OK) {
        snprintf(err, errlen, "%s: cannot read user_version: %s", path, sqlite3_errmsg(db));
        return -EIO;
    }
    if (version > schema_migration_count) {
        snprintf(err, errlen,
                 "%s: database schema version %lld is newer than this foreshockd knows (%d); "
                 "refusing to open it",
                 path, (long long)version, schema_migration_count);
        return -EPROTO;
    }
    for (int i = (int)version; i < schema_migration_count; i++) {
        const struct schema_migration *m = &schema_migrations[i];
        char what[256], sql[64];
        snprintf(what, sizeof(what), "%s: migration %s", path, m->name);
        snprintf(sql, sizeof(sql), "PRAGMA user_version = %d", m->version);
        if (exec_sql(db, "BEGIN IMMEDIATE", err, errlen, what) != SQLITE_OK)
            return -EIO;
        if (exec_sql(db, m->sql, err, errlen, what) != SQLITE_OK ||
            exec_sql(db, sql, err, errlen, what) != SQLITE_OK ||
            exec_sql(db, "COMMIT", err, errlen, what) != SQLITE_OK) {
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

static int import_legacy_spool(struct store *s, const char *path, char *err, size_t errlen)
{
    int64_t rows = 0;
    if (pragma_int(s->db, "SELECT count(*) FROM spool", &rows) != SQLITE_OK) {
        snprintf(err, errlen, "%s: reading the spool table: %s", path, sqlite3_errmsg(s->db));
        return -EIO;
    }
    if (rows == 0)
        return 0;
    sqlite3_stmt *q;
    if (sqlite3_prepare_v2(s->db,
                           "SELECT sp.run_id, sp.stream_id, st.rank, sp.seq, sp.step, sp.body "
                           "FROM spool sp JOIN streams st ON st.id = sp.stream_id ORDER BY sp.id",
                           -1, &q, NULL) != SQLITE_OK) {
        snprintf(err, errlen, "%s: reading the spool table: %s", path, sqlite3_errmsg(s->db));
        return -EIO;
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
    if (e == 0 && (exec_sql(s->db, "BEGIN IMMEDIATE", err, errlen, path) != SQLITE_OK ||
                   exec_sql(s->db, "DELETE FROM spool", err, errlen, path) != SQLITE_OK))
        e = -EIO;
    if (e == 0) {
        sqlite3_stmt *st = s->st[ST_SPOOL_HEAD];
        sqlite3_bind_int64(st, 1, (int64_t)head.seg);
        sqlite3_bind_int64(st, 2, (int64_t)head.off);
        if (!ok(exec1(st, NULL, 0)) || exec_sql(s->db, "COMMIT", err, errlen, path) != SQLITE_OK)
            e = -EIO;
    }
    if (e < 0) {
        if (!sqlite3_get_autocommit(s->db))
            sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
        spool_rewind(s->spool, &s->committed);
        if (e != -EIO || !err[0])
            snprintf(err, errlen, "%s: moving the spool table into the spool log: %s", path,
                     e == -EIO ? sqlite3_errmsg(s->db) : strerror(-e));
        return e;
    }
    s->committed = head;
    log_info("store", "moved %llu spooled reports (%llu bytes) from the database into the spool "
             "log; the database keeps their free pages until a VACUUM",
             (unsigned long long)moved, (unsigned long long)bytes);
    return 0;
}

static int open_spool(struct store *s, const char *path, char *err, size_t errlen)
{
    char dir[SPOOL_PATH_MAX];
    if (spool_dir_of(path, dir, sizeof(dir)) < 0) {
        snprintf(err, errlen, "%s: path too long for its spool directory", path);
        return -ENAMETOOLONG;
    }
    if (read_spool_head(s->db, &s->committed) != SQLITE_OK) {
        snprintf(err, errlen, "%s: reading spool_log: %s", path, sqlite3_errmsg(s->db));
        return -EIO;
    }
    struct spool_opts so = {.sync_full = s->opts.synchronous_full};
    int rc = spool_open(dir, &s->committed, &so, &s->spool, err, errlen);
    if (rc < 0)
        return rc;
    spool_set_yield(s->spool, hello_interlude, s);
    err[0] = '\0';
    if ((rc = import_legacy_spool(s, path, err, errlen)) < 0)
        return rc;
    sqlite3_stmt *q;
    if (sqlite3_prepare_v2(s->db,
                           "SELECT id, spool_done_step FROM runs WHERE spool_done_step IS NOT NULL",
                           -1, &q, NULL) != SQLITE_OK) {
        snprintf(err, errlen, "%s: reading evaluated steps: %s", path, sqlite3_errmsg(s->db));
        return -EIO;
    }
    while ((rc = sqlite3_step(q)) == SQLITE_ROW)
        if (spool_set_done(s->spool, sqlite3_column_int64(q, 0), sqlite3_column_int64(q, 1)) < 0)
            break;
    sqlite3_finalize(q);
    if (rc != SQLITE_DONE) {
        snprintf(err, errlen, "%s: reading evaluated steps: %s", path,
                 rc == SQLITE_ROW ? "out of memory" : sqlite3_errmsg(s->db));
        return -EIO;
    }
    size_t freed = spool_release(s->spool, &s->committed);
    if (freed)
        log_info("store", "spool: deleted %zu segments of evaluated steps", freed);
    return 0;
}

static int configure(sqlite3 *db, const char *path, int full, char *err, size_t errlen)
{
    sqlite3_extended_result_codes(db, 1);
    sqlite3_busy_timeout(db, FS_STORE_BUSY_TIMEOUT_MS);
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "PRAGMA journal_mode = WAL", -1, &st, NULL) != SQLITE_OK) {
        snprintf(err, errlen, "%s: %s", path, sqlite3_errmsg(db));
        return -EIO;
    }
    int rc = sqlite3_step(st);
    const char *mode = rc == SQLITE_ROW ? (const char *)sqlite3_column_text(st, 0) : NULL;
    int wal = mode && (strcmp(mode, "wal") == 0 || strcmp(mode, "memory") == 0);
    char got[32];
    snprintf(got, sizeof(got), "%s", mode ? mode : "?");
    sqlite3_finalize(st);
    if (!wal) {
        snprintf(err, errlen, "%s: cannot enable WAL (journal_mode is %s): %s", path, got,
                 sqlite3_errmsg(db));
        return -EIO;
    }
    if (exec_sql(db, full ? "PRAGMA synchronous = FULL" : "PRAGMA synchronous = NORMAL", err,
                 errlen, path) != SQLITE_OK ||
        exec_sql(db, "PRAGMA foreign_keys = ON", err, errlen, path) != SQLITE_OK)
        return -EIO;
    return 0;
}

int store_open(const char *path, const struct store_opts *opts, struct store **out, char *err,
               size_t errlen)
{
    int rc = -ENOMEM;
    struct store *s = calloc(1, sizeof(*s));
    if (!s) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
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
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX;
    if (sqlite3_open_v2(path, &s->db, flags, NULL) != SQLITE_OK) {
        snprintf(err, errlen, "cannot open database %s: %s", path,
                 s->db ? sqlite3_errmsg(s->db) : "out of memory");
        rc = -EIO;
        goto fail;
    }
    if ((rc = configure(s->db, path, opts->synchronous_full, err, errlen)) < 0 ||
        (rc = migrate(s->db, path, err, errlen)) < 0)
        goto fail;
    for (int i = 0; i < ST_COUNT; i++) {
        if (sqlite3_prepare_v3(s->db, stmt_sql[i], -1, SQLITE_PREPARE_PERSISTENT, &s->st[i],
                               NULL) != SQLITE_OK) {
            snprintf(err, errlen, "%s: preparing statement %d: %s", path, i, sqlite3_errmsg(s->db));
            rc = -EIO;
            goto fail;
        }
    }
    if ((rc = open_spool(s, path, err, errlen)) < 0)
        goto fail;
    s->spool_bytes = spool_bytes(s->spool);
    atomic_store(&s->stats->spool_bytes, s->spool_bytes);
    if ((rc = advice_store_open(s->db, &s->advice)) < 0 ||
        (rc = attempts_store_open(s->db, &s->attempts)) < 0) {
        snprintf(err, errlen, "%s: preparing the advice and attempt statements: %s", path,
                 sqlite3_errmsg(s->db));
        goto fail;
    }
    rc = -ENOMEM;
    if (!(s->opts.prune_interval_s > 0))
        s->opts.prune_interval_s = FS_STORE_PRUNE_INTERVAL_S;
    /* The writer's timed wait (retention) is on the monotonic clock. */
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0) {
        snprintf(err, errlen, "cannot create writer locks");
        goto fail;
    }
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    mu = !pthread_mutex_init(&s->mu, NULL);
    cv = mu && !pthread_cond_init(&s->cv, &ca);
    done = cv && !pthread_cond_init(&s->done_cv, NULL);
    pthread_condattr_destroy(&ca);
    if (!done) {
        snprintf(err, errlen, "cannot create writer locks");
        goto fail;
    }
    if (pthread_create(&s->thread, NULL, writer_main, s) != 0) {
        snprintf(err, errlen, "cannot start the writer thread");
        rc = -EAGAIN;
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
    for (int i = 0; i < ST_COUNT; i++)
        sqlite3_finalize(s->st[i]);
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
    for (int i = 0; i < ST_COUNT; i++)
        sqlite3_finalize(s->st[i]);
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
    cache_free(&s->cache);
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

int store_open_readonly(const char *path, sqlite3 **out, char *err, size_t errlen)
{
    sqlite3 *db = NULL;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK) {
        snprintf(err, errlen, "cannot open database %s read-only: %s", path,
                 db ? sqlite3_errmsg(db) : "out of memory");
        sqlite3_close(db);
        return -EIO;
    }
    sqlite3_busy_timeout(db, FS_STORE_BUSY_TIMEOUT_MS);
    if (exec_sql(db, "PRAGMA query_only = 1", err, errlen, path) != SQLITE_OK) {
        sqlite3_close(db);
        return -EIO;
    }
    *out = db;
    return 0;
}
