#ifndef FORESHOCK_STAGE_H
#define FORESHOCK_STAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "config.h"
#include "detect.h"
#include "foreshock.pb-c.h"
#include "run.h"
#include "stats.h"
#include "store.h"

/* The monitor stage: glue on the loop thread between ingest, the run
 * registry (run.h), the worker pool and the writer.
 *
 *   ingest --stage_feed--> run registry (shard/rank reduction, per step)
 *     a ready bucket (step order per run) --uv_queue_work, chunks of heads-->
 *     workers: qk_head_from_grams / router_weight_compute / router_decision
 *     --after_work (loop thread), in step order per run--> series points,
 *     detect_step + alert_step on the per-layer aggregates, attribution,
 *     evidence --> one STORE_ITEM_MONITOR (points, detector states, alert
 *     rows and events, incomplete rows, spool deletion of steps <= step).
 *   Scalars (loss, grad_norm, per-layer weight_norm / update_ratio of rank
 *   0) need no math: they are detected in stage_feed and their detector
 *   and alert rows are queued right after the REPORT item.
 *
 * Feeding order is the contract: ingest calls stage_feed only after
 * store_submit accepted the report, so the spool insert is queued before
 * anything the stage queues about that step. A report whose seq was
 * already fed on its stream (a resend) is not fed again.
 *
 * Restart: stage_load (before ingest accepts connections) reads the
 * persisted detector and alert state and each run's evaluated step
 * (runs.spool_done_step), then re-feeds the spool log (spool.h) oldest
 * first, skipping frames of evaluated steps; detection is idempotent per
 * series (a step at or below the series' last detected step is skipped),
 * so a replay neither re-fires nor forgets.
 *
 * Attempts and rewinds (attempts.h, rewind.h): each stream's attempt comes
 * with its Welcome (stage_attempt). When a Hello starts an attempt that
 * rewinds the run to step s, the stage drops the old attempt's steps after s
 * still reducing or queued, lets its computed steps <= s be evaluated,
 * rebuilds the run's detection state at s from the stored points on a
 * worker (the backtest's code), supersedes the incidents that opened after
 * s, and stores the rebuilt state in one transaction (attempts.rebuilt_at);
 * the new attempt's steps wait meanwhile and are then evaluated as its own.
 * Reports of older attempts for steps after s are ignored from then on (a
 * restart re-reads which attempt each stream belongs to; a rewind not yet
 * stored is rebuilt by stage_load).
 *
 * Threads: every function here runs on the loop thread (stage_load on the
 * main thread before uv_run, which is the same thread). Workers only touch
 * the groups of the bucket they were given and a workspace checked out of
 * a mutex-guarded pool (monitor_ws.h).
 *
 * Files: stage.c (feed, dispatch, drain, stop), stage_eval.c (the workers'
 * math and evaluation), stage_rows.c (the monitor item), stage_rewind.c
 * (attempts and rewinds), stage_load.c (restart, reading through
 * store_restart.h); stage_internal.h is what they share. */

struct stage_opts {
    uv_loop_t *loop;
    struct store *store;
    struct fs_stats *stats;
    const struct detect_rules *rules; /* read-only, outlives the stage */
    double reduce_timeout_s;
    uint64_t reduce_max_bytes;
    uint64_t spool_max_bytes; /* spooled frame bytes of steps not yet evaluated (0: none) */
    /* ... of one run (0: none): past it only that run's streams that can
     * complete its oldest step are read; at spool_max_bytes, only those of
     * the runs holding at least an equal share of it (stage_may_read). */
    uint64_t spool_run_max_bytes;
    /* Per run (max_run_bytes; 0: none): half for its detected series'
     * state (EVAL_TRACK_BYTES each), a quarter for its queued scalars. A
     * Hello whose declared shape needs more is refused (stage_shape_check);
     * series past it are not detected (logged once per run). */
    uint64_t max_run_bytes;
    uint64_t head_points_every; /* per-head points at multiples of this step (0, 1: all) */
    uint64_t detect_from_step;  /* for runs whose Hello does not set it */
    unsigned max_chunks;        /* work requests per bucket (0: default) */
    double stop_timeout_s;      /* stage_stop: cancel math not started after this (0: none) */
    const char *db_path;        /* rewinds read stored points here (NULL: stage_load's) */
};

/* One decoded report, as ingest (or the spool replay) hands it over. */
struct stage_report {
    int64_t run_id;
    int64_t stream_id;
    uint32_t rank;
    uint64_t seq;
    uint64_t step;
    double time;                     /* sample time, unix seconds */
    const Foreshock__Report *report; /* read during the call only */
    size_t spool_bytes;              /* frame bytes spooled for it (0: not spooled) */
};

struct stage;

/* Creates the stage on loop (a sweep timer for timeouts). Returns 0 and
 * *out or a negative errno-style code with err. Loop thread, before uv_run. */
int stage_create(const struct stage_opts *opts, struct stage **out, struct fs_err *err);

/* Restart: reads runs, detector_state and alerts through a read-only
 * connection to db_path, then re-feeds the spool log "<db_path>.spool" up
 * to the end the database recorded, oldest first. 0 or a negative code
 * with err. Main (= loop) thread, after store_open and before ingest
 * starts. */
int stage_load(struct stage *st, const char *db_path, struct fs_err *err);

/* Ingest backpressure: cb(ctx, 1) when the reduction memory reached
 * reduce_max_bytes or the spooled frames of steps not yet evaluated reached
 * spool_max_bytes (read only stage_may_read streams), cb(ctx, 0) when both
 * drained below 3/4 of their bound. NULL detaches. Loop thread. */
void stage_set_pressure(struct stage *st, void (*cb)(void *ctx, int full), void *ctx);

/* True while reading should stay stopped for the stage. */
bool stage_full(const struct stage *st);

/* While stage_full: whether this stream's connection may still be read
 * because its next reports can complete the run's oldest reducing step
 * (pausing every connection would leave such a step to time out). True
 * when not full. Loop thread. */
bool stage_may_read(struct stage *st, int64_t run_id, int64_t stream_id);

/* Detected series per declared layer that a run needs at least: the four
 * attention aggregates of one window (qk.d2.{erank,entropy,srank}.min,
 * qk.cqk.max) and the lead rank's weight_norm and update_ratio. */
#define STAGE_SERIES_PER_LAYER 6u

/* Before a Hello is admitted: 0 when the shape it declares fits the run
 * budget (max_run_bytes), else -E2BIG with the reason in why (len bytes):
 * n_layers x STAGE_SERIES_PER_LAYER detected series of EVAL_TRACK_BYTES
 * each must fit in half of it. Pure. */
int stage_shape_check(const struct stage *st, const struct run_hello *h, char *why, size_t len);

/* A stream's Welcome went out: registers the run (name, world size, shape,
 * MoE announcement, detect_from_step) and that seqs <= last_seq of the
 * stream are committed. 0 or -ENOMEM. Loop thread. */
int stage_hello(struct stage *st, int64_t run_id, const char *run_name, int64_t stream_id,
                uint64_t last_seq, const struct run_hello *h);

/* A stream's Welcome went out (after stage_hello): its attempt, and the
 * run's latest (STORE_RESULT_HELLO). Starts a rewind when run->rewind says
 * this Hello started one. 0 or -ENOMEM. Loop thread. */
int stage_attempt(struct stage *st, int64_t run_id, int64_t stream_id, uint32_t attempt,
                  const struct attempt_info *run);

/* Feeds one accepted report. 0, or -ENOMEM (the report's sketches are
 * partly lost; they stay in the spool and are re-fed at the next start).
 * Loop thread. */
int stage_feed(struct stage *st, const struct stage_report *in);

/* Whether ingest should spool this report (keep its frame until the stage
 * deletes it with the rows derived from it): every report with sketches,
 * and the lead rank's (rank 0, or the lowest of a declared local group)
 * reports with detected scalars, whose detection waits for earlier steps
 * and must survive a crash. Loop thread (reads the run registry). */
bool stage_wants_spool(struct stage *st, int64_t run_id, uint32_t rank, const Foreshock__Report *r);

/* The run was deleted (store_runs.c): its state is freed now, or, while
 * buckets of it are on the workers or a rewind runs, as soon as they are
 * done (what they produce is dropped by the writer). Loop thread. */
void stage_forget(struct stage *st, int64_t run_id);

/* Evaluates ready buckets now (the sweep timer does this too). Loop thread. */
void stage_poll(struct stage *st);

/* Work requests in flight. */
size_t stage_inflight(const struct stage *st);

/* Orderly stop: no new buckets start; buckets already on workers finish,
 * are evaluated in order and their items submitted; then done(ctx) is
 * called on the loop thread. Buckets still reducing stay in the spool. A
 * second call is a no-op. Loop thread. */
void stage_stop(struct stage *st, void (*done)(void *ctx), void *ctx);

/* Frees the stage after done was called (or if stage_stop was never called
 * and the loop no longer runs; NULL is a no-op). Loop thread. */
void stage_free(struct stage *st);

#endif
