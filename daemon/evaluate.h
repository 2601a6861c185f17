#ifndef FORESHOCK_EVALUATE_H
#define FORESHOCK_EVALUATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "alert.h"
#include "detect.h"
#include "fs_index.h"
#include "store.h"

/* Detection and alert lifecycle of one run's detected series: the one
 * implementation behind the live monitor stage (stage.c) and `foreshock
 * backtest` (client/cli/backtest.c), so that a backtest with the live
 * settings raises exactly the live alerts.
 *
 * Pure: no I/O, no clocks (time is an argument), no threads; it allocates
 * its track table and batches. Everything here belongs to one thread: the
 * loop thread in the daemon.
 *
 *  - struct eval_run: the tracks of a run, one per detected series (a
 *    detector state, an alert state, the evidence of its last transition).
 *  - eval_feed: one sample of one series, in step order per run. Within a
 *    run, samples must be fed in the order the daemon feeds them: by step;
 *    within a step, the sketch-derived series (attention aggregates, router)
 *    and then the scalars (loss, grad_norm, weight_norm, update_ratio).
 *  - struct eval_batch: the alert rows that changed since the caller last
 *    took them. Every changed row carries its label: an incident's label is
 *    decided from the run's open evidence once every sample of the step it
 *    was raised at has been fed (alert_attribute), so it does not depend on
 *    how samples are grouped into batches, nor on their order within a step.
 */

#define EVAL_WHY_MAX 192 /* "qk.d2.srank.min layer=2 window=25; update_ratio layer=1" */

/* When detection starts, by training progress (docs/monitors.md section 4: early
 * training legitimately passes through sharp low-rank phases and fast
 * drifts; a baseline that holds them is too wide, one that fires on them is
 * wrong). The learning rate tells where training is: its warm-up ends at
 * the first step it stops rising, and the fast early phase lasts a few
 * warm-ups more. Detection of a series starts at
 *   detect_from_step, when the run (Hello) or the configuration sets one;
 *   else EVAL_START_WARMUPS x the LR warm-up end, at least EVAL_START_MIN;
 *   else, for a trainer that reports no learning rate, EVAL_START_NO_LR.
 * Steps count from the run's origin: step 0, or, for a run whose first
 * learning rate came at step EVAL_LATE_FIRST_STEP or later (a Monitor
 * attached to a resumed job or a running one), that first step. The
 * warm-up end is then the first step after the origin that the LR did not
 * rise (origin + 1 when the warm-up was over before the monitor came):
 * detection starts at origin + EVAL_START_WARMUPS x (warm-up end -
 * origin), at least origin + EVAL_START_MIN. Counted from step 0, a job
 * resumed at step 1,000 with its rate past the warm-up had no detection
 * until step 3,003 (the tenth held-out look: no attention rule ever ran).
 * Samples before the start neither fire (a non-finite value aside) nor
 * enter the baseline; after it, each rule's `warmup` samples build the
 * baseline. A series already started (restored after a restart) goes on. */
#define EVAL_START_WARMUPS 3
#define EVAL_START_MIN 100
#define EVAL_START_NO_LR 150
#define EVAL_LATE_FIRST_STEP 100
/* Where the baseline of an early_baseline rule (detect.h) starts, and its
 * detection once the baseline is warm: at the LR warm-up end (the step
 * size is at its scheduled level from there on, so it needs no
 * EVAL_START_WARMUPS wait), but not before EVAL_BASELINE_MIN (Adam's first steps
 * move every weight by about the full rate: a baseline of them is too
 * high); the same for a trainer that reports no learning rate; with an
 * explicit detect_from_step, there. */
#define EVAL_BASELINE_MIN 50

/* The logged learning rates a per_lr rule's sample is judged against
 * (detect.h): the mean over the steps since the series' previous sample,
 * and the rates at its baseline samples' steps, from the last
 * EVAL_LR_HISTORY steps' rates (a sketch every 10 steps and a 64-sample
 * baseline span 640 steps; an older baseline sample is left out). A
 * restart rebuilds them from the stored rates. */
#define EVAL_LR_HISTORY 1024
/* The baseline's rate counts as at least this share of the warm-up's peak:
 * a baseline from the end of a decay to zero does not credit every later
 * rate as a rise of hundreds. */
#define EVAL_LR_BASE_MIN_REL 0.01
/* A within_peak rule's bound: the warm-up's peak, give or take this share
 * (a schedule that returns to its peak recomputes it; rounding may differ). */
#define EVAL_LR_PEAK_TOL 1e-6

/* A run whose update follows the gradient (eval_run.update_follows_grad):
 * a per_lr rule credits the square root of the gradient norm's rise
 * (evaluate.c: per_grad_credit), the norm averaged over at least the last
 * EVAL_GRAD_SPAN steps. Under momentum SGD the monitored layers' steps do
 * not rise one for one with the global norm (it counts every parameter;
 * momentum smooths the step): on the SGD MoE of the fifth and eleventh
 * held-out looks the full credit, or one over the current step alone,
 * silenced hidden rate faults that the square root over 5 steps keeps. */
#define EVAL_GRAD_CREDIT_POWER 0.5
#define EVAL_GRAD_SPAN 5

/* A rule with early_grad_rise (detect.h) keeps, between the LR warm-up end
 * and the start of detection, its own baseline of the samples since the
 * warm-up end (evaluate.c: early_relative): the latest EVAL_EARLY_RING of
 * them, judged once at least EVAL_EARLY_MIN of them span the rule's
 * warmup_steps. */
#define EVAL_EARLY_RING 32
#define EVAL_EARLY_MIN 8
struct eval_early {
    double value[EVAL_EARLY_RING];
    uint32_t head, count;
    int64_t first_step; /* of the first sample kept (while count > 0) */
};

/* The newest EVAL_LR_HISTORY (step, value) pairs of one scalar, circular,
 * steps increasing. */
struct eval_history {
    double value[EVAL_LR_HISTORY];
    int64_t step[EVAL_LR_HISTORY];
    uint32_t head, count;
};

struct eval_progress {
    bool lr_seen;
    int64_t lr_first_step; /* step of the first LR seen */
    double lr_last;
    int64_t lr_last_step;
    int64_t warmup_end; /* first step the LR did not rise (-1: still rising, or none seen) */
    double lr_peak;     /* the largest LR up to the warm-up end (0: none) */
    struct eval_history lr_hist;
    /* The lead rank's gradient norms, for a run whose update follows the
     * gradient (eval_run.update_follows_grad). */
    struct eval_history grad_hist;
    int64_t grad_last_step;
};

struct eval_track {
    struct store_series_key key;
    char rule_name[DETECT_NAME_MAX];
    const struct detect_rule *rule;
    struct detect_state ds;
    struct alert_state as;
    int64_t last_step;                           /* last step fed (-1: none) */
    uint8_t row_blob[ALERT_STATE_ENCODED_BYTES]; /* alert blob as last taken */
    /* Evidence of the latest transition, and the label of the incident
     * with the series that decided it. */
    double ev_value, ev_median, ev_mad, ev_z;
    enum alert_attribution ev_attr;
    char ev_why[EVAL_WHY_MAX];
    uint64_t hash;
    struct eval_early early; /* before the start (early_grad_rise); not persisted */
};

/* The run's latest breaches of size of rules with cross_layer_windows
 * (evaluate.c: cross_layer_confirms), a ring of EVAL_CROSS_LAYER_MAX; the
 * oldest goes. A breach is confirmed by breaches of other layers, one more
 * for every EVAL_CROSS_LAYER_PER layers the run has: chance dips of
 * separate layers coincide more often in a deeper model. */
#define EVAL_CROSS_LAYER_MAX 32
#define EVAL_CROSS_LAYER_PER 16
struct eval_size_breach {
    int32_t window, rank, layer;
    int64_t step; /* -1: the slot is free */
};

struct eval_run {
    const struct detect_rules *rules; /* read-only, outlives the run */
    struct eval_track **tracks;
    size_t n_tracks, cap_tracks;
    struct fs_index index; /* over tracks, by eval_track.hash */
    struct eval_progress progress;
    /* The run's memory budget (max_run_bytes): at most max_tracks tracks
     * (0: no bound; kept by eval_run_clear); eval_track_get refuses more
     * and counts them in capped. */
    size_t max_tracks;
    uint64_t capped;
    /* The run's optimizer steps by the rate times the gradient (SGD and its
     * kin: eval_optimizer_follows_grad), so a per_lr rule also credits a
     * rise of the gradient norm (evaluate.c: per_grad_credit). */
    bool update_follows_grad;
    /* Not persisted: after a restart or a rewind a breach waits for its own
     * persistence once. */
    struct eval_size_breach size_breach[EVAL_CROSS_LAYER_MAX];
    uint32_t size_breach_next; /* the ring's next slot */
};

/* Bytes one track costs a run (the track, its pointer, its index slots):
 * what max_run_bytes is accounted in. */
#define EVAL_TRACK_BYTES (sizeof(struct eval_track) + 3 * sizeof(void *))

/* One alert row that changed, with the transition that changed it (if any). */
struct eval_event {
    struct eval_track *t;
    bool has_event; /* tr holds a lifecycle change */
    struct alert_transition tr;
    int32_t argmin_head; /* head that held the min (-1: none) */
    enum alert_attribution attr;
    char why[EVAL_WHY_MAX];
};

struct eval_batch {
    struct eval_event *ev; /* in feeding order, so by step */
    size_t n, cap;
    size_t next_label; /* ev[0..next_label) are labeled */
    int oom;           /* an event could not be recorded */
};

void eval_run_init(struct eval_run *er, const struct detect_rules *rules);

/* Frees every track; er is then empty and may be reused. */
void eval_run_clear(struct eval_run *er);

/* The track of series k detected by rule rule_name, created on first use
 * (rule_name is matched against er->rules). NULL when no rule matches, out
 * of memory, or the run holds max_tracks tracks (er->capped counts it). */
struct eval_track *eval_track_get(struct eval_run *er, const struct store_series_key *k,
                                  const char *rule_name);

/* The rule name of a stored detected series: attention aggregates drop
 * their aggregate ("qk.d2.erank.min" -> "qk.d2.erank"); others are their
 * own rule. */
void eval_rule_of_series(const char *series, char *rule, size_t len);

/* Is stored series k an input of detection under rules, and with which
 * rule? The attention aggregates the daemon detects on
 * (qk.d2.{erank,entropy,srank}.min, qk.cqk.max per layer and window),
 * router series with a matching rule, and the lead rank's loss,
 * grad_norm, lr, weight_norm and update_ratio (lead_rank: 0, or the lowest
 * rank of the local group a per-node daemon hears). Writes the rule name
 * into rule. The live stage asks the same question of the series it
 * builds, so a backtest reads back exactly what was detected live. */
bool eval_input_rule(const struct detect_rules *rules, const struct store_series_key *k,
                     uint32_t lead_rank, char *rule, size_t len);

/* Rank 0's learning rate at step (in step order). Progress is judged from
 * the learning rates of earlier steps only, so the order in which a step's
 * series and its LR are fed does not matter for it. A per_lr rule's
 * sample (detect.h) is judged against the rates of the steps it covers,
 * its own step's included when fed first: the live stage feeds a report's
 * LR before its other scalars, store_reader_points a step's LR first. */
void eval_progress_lr(struct eval_run *er, uint64_t step, double lr);

/* The lead rank's gradient norm at `step` (steps increasing; a
 * non-finite or non-positive norm, or an earlier step, is ignored), for
 * per_grad_credit. */
void eval_progress_grad(struct eval_run *er, uint64_t step, double grad_norm);

/* Whether an optimizer of this class name (Hello's ModelShape.optimizer,
 * case-insensitive) steps by the rate times the gradient: SGD and its kin.
 * NULL or anything else: false. */
bool eval_optimizer_follows_grad(const char *name);

/* Whether an optimizer of this class name orthogonalizes each matrix's
 * update (Muon and its variants: the name holds "muon", any case). The
 * Delta2 attention rules see little of an attention fault under it
 * (docs/detection.md, the seventeenth held-out look). NULL: false. */
bool eval_optimizer_orthogonalizes(const char *name);

/* The step detection of a not yet started series starts at, for a sample at
 * `step` (INT64_MAX while the LR is still warming up); detect_from_step > 0
 * (the run's or the configuration's) wins. */
int64_t eval_start_step(const struct eval_run *er, uint64_t step, int64_t detect_from_step);

/* The step an early_baseline rule's baseline starts at, for a sample at
 * `step` (see EVAL_BASELINE_MIN; INT64_MAX while the LR still rises). */
int64_t eval_baseline_step(const struct eval_run *er, uint64_t step, int64_t detect_from_step);

/* Feeds one sample of track t (a track of er) for step: labels the events
 * of b raised at earlier steps, runs detect_step and alert_step, and
 * appends an event to b when the alert row changed. A step at or below the
 * track's last one is skipped (a replay after a restart changes nothing).
 * detect_from_step: the run's or the configuration's (0: by progress, see
 * EVAL_START_WARMUPS).
 * Returns 1 when fed, 0 when skipped, -ENOMEM (b->oom set) when the event
 * could not be recorded, -EINVAL for bad arguments. */
int eval_feed(struct eval_run *er, struct eval_batch *b, struct eval_track *t, uint64_t step,
              double value, bool present, int32_t argmin_head, int64_t detect_from_step,
              double now);

/* One stored point (store_read.h's order: by step), fed as the live stage
 * fed it: the lead rank's learning rate to training progress, a detected series
 * (eval_input_rule) to its track (eval_feed, no argmin head, time 0). The
 * one path of `foreshock backtest` and of a rewind's rebuild (stage.h).
 * Returns 1 when fed, 0 when k is no input or the step was seen, or
 * -ENOMEM / -EINVAL. */
int eval_feed_stored(struct eval_run *er, struct eval_batch *b, const struct store_series_key *k,
                     uint64_t step, double value, bool present, uint32_t lead_rank,
                     int64_t detect_from_step);

/* Labels every event of b not yet labeled (the caller has fed every sample
 * of their steps). */
void eval_label_all(struct eval_run *er, struct eval_batch *b);

/* Forgets b's events (keeps its memory). */
void eval_batch_reset(struct eval_batch *b);
void eval_batch_free(struct eval_batch *b);

#endif
