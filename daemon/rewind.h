#ifndef FORESHOCK_REWIND_H
#define FORESHOCK_REWIND_H

#include <stddef.h>
#include <stdint.h>

#include "alert.h"
#include "evaluate.h"
#include "fs_err.h"

/* Rewind: a trainer restarted from a checkpoint taken at step s announces
 * a new attempt with Hello.resume_step = s (attempts.h). Its re-done steps
 * (> s) are the new attempt's, evaluated as such, not late; detection goes
 * on from the state the run had at s, rebuilt from the stored points of
 * steps <= s with the code `foreshock backtest` runs (eval_feed_stored);
 * the incidents the abandoned attempt opened after s end as superseded.
 * The monitor stage (stage_rewind.c) drives it: it drops what the old attempt left
 * reducing after s, lets its computed steps <= s finish, runs
 * rewind_rebuild on a worker, then decides each alert's fate with
 * rewind_fate and stores the rebuilt state in one transaction. */

/* The run's detection state at step (detector and alert states, training
 * progress) from its stored points of steps <= step, into er (initialised
 * by the caller with the live rules). lead_rank: the rank whose scalars the
 * run detects (run.h); detect_from_step: the run's or the configuration's. Opens its own read-only
 * connection to db_path: any thread (the stage runs it on a worker). 0, or a negative errno with
 * err. The caller must have had every point of steps <= step committed. */
int rewind_rebuild(const char *db_path, int64_t run_id, uint64_t step, uint32_t lead_rank,
                   int64_t detect_from_step, struct eval_run *er, struct fs_err *err);

/* What a rewind to `step` does to one alert, from its live state (old; all
 * zero for a series the live run never had) and the rebuilt one. Pure. */
enum rewind_fate {
    REWIND_KEEP = 0,      /* the stored row stays as it is */
    REWIND_ROW = 1,       /* the row takes the rebuilt state; no event */
    REWIND_SUPERSEDE = 2, /* the open incident opened after step: to_superseded */
    /* The open incident opened at or before step but the rebuilt state
     * lost it (a non-finite value is stored as absent): the live alert
     * state goes on. */
    REWIND_CONTINUE = 3,
};
enum rewind_fate rewind_fate(const struct alert_state *old, const struct alert_state *rebuilt,
                             int64_t step);

/* The state the stored row shows after the rewind (its blob is the
 * rebuilt state, or the old one for REWIND_CONTINUE): superseded unless the
 * rebuilt alert is open; an old row that was not open keeps what it shows
 * (a resolved incident of the abandoned attempt did resolve). Pure. */
int rewind_row_state(enum rewind_fate f, const struct alert_state *old,
                     const struct alert_state *rebuilt);

#endif
