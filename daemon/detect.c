/* Per-series robust detection: rule table, config overrides, the scoring
 * step and its persistent state. See detect.h and docs/monitors.md section 4. */
#include "detect.h"

#include <errno.h>
#include <fnmatch.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Shared defaults for every rule; each row below sets what differs. Rules
 * that change z spell every field out (an initializer may not set a field
 * twice under -Werror). Router rules warm up over DETECT_ROUTER_WARMUP_STEPS
 * (detect.h), the rest over DETECT_DEFAULT_WARMUP_STEPS. */
#define RULE_BASE                                                                                  \
    .enabled = true, .severity = DETECT_SEVERITY_WARNING, .warmup = DETECT_DEFAULT_WARMUP,         \
    .window = DETECT_DEFAULT_WINDOW, .z = DETECT_DEFAULT_Z,                                        \
    .resolve_after = DETECT_DEFAULT_RESOLVE_AFTER, .persistence = DETECT_DEFAULT_PERSISTENCE
#define RULE_DEFAULTS RULE_BASE, .warmup_steps = DETECT_DEFAULT_WARMUP_STEPS
#define RULE_ROUTER RULE_BASE, .warmup_steps = DETECT_ROUTER_WARMUP_STEPS
/* The two step-size rules on the update-to-weight ratio: a multiple of the
 * run's own baseline (z out of reach), from the LR warm-up end, the logged
 * rate's rises credited, a still (frozen) series re-warming. Each sets its
 * own rise_ratio and persistence. */
#define RULE_STEP_RATIO                                                                            \
    .enabled = true, .severity = DETECT_SEVERITY_WARNING, .warmup = DETECT_DEFAULT_WARMUP,         \
    .warmup_steps = DETECT_DEFAULT_WARMUP_STEPS, .window = DETECT_DEFAULT_WINDOW,                  \
    .z = DETECT_MAX_Z, .resolve_after = DETECT_DEFAULT_RESOLVE_AFTER,                              \
    .family = DETECT_FAMILY_STEP_SIZE, .direction = DETECT_RISE_IS_BAD, .early_baseline = true,    \
    .per_lr = true, .still_rewarms = true

/* Built-in rules, first match wins (detect_rules_match), so exact names come
 * before any pattern. Directions from docs/monitors.md section 4. */
static const struct detect_rule default_rules[] = {
    /* Delta2 family: the attention-numerics early signal. Two bounds that
     * hold on every head size and phase of training, besides the z-score:
     *  - a rank-one floor (srank <= 1.05, erank_2 <= 1.2): Delta2 of rank
     *    one is rank one whatever head_dim is. It holds from the LR
     *    warm-up end (evaluate.c: bounds_from), through the rule's warm-up
     *    and before the start of detection, so a collapse already there
     *    is caught, and one soon after a long warm-up too.
     *    (The earlier floors, 1.2 and 1.5, sat inside healthy training:
     *    healthy heads of the corpora dipped to srank 1.09 and erank 1.54.)
     *  - a relative floor (floor_rel): the excess over rank one fell to
     *    30% of the head's own baseline excess.
     * Their z-scores count a fall only from 10% of the baseline level a
     * unit of z (scale_rel, DETECT_D2_SCALE_REL): a head's Delta2 can sit
     * still for a few hundred steps (MAD 1% of its level) and then move
     * to a new, noisier level 15-45% lower in healthy training (held-out
     * LLaMA runs: entropy 2.41 -> 1.86, erank 11 -> 6.4), which the bare
     * MAD scored beyond z 5. A fault's collapse is larger and also
     * crosses the floors.
     * A breach of size fires on its second sample (magnitude_persistence),
     * or at once when another layer breached by size within the last two
     * windows (cross_layer_windows; one more layer per 16 layers of the
     * run, evaluate.c: cross_layer_confirms): the fault biases every layer's
     * attention, and under SGD it can diverge a run within four window-10
     * sketches of its start while its collapse moves between layers (the
     * sixteenth held-out look's MoE: layer 1 at 1,010, layer 0 at 1,030,
     * divergence at 1,038; caught at 1,030 since). At five windows no
     * healthy run or healthy phase of the nineteen corpora alerts either
     * (docs/detection.md, "Confirmed across layers").
     * Before the start of detection (3 warm-ups) the relative floor holds
     * from the warm-up end when the gradient norm confirms it
     * (early_grad_rise, 2x its level since the warm-up end): an attention
     * fault 350 steps after a 600-step warm-up (the twelfth look's Lion
     * MoE) diverged its run at 1,196 with Delta2's excess at 20-30% of its
     * level from 1,100 and the gradient 13x, and a sequence length doubled
     * on learned positions (the same look's LLaMA) took Delta2 as low with
     * the gradient unmoved. */
    {RULE_DEFAULTS, .name = "qk.d2.erank", .family = DETECT_FAMILY_ATTENTION_D2,
     .magnitude_persistence = 2, .cross_layer_windows = DETECT_D2_CROSS_LAYER_WINDOWS,
     .early_grad_rise = DETECT_D2_EARLY_GRAD_RISE, .direction = DETECT_FALL_IS_BAD,
     .has_floor = true, .floor = DETECT_D2_ERANK_FLOOR, .floor_rel = DETECT_D2_FLOOR_REL,
     .rel_origin = 1.0, .scale_rel = DETECT_D2_SCALE_REL},
    {RULE_DEFAULTS, .name = "qk.d2.entropy", .family = DETECT_FAMILY_ATTENTION_D2,
     .direction = DETECT_FALL_IS_BAD, .scale_rel = DETECT_D2_SCALE_REL},
    {RULE_DEFAULTS, .name = "qk.d2.srank", .family = DETECT_FAMILY_ATTENTION_D2,
     .magnitude_persistence = 2, .cross_layer_windows = DETECT_D2_CROSS_LAYER_WINDOWS,
     .early_grad_rise = DETECT_D2_EARLY_GRAD_RISE, .direction = DETECT_FALL_IS_BAD,
     .has_floor = true, .floor = DETECT_D2_SRANK_FLOOR, .floor_rel = DETECT_D2_FLOOR_REL,
     .rel_origin = 1.0, .scale_rel = DETECT_D2_SCALE_REL},
    /* c_qk rises when successive Q and K updates line up: the same fault.
     * Its z counts from 7% of its level a unit (DETECT_QK_CQK_SCALE_REL:
     * z 5 is a rise of 35%). A healthy 16-expert MoE of the tenth held-out
     * look, watched from a resume at step 1,001, held layer 2's window-10
     * c_qk at 0.159 with a MAD of 0.004 and then rose 27% to 0.201: z 6.7
     * against the MAD, 3.8 now. 0.05 still fires there; 0.1 also quiets
     * it, and then the eleventh look's qk-norm combined-late run reads
     * optimizer-hyperparameter instead of combined (its c_qk breach comes
     * after the step-size page; both labels count as right there, as that
     * shape's attention fault alone does not diverge): the smaller scale
     * keeps more of c_qk's sensitivity. No catch of the fourteen corpora
     * moves; one held-out corpus's median lead 66% -> 61%. The attention
     * fault lifts c_qk 2.4-2.8x (z 20-25 with this scale).
     * Over a long window (50 steps and more: DETECT_LONG_WINDOW) the z
     * counts from 30% a unit (scale_rel_long: z 5 is 2.5x). A long
     * window sums the updates of many steps, so its c_qk follows the
     * update directions that persist, and healthy learning makes them
     * persist: a 4-expert MoE trained from scratch at 2e-4 (the
     * fourteenth held-out look) formed its attention patterns hundreds
     * of steps after detection started, and its window-50 c_qk rose
     * 1.7-2.3x for 100-300 steps (0.068 to 0.144, z 9.7 at 7%) while its
     * window-10 c_qk stayed within its noise; three of nine healthy runs
     * paged. 12% still paged them, 15% quieted them. The faults lift the
     * window-50 c_qk 3.5-14x, and no diverged run of the seventeen
     * corpora was first caught by it: from 12% to 50% no catch, label or
     * lead moves, and two undiverged attention faults alert 40 and 70
     * steps later. The window-10 series keeps 7%: 15% for every
     * window quiets the same runs but costs leads (79% -> 24% on one
     * held-out run). */
    {RULE_DEFAULTS, .name = "qk.cqk", .family = DETECT_FAMILY_ATTENTION_D2,
     .direction = DETECT_RISE_IS_BAD, .scale_rel = DETECT_QK_CQK_SCALE_REL,
     .scale_rel_long = DETECT_QK_CQK_SCALE_REL_LONG},
    /* Router weight side: too large a learning rate. Similarity and z-loss
     * drift up in healthy training too (fastest early), so, like centered
     * energy, they are judged against the run's own trend: growth that
     * breaks the line, not growth. Similarity's z counts from 3% of its
     * level a unit (DETECT_ROUTER_SIM_SCALE_REL): a top-1 router trained
     * only by the balancing loss held its similarity within 0.1% for
     * 1,700 healthy steps, then drifted 3.6% and scored z 6. */
    {RULE_ROUTER, .name = "router.similarity", .family = DETECT_FAMILY_ROUTER_WEIGHT,
     .direction = DETECT_RISE_IS_BAD, .trend = true, .scale_rel = DETECT_ROUTER_SIM_SCALE_REL,
     .still_rewarms = true},
    /* Centered energy grows steadily under AdamW, faster or slower as the
     * schedule moves, so it is scored against its local trend (detect.h).
     * By how much, not by a z-score: the series is smooth, so the
     * residuals' MAD is tiny and a healthy acceleration of a few percent
     * scored z 9-19 on healthy runs of other shapes (z 8 had held on the
     * first corpus only). A too-large step grows router weights by tens of
     * percent within tens of steps; the rule breaches at 15% above the
     * line (rise_ratio) and takes z out of reach. */
    {.enabled = true,
     .severity = DETECT_SEVERITY_WARNING,
     .warmup = DETECT_DEFAULT_WARMUP,
     .warmup_steps = DETECT_ROUTER_WARMUP_STEPS,
     .window = DETECT_DEFAULT_WINDOW,
     .z = DETECT_MAX_Z,
     .rise_ratio = DETECT_ROUTER_ENERGY_RATIO,
     .resolve_after = DETECT_DEFAULT_RESOLVE_AFTER,
     .persistence = DETECT_DEFAULT_PERSISTENCE,
     .name = "router.centered_energy",
     .family = DETECT_FAMILY_ROUTER_WEIGHT,
     .direction = DETECT_RISE_IS_BAD,
     .trend = true,
     .still_rewarms = true},
    /* Growing logits (z-loss) are the decision-side face of router weights
     * growing under too large a step, so they share that family. */
    /* z 8: a healthy router's logits wander around their trend like its
     * energy does (healthy runs of both corpora breached z 5-7). Its z
     * counts from 10% of the line's level a unit
     * (DETECT_ROUTER_ZLOSS_SCALE_REL: z 8 is 80% above the line). Under SGD
     * without weight decay healthy router logits grow ever faster: a
     * 32-expert top-4 router (the fifth held-out look) stood 7% above its
     * line at 780 (z 8.7 against its MAD; 1.5% quieted it), and an 8-expert
     * top-2 router at rate 0.3 (the sixteenth look) went from 9.5 to 18.9
     * over steps 200-350 and stood 38% above its line (18.87 against 13.71:
     * z 12.6 at the earlier 3%). 5% is the least that quiets it; at 10% no
     * catch, label or lead of the nineteen corpora moves (z-loss was never
     * a diverged run's first alert). A rate fault that doubles the logits
     * is still z 10. */
    {.enabled = true,
     .severity = DETECT_SEVERITY_WARNING,
     .warmup = DETECT_DEFAULT_WARMUP,
     .warmup_steps = DETECT_ROUTER_WARMUP_STEPS,
     .window = DETECT_DEFAULT_WINDOW,
     .z = 8.0,
     .scale_rel = DETECT_ROUTER_ZLOSS_SCALE_REL,
     .resolve_after = DETECT_DEFAULT_RESOLVE_AFTER,
     .persistence = DETECT_DEFAULT_PERSISTENCE,
     .name = "router.zloss",
     .family = DETECT_FAMILY_ROUTER_WEIGHT,
     .direction = DETECT_RISE_IS_BAD,
     .trend = true},
    /* Router balance. The most loaded expert's excess over an even share
     * wanders with the batch: on a healthy top-2-of-8 router (the third
     * held-out corpus, 512 tokens a step) it doubled, 0.42 to 0.83, for a
     * few sketches while its MAD was 0.02 (z 13.7), so its z counts from
     * 30% of its level a unit (DETECT_ROUTER_MAXVIO_SCALE_REL): z 5 is
     * 2.5 times the level. 20% (0.15 was the least that quiets that run)
     * paged a healthy top-2-of-4 router at 256 tokens a step (the
     * thirteenth held-out look: 0.198 to 0.439, 2.2x, z 5.2); no row of
     * the sixteen corpora moves with 30% or 40%. A collapse onto one
     * expert moves it to about E - 1: a z of dozens still. */
    {RULE_ROUTER, .name = "router.maxvio", .family = DETECT_FAMILY_ROUTER_BALANCE,
     .direction = DETECT_RISE_IS_BAD, .scale_rel = DETECT_ROUTER_MAXVIO_SCALE_REL},
    /* The entropy of the expert load sits still near its maximum, ln(E):
     * a plain healthy 8-expert top-2 router of the ninth held-out look
     * held it within 0.1% (MAD 0.0027 at 2.065) and then dipped 1.7% for
     * a few sketches, z -8.9. Its z counts from 2% of its level a unit
     * (DETECT_ROUTER_LOAD_ENTROPY_SCALE_REL: z -5 is a 10% fall; 0.01
     * already quiets that run, and 0.05 moves no catch of the twelve
     * corpora). A collapse onto a few experts falls by tens of percent. */
    {RULE_ROUTER, .name = "router.load_entropy", .family = DETECT_FAMILY_ROUTER_BALANCE,
     .direction = DETECT_FALL_IS_BAD, .scale_rel = DETECT_ROUTER_LOAD_ENTROPY_SCALE_REL},
    /* Weight norms (optional per-layer scalars, docs/monitors.md section 2). They
     * grow during healthy training too (sqrt- or log-like under AdamW), so
     * the rule follows their trend, like centered energy. Off by default:
     * a symptom of either fault that names neither, and one that still
     * paged a healthy run of the corpus (z 11 around its trend as weight
     * decay bent the growth) while adding no catch the mechanism rules had
     * not made first. The series is stored and graphed either way; turn
     * the rule on with [detect "weight_norm"] enabled = true. It warms up
     * by samples only (20): its growth bends hardest around the LR
     * warm-up, and a line through 8 samples sketched every 10 steps
     * breaks there (test_detect's healthy growth table). */
    {.enabled = false,
     .severity = DETECT_SEVERITY_WARNING,
     .warmup = DETECT_DEFAULT_WARMUP,
     .warmup_steps = 0, /* samples only: see below */
     .window = DETECT_DEFAULT_WINDOW,
     .z = DETECT_DEFAULT_Z,
     .resolve_after = DETECT_DEFAULT_RESOLVE_AFTER,
     .persistence = DETECT_DEFAULT_PERSISTENCE,
     .name = "weight_norm",
     .family = DETECT_FAMILY_WEIGHT_NORM,
     .direction = DETECT_RISE_IS_BAD,
     .trend = true},
    /* The update-to-weight ratio of a layer's monitored weights (Q, K,
     * router): the step size as the weights feel it. Under Adam an update
     * is about lr in size whatever the gradient, so the ratio scales with
     * the effective learning rate: it is how a too-large step shows when
     * the logged rate does not (a gradient-accumulation or loss-scale bug,
     * a peak mistyped from the start). The attention fault moves it too,
     * but by a z-score's worth (measured on the corpus: z 5 within 15
     * steps of either fault), not by a multiple: so only the multiple
     * counts (rise_ratio, against the layer's own baseline; z is out of
     * reach), and that names the step size.
     * Its baseline starts at the end of the LR warm-up (early_baseline)
     * and it detects once that is warm: from there the schedule sets its
     * level. A baseline that only started with detection (3 warm-ups
     * later) was still warming when an LR fault 50 steps after that start
     * diverged the run (the first corpus: 3 of 6 LR faults missed without
     * the `lr` rule); detection from 3 warm-ups missed every LR fault at
     * step 700 of the third held-out corpus's 300-step warm-ups. One breach
     * fires it (DETECT_STEP_PERSISTENCE): a sample covers every step since
     * the previous sketch, and a stretch of training whose steps are three
     * times its own baseline is no noise (no healthy run of four corpora,
     * 53,600 steps, reached two times; 1.5 times paged one). Three
     * breaches came after divergence on every run whose LR fault diverged
     * it within 30 steps, two on a hidden 10x jump that diverged it in 14
     * (the second held-out look).
     * A rise of the logged rate is credited (per_lr, evaluate.c): the
     * sample is divided by the logged rate over the steps it covers (at
     * most the warm-up's peak) over the rate at the baseline's samples,
     * when that is above 1. Cosine with warm restarts (the fifth held-out
     * look, decay to zero every 500 steps, both shapes) paged layers 0 and
     * 1 at each restart, 3-4.7x (SGD) and 3.2-6.2x (AdamW) the median of
     * a baseline taken mostly from the decayed tail; credited, the most
     * any sample of theirs reached is 1.4x and 2x. Only rises are credited,
     * and only up to the peak: a hidden fault leaves the logged rate alone,
     * a logged rate above its own peak is the fault, and no row of the
     * eight corpora moved but these two. Dividing by the logged rate in
     * every sample (decays too) caught hidden faults up to 180 steps
     * sooner (and a hidden 3x ramp on the AdamW shape) but read two
     * attention faults of that look `combined`: under
     * SGD and under AdamW with beta2 0.999 the update follows the gradient,
     * and a baseline no longer inflated by the decay's earlier, larger
     * steps tripled with it. */
    {RULE_STEP_RATIO, .name = "update_ratio", .rise_ratio = DETECT_DEFAULT_STEP_RATIO,
     .persistence = DETECT_STEP_PERSISTENCE},
    /* The same step size at the resolution of one optimizer step: the
     * client's step_update_ratio, |W(t) - W(t-1)| / |W(t-1)| over the
     * monitored weights that moved (frozen ones left out, so unfreezing
     * is no jump), sent with every step. update_ratio is sampled
     * once per sketch, so a step 10x too large that diverges a run within
     * the 10 steps between two sketches (the third and eighth held-out
     * looks: 9 steps) was seen only after it; here it is seen from its
     * first step. Judged like update_ratio (three times the run's own
     * baseline, the logged rate's rises credited, from the warm-up end,
     * a still series re-warming), but five breaching steps in a row fire
     * it (DETECT_STEP_UPDATE_PERSISTENCE), not one: a single step is not a
     * stretch of training. An optimizer whose moments were reset takes
     * its first steps at the full rate (Adam: each weight moves by lr) and
     * settles within a few; a single outsized gradient under SGD moves one
     * step. A sustained jump holds every step.
     * Warm restarts: the eleventh look's SGD restarts (the rate from about
     * 0 back to 0.3 every 500 steps) paged 32 steps after each while the
     * baseline kept credited samples: once half of its 64 samples were
     * newer than the restart, the credit's reference rate became the new
     * one while the samples stayed at the old level. The baseline now
     * keeps samples uncredited (detect.h per_lr), and the restarts are
     * quiet with no re-warming. */
    {RULE_STEP_RATIO, .name = "step_update_ratio", .persistence = DETECT_STEP_UPDATE_PERSISTENCE,
     .rise_ratio = DETECT_STEP_UPDATE_RATIO},
    /* The learning rate itself (rank 0's). After the start of detection
     * (past the warm-up) a healthy schedule holds or decays it; a rise is a
     * step-size fault at its source (a mistyped peak, a schedule or resume
     * bug). Falls are fine, and so is a return to at most the peak the
     * warm-up reached (within_peak): warm restarts (the fifth held-out
     * look) go back to it by design and paged at every restart (z 75). A
     * rise above that peak still fires; a resume bug that puts the rate
     * back at the peak does not (it is indistinguishable from a restart in
     * the logged rate: update_ratio judges the step). Cyclical schedules
     * whose cycles climb above the warm-up's peak should turn it off. */
    {RULE_DEFAULTS, .name = "lr", .family = DETECT_FAMILY_STEP_SIZE,
     .direction = DETECT_RISE_IS_BAD, .within_peak = true},
    /* The classic baselines. Per-step minibatch loss and gradient norm are
     * heavy-tailed: judged on a single step (Megatron's rule) they paged
     * every healthy run tried (single-step grad-norm spikes at z 6-15), so
     * they need three consecutive breaching steps like every other rule,
     * which delays a real spike by two steps. A non-finite value still
     * fires at once (alert.c).
     * The gradient norm's z counts from 25% of its level a unit
     * (DETECT_GRAD_NORM_SCALE_REL): z 5 is 2.25 times the norm. Its
     * minibatch noise scales as 1/sqrt(batch), so a batch halved mid-run
     * lifts a noise-dominated norm by up to 41% for good (0.56 -> 0.78 on
     * the fifth held-out look's MoE, z 5 against the bare MAD), and SGD's
     * warm restarts lift it too; both paged healthy runs. No mechanism
     * catch moved for it; the first symptom page of 33 of the nine
     * corpora's 147 diverged faults comes later (median 8 steps), and a
     * 10x jump of the eighth look that diverged within a sketch lost its
     * only early page (docs/detection.md). 20% (z 5 a doubled norm) paged
     * the healthy phase of a 24-layer GPT (the nineteenth look): three
     * steps at 2.3-2.7x (0.55 to 1.27, 1.51, 1.37) with the loss flat; a
     * deep stack's gradient norm is spikier. At 25% no first mechanism
     * alert of the twenty-two corpora moves, and the first page of 26
     * diverged runs comes 1-35 steps later (median 5; still before
     * divergence). */
    {RULE_DEFAULTS, .name = "loss", .family = DETECT_FAMILY_SCALAR_LOSS,
     .direction = DETECT_RISE_IS_BAD, .spike_ratio = DETECT_DEFAULT_SPIKE_RATIO},
    {RULE_DEFAULTS, .name = "grad_norm", .family = DETECT_FAMILY_SCALAR_LOSS,
     .direction = DETECT_RISE_IS_BAD, .spike_ratio = DETECT_DEFAULT_SPIKE_RATIO,
     .scale_rel = DETECT_GRAD_NORM_SCALE_REL,
     .nonfinite_persistence = DETECT_GRAD_NONFINITE_PERSISTENCE},
};

_Static_assert(sizeof default_rules / sizeof default_rules[0] <= DETECT_MAX_RULES,
               "default rule table exceeds DETECT_MAX_RULES");

void detect_rules_default(struct detect_rules *out)
{
    memset(out, 0, sizeof(*out));
    out->n = sizeof default_rules / sizeof default_rules[0];
    memcpy(out->rule, default_rules, sizeof default_rules);
}

const struct detect_rule *detect_rules_match(const struct detect_rules *rules,
                                             const char *series_name)
{
    if (!rules || !series_name)
        return NULL;
    for (size_t i = 0; i < rules->n && i < DETECT_MAX_RULES; i++) {
        if (fnmatch(rules->rule[i].name, series_name, 0) == 0)
            return &rules->rule[i];
    }
    return NULL;
}

struct detect_rule *detect_rules_find(struct detect_rules *rules, const char *name)
{
    if (!rules || !name)
        return NULL;
    for (size_t i = 0; i < rules->n && i < DETECT_MAX_RULES; i++) {
        if (strcmp(rules->rule[i].name, name) == 0)
            return &rules->rule[i];
    }
    return NULL;
}

/* Value parsers: the whole string must be consumed (surrounding blanks are
 * allowed), the result finite and in range. */
static bool is_blank(const char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    return *s == '\0';
}

static int parse_double(const char *s, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno != 0 || !is_blank(end) || !isfinite(v) || v < lo || v > hi)
        return -EINVAL;
    *out = v;
    return 0;
}

static int parse_u32(const char *s, uint32_t lo, uint32_t hi, uint32_t *out)
{
    char *end;
    while (*s == ' ' || *s == '\t')
        s++;
    if (*s < '0' || *s > '9') /* no sign, no hex surprises */
        return -EINVAL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || !is_blank(end) || v < lo || v > hi)
        return -EINVAL;
    *out = (uint32_t)v;
    return 0;
}

static bool word_is(const char *s, const char *w)
{
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(w);
    return strncmp(s, w, n) == 0 && is_blank(s + n);
}

static int parse_bool(const char *s, bool *out)
{
    static const char *const yes[] = {"true", "yes", "on", "1"};
    static const char *const no[] = {"false", "no", "off", "0"};
    for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++) {
        if (word_is(s, yes[i])) {
            *out = true;
            return 0;
        }
        if (word_is(s, no[i])) {
            *out = false;
            return 0;
        }
    }
    return -EINVAL;
}

/* floor/ceiling: a number, or "none" to remove the bound. */
static int parse_bound(const char *s, bool *has, double *v)
{
    if (word_is(s, "none")) {
        *has = false;
        *v = 0;
        return 0;
    }
    if (parse_double(s, -HUGE_VAL, HUGE_VAL, v) != 0)
        return -EINVAL;
    *has = true;
    return 0;
}

/* The [detect "RULE"] keys, one row each: how the value parses, where it
 * goes in struct detect_rule, and what a bad value is told to be. */
enum detect_key_kind {
    DETECT_KEY_U32,      /* an integer in lo..hi */
    DETECT_KEY_DOUBLE,   /* a number in lo..hi, then validate */
    DETECT_KEY_BOUND,    /* a number or none (parse_bound; has_off is its flag) */
    DETECT_KEY_BOOL,     /* parse_bool */
    DETECT_KEY_SEVERITY, /* warning or critical */
};

struct detect_key {
    const char *key;
    enum detect_key_kind kind;
    size_t off;                 /* the field in struct detect_rule */
    size_t has_off;             /* DETECT_KEY_BOUND: its has_ flag */
    double lo, hi;              /* DETECT_KEY_U32 and DETECT_KEY_DOUBLE */
    bool none_is_zero;          /* DETECT_KEY_DOUBLE: "none" stores 0 (that check off) */
    bool (*validate)(double v); /* DETECT_KEY_DOUBLE, after the range: false rejects */
    const char *expect;         /* "expected ..." in the error */
};

/* A ratio in (0, 1] would breach on the baseline itself (rise_ratio) or call
 * every new maximum a spike (spike_ratio): 0 (off) or above 1. */
static bool ratio_off_or_above_one(double v)
{
    return v == 0 || v > 1;
}

static bool below_one(double v)
{
    return v < 1;
}

static bool off_or_at_least_one(double v)
{
    return v == 0 || v >= 1;
}

static bool positive(double v)
{
    return v > 0;
}

#define DETECT_FIELD(f) offsetof(struct detect_rule, f)

static const struct detect_key detect_keys[] = {
    {.key = "warmup",
     .kind = DETECT_KEY_U32,
     .off = DETECT_FIELD(warmup),
     .lo = 0,
     .hi = DETECT_MAX_WARMUP,
     .expect = "an integer 0..1000000"},
    {.key = "warmup_steps",
     .kind = DETECT_KEY_U32,
     .off = DETECT_FIELD(warmup_steps),
     .lo = 0,
     .hi = DETECT_MAX_WARMUP_STEPS,
     .expect = "an integer 0..1000000"},
    {.key = "rise_ratio",
     .kind = DETECT_KEY_DOUBLE,
     .off = DETECT_FIELD(rise_ratio),
     .lo = 0,
     .hi = DETECT_MAX_RATIO,
     .none_is_zero = true,
     .validate = ratio_off_or_above_one,
     .expect = "a number > 1, or 0/none to disable"},
    {.key = "floor_rel",
     .kind = DETECT_KEY_DOUBLE,
     .off = DETECT_FIELD(floor_rel),
     .lo = 0,
     .hi = 1,
     .none_is_zero = true,
     .validate = below_one,
     .expect = "a number in (0, 1), or 0/none to disable"},
    {.key = "window",
     .kind = DETECT_KEY_U32,
     .off = DETECT_FIELD(window),
     .lo = 1,
     .hi = DETECT_MAX_WINDOW,
     .expect = "an integer 1..256"},
    {.key = "z",
     .kind = DETECT_KEY_DOUBLE,
     .off = DETECT_FIELD(z),
     .lo = 0,
     .hi = DETECT_MAX_Z,
     .validate = positive,
     .expect = "a number > 0"},
    {.key = "floor",
     .kind = DETECT_KEY_BOUND,
     .off = DETECT_FIELD(floor),
     .has_off = DETECT_FIELD(has_floor),
     .expect = "a number or none"},
    {.key = "ceiling",
     .kind = DETECT_KEY_BOUND,
     .off = DETECT_FIELD(ceiling),
     .has_off = DETECT_FIELD(has_ceiling),
     .expect = "a number or none"},
    {.key = "spike_ratio",
     .kind = DETECT_KEY_DOUBLE,
     .off = DETECT_FIELD(spike_ratio),
     .lo = 0,
     .hi = DETECT_MAX_Z,
     .none_is_zero = true,
     .validate = ratio_off_or_above_one,
     .expect = "a number > 1, or 0/none to disable"},
    {.key = "persistence",
     .kind = DETECT_KEY_U32,
     .off = DETECT_FIELD(persistence),
     .lo = 1,
     .hi = DETECT_MAX_PERSISTENCE,
     .expect = "an integer 1..10000"},
    {.key = "scale_rel",
     .kind = DETECT_KEY_DOUBLE,
     .off = DETECT_FIELD(scale_rel),
     .lo = 0,
     .hi = 1,
     .expect = "a number in [0, 1] (0: the default 0.001)"},
    {.key = "scale_rel_long",
     .kind = DETECT_KEY_DOUBLE,
     .off = DETECT_FIELD(scale_rel_long),
     .lo = 0,
     .hi = 1,
     .expect = "a number in [0, 1] (0: scale_rel for every window)"},
    {.key = "magnitude_persistence",
     .kind = DETECT_KEY_U32,
     .off = DETECT_FIELD(magnitude_persistence),
     .lo = 0,
     .hi = DETECT_MAX_PERSISTENCE,
     .expect = "an integer 0..10000"},
    {.key = "cross_layer_windows",
     .kind = DETECT_KEY_U32,
     .off = DETECT_FIELD(cross_layer_windows),
     .lo = 0,
     .hi = DETECT_MAX_CROSS_LAYER_WINDOWS,
     .expect = "an integer 0..16"},
    {.key = "early_grad_rise",
     .kind = DETECT_KEY_DOUBLE,
     .off = DETECT_FIELD(early_grad_rise),
     .lo = 0,
     .hi = DETECT_MAX_EARLY_GRAD_RISE,
     .none_is_zero = true,
     .validate = off_or_at_least_one,
     .expect = "a number >= 1, or 0/none to disable"},
    {.key = "nonfinite_persistence",
     .kind = DETECT_KEY_U32,
     .off = DETECT_FIELD(nonfinite_persistence),
     .lo = 0,
     .hi = DETECT_MAX_PERSISTENCE,
     .expect = "an integer 0..10000"},
    {.key = "resolve_after",
     .kind = DETECT_KEY_U32,
     .off = DETECT_FIELD(resolve_after),
     .lo = 1,
     .hi = DETECT_MAX_PERSISTENCE,
     .expect = "an integer 1..10000"},
    {.key = "severity",
     .kind = DETECT_KEY_SEVERITY,
     .off = DETECT_FIELD(severity),
     .expect = "warning or critical"},
    {.key = "enabled",
     .kind = DETECT_KEY_BOOL,
     .off = DETECT_FIELD(enabled),
     .expect = "true or false"},
    {.key = "trend",
     .kind = DETECT_KEY_BOOL,
     .off = DETECT_FIELD(trend),
     .expect = "true or false"},
    {.key = "early_baseline",
     .kind = DETECT_KEY_BOOL,
     .off = DETECT_FIELD(early_baseline),
     .expect = "true or false"},
    {.key = "per_lr",
     .kind = DETECT_KEY_BOOL,
     .off = DETECT_FIELD(per_lr),
     .expect = "true or false"},
    {.key = "within_peak",
     .kind = DETECT_KEY_BOOL,
     .off = DETECT_FIELD(within_peak),
     .expect = "true or false"},
    {.key = "still_rewarms",
     .kind = DETECT_KEY_BOOL,
     .off = DETECT_FIELD(still_rewarms),
     .expect = "true or false"},
};

/* Parses value into the row's field of *r. Returns 0 or -EINVAL. */
static int detect_key_parse(const struct detect_key *k, const char *value, struct detect_rule *r)
{
    char *field = (char *)r + k->off;
    switch (k->kind) {
    case DETECT_KEY_U32:
        return parse_u32(value, (uint32_t)k->lo, (uint32_t)k->hi, (uint32_t *)(void *)field);
    case DETECT_KEY_DOUBLE: {
        double *v = (double *)(void *)field;
        if (k->none_is_zero && word_is(value, "none")) {
            *v = 0;
            return 0;
        }
        int rc = parse_double(value, k->lo, k->hi, v);
        if (rc == 0 && k->validate && !k->validate(*v))
            rc = -EINVAL;
        return rc;
    }
    case DETECT_KEY_BOUND:
        return parse_bound(value, (bool *)(void *)((char *)r + k->has_off),
                           (double *)(void *)field);
    case DETECT_KEY_BOOL:
        return parse_bool(value, (bool *)(void *)field);
    case DETECT_KEY_SEVERITY: {
        const char *w = value + strspn(value, " \t");
        size_t n = strcspn(w, " \t");
        if (!is_blank(w + n) ||
            detect_severity_parse(w, n, (enum detect_severity *)(void *)field) < 0)
            return -EINVAL;
        return 0;
    }
    }
    return -EINVAL;
}

int detect_rules_set(struct detect_rules *rules, const char *rule_name, const char *key,
                     const char *value, struct fs_err *err)
{
    if (!rules || !rule_name || !key || !value)
        return fs_err_set(err, -EINVAL, "missing argument");
    struct detect_rule *target = detect_rules_find(rules, rule_name);
    if (!target)
        return fs_err_set(err, -ENOENT, "detect \"%.64s\": no such rule", rule_name);
    if (strlen(value) >= DETECT_VALUE_MAX)
        return fs_err_set(err, -EINVAL, "detect \"%s\": %.32s: value too long", target->name, key);
    const struct detect_key *k = NULL;
    for (size_t i = 0; !k && i < sizeof detect_keys / sizeof detect_keys[0]; i++)
        if (strcmp(key, detect_keys[i].key) == 0)
            k = &detect_keys[i];
    if (!k)
        return fs_err_set(err, -EINVAL, "detect \"%s\": unknown key \"%.32s\"", target->name, key);
    /* Work on a copy so a bad value leaves the rule as it was. */
    struct detect_rule r = *target;
    int rc = detect_key_parse(k, value, &r);
    if (rc == 0 && r.has_floor && r.has_ceiling && r.floor >= r.ceiling)
        return fs_err_set(err, -EINVAL, "detect \"%s\": floor must be below ceiling", target->name);
    if (rc != 0)
        return fs_err_set(err, -EINVAL, "detect \"%s\": %s = \"%s\": expected %s", target->name,
                          key, value, k->expect);
    *target = r;
    return 0;
}

void detect_state_init(struct detect_state *st)
{
    memset(st, 0, sizeof(*st));
    st->last_step = -1;
}

/* k-th smallest (0-based) of a[0..n), reordering a so that a[0..k) <= a[k]
 * <= a(k..n). Wirth's selection (Algorithms + Data Structures = Programs,
 * "find"); n <= DETECT_MAX_WINDOW, so the quadratic worst case is bounded.
 * The value returned depends only on the multiset, so a decoded state
 * scores exactly like the original. Inputs are finite (never NaN). */
static double select_kth(double *a, uint32_t n, uint32_t k)
{
    int64_t l = 0, m = (int64_t)n - 1, kk = k;
    while (l < m) {
        double x = a[kk];
        int64_t i = l, j = m;
        do {
            while (a[i] < x)
                i++;
            while (x < a[j])
                j--;
            if (i <= j) {
                double t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        } while (i <= j);
        if (j < kk)
            l = i;
        if (kk < i)
            m = j;
    }
    return a[kk];
}

/* Median of a[0..n), n >= 1, reordering a. */
static double median_of(double *a, uint32_t n)
{
    uint32_t k = n / 2;
    double hi = select_kth(a, n, k);
    if (n % 2)
        return hi;
    /* After selecting k, a[0..k) holds the k smallest: the lower middle is
     * their maximum. */
    double lo = a[0];
    for (uint32_t i = 1; i < k; i++)
        if (a[i] > lo)
            lo = a[i];
    return lo + (hi - lo) / 2;
}

double detect_median_mad(double *a, uint32_t n, double *mad)
{
    double med = median_of(a, n);
    for (uint32_t i = 0; i < n; i++)
        a[i] = fabs(a[i] - med);
    *mad = median_of(a, n);
    return med;
}

/* Median and raw MAD of the last `window` accepted samples. */
static uint32_t baseline_stats(const struct detect_state *st, uint32_t window, double *median,
                               double *mad)
{
    double tmp[DETECT_MAX_WINDOW];
    uint32_t n = st->ring_count < window ? st->ring_count : window;
    if (n == 0) {
        *median = NAN;
        *mad = NAN;
        return 0;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t idx = (st->ring_head + DETECT_MAX_WINDOW - 1 - i) % DETECT_MAX_WINDOW;
        tmp[i] = st->ring[idx];
    }
    *median = detect_median_mad(tmp, n, mad);
    return n;
}

/* Robust local line over the newest baseline samples with known steps (at
 * most `window`), evaluated at `step`: Theil-Sen slope (median of pairwise
 * slopes), then *pred = median of x_i + slope * (step - step_i), the value
 * each sample's line predicts now, and *mad = median |residual|. Steps are
 * taken relative to `step`, so large step numbers cost no precision.
 *
 * Cost per scored sample: the slope comes from m = min(n, 64) samples
 * evenly spaced over the n baseline samples, i.e. m(m-1)/2 <= 2016
 * divisions and one selection over them (expected linear, Wirth's worst
 * case quadratic); the prediction and the MAD are two selections over n <=
 * 256. About 20 KiB of stack, no allocation. With the default window of 64
 * every pair is used: the plain Theil-Sen estimator. The result depends
 * only on the baseline in order, so a decoded state scores identically.
 *
 * With fewer than two distinct steps, or a slope towards the good side,
 * the slope is 0 and this is the level baseline (median, MAD). A slope
 * that overflows the residuals (values near DBL_MAX) also falls back to 0,
 * so the prediction is always finite. */
static uint32_t trend_stats(const struct detect_state *st, uint32_t window,
                            enum detect_direction dir, int64_t step, double *pred, double *mad,
                            double *slope)
{
    double y[DETECT_MAX_WINDOW], dx[DETECT_MAX_WINDOW], tmp[DETECT_MAX_WINDOW];
    double pair[DETECT_TREND_MAX_PAIRS];
    uint32_t avail = st->ring_count < window ? st->ring_count : window;
    uint32_t n = 0;
    /* Newest first; stop at the first sample restored without its step. */
    for (uint32_t i = 0; i < avail; i++) {
        uint32_t idx = (st->ring_head + DETECT_MAX_WINDOW - 1 - i) % DETECT_MAX_WINDOW;
        if (st->ring_step[idx] == DETECT_STEP_UNKNOWN)
            break;
        y[n] = st->ring[idx];
        dx[n] = (double)st->ring_step[idx] - (double)step;
        n++;
    }
    *slope = 0;
    if (n == 0) {
        *pred = NAN;
        *mad = NAN;
        return 0;
    }
    uint32_t m = n < DETECT_TREND_MAX_POINTS ? n : DETECT_TREND_MAX_POINTS;
    uint32_t np = 0;
    for (uint32_t a = 0; m > 1 && a < m; a++) {
        uint32_t i = (uint32_t)((uint64_t)a * (n - 1) / (m - 1));
        for (uint32_t c = a + 1; c < m; c++) {
            uint32_t j = (uint32_t)((uint64_t)c * (n - 1) / (m - 1));
            double d = dx[j] - dx[i];
            if (d != 0)
                pair[np++] = (y[j] - y[i]) / d;
        }
    }
    double b = np > 0 ? median_of(pair, np) : 0;
    /* Follow drift towards the bad side only. A line that extrapolates a
     * healthy move the other way (a weight norm shrinking under weight
     * decay) turns every stall or reversal into a breach that the frozen
     * line never resolves; the level baseline already judges such a series
     * conservatively, and slope 0 is exactly that baseline. */
    if (dir == DETECT_RISE_IS_BAD ? b < 0 : b > 0)
        b = 0;
    for (int attempt = 0; attempt < 2; attempt++) {
        bool finite = isfinite(b);
        for (uint32_t i = 0; finite && i < n; i++) {
            tmp[i] = y[i] - b * dx[i];
            finite = isfinite(tmp[i]);
        }
        if (finite)
            break;
        b = 0; /* the level baseline: y[i] are finite */
    }
    /* tmp holds x_i + b * (step - step_i); keep a copy, median_of reorders. */
    memcpy(y, tmp, n * sizeof tmp[0]);
    double p = median_of(tmp, n);
    for (uint32_t i = 0; i < n; i++)
        tmp[i] = fabs(y[i] - p);
    *pred = p;
    *mad = median_of(tmp, n);
    *slope = b;
    return n;
}

/* True while the rule's baseline is still warming up at `step` (detect.h):
 * fewer than `warmup` samples accepted, unless (warmup_steps > 0) at least
 * DETECT_WARMUP_MIN_SAMPLES of them span `warmup_steps` steps. The span is
 * measured from the oldest sample in the ring, which is the first one
 * accepted until the ring turns over; by then DETECT_MAX_WINDOW samples
 * were accepted and the span only grew. A sample restored without its step
 * (version-1 blob) counts by samples only. */
static bool warming_up(const struct detect_state *st, const struct detect_rule *rule, int64_t step)
{
    if (st->accepted >= rule->warmup)
        return false;
    if (rule->warmup_steps == 0 || st->accepted < DETECT_WARMUP_MIN_SAMPLES || st->ring_count == 0)
        return true;
    uint32_t oldest = (st->ring_head + DETECT_MAX_WINDOW - st->ring_count) % DETECT_MAX_WINDOW;
    int64_t first = st->ring_step[oldest];
    if (first == DETECT_STEP_UNKNOWN || step < first)
        return true;
    return (uint64_t)(step - first) < rule->warmup_steps;
}

/* True when the baseline holds at least DETECT_STILL_SAMPLES samples, all
 * bit-identical, and value differs from them: a still series starts to move. */
static bool leaves_still(const struct detect_state *st, double value)
{
    if (st->ring_count < DETECT_STILL_SAMPLES)
        return false;
    uint32_t last = (st->ring_head + DETECT_MAX_WINDOW - 1) % DETECT_MAX_WINDOW;
    double v0 = st->ring[last];
    for (uint32_t i = 1; i < st->ring_count; i++)
        if (memcmp(&st->ring[(last + DETECT_MAX_WINDOW - i) % DETECT_MAX_WINDOW], &v0, sizeof v0) !=
            0)
            return false;
    return memcmp(&value, &v0, sizeof v0) != 0;
}

/* Forgets the baseline, keeping only what was seen: the rule warms up
 * again from the next sample. */
void detect_restart_baseline(struct detect_state *st)
{
    uint64_t seen = st->seen;
    int64_t last_step = st->last_step;
    detect_state_init(st);
    st->seen = seen;
    st->last_step = last_step;
}

static void ring_push(struct detect_state *st, int64_t step, double v)
{
    st->ring[st->ring_head] = v;
    st->ring_step[st->ring_head] = step;
    st->ring_head = (st->ring_head + 1) % DETECT_MAX_WINDOW;
    if (st->ring_count < DETECT_MAX_WINDOW)
        st->ring_count++;
}

/* Scores a finite sample against the baseline out->median/mad already
 * hold (z, spike ratio, floors, ceilings, relative bounds) and sets
 * out->breach and out->breach_kind, most specific reason first. */
static void score_finite(const struct detect_state *st, const struct detect_rule *rule,
                         int64_t step, double value, int64_t bounds_from_step, double ok_max,
                         double scale_rel, struct detect_verdict *out)
{
    if (out->baseline_n > 0) {
        double scale = DETECT_MAD_SCALE * out->mad;
        if (!(scale_rel > 0))
            scale_rel = rule->scale_rel > 0 ? rule->scale_rel : DETECT_MAD_REL_FLOOR;
        double rel = scale_rel * fabs(out->median);
        if (scale < rel)
            scale = rel;
        if (scale < DETECT_MAD_ABS_FLOOR)
            scale = DETECT_MAD_ABS_FLOOR;
        out->z = (value - out->median) / scale;
        /* Keep z finite for the evidence even for absurd inputs. */
        if (!isfinite(out->z))
            out->z = out->z > 0 ? DETECT_MAX_Z : -DETECT_MAX_Z;
    }
    if (rule->spike_ratio > 0 && st->has_max && st->running_max > 0)
        out->spike_ratio = value / st->running_max;
    /* Absolute floors and ceilings need no baseline: they hold from
     * bounds_from_step (at or before the start of detection), through the
     * rule's warm-up, so a collapse that is already there when detection
     * starts is still caught. */
    bool started = step >= bounds_from_step;
    bool low = started && rule->has_floor && value <= rule->floor;
    bool high = started && rule->has_ceiling && value >= rule->ceiling;
    if (out->in_warmup && (low || high)) {
        out->breach_kind = DETECT_BREACH_FLOOR;
        out->breach = true;
    } else if (!out->in_warmup) {
        bool zbad =
            out->baseline_n > 0 &&
            (rule->direction == DETECT_FALL_IS_BAD ? out->z <= -rule->z : out->z >= rule->z);
        bool spike = rule->direction == DETECT_RISE_IS_BAD && out->spike_ratio > 0 &&
                     out->spike_ratio > rule->spike_ratio;
        double o = rule->rel_origin, above = value - o, base = out->median - o;
        bool rel = out->baseline_n > 0 && base > 0 &&
                   (rule->direction == DETECT_RISE_IS_BAD
                        ? rule->rise_ratio > 1 && above >= rule->rise_ratio * base
                        : rule->floor_rel > 0 && above <= rule->floor_rel * base);
        /* Most specific reason first. */
        if (low || high)
            out->breach_kind = DETECT_BREACH_FLOOR;
        else if (spike)
            out->breach_kind = DETECT_BREACH_SPIKE;
        else if (rel)
            out->breach_kind =
                fabs(value - out->median) >= DETECT_SIZE_NOISE_Z * DETECT_MAD_SCALE * out->mad
                    ? DETECT_BREACH_RELATIVE
                    : DETECT_BREACH_RELATIVE_IN_NOISE;
        else if (zbad)
            out->breach_kind = DETECT_BREACH_Z;
        out->breach = out->breach_kind != DETECT_BREACH_NONE;
    }
    /* Within the caller's bound a rise is no breach, whatever the reason. */
    if (rule->direction == DETECT_RISE_IS_BAD && isfinite(ok_max) && value <= ok_max) {
        out->breach = false;
        out->breach_kind = DETECT_BREACH_NONE;
    }
}

int detect_step(struct detect_state *st, const struct detect_rule *rule, int64_t step, double value,
                bool is_present, int64_t detect_from_step, struct detect_verdict *out)
{
    return detect_step_from(st, rule, step, value, is_present, detect_from_step, detect_from_step,
                            out);
}

int detect_step_from(struct detect_state *st, const struct detect_rule *rule, int64_t step,
                     double value, bool is_present, int64_t baseline_from_step,
                     int64_t detect_from_step, struct detect_verdict *out)
{
    struct detect_judging j = {.baseline_from = baseline_from_step,
                               .detect_from = detect_from_step,
                               .bounds_from = detect_from_step,
                               .ok_max = NAN,
                               .credit = 1};
    return detect_step_judged(st, rule, step, value, is_present, &j, out);
}

int detect_step_judged(struct detect_state *st, const struct detect_rule *rule, int64_t step,
                       double value, bool is_present, const struct detect_judging *j,
                       struct detect_verdict *out)
{
    if (!st || !rule || !j || !out)
        return -EINVAL;
    int64_t baseline_from_step = j->baseline_from, detect_from_step = j->detect_from;
    double ok_max = j->ok_max, credit = j->credit;
    memset(out, 0, sizeof(*out));
    /* `value` is what the baseline keeps; `judged` is what is scored. */
    double judged = credit > 0 && credit < 1 ? value * credit : value;
    out->value = judged;
    out->median = NAN;
    out->mad = NAN;
    if (!is_present || !rule->enabled) {
        /* Absent: no spectrum this step. Disabled: the rule is off. Neither
         * breaches nor touches the baseline or the open-breach counters. */
        out->present = is_present;
        return 0;
    }
    out->present = true;
    st->seen++;
    st->last_step = step;
    if (rule->still_rewarms && isfinite(value) && leaves_still(st, value))
        detect_restart_baseline(st);

    if (rule->trend)
        out->baseline_n = trend_stats(st, rule->window, rule->direction, step, &out->median,
                                      &out->mad, &out->slope);
    else
        out->baseline_n = baseline_stats(st, rule->window, &out->median, &out->mad);
    out->in_warmup = warming_up(st, rule, step) || step < detect_from_step;
    /* A trend rule re-warms after a version-1 blob, whose samples have no
     * steps: a line through one or two samples would breach on anything.
     * Without such a blob baseline_n already reaches this bound when
     * warm-up ends, so this changes nothing. */
    uint32_t need = rule->warmup < rule->window ? rule->warmup : rule->window;
    if (rule->warmup_steps > 0 && need > DETECT_WARMUP_MIN_SAMPLES)
        need = DETECT_WARMUP_MIN_SAMPLES;
    if (rule->trend && out->baseline_n < need)
        out->in_warmup = true;

    if (!isfinite(value)) {
        out->non_finite = true;
        out->breach = true;
        out->breach_kind = DETECT_BREACH_NONFINITE;
    } else {
        score_finite(st, rule, step, judged,
                     j->bounds_from < detect_from_step ? j->bounds_from : detect_from_step, ok_max,
                     j->scale_rel, out);
    }

    if (out->breach) {
        st->open = true;
        st->normal_run = 0;
        return 0;
    }
    /* Before the baseline starts (early training: LR warm-up, the fast
     * early transitions) a finite sample does not even build the baseline:
     * a baseline that holds them is too wide for what follows. For most
     * rules the baseline starts with detection; an early_baseline rule's
     * starts sooner (detect.h). */
    int64_t base_from =
        baseline_from_step < detect_from_step ? baseline_from_step : detect_from_step;
    if (step < base_from)
        return 0;
    /* A normal, finite sample. While a breach is open it stays out of the
     * baseline (a collapsed level must not become the new normal) until
     * resolve_after normal samples close it. Warm-up only builds the
     * baseline, so there every finite sample is accepted. */
    bool was_open = st->open;
    if (st->open && ++st->normal_run >= rule->resolve_after) {
        st->open = false;
        st->normal_run = 0;
    }
    if (!was_open || out->in_warmup) {
        ring_push(st, step, value);
        st->accepted++;
        if (!st->has_max || value > st->running_max) {
            st->running_max = value;
            st->has_max = true;
        }
        out->accepted_into_baseline = true;
    }
    return 0;
}

uint32_t detect_baseline_steps(const struct detect_state *st, uint32_t window, int64_t *steps)
{
    uint32_t avail = st->ring_count < window ? st->ring_count : window, n = 0;
    for (uint32_t i = 0; i < avail; i++) {
        uint32_t idx = (st->ring_head + DETECT_MAX_WINDOW - 1 - i) % DETECT_MAX_WINDOW;
        if (st->ring_step[idx] != DETECT_STEP_UNKNOWN)
            steps[n++] = st->ring_step[idx];
    }
    return n;
}

/* Little-endian fixed-width helpers; doubles travel as their IEEE-754 bits. */
static void put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put_f64(uint8_t *p, double d)
{
    uint64_t v;
    memcpy(&v, &d, sizeof v);
    put_u64(p, v);
}
static uint16_t get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}
static uint32_t get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}
static double get_f64(const uint8_t *p)
{
    uint64_t v = get_u64(p);
    double d;
    memcpy(&d, &v, sizeof d);
    return d;
}

#define FLAG_HAS_MAX 0x1u
#define FLAG_OPEN 0x2u

int detect_state_encode(const struct detect_state *st, uint8_t *buf, size_t len)
{
    if (!st || !buf)
        return -EINVAL;
    uint32_t n = st->ring_count > DETECT_MAX_WINDOW ? DETECT_MAX_WINDOW : st->ring_count;
    size_t need = DETECT_STATE_HEADER_BYTES + 16 * (size_t)n;
    if (len < need)
        return -ENOSPC;
    uint16_t flags = (uint16_t)((st->has_max ? FLAG_HAS_MAX : 0) | (st->open ? FLAG_OPEN : 0));
    put_u32(buf + 0, DETECT_STATE_MAGIC);
    put_u16(buf + 4, DETECT_STATE_VERSION);
    put_u16(buf + 6, flags);
    put_u32(buf + 8, st->normal_run);
    put_u32(buf + 12, n);
    put_u64(buf + 16, st->accepted);
    put_u64(buf + 24, st->seen);
    put_u64(buf + 32, (uint64_t)st->last_step);
    put_f64(buf + 40, st->running_max);
    /* Oldest first, so the blob is canonical whatever the ring position:
     * all the values, then all their steps. */
    uint8_t *steps = buf + DETECT_STATE_HEADER_BYTES + 8 * (size_t)n;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t idx = (st->ring_head + DETECT_MAX_WINDOW - n + i) % DETECT_MAX_WINDOW;
        put_f64(buf + DETECT_STATE_HEADER_BYTES + 8 * (size_t)i, st->ring[idx]);
        put_u64(steps + 8 * (size_t)i, (uint64_t)st->ring_step[idx]);
    }
    return (int)need;
}

int detect_state_decode(struct detect_state *st, const uint8_t *buf, size_t len)
{
    if (!st || !buf || len < DETECT_STATE_HEADER_BYTES)
        return -EINVAL;
    if (get_u32(buf) != DETECT_STATE_MAGIC)
        return -EINVAL;
    uint16_t version = get_u16(buf + 4);
    if (version != DETECT_STATE_VERSION && version != DETECT_STATE_VERSION_NO_STEPS)
        return -ENOTSUP;
    bool has_steps = version == DETECT_STATE_VERSION;
    uint16_t flags = get_u16(buf + 6);
    uint32_t n = get_u32(buf + 12);
    if ((flags & ~(FLAG_HAS_MAX | FLAG_OPEN)) != 0 || n > DETECT_MAX_WINDOW ||
        len != DETECT_STATE_HEADER_BYTES + (has_steps ? 16 : 8) * (size_t)n)
        return -EINVAL;
    struct detect_state s;
    detect_state_init(&s);
    s.has_max = (flags & FLAG_HAS_MAX) != 0;
    s.open = (flags & FLAG_OPEN) != 0;
    s.normal_run = get_u32(buf + 8);
    s.ring_count = n;
    s.ring_head = n % DETECT_MAX_WINDOW;
    s.accepted = get_u64(buf + 16);
    s.seen = get_u64(buf + 24);
    s.last_step = (int64_t)get_u64(buf + 32);
    s.running_max = get_f64(buf + 40);
    const uint8_t *steps = buf + DETECT_STATE_HEADER_BYTES + 8 * (size_t)n;
    for (uint32_t i = 0; i < n; i++) {
        s.ring[i] = get_f64(buf + DETECT_STATE_HEADER_BYTES + 8 * (size_t)i);
        /* Only finite samples are ever accepted. */
        if (!isfinite(s.ring[i]))
            return -EINVAL;
        /* Version 1 kept no steps: see the layout in detect.h. */
        s.ring_step[i] = has_steps ? (int64_t)get_u64(steps + 8 * (size_t)i) : DETECT_STEP_UNKNOWN;
    }
    if (s.has_max && !isfinite(s.running_max))
        return -EINVAL;
    if (s.accepted < n)
        return -EINVAL;
    *st = s;
    return 0;
}

const char *detect_family_name(enum detect_family f)
{
    static const char *const names[] = {
        [DETECT_FAMILY_ATTENTION_D2] = "attention_d2",
        [DETECT_FAMILY_ROUTER_WEIGHT] = "router_weight",
        [DETECT_FAMILY_WEIGHT_NORM] = "weight_norm",
        [DETECT_FAMILY_ROUTER_BALANCE] = "router_balance",
        [DETECT_FAMILY_SCALAR_LOSS] = "scalar_loss",
        [DETECT_FAMILY_STEP_SIZE] = "step_size",
    };
    return (unsigned)f < DETECT_FAMILY_COUNT ? names[f] : "unknown";
}

/* NULL-terminated for CONFIG_ENUM choices (config.h). */
const char *const detect_severity_names[] = {
    [DETECT_SEVERITY_WARNING] = "warning",
    [DETECT_SEVERITY_CRITICAL] = "critical",
    NULL,
};

const char *detect_severity_name(enum detect_severity s)
{
    return (unsigned)s <= DETECT_SEVERITY_CRITICAL ? detect_severity_names[s] : "unknown";
}

int detect_severity_parse(const char *s, size_t len, enum detect_severity *out)
{
    for (unsigned i = 0; s && detect_severity_names[i]; i++) {
        if (strlen(detect_severity_names[i]) == len &&
            memcmp(detect_severity_names[i], s, len) == 0) {
            *out = (enum detect_severity)i;
            return 0;
        }
    }
    return -EINVAL;
}

const char *detect_breach_kind_name(enum detect_breach_kind k)
{
    switch (k) {
    case DETECT_BREACH_NONE:
        return "none";
    case DETECT_BREACH_Z:
        return "z";
    case DETECT_BREACH_FLOOR:
        return "floor";
    case DETECT_BREACH_NONFINITE:
        return "nonfinite";
    case DETECT_BREACH_SPIKE:
        return "spike";
    case DETECT_BREACH_RELATIVE:
        return "relative";
    case DETECT_BREACH_RELATIVE_IN_NOISE:
        return "relative_in_noise";
    }
    return "unknown";
}

const char *detect_direction_name(enum detect_direction d)
{
    switch (d) {
    case DETECT_FALL_IS_BAD:
        return "fall_is_bad";
    case DETECT_RISE_IS_BAD:
        return "rise_is_bad";
    }
    return "unknown";
}
