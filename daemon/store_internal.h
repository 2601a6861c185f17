#ifndef FORESHOCK_STORE_INTERNAL_H
#define FORESHOCK_STORE_INTERNAL_H

/* Inside the store: what the writer's files share, for them only (other
 * modules use store.h). The store is one writer thread over one read-write
 * connection, split by job:
 *
 *   store.c          the queue, the writer thread (batches, transactions,
 *                    retries, giving up at the stop deadline) and results
 *                    announced after COMMIT; the public API
 *   store_open.c     the statement table, configuration, migrations, the
 *                    spool log at open, store_open / store_close
 *   store_apply.c    applying one item inside the open transaction (Hello,
 *                    report, monitor output with alerts, outbox and advice
 *                    rows, the pager's outcomes) and the batch's results
 *   store_series.c   the series id cache and point rows
 *   store_silence.c  the HTTP API's silence writes and their waiters
 *   store_prune.c    retention of finished outbox rows and old silences
 *   store_runs.c     the run lifecycle: live-run quotas, ending runs,
 *                    deleting every row of a run (API and retention)
 *
 * Everything here runs on the writer thread (the main thread at open and
 * close) unless it says otherwise. SQLite result codes, not errno, unless
 * it says otherwise. */
#include <math.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fs_index.h"
#include "log.h"
#include "spool.h"
#include "store.h"

/* The writer's prepared statements (s->st); their SQL is stmt_sql[] in store_open.c. */
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
    ST_RUN_UNDONE,
    ST_STREAM_BUMP,
    ST_RUN_BUMP,
    ST_STATE_PUT,
    ST_ALERT_UPSERT,
    ST_EVENT_INSERT,
    ST_INCOMPLETE_PUT,
    ST_OUTBOX_INSERT,
    ST_OUTBOX_OUTCOME,
    ST_FRAME_INSERT,
    ST_FRAME_DONE,
    ST_STREAM_EXISTS,
    ST_RUN_EXISTS,
    ST_COUNT
};

/* A run is live from its first report until it ends or is marked for
 * deletion (schema/010_run_lifecycle.sql); max_runs counts live runs. */
#define STORE_RUN_LIVE_SQL "(reports > 0 AND ended_at IS NULL AND deleting = 0)"
/* The id a new row of table T takes: never one a deleted row had
 * (id_floor, schema/010_run_lifecycle.sql). */
#define STORE_NEXT_ID_SQL(T)                                                                       \
    "(SELECT max(COALESCE((SELECT max(id) FROM " T "), 0), "                                       \
    "COALESCE((SELECT id FROM id_floor WHERE tbl = '" T "'), 0)) + 1)"

/* Stream keys of queued reports, as bits (take_hellos). A false positive
 * only leaves a Hello in its place. */
#define STORE_HELLO_FILTER_BITS 65536u

/* --- series id cache (writer thread only) --------------------------------------
 * Entries live in a dense array (indices are stable while a batch runs);
 * an open-addressing index maps keys to entry indices. Each entry also
 * accumulates the batch's new points so that series.points/first_step/
 * last_step are written once per series per transaction. */
#define SERIES_NAME_MAX 48
#define SERIES_INDEX_MIN_SLOTS 1024u /* slots of the first index */

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
    struct fs_index index; /* over ents, by series_entry.hash */
    uint32_t *dirty;       /* entry indices with add_points > 0 */
    size_t ndirty, capdirty;
};

/* Silence statements (store_silence.c), prepared on first use. */
enum { SIL_INSERT, SIL_EXPIRE, SIL_EXISTS, SIL_LIVE, SIL_COUNT };

struct store {
    sqlite3 *db;
    sqlite3_stmt *st[ST_COUNT];
    struct store_opts opts;
    struct fs_stats *stats;
    struct fs_stats own_stats; /* when opts.stats is NULL */

    pthread_t thread;
    int thread_started;
    pthread_mutex_t mu;     /* guards everything down to `serving` */
    pthread_cond_t cv;      /* writer waits for items / stop */
    pthread_cond_t done_cv; /* store_flush waits for batches */
    struct store_item *head, *tail;
    uint64_t q_items, q_bytes;                       /* queued + in the open transaction */
    uint64_t q_hellos;                               /* HELLO items queued (not yet taken) */
    uint8_t w_reported[STORE_HELLO_FILTER_BITS / 8]; /* writer: take_hellos' scratch */
    uint64_t submitted, settled;                     /* item counts, for store_flush */
    uint64_t spool_bytes;                            /* bytes in the spool's segment files */
    int refusing, stopping;
    double stop_deadline;     /* monotonic; > 0: failing writes are given up past it */
    int stop_asked;           /* store_set_stop_deadline was called (under mu) */
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
        bool lower; /* a rewind lowered it to step (else raised) */
    } * w_done;     /* runs.spool_done_step changed by the open transaction, in order */
    size_t nw_done, capw_done;
    char w_spool_err[160]; /* why the open transaction's spool work failed ("": it did not) */
    /* The batch whose records spool_batch is appending, before its
     * transaction begins: store_hello_interlude may commit Hellos meanwhile. */
    struct store_item *const *w_spooling;
    size_t nw_spooling;
    struct series_cache cache;
    struct store_item **batch; /* batch_max_items */
    unsigned char *refused;    /* batch_max_items flags */
    struct store_result *wres; /* results of the batch being written */
    size_t nwres, capwres;
    int64_t w_outbox_max; /* highest outbox id inserted by the open transaction */
    char w_targets[STATS_MAX_TARGETS][STATS_TARGET_NAME_MAX]; /* copy taken per batch */
    size_t w_ntargets;
    struct log_ratelimit rl_fail, rl_hello;
    sqlite3_stmt *sil_st[4]; /* silence statements, prepared on first use (writer thread) */
    /* advice (advice.h): the policy (read-only; NULL: none) and the writer's
     * statements */
    const struct advice_policy *advice_policy;   /* under mu */
    const struct advice_policy *w_advice_policy; /* copy taken per batch */
    struct advice_store *advice;
    struct attempts_store *attempts;
    int w_runs_due; /* a run was marked for deletion: the lifecycle pass is due now */
};

struct batch_counts {
    uint64_t reports, duplicates, points;
};

/* Steps st once, reading ncols int64 columns of a row into cols; resets
 * it and clears its bindings. Returns SQLITE_ROW, SQLITE_DONE or an error. */
static inline int exec1(sqlite3_stmt *st, int64_t *cols, int ncols)
{
    int rc = sqlite3_step(st);
    if (rc == SQLITE_ROW)
        for (int i = 0; i < ncols; i++)
            cols[i] = sqlite3_column_int64(st, i);
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    return rc;
}

static inline int ok(int rc)
{
    return rc == SQLITE_ROW || rc == SQLITE_DONE || rc == SQLITE_OK;
}

static inline int bind_value(sqlite3_stmt *st, int i, double v)
{
    /* SQLite stores NaN as NULL anyway; say so explicitly. NULL in points
     * means "absent", so a NaN loss is not distinguishable from no loss in
     * the database; the live value still reaches the detectors. */
    return isnan(v) ? sqlite3_bind_null(st, i) : sqlite3_bind_double(st, i, v);
}

/* --- store.c ------------------------------------------------------------------- */

/* The writer thread's body (pthread start routine; arg is the store). */
void *store_writer_main(void *arg);
/* The spool's yield hook (spool_set_yield): commits queued Hellos between the
 * pieces of a batch's spool writes (store.c). Writer thread. */
void store_hello_interlude(void *ctx);

/* --- store_apply.c ------------------------------------------------------------- */

/* Applies one item inside the open transaction; SQLite rc. A HELLO refused
 * by a limit is not an error: its result carries the refusal. */
int store_apply_item(struct store *s, const struct store_item *it, double now,
                     struct batch_counts *bc);

/* Appends a zeroed result to the batch's results (s->wres); NULL when out
 * of memory. The array may move: earlier pointers into it go stale. */
struct store_result *store_wres_add(struct store *s);

/* A spool failure inside the transaction: records why in s->w_spool_err
 * and returns SQLite's code for it (SQLITE_FULL, SQLITE_NOMEM or
 * SQLITE_IOERR: transient, the batch is retried with backoff). err is a
 * negative errno. */
int store_spool_failed(struct store *s, const char *what, int err);

/* --- store_series.c ------------------------------------------------------------ */

/* Finds or creates the series (run_id, name, layer l, head h, window w,
 * rank r); *idx is its entry in s->cache, valid until the cache is
 * cleared. */
int store_series_get(struct store *s, int64_t run_id, const char *name, int32_t l, int32_t h,
                     int32_t w, int32_t r, long *idx);

/* Stores value at step in the series of cache entry idx, at time t; a
 * re-done step replaces its value without adding a point. Adds the new
 * points to *points. */
int store_point_put(struct store *s, long idx, uint64_t step, double value, double t,
                    uint64_t *points);

/* Writes the batch's point counts and step ranges into the series rows
 * (once per series per transaction). */
int store_series_flush(struct store *s);

/* Forgets every cached id (after a rollback, or when the cache is full). */
void store_cache_clear(struct series_cache *c);

/* Frees the cache's memory. */
void store_cache_free(struct series_cache *c);

/* --- store_silence.c ----------------------------------------------------------- */

/* Applies a STORE_ITEM_SILENCE, keeping its outcome in the item (published
 * by store_silence_settle after the batch). */
int store_apply_silence(struct store *s, struct store_item *it, double now);

/* After the batch: publishes each silence item's outcome to its waiter
 * (-EIO when refused[i]). */
void store_silence_settle(struct store *s, struct store_item **batch, size_t n);

/* Sets the waiter's outcome once (later calls do nothing). Any thread. */
void store_waiter_settle(struct store_waiter *w, int status, int64_t id);

/* --- store_prune.c ------------------------------------------------------------- */

/* Runs one retention transaction when *next (monotonic seconds) is due,
 * and sets the next due time. */
void store_prune_if_due(struct store *s, double *next);

/* --- store_runs.c -------------------------------------------------------------- */

/* The run lifecycle pass (store_runs.c) when due (or w_runs_due): ends idle
 * runs, deletes those due, announces STORE_RESULT_RUN_GONE. Writer thread,
 * between item batches. */
void store_runs_if_due(struct store *s, double *next);

/* Whether a Hello may make a run live: "" in why (len bytes) when it may,
 * else the refusal. SQLite rc. Inside the open transaction. */
int store_run_quota(struct store *s, const char *owner, char *why, size_t len);

/* Applies a STORE_ITEM_RUN, keeping its outcome in the item. */
int store_apply_run(struct store *s, struct store_item *it, double now);

/* After the batch: publishes each run item's outcome to its waiter. */
void store_runs_settle(struct store *s, struct store_item **batch, size_t n);

/* --- store.c (announcing) --- */

/* Under mu: appends an announced result (not tied to the open transaction). */
int store_res_push(struct store *s, const struct store_result *r);

#endif
