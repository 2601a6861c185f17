#ifndef FORESHOCK_STORE_RESTART_H
#define FORESHOCK_STORE_RESTART_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "alert.h"
#include "spool.h"
#include "store.h"

/* What the monitor stage reads back at a restart (stage_load, stage.h):
 * each run's shape and evaluated step, the lead rank's learning rates, the
 * persisted detector and alert states, the streams' and runs' attempts, and
 * where the spool log's unreleased records start. The queries live here,
 * beside the schema they read; the stage gets plain rows and never sees
 * SQL.
 *
 * Opens its own read-only connection (store_open_readonly), so it runs
 * beside the writer. One thread, the caller's: the main thread before the
 * loop runs.
 *
 * Every iterator calls cb once per row, with pointers valid during the call
 * only; cb returns 0 to go on, anything else to stop (returned). Each
 * returns 0, a negative errno-style code with err ("loading monitor state
 * (WHAT): ..."), or cb's value. */

struct store_restart;

/* Opens path read-only. 0 and *out, or a negative errno-style code with err. */
int store_restart_open(const char *path, struct store_restart **out, struct fs_err *err);
void store_restart_close(struct store_restart *r);

struct store_restart_run {
    int64_t id;
    const char *name;
    uint32_t world_size;
    uint64_t detect_from_step;                /* 0: the run's Hello did not set it */
    uint32_t n_layers, n_heads;               /* from the stored model shape; 0: not known */
    char optimizer[FS_MAX_OPTIMIZER_LEN + 1]; /* the stored model shape's; "": not known */
    const char *local_ranks; /* the latest attempt's local group (ranks.h text); NULL: none */
    bool has_done_step;      /* false: a database of a version that did not record it */
    int64_t done_step;       /* every step <= it was evaluated (runs.spool_done_step) */
};

/* Every run. */
int store_restart_runs(struct store_restart *r,
                       int (*cb)(void *ctx, const struct store_restart_run *run), void *ctx,
                       struct fs_err *err);

/* Per run, the last step any sketch-derived (rank -1) series was detected
 * at: the evaluated step of a database that did not record it. */
int store_restart_detected_steps(struct store_restart *r,
                                 int (*cb)(void *ctx, int64_t run_id, int64_t step), void *ctx,
                                 struct fs_err *err);

/* The stored values of one whole-model scalar (`lr`, `grad_norm`) of one
 * run's rank, by step; points without a value or with a negative step are
 * left out. */
int store_restart_scalar(struct store_restart *r, int64_t run_id, uint32_t rank, const char *name,
                         int (*cb)(void *ctx, uint64_t step, double value), void *ctx,
                         struct fs_err *err);

struct store_restart_detector {
    int64_t run_id;
    struct store_series_key key;
    int64_t step;      /* the last step detected */
    const void *state; /* detect_state_encode's bytes (NULL when empty) */
    size_t len;
};

/* Every persisted detector state (rows of series without a name are left out). */
int store_restart_detectors(struct store_restart *r,
                            int (*cb)(void *ctx, const struct store_restart_detector *d), void *ctx,
                            struct fs_err *err);

struct store_restart_alert {
    int64_t run_id;
    struct store_series_key key;
    const void *state; /* alert_state_encode's bytes (NULL when empty) */
    size_t len;
    enum alert_attribution attribution; /* of the latest transition (NONE: unknown name) */
    double value, median, mad, z;       /* its evidence; NAN where NULL */
};

/* Every alert row (rows of series without a name are left out). */
int store_restart_alerts(struct store_restart *r,
                         int (*cb)(void *ctx, const struct store_restart_alert *a), void *ctx,
                         struct fs_err *err);

/* Every stream's attempt. */
int store_restart_streams(struct store_restart *r,
                          int (*cb)(void *ctx, int64_t stream_id, int64_t run_id, uint32_t attempt),
                          void *ctx, struct fs_err *err);

struct store_restart_attempt {
    int64_t run_id;
    uint32_t attempt; /* the run's latest */
    bool has_resume;  /* it rewound the run to resume_step */
    uint64_t resume_step;
    bool rebuilt;      /* the detection state at resume_step was stored */
    bool has_previous; /* an earlier attempt exists: previous */
    uint32_t previous;
};

/* Every run's latest attempt. */
int store_restart_attempts(struct store_restart *r,
                           int (*cb)(void *ctx, const struct store_restart_attempt *a), void *ctx,
                           struct fs_err *err);

/* Where the spool log's records not yet released start ({0, 0}: no record
 * of it, a new database). 0 or a negative code with err. */
int store_restart_spool_head(struct store_restart *r, struct spool_pos *out, struct fs_err *err);

/* The acknowledged frames of steps not yet evaluated (spool_frames, steps
 * past their run's spool_done_step), in log order: *out (malloc'd, NULL
 * when none) and *n. 0 or a negative code with err. */
int store_restart_spool_frames(struct store_restart *r, struct spool_frame **out, size_t *n,
                               struct fs_err *err);

#endif
