#ifndef FORESHOCK_STAGE_INTERNAL_H
#define FORESHOCK_STAGE_INTERNAL_H

/* What the files of the monitor stage share; not for use outside them.
 *
 *   stage.c         feed, dispatch, drain, stop: the loop-thread glue, the
 *                   per-run scalar queue and the ingest backpressure
 *   stage_eval.c    the workers' math (work_cb) and the evaluation of a
 *                   computed bucket into series points and detection
 *   stage_rows.c    building one STORE_ITEM_MONITOR (struct build) from the
 *                   evaluator's tracks and batches, and submitting it
 *   stage_rewind.c  attempts and rewinds: dropping an abandoned attempt's
 *                   steps, the rebuild on a worker, storing its outcome
 *   stage_load.c    restart: persisted state (store_restart.h) and the
 *                   spool re-fed
 *
 * Threads as in stage.h: everything here runs on the loop thread, except
 * stage_work_cb (a threadpool thread, which touches only its chunk's groups
 * and the workspace pool). */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "evaluate.h"
#include "log.h"
#include "monitor_ws.h"
#include "run.h"
#include "stage.h"

/* Scalars of a rank-0 report waiting for the earlier steps' buckets, so that
 * every detector of a run sees its steps in order and attribution at a
 * step reflects only what was known up to that step. */
struct scalar_sample;
/* Bytes a queued sample holds (max_run_bytes accounting). */
#define stage_sample_bytes(x) (sizeof(*(x)) + ((size_t)(x)->n_wn + (x)->n_ur) * sizeof(float))

struct scalar_sample {
    uint64_t step;
    double time;
    uint32_t rank; /* the run's lead rank when queued */
    bool has_loss, has_grad, has_lr, has_sur;
    double loss, grad, lr, sur; /* sur: step_update_ratio */
    uint32_t n_wn, n_ur;
    float *wn, *ur; /* owned */
    struct scalar_sample *next;
};

/* A stream's attempt (stage_attempt, or the streams table at a restart). */
struct stream_attempt {
    int64_t stream_id;
    uint32_t attempt;
};

enum rewind_phase {
    REWIND_IDLE = 0,
    REWIND_DRAINING = 1,   /* the old attempt's jobs of steps <= the rewind step finish */
    REWIND_REBUILDING = 2, /* rewind_rebuild on a worker */
};

/* Spooled frame bytes of one step not yet evaluated (spool_max_bytes). */
struct spool_step {
    uint64_t step;
    uint64_t bytes;
};

struct stage_run {
    struct scalar_sample *sc_head, *sc_tail;
    size_t n_sc;
    struct spool_step *spooled; /* ascending step */
    size_t n_spooled, cap_spooled;
    struct eval_run ev; /* detector and alert state of the run's detected series */
    bool dropping;      /* a step was abandoned at shutdown: later ones are not evaluated either */
    struct job *jobs_head, *jobs_tail; /* buckets on workers or waiting to be evaluated */
    /* Attempts (stage.h): the run's latest and its rewind step, and each
     * stream's. Reports of an older attempt after resume_step are ignored. */
    uint32_t attempt;
    bool has_resume;
    uint64_t resume_step;
    struct stream_attempt *streams;
    size_t n_streams, cap_streams;
    bool forget;          /* deleted (stage_forget): freed once no job of it is on the workers */
    uint64_t sc_bytes;    /* of the queued scalar samples (stage_sample_bytes) */
    uint64_t spool_bytes; /* sum of spooled[].bytes */
    bool budget_logged;   /* a series past max_run_bytes was logged */
    /* A rewind in progress: nothing of the run is dispatched or detected. */
    enum rewind_phase rewind;
    uint64_t rewind_step;
    uint32_t rewind_from;    /* the attempt being abandoned */
    uint32_t rewind_attempt; /* the attempt that rewinds (a later plain restart may be
                                sr->attempt by the time its rebuild is stored) */
    unsigned rewind_gen;     /* a newer rewind makes a rebuild in flight stale */
    bool rebuild_busy;       /* a rewind_work of this run is on a worker */
};

/* --- jobs: one bucket on the workers ----------------------------------------------------- */

struct chunk {
    uv_work_t req;
    struct job *job;
    size_t lo, hi;  /* units[lo..hi) */
    double seconds; /* CPU time of the worker thread (fs_clock_thread_cpu) */
    uint64_t heads;
};

struct job {
    struct stage *st;
    int64_t run_id;
    struct run_bucket *b;
    struct run_group **units; /* groups that need the workers */
    size_t n_units;
    struct chunk *chunks;
    size_t n_chunks, pending;
    bool computed;
    bool cancelled;  /* a chunk never ran (shutdown deadline): not to be evaluated */
    bool superseded; /* a step a rewind abandoned: not to be evaluated */
    struct job *next;
};

struct stage {
    struct stage_opts opts;
    struct fs_stats *stats;
    struct fs_stats own_stats;
    struct run_registry *reg;
    struct monitor_ws_pool *pool; /* workers' workspaces */
    uv_timer_t sweep;
    int timer_open;
    size_t inflight; /* chunks on workers */
    size_t jobs;     /* jobs not yet evaluated */
    int stopping;
    size_t abandoned;       /* steps left unevaluated (spooled) by the deadline */
    uint64_t spool_pending; /* spooled frame bytes of steps not yet evaluated, all runs */
    size_t runs_spooling;   /* runs with spool_bytes > 0 */
    size_t runs_over;       /* runs at spool_run_max_bytes */
    int full;
    void (*pressure)(void *ctx, int full);
    void *pressure_ctx;
    void (*done)(void *ctx);
    void *done_ctx;
    char *db_path; /* for rewinds (opts.db_path or stage_load's), owned */
    struct log_ratelimit rl_incomplete, rl_late, rl_dup, rl_err, rl_superseded;
};

/* One STORE_ITEM_MONITOR being built (stage_rows.c). */
struct build {
    struct store_item *it;
    size_t cap_points, cap_states, cap_alerts, cap_incomplete;
    size_t *blob_off; /* per state: offset into blobs */
    size_t blob_len, blob_cap;
    struct eval_batch batch; /* alert rows changed by this item */
    int oom;
};

static inline double now_mono(void)
{
    return (double)uv_hrtime() * 1e-9;
}

static inline int64_t detect_from(const struct stage *st, const struct run *run)
{
    return (int64_t)(run->has_detect_from_step ? run->detect_from_step : st->opts.detect_from_step);
}

/* --- stage.c ------------------------------------------------------------------------- */

/* The run's stage state, created on first use. NULL when out of memory. */
struct stage_run *stage_run_of(const struct stage *st, struct run *run);

void stage_sample_free(struct scalar_sample *s);

/* Every step <= step of the run is evaluated: its spooled frames no longer
 * count against spool_max_bytes. */
void stage_spool_evaluated(struct stage *st, struct stage_run *sr, uint64_t step);

/* Detects queued scalars of steps below every pending bucket (all of them
 * when `all`), into bd or, when bd is NULL, into one item of their own. */
void stage_flush_scalars(struct stage *st, struct run *run, struct build *bd, bool all);

/* Starts every ready bucket of the run, earliest first. */
void stage_pump(struct stage *st, struct run *run, double now);

/* Tells ingest whether to pause reading (stage_set_pressure). */
void stage_check_pressure(struct stage *st);

/* Calls the stop callback once stopping and nothing is on the workers. */
void stage_maybe_done(struct stage *st);

/* Logs what a declared local group means for the run's monitors. */
void stage_log_local_group(const struct run *run);

/* --- stage_rows.c -------------------------------------------------------------------- */

/* An empty item for run_id. 0 or -ENOMEM. */
int build_begin(struct build *bd, int64_t run_id, double time);

/* realloc-doubling of an array p of n elements of size (capacity *cap):
 * p itself while n < *cap, else the grown array (NULL and *oom set when out
 * of memory; p is then still valid). */
void *build_grow(void *p, size_t *cap, size_t n, size_t size, int *oom);

void build_key(struct store_series_key *k, const char *name, int32_t layer, int32_t head,
               int32_t window, int32_t rank);
void build_point(struct build *bd, const struct store_series_key *k, uint64_t step, double value);

/* The detector-state row of track t. */
void build_state(struct build *bd, const struct eval_track *t);
void build_incomplete(struct build *bd, uint64_t step, const struct run_incomplete *r);

/* One sample into a detected series (evaluate.h), with its state row. */
void build_feed(struct stage *st, struct stage_run *sr, struct run *run, struct build *bd,
                const struct store_series_key *k, const char *rule_name, uint64_t step,
                double value, bool present, int32_t argmin_head);

/* Labels the changed alert rows and turns them into rows. */
void build_finish(struct stage_run *sr, const struct run *run, struct build *bd);

/* Submits the item to the writer (or drops an empty one). */
void build_submit(struct stage *st, struct build *bd);

/* --- stage_eval.c -------------------------------------------------------------------- */

/* Threadpool thread: the math of one chunk (struct chunk in req->data). */
void stage_work_cb(uv_work_t *req);

/* A computed bucket into points, detection and one item. Loop thread. */
void stage_evaluate(struct stage *st, struct run *run, struct run_bucket *b);

/* The queued scalars of one report into detection (bd of the run). */
void stage_detect_scalars(struct stage *st, struct stage_run *sr, struct run *run, struct build *bd,
                          const struct scalar_sample *x);

/* --- stage_rewind.c ------------------------------------------------------------------ */

/* A Hello started an attempt that rewinds the run to step (abandoning
 * attempt `from`). */
void stage_rewind_start(struct stage *st, struct run *run, struct stage_run *sr, uint64_t step,
                        uint32_t from);

/* Starts the rebuild once the old attempt's steps up to the rewind step are
 * evaluated (a no-op before). */
void stage_rewind_rebuild(struct stage *st, struct run *run);

/* A stream's attempt. 0, -ENOSPC (too many streams) or -ENOMEM. */
int stage_stream_attempt_set(struct stage_run *sr, int64_t stream_id, uint32_t attempt);

/* The run's latest attempt (and its rewind step) as the writer knows it. */
void stage_run_attempt_set(struct stage_run *sr, const struct attempt_info *a);

#endif
