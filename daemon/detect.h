#ifndef FORESHOCK_DETECT_H
#define FORESHOCK_DETECT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fs_err.h"

/* Per-series robust detection (docs/monitors.md section 4). Pure: no I/O,
 * no clocks, no threads, no allocation. Step and time are inputs.
 *
 * Two kinds of object:
 *  - struct detect_rules: the rule table (defaults from detect_rules_default,
 *    then per-monitor `key = value` overrides from the config). Built once by
 *    the config code, read-only afterwards, so any thread may read it.
 *  - struct detect_state: one per series, owned by the daemon's loop thread,
 *    fed samples in step order by detect_step(), persisted through
 *    detect_state_encode()/detect_state_decode() so a restart changes no
 *    outcome.
 *
 * Scoring: z = (x - median) / scale over the last `window` samples accepted
 * into the baseline, scale = max(1.4826 * MAD, DETECT_MAD_REL_FLOOR * |median|,
 * DETECT_MAD_ABS_FLOOR). The floor defines the MAD == 0 case: a perfectly
 * flat baseline does not divide by zero, and any move by more than
 * z * 0.1 % of the median counts as a breach (a series that never moved and
 * now moves is news).
 *
 * Trend rules (rule->trend): some series grow during healthy training
 * (router centered energy, weight norms under AdamW). A level baseline lags
 * such a series by half a window, and its MAD is tiny while the series is
 * still nearly flat: when the growth starts or speeds up the level z
 * breaches, the breach freezes the baseline and the series walks away from
 * it for good. A trend rule scores against a robust line instead. Over the
 * baseline samples (value and step), the slope b is the Theil-Sen estimate
 * (median of the pairwise slopes), set to 0 when it points to the good side
 * (falling, for a rise-is-bad rule: extrapolating a healthy decline would
 * call every stall or reversal a breach; slope 0 is the level baseline,
 * which judges such a series conservatively). The expected value at the
 * current step is
 *     predicted = median_i(x_i + b * (step - step_i)),
 * and z = (x - predicted) / scale, where scale is as above with the MAD of
 * the residuals around the line, floored on |predicted|. The verdict's
 * `median` field carries `predicted` (what the alert's evidence shows as
 * the baseline), `mad` the raw residual MAD and `slope` b. While a breach
 * is open the frozen line is extrapolated: a trend that resumes resolves,
 * a fault (a level jump, a slope several times steeper) stays open. The
 * line is straight, so growth that curves up sharply within one window
 * looks like that fault too; and a breach while the growth accelerates
 * (noise on top of an LR warm-up's onset) stays open, because the frozen
 * line cannot bend. A rule without trend scores exactly as described
 * above. */

#define DETECT_MAX_WINDOW 256        /* largest baseline window (samples) */
#define DETECT_MAX_RULES 64          /* rules in one table */
#define DETECT_NAME_MAX 64           /* rule name / pattern, including the NUL */
#define DETECT_MAX_WARMUP 1000000    /* largest warmup override (samples) */
#define DETECT_MAX_PERSISTENCE 10000 /* largest persistence / resolve_after */
#define DETECT_MAX_Z 1e6             /* largest z override */
#define DETECT_VALUE_MAX 64          /* longest override value text we parse */
#define DETECT_MAD_SCALE 1.4826      /* MAD -> sigma for a normal distribution */
/* A relative breach closer to the baseline than this many robust standard
 * deviations is DETECT_BREACH_RELATIVE_IN_NOISE. The fifth held-out look's
 * LLaMA, its batch halved to one sequence, has a Delta2 srank series whose
 * healthy samples span 1.3-4.0 around a median of 2.4: its relative floor
 * (1.41) sat 2.3 robust SDs down, and two dips in a row paged it. The cost
 * is a sketch or more on faults whose first breaches were shallow: the
 * first corpus's median lead 75% -> 71% (validation seeds), the sixth
 * look's 82% -> 71%, no catch or label lost (docs/detection.md). */
#define DETECT_SIZE_NOISE_Z 2.5
/* Bit-identical baseline samples that make a still series (still_rewarms). */
#define DETECT_STILL_SAMPLES 8
#define DETECT_MAD_REL_FLOOR 1e-3  /* scale floor relative to |median| */
#define DETECT_MAD_ABS_FLOOR 1e-12 /* scale floor when the median is ~0 */
/* Trend fit: the slope is fitted over at most this many baseline samples
 * (evenly spaced over a longer window), so at most 64 * 63 / 2 = 2016
 * pairwise slopes per scored sample whatever the window. */
#define DETECT_TREND_MAX_POINTS 64
#define DETECT_TREND_MAX_PAIRS (DETECT_TREND_MAX_POINTS * (DETECT_TREND_MAX_POINTS - 1) / 2)
/* Step of a baseline sample restored from a version-1 blob, which did not
 * store steps. A trend fit uses only the newest run of samples with known
 * steps. */
#define DETECT_STEP_UNKNOWN INT64_MIN

/* Defaults (docs/monitors.md section 4); each one is overridable per rule. */
#define DETECT_DEFAULT_WARMUP 20
#define DETECT_DEFAULT_WINDOW 64
#define DETECT_DEFAULT_Z 5.0
#define DETECT_DEFAULT_PERSISTENCE 3
#define DETECT_DEFAULT_RESOLVE_AFTER 5
#define DETECT_DEFAULT_SPIKE_RATIO 10.0 /* Megatron: 10x the running max */
/* Warm-up in steps (rule->warmup_steps): a baseline is also warm once at
 * least DETECT_WARMUP_MIN_SAMPLES accepted samples span warmup_steps
 * steps, whatever the sketch cadence (a sketch every 10 steps needed 200
 * steps for 20 samples: a fault in those steps found no baseline);
 * rule->warmup samples still end warm-up when they come first (a scalar
 * sent every step: 20 steps). A median and MAD over fewer than
 * DETECT_WARMUP_MIN_SAMPLES samples is noise. */
#define DETECT_DEFAULT_WARMUP_STEPS 100
#define DETECT_WARMUP_MIN_SAMPLES 8
/* Router rules: longer. Router statistics still move fast 100 steps into
 * detection (healthy MoE runs of both corpora breached centered energy z
 * 11 and load entropy z -7 at steps 270-290 with 100), and the trend rules
 * among them fit a line through the warm-up samples. */
#define DETECT_ROUTER_WARMUP_STEPS 150
/* router.centered_energy's rise_ratio: 15% above its own trend line. */
#define DETECT_ROUTER_ENERGY_RATIO 1.15
#define DETECT_MAX_WARMUP_STEPS 1000000 /* largest warmup_steps override */
#define DETECT_MAX_RATIO 1e6            /* largest rise_ratio override */
/* update_ratio's rise_ratio: the effective step tripled against the layer's
 * own baseline (Adam: the update-to-weight ratio scales with the rate). */
#define DETECT_DEFAULT_STEP_RATIO 3.0
#define DETECT_STEP_PERSISTENCE 1 /* update_ratio: breaches to fire (detect.c) */
/* step_update_ratio: breaching steps in a row to fire, and its rise_ratio
 * (detect.c). */
#define DETECT_STEP_UPDATE_PERSISTENCE 5
#define DETECT_STEP_UPDATE_RATIO 2.5
/* grad_norm's nonfinite_persistence: fp16 training under dynamic loss
 * scaling overflows routinely (the scaler skips the step and halves its
 * scale; PyTorch's recipe then reports an inf gradient norm), a few steps
 * in a row while the scale calibrates. A blow-up that is not skipped
 * turns the weights and the next loss non-finite, and `loss` fires at
 * once. 32 halvings take any starting scale below what a healthy run
 * needs. */
#define DETECT_GRAD_NONFINITE_PERSISTENCE 32
/* Delta2 floors (detect.c): rank one, and 30% of the head's own excess over
 * rank one. */
#define DETECT_D2_SCALE_REL 0.1      /* Delta2 ranks' z scale floor, x level */
#define DETECT_QK_CQK_SCALE_REL 0.07 /* qk.cqk's, x level: z 5 = +35% */
/* qk.cqk's over a long window (scale_rel_long; detect.c): z 5 = 2.5x. */
#define DETECT_QK_CQK_SCALE_REL_LONG 0.3
/* A series over a window of at least this many steps is a long-window one
 * for scale_rel_long (the Monitor's default windows are 10 and 50). */
#define DETECT_LONG_WINDOW 50
#define DETECT_ROUTER_SIM_SCALE_REL 0.03          /* router.similarity's, x level */
#define DETECT_ROUTER_MAXVIO_SCALE_REL 0.3        /* router.maxvio's, x level */
#define DETECT_ROUTER_ZLOSS_SCALE_REL 0.1         /* router.zloss's, x the trend line */
#define DETECT_GRAD_NORM_SCALE_REL 0.25           /* grad_norm's, x level: z 5 = 2.25x */
#define DETECT_ROUTER_LOAD_ENTROPY_SCALE_REL 0.02 /* router.load_entropy's, x level */
#define DETECT_D2_SRANK_FLOOR 1.05
#define DETECT_D2_ERANK_FLOOR 1.2
#define DETECT_D2_FLOOR_REL 0.3
/* A Delta2 breach of size in one layer confirms one in another layer of
 * the same window within this many windows (cross_layer_windows; detect.c). */
#define DETECT_D2_CROSS_LAYER_WINDOWS 2
#define DETECT_MAX_CROSS_LAYER_WINDOWS 16
/* Before the start of detection, a Delta2 rank's relative floor holds from
 * the LR warm-up end while the gradient norm stands this many times its
 * level since then (early_grad_rise; detect.c, evaluate.c). */
#define DETECT_D2_EARLY_GRAD_RISE 2.0
#define DETECT_MAX_EARLY_GRAD_RISE 1000.0

/* Families, for attribution (alert_attribute). Values are pinned: they are
 * bit positions in attribution masks and may be stored. */
enum detect_family {
    DETECT_FAMILY_ATTENTION_D2 = 0,  /* qk.d2.* spectra and qk.cqk */
    DETECT_FAMILY_ROUTER_WEIGHT = 1, /* router similarity, centered energy, z-loss */
    DETECT_FAMILY_WEIGHT_NORM =
        2, /* per-layer |W| and |dW|/|W|: symptoms, grow under either fault */
    DETECT_FAMILY_ROUTER_BALANCE = 3, /* MaxVio, load entropy */
    DETECT_FAMILY_SCALAR_LOSS = 4,    /* loss, grad_norm */
    DETECT_FAMILY_STEP_SIZE = 5,      /* the learning rate rising after warm-up */
    DETECT_FAMILY_COUNT
};

enum detect_direction {
    DETECT_FALL_IS_BAD = 0,
    DETECT_RISE_IS_BAD = 1,
};

enum detect_severity {
    DETECT_SEVERITY_WARNING = 0,
    DETECT_SEVERITY_CRITICAL = 1,
};

/* Why a sample breached. Pinned: stored in state blobs and alert rows. */
enum detect_breach_kind {
    DETECT_BREACH_NONE = 0,
    DETECT_BREACH_Z = 1,         /* robust z beyond the threshold, bad direction */
    DETECT_BREACH_FLOOR = 2,     /* absolute floor or ceiling crossed */
    DETECT_BREACH_NONFINITE = 3, /* NaN or +-Inf: fires at once, critical */
    DETECT_BREACH_SPIKE = 4,     /* value / running max beyond spike_ratio */
    DETECT_BREACH_RELATIVE = 5,  /* beyond rise_ratio or floor_rel x the baseline */
    /* Beyond rise_ratio or floor_rel too, but within DETECT_SIZE_NOISE_Z
     * robust standard deviations (1.4826 x MAD) of the baseline: the
     * series' own healthy noise reaches that far, so it is no breach of
     * size (magnitude_persistence does not apply) and needs the rule's
     * full persistence. */
    DETECT_BREACH_RELATIVE_IN_NOISE = 6,
};
#define DETECT_BREACH_KIND_MAX DETECT_BREACH_RELATIVE_IN_NOISE

struct detect_rule {
    char name[DETECT_NAME_MAX]; /* series name or fnmatch(3) pattern */
    enum detect_family family;
    enum detect_direction direction;
    enum detect_severity severity;
    bool enabled;
    bool trend; /* score against a robust local line, not the level */
    /* Build the baseline from the end of the LR warm-up (evaluate.h:
     * eval_baseline_step) and detect as soon as it is warm, not from the
     * run's start of detection (3 warm-ups). For series whose level the
     * schedule sets once the warm-up is over (the update ratio), not for
     * those the fast early phase moves. */
    bool early_baseline;
    /* Credit a rise of the logged learning rate (evaluate.c, for the
     * update ratio): the sample is divided by how much the logged rate
     * over the steps it covers rose above the rate at the baseline's
     * samples (their median), counting the rate only up to the warm-up's
     * peak, never below 1. A step the schedule itself made larger (a warm
     * restart) is no breach; one beyond what the logged rate explains is,
     * and so is a logged rate above its own peak. The baseline keeps the
     * samples uncredited (detect_step_judged), so a baseline that spans a
     * rise holds each sample at the level its own rate gave it. */
    bool per_lr;
    /* Rise-is-bad only: a value at or below the learning rate's warm-up
     * peak never breaches (evaluate.c, for the logged rate itself: a warm
     * restart returns to the peak by design; a rise above it still fires). */
    bool within_peak;
    /* A baseline of DETECT_STILL_SAMPLES or more bit-identical samples is
     * a layer whose weights did not move (frozen: an update ratio of
     * exactly 0, a router's weight statistics to the last bit), not a
     * level: the first sample that differs starts the baseline and its
     * warm-up over, so unfreezing is no breach. For weight-side series
     * only; a learning rate held constant is a level (the `lr` rule). */
    bool still_rewarms;
    uint32_t warmup;       /* samples that only build the baseline */
    uint32_t warmup_steps; /* or: steps they span (0: samples only); see above */
    uint32_t window;       /* baseline samples, 1..DETECT_MAX_WINDOW */
    double z;              /* |z| threshold, > 0 */
    bool has_floor;        /* breach when value <= floor */
    double floor;
    bool has_ceiling; /* breach when value >= ceiling */
    double ceiling;
    double spike_ratio; /* > 0: breach when value > ratio * running max (rise only) */
    /* Relative bounds, judged against the series' own baseline (median, or
     * the trend line's prediction) once warm: no absolute number that
     * depends on the model's shape or the phase of training.
     * rise_ratio > 1 (rise-is-bad rules): breach when value >=
     * rise_ratio * baseline; floor_rel in (0, 1) (fall-is-bad rules):
     * breach when value <= floor_rel * baseline (both measured from
     * rel_origin, below). 0: off. A baseline <= rel_origin disables both
     * for that sample. */
    double rise_ratio;
    double floor_rel;
    /* The value the series cannot go below (1 for the Delta2 ranks: rank
     * one); rise_ratio and floor_rel scale the distance from it:
     * value - origin >= rise_ratio * (baseline - origin), value - origin
     * <= floor_rel * (baseline - origin). 0 for most series. */
    double rel_origin;
    /* > 0: the z scale's floor relative to |baseline| for this rule, in
     * place of DETECT_MAD_REL_FLOOR (a smooth series' tiny MAD otherwise
     * turns a few percent of healthy drift into a large z). */
    double scale_rel;
    /* > 0: scale_rel for a series over a window of DETECT_LONG_WINDOW
     * steps or more (evaluate.c passes it as detect_judging.scale_rel);
     * 0: scale_rel for every window. */
    double scale_rel_long;
    uint32_t persistence; /* consecutive breaching samples to fire */
    /* > 0 and < persistence: fewer breaches fire when the incident opened
     * on, and this sample is, a breach of size (an absolute floor or
     * ceiling, or a relative one beyond the series' noise; not a z-score):
     * alert.c persisted(). 0: off. */
    uint32_t magnitude_persistence;
    /* > 0: a breach of size fires at once when other layers' series of
     * rules with cross_layer_windows (the same window, the same rank) had
     * breaches of size in the last cross_layer_windows windows before this
     * step: one other layer, one more for every EVAL_CROSS_LAYER_PER
     * layers of the run (evaluate.c: cross_layer_confirms; alert.c
     * persisted()). A fault that reaches every layer shows in several; a
     * healthy dip is one layer's. 0: off. */
    uint32_t cross_layer_windows;
    /* > 0 (fall-is-bad rules with floor_rel): between the LR warm-up end
     * and the start of detection, the relative floor is judged against a
     * baseline of the series' samples since the warm-up end, and a sample
     * under it is a breach of size only while the run's gradient norm
     * stands at least this many times its level since the warm-up end
     * (evaluate.c: early_relative). Nothing from the start on changes. 0:
     * the relative floor waits for the start. */
    double early_grad_rise;
    uint32_t resolve_after; /* consecutive normal samples to resolve */
    /* Consecutive breaching samples, the current one non-finite, before a
     * non-finite value fires (alert.c); 0 or 1: at once, critical. */
    uint32_t nonfinite_persistence;
};

struct detect_rules {
    size_t n;
    struct detect_rule rule[DETECT_MAX_RULES];
};

/* Per-series state. Treat as opaque; sized for DETECT_MAX_WINDOW so no
 * sample allocates. */
struct detect_state {
    double ring[DETECT_MAX_WINDOW];       /* accepted samples, circular */
    int64_t ring_step[DETECT_MAX_WINDOW]; /* their steps (or DETECT_STEP_UNKNOWN) */
    uint32_t ring_head;                   /* next slot to write */
    uint32_t ring_count;                  /* valid samples, <= DETECT_MAX_WINDOW */
    uint64_t accepted;                    /* samples ever accepted into the baseline */
    uint64_t seen;                        /* present samples ever seen */
    bool has_max;                         /* running max of accepted samples valid */
    double running_max;
    bool open;           /* a breach is open: baseline frozen */
    uint32_t normal_run; /* consecutive normal samples while open */
    int64_t last_step;   /* step of the last present sample, or -1 */
};

/* What detect_step concluded about one sample. */
struct detect_verdict {
    bool present; /* false: absent sample, nothing else is meaningful */
    bool non_finite;
    bool in_warmup;
    bool breach;
    enum detect_breach_kind breach_kind;
    bool accepted_into_baseline;
    double value;
    double median;       /* baseline median; trend rules: the value the line
                            predicts at this step (NAN when the baseline is empty) */
    double mad;          /* raw MAD (trend: of the residuals around the line),
                            before the 1.4826 scale and the floor */
    double slope;        /* trend rules: slope per step of the line (0 when it
                            would point to the good side); 0 otherwise */
    double z;            /* signed robust z (0 when the baseline is empty) */
    double spike_ratio;  /* value / running max (0 when not computed) */
    uint32_t baseline_n; /* samples the median/MAD were computed over */
    /* Set by the caller, not detect_step: another layer's breach of size
     * confirms this one (detect_rule.cross_layer_windows). */
    bool confirmed;
};

/* Blob layout (little-endian), version 2:
 *   u32 magic 'FSDS', u16 version, u16 flags (bit0 has_max, bit1 open),
 *   u32 normal_run, u32 ring_count, u64 accepted, u64 seen, i64 last_step,
 *   f64 running_max, f64 ring[ring_count] oldest first,
 *   i64 ring_step[ring_count] oldest first (INT64_MIN: unknown).
 * Version 1 is the same without ring_step. It still decodes: the values
 * are kept (a level rule scores exactly as before the upgrade) and their
 * steps are DETECT_STEP_UNKNOWN, because a v1 blob cannot tell how far
 * apart its samples were (monitors may come every k steps, and breaches and
 * absent samples leave gaps); guessing consecutive steps would give a
 * trend rule a line k times too steep until the baseline turned over. A
 * trend rule fits only samples with known steps, and counts as in warm-up
 * until it has min(warmup, window) of them; then its baseline grows back
 * to `window` samples as they come. */
#define DETECT_STATE_MAGIC 0x53445346u /* "FSDS" little-endian */
#define DETECT_STATE_VERSION 2
#define DETECT_STATE_VERSION_NO_STEPS 1
#define DETECT_STATE_HEADER_BYTES 48
#define DETECT_STATE_ENCODED_MAX (DETECT_STATE_HEADER_BYTES + 16 * DETECT_MAX_WINDOW)

/* Fills *out with the built-in rule table (designated initializers in
 * detect.c). The caller owns *out. Any thread. */
void detect_rules_default(struct detect_rules *out);

/* The first rule whose name matches series_name (exact or fnmatch pattern),
 * or NULL. Returns a pointer into rules; read-only. Any thread. */
const struct detect_rule *detect_rules_match(const struct detect_rules *rules,
                                             const char *series_name);

/* The rule whose name equals `name` exactly, or NULL. Any thread. */
struct detect_rule *detect_rules_find(struct detect_rules *rules, const char *name);

/* Applies one config override `key = value` to the rule named rule_name
 * (exact match; the config's [detect "NAME"] section). Keys: warmup,
 * warmup_steps, window, z, floor, ceiling (a number or "none"), spike_ratio
 * (0 or "none" disables), rise_ratio (> 1; 0 or "none" disables), floor_rel
 * (in (0, 1); 0 or "none" disables),
 * persistence, magnitude_persistence (0 disables), cross_layer_windows (0 disables),
 * early_grad_rise (>= 1; 0 or "none" disables),
 * resolve_after, severity (warning|critical),
 * enabled, trend, early_baseline, per_lr and within_peak (true|false|yes|no|on|off|1|0).
 * Returns 0; -ENOENT for an
 * unknown rule, -EINVAL for an unknown key or a bad value (err says which). The rule is unchanged
 * on error. Config thread, before the table is shared. */
int detect_rules_set(struct detect_rules *rules, const char *rule_name, const char *key,
                     const char *value, struct fs_err *err);

/* Resets a series' state (empty baseline). Caller owns st. */
void detect_state_init(struct detect_state *st);

/* Scores one sample of the series and updates its state. is_present false
 * (an absent point: no spectrum) changes nothing and never breaches. Steps
 * before detect_from_step are ignored (only a non-finite value breaches
 * there); after it, accepted samples only build the baseline until
 * rule->warmup of them were accepted, or (rule->warmup_steps > 0) until at
 * least DETECT_WARMUP_MIN_SAMPLES of them span rule->warmup_steps steps,
 * whichever comes first; then too only absolute floors and non-finite
 * values breach. A breaching
 * sample, and every sample while a breach is open (from a breach until
 * rule->resolve_after consecutive normal samples), stays out of the
 * baseline. A trend rule is also in warm-up while fewer than
 * min(rule->warmup, rule->window) baseline samples have known steps (only
 * after decoding a version-1 blob). A disabled rule never breaches and
 * leaves st unchanged. Trend rules cost O(DETECT_TREND_MAX_PAIRS +
 * window) per sample (see detect.c); level rules O(window).
 * Returns 0, or -EINVAL for NULL arguments. Loop thread (owner of st). */
int detect_step(struct detect_state *st, const struct detect_rule *rule, int64_t step, double value,
                bool is_present, int64_t detect_from_step, struct detect_verdict *out);

/* detect_step with the baseline started apart from detection: samples from
 * baseline_from_step (<= detect_from_step) are accepted into the baseline,
 * as warm-up samples, while nothing but a non-finite value breaches before
 * detect_from_step. detect_step(..., from, out) is
 * detect_step_from(..., from, from, out). */
int detect_step_from(struct detect_state *st, const struct detect_rule *rule, int64_t step,
                     double value, bool is_present, int64_t baseline_from_step,
                     int64_t detect_from_step, struct detect_verdict *out);

/* Forgets st's baseline, keeping what was seen: the rule warms up again
 * from the next sample (a still series that starts to move). */
void detect_restart_baseline(struct detect_state *st);

/* How the caller (evaluate.c) has one sample judged, beyond its rule. */
struct detect_judging {
    /* As detect_step_from's: samples from baseline_from (<= detect_from)
     * build the baseline; breaches count from detect_from. */
    int64_t baseline_from, detect_from;
    /* The rule's absolute floor and ceiling hold from here (<=
     * detect_from), with no baseline needed: a value beyond one is no phase
     * of healthy training, so it need not wait for the start of detection. */
    int64_t bounds_from;
    /* A bound below which a rise-is-bad rule's finite sample never
     * breaches: at or below it the sample is a normal one (scored, and
     * accepted into the baseline like any other). NAN: no bound. (The
     * learning rate's warm-up peak for a within_peak rule.) */
    double ok_max;
    /* In (0, 1]: the sample is judged as value x credit, and the baseline
     * keeps value as it came. (A per_lr rule's credit for a rise of the
     * logged rate: the baseline holds samples as the rate at their own
     * steps made them, and each judged sample is credited against the rate
     * at the baseline's steps, so the two stay consistent when the rate
     * moves.) 1, or anything outside (0, 1]: no credit. */
    double credit;
    /* > 0: the z scale's floor share for this sample, in place of the
     * rule's scale_rel (a long-window series of a rule with
     * scale_rel_long); 0: the rule's. */
    double scale_rel;
};

/* detect_step_from as *j has it; {from, from, from, NAN, 1} is exactly
 * detect_step_from(..., from, from, out). */
int detect_step_judged(struct detect_state *st, const struct detect_rule *rule, int64_t step,
                       double value, bool is_present, const struct detect_judging *j,
                       struct detect_verdict *out);

/* The median of a[0..n) and, into *mad, the raw median absolute deviation
 * from it (1 <= n <= DETECT_MAX_WINDOW; a is overwritten). What a level
 * baseline is judged by (baseline_stats). */
double detect_median_mad(double *a, uint32_t n, double *mad);

/* A breach of size: a floor or ceiling, absolute or relative, not a
 * z-score nor a relative one within the series' noise
 * (DETECT_SIZE_NOISE_Z). magnitude_persistence and cross_layer_windows
 * count only these. */
static inline bool detect_breach_of_size(int kind)
{
    return kind == DETECT_BREACH_FLOOR || kind == DETECT_BREACH_RELATIVE;
}

/* The steps of the newest min(window, held) baseline samples of st, newest
 * first, into steps[] (room for DETECT_MAX_WINDOW); a sample restored
 * without its step is left out. Returns how many. */
uint32_t detect_baseline_steps(const struct detect_state *st, uint32_t window, int64_t *steps);

/* Encodes st into buf (len bytes). Returns the number of bytes written
 * (<= DETECT_STATE_ENCODED_MAX), or -ENOSPC if len is too small. */
int detect_state_encode(const struct detect_state *st, uint8_t *buf, size_t len);

/* Decodes a blob written by detect_state_encode (version 2) or by an older
 * daemon (version 1: steps unknown, see the layout above) into *st. Returns 0, or
 * -EINVAL for a malformed blob, -ENOTSUP for an unknown version; *st is
 * untouched on error. */
int detect_state_decode(struct detect_state *st, const uint8_t *buf, size_t len);

/* Static names for logs, JSON and labels. Unknown values give "unknown". */
const char *detect_family_name(enum detect_family f);
const char *detect_severity_name(enum detect_severity s);
/* The one table of severity names, by value, NULL-terminated (a CONFIG_ENUM
 * choice list); detect_severity_parse reads s (len bytes, no NUL needed)
 * into *out: 0, or -EINVAL for any other text. Pure; any thread. */
extern const char *const detect_severity_names[];
int detect_severity_parse(const char *s, size_t len, enum detect_severity *out);
const char *detect_breach_kind_name(enum detect_breach_kind k);
const char *detect_direction_name(enum detect_direction d);

#endif
