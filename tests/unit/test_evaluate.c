/* evaluate.c: when detection starts (training progress), which stored
 * series are detection inputs, and per-incident labels that depend neither
 * on the order of a step's samples nor on how they are batched. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "evaluate.h"

/* ---- start of detection ------------------------------------------------------- */

/* The tests' noise: uniform in [0, 1) from a 64-bit LCG (their expected
 * steps are those of this stream). */
static double noise01(uint64_t *seed)
{
    *seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(*seed >> 11) / 9007199254740992.0;
}

/* LR schedules, one value per step from step 1; start asked for at `at`. */
static double warm50_const(int64_t s)
{
    return s < 50 ? 1e-3 * (double)(s + 1) / 50 : 1e-3;
}
static double warm10_cosine(int64_t s)
{
    return s < 10 ? 1e-3 * (double)(s + 1) / 10 : 1e-3 * (0.55 + 0.45 * cos((double)s / 500));
}
static double constant(int64_t s)
{
    (void)s;
    return 3e-4;
}
static double warm2000(int64_t s)
{
    return 1e-3 * (double)(s + 1) / 2000;
}
/* A fine-tune of a trained model from step 1,001: warmed up again over 100
 * steps, then constant. */
static double rewarm_at_1001(int64_t s)
{
    return s < 1100 ? 1e-3 * (double)(s - 1000) / 100 : 1e-3;
}

/* A run's logged rates and the start asked for at `at`. */
struct progress_case {
    const char *name;
    double (*lr)(int64_t);
    int64_t feed_from, feed_until; /* LR fed for steps feed_from..feed_until (lr NULL: none) */
    int64_t detect_from;
    uint64_t at;
    int64_t want;
};

/* er, fresh on the default rules, fed c's logged rates. */
static void progress_of(struct eval_run *er, struct detect_rules *rules,
                        const struct progress_case *c)
{
    detect_rules_default(rules);
    eval_run_init(er, rules);
    for (int64_t s = c->feed_from; c->lr && s <= c->feed_until; s++)
        eval_progress_lr(er, (uint64_t)s, c->lr(s));
}

static const struct progress_case start_cases[] = {
    {"50-step warm-up, then constant: 3 x 50", warm50_const, 1, 400, 0, 300, 150},
    {"10-step warm-up, cosine: at least step 100", warm10_cosine, 1, 400, 0, 300, 100},
    {"constant from step 1", constant, 1, 400, 0, 300, 100},
    {"still warming up: not yet", warm2000, 1, 400, 0, 300, INT64_MAX},
    {"no LR reported", NULL, 0, 0, 0, 300, 150},
    {"detect_from_step wins", warm50_const, 1, 400, 40, 300, 40},
    {"detect_from_step wins without LR", NULL, 0, 0, 500, 300, 500},
    /* The LR of step 50 is the first that does not rise: the warm-up ends
     * there; a sample of step 50 itself does not know yet (its LR may be
     * fed after it). */
    {"warm-up end seen at its own step: not yet", warm50_const, 1, 50, 0, 50, INT64_MAX},
    {"warm-up end seen a step later", warm50_const, 1, 50, 0, 51, 150},
    /* A Monitor attached to a trained model (evaluate.h: the run's origin
     * is its first LR's step). Counted from step 0 these started at 3 x
     * 1,002: no detection for 2,000 steps. */
    {"attached at 1,001 past the warm-up: 100 steps on", warm10_cosine, 1001, 1400, 0, 1300, 1101},
    {"re-warmed over 100 steps from 1,001: 3 of those warm-ups", rewarm_at_1001, 1001, 1400, 0,
     1400, 1301},
    {"first LR at step 99: seen from the start, 3 x 100", constant, 99, 400, 0, 300, 300},
};

Test(evaluate, start_of_detection_by_progress)
{
    for (size_t i = 0; i < sizeof(start_cases) / sizeof(start_cases[0]); i++) {
        struct detect_rules rules;
        struct eval_run er;
        progress_of(&er, &rules, &start_cases[i]);
        int64_t got = eval_start_step(&er, start_cases[i].at, start_cases[i].detect_from);
        cr_expect_eq(got, start_cases[i].want, "%s: got %lld", start_cases[i].name, (long long)got);
        eval_run_clear(&er);
    }
}

/* Where an early_baseline rule's baseline starts (update_ratio): at the
 * warm-up end; it detects once that baseline is warm (below), long before
 * the other rules start 3 warm-ups later. */
static const struct progress_case baseline_cases[] = {
    {"50-step warm-up: at its end", warm50_const, 1, 400, 0, 300, 50},
    {"10-step warm-up: not before step 50", warm10_cosine, 1, 400, 0, 300, 50},
    {"constant from step 1: step 50", constant, 1, 400, 0, 300, 50},
    {"still warming up: not yet", warm2000, 1, 400, 0, 300, INT64_MAX},
    {"no LR reported", NULL, 0, 0, 0, 300, 50},
    {"detect_from_step wins", warm50_const, 1, 400, 40, 300, 40},
    {"warm-up end seen at its own step: not yet", warm50_const, 1, 50, 0, 50, INT64_MAX},
    /* Attached late: not before 50 steps after the first (an optimizer
     * reset with the attach moves every weight by the full rate). */
    {"attached at 1,001 past the warm-up: step 1,051", warm10_cosine, 1001, 1400, 0, 1300, 1051},
    {"re-warmed over 100 steps from 1,001: at its end", rewarm_at_1001, 1001, 1400, 0, 1400, 1101},
};

Test(evaluate, start_of_early_baselines_by_progress)
{
    for (size_t i = 0; i < sizeof(baseline_cases) / sizeof(baseline_cases[0]); i++) {
        struct detect_rules rules;
        struct eval_run er;
        progress_of(&er, &rules, &baseline_cases[i]);
        int64_t got = eval_baseline_step(&er, baseline_cases[i].at, baseline_cases[i].detect_from);
        cr_expect_eq(got, baseline_cases[i].want, "%s: got %lld", baseline_cases[i].name,
                     (long long)got);
        cr_expect(got == INT64_MAX || got <= eval_start_step(&er, baseline_cases[i].at,
                                                             baseline_cases[i].detect_from),
                  "%s: the baseline starts after detection", baseline_cases[i].name);
        eval_run_clear(&er);
    }
}

static double warm300_const(int64_t s)
{
    return s < 300 ? 3e-3 * (double)(s + 1) / 300 : 3e-3;
}

/* The first step a series of `rule` fires at, fed a sample every 10 steps
 * from step 10 (level 0.05, tenfold from step `jump`) after the 300-step
 * warm-up's learning rates; -1: never before step 1,000. */
/* The step of b's first transition to firing, into *fired while that is
 * still -1. */
static void note_first_firing(const struct eval_batch *b, int64_t *fired)
{
    for (size_t i = 0; i < b->n && *fired < 0; i++)
        if (b->ev[i].has_event && b->ev[i].tr.change == ALERT_CHANGE_TO_FIRING)
            *fired = b->ev[i].tr.step;
}

/* Labels b's events, notes its first firing into *fired (note_first_firing)
 * and empties it for the next step. */
static void label_and_note(struct eval_run *er, struct eval_batch *b, int64_t *fired)
{
    eval_label_all(er, b);
    note_first_firing(b, fired);
    eval_batch_reset(b);
}

/* One series of rule on layer 0 (window `window`), a sample every 10 steps
 * of a run warmed up over 300 steps: `before` (+0-2%) until `at`, `after`
 * (+0-2%) from there. With grad_from >= 0 the gradient norm is fed every
 * step too: about 1 (+0-10%) until grad_from, `grad` times that from there.
 * early_grad_rise: the rule's key set so (NULL: the default). */
struct firing_run {
    const char *series, *rule;
    int32_t window;
    double before, after;
    int64_t at, until;
    int64_t grad_from;
    double grad;
    const char *early_grad_rise;
};

/* The first step such a run fires at; -1 when none fired by `until`. */
static int64_t first_firing_of(const struct firing_run *r)
{
    struct detect_rules rules;
    struct eval_run er;
    struct eval_batch b = {0};
    struct store_series_key k = {"", 0, -1, r->window, 0};
    snprintf(k.name, sizeof(k.name), "%s", r->series);
    detect_rules_default(&rules);
    if (r->early_grad_rise)
        cr_assert_eq(detect_rules_set(&rules, r->rule, "early_grad_rise", r->early_grad_rise, NULL),
                     0);
    eval_run_init(&er, &rules);
    struct eval_track *t = eval_track_get(&er, &k, r->rule);
    cr_assert(t);
    int64_t fired = -1;
    uint64_t seed = 99;
    for (int64_t s = 1; s < r->until && fired < 0; s++) {
        eval_progress_lr(&er, (uint64_t)s, warm300_const(s));
        if (r->grad_from >= 0)
            eval_progress_grad(&er, (uint64_t)s,
                               (s >= r->grad_from ? r->grad : 1) * (1 + 0.1 * noise01(&seed)));
        if (s % 10)
            continue;
        double v = (s >= r->at ? r->after : r->before) * (1 + 0.02 * noise01(&seed));
        cr_assert_geq(eval_feed(&er, &b, t, (uint64_t)s, v, true, -1, 0, 0), 0);
        label_and_note(&er, &b, &fired);
    }
    eval_batch_free(&b);
    eval_run_clear(&er);
    return fired;
}

/* first_firing_of without a gradient norm, the rule's defaults. */
static int64_t first_firing(const char *series, int32_t window, const char *rule, double before,
                            double after, int64_t at, int64_t until)
{
    struct firing_run r = {series, rule, window, before, after, at, until, -1, 1, NULL};
    return first_firing_of(&r);
}

/* An early_baseline rule detects as soon as its baseline (from the warm-up
 * end) is warm, not 3 warm-ups later: a step ten times too large at step
 * 700 of a run whose warm-up ended at 300 is caught at once. Rules without
 * it start at 3 x 300 = 900: the same jump in grad_norm goes unjudged. */
Test(evaluate, early_baseline_rules_detect_once_warm)
{
    cr_expect_eq(first_firing("update_ratio", 0, "update_ratio", 0.05, 0.5, 700, 1000), 700);
    cr_expect_eq(first_firing("update_ratio", 0, "update_ratio", 0.05, 0.5, 1000, 1000), -1,
                 "healthy: no alert");
    cr_expect_eq(first_firing("grad_norm", 0, "grad_norm", 0.05, 0.5, 700, 1000), -1);
}

/* A rank-one floor holds from the warm-up end (300), not from the start of
 * detection (900): Delta2 (qk.d2.srank, 3) at rank one (1.0, under the
 * 1.05 floor with its noise) from step 500 fires on its second sample
 * (magnitude_persistence 2). A fall to 1.5, above the floor, waits for the
 * start, and a baseline built from there holds it as the level. */
Test(evaluate, rank_one_floors_hold_from_the_warmup_end)
{
    cr_expect_eq(first_firing("qk.d2.srank.min", 10, "qk.d2.srank", 3, 1.0, 500, 1200), 510);
    cr_expect_eq(first_firing("qk.d2.srank.min", 10, "qk.d2.srank", 3, 1.5, 500, 1200), -1);
    cr_expect_eq(first_firing("qk.d2.srank.min", 10, "qk.d2.srank", 3, 3, 500, 1200), -1,
                 "healthy: no alert");
}

/* Warm restarts: a 50-step warm-up to 1e-3, then the rate decays
 * exponentially (e-folding 80 steps) and restarts at the peak every 400
 * steps (450, 850, 1250, 1650): most of a baseline sits far below the
 * peak. From step `fault` (0: none) the step is 10 times the schedule's:
 * hidden (`visible` false: the logged rate is the schedule's) or logged. */
static double restarts_lr(int64_t s)
{
    if (s < 50)
        return 1e-3 * (double)(s + 1) / 50;
    return 1e-3 * exp(-(double)((s - 50) % 400) / 80);
}

struct restart_fires {
    int64_t update_ratio, lr; /* first firing step (-1: none before 2,000) */
};

/* Fed as `foreshock backtest` feeds stored points: the logged rate every
 * step, the update ratio every 10 (40 x the mean step taken over those 10,
 * 2% noise: the update since the previous sketch). */
static struct restart_fires run_restarts(int64_t fault, bool visible, bool per_lr)
{
    struct detect_rules rules;
    struct eval_run er;
    struct eval_batch b = {0};
    struct store_series_key klr = {"lr", -1, -1, 0, 0}, kur = {"update_ratio", 0, -1, 0, 0};
    struct restart_fires out = {-1, -1};
    detect_rules_default(&rules);
    if (!per_lr) /* the defaults otherwise */
        detect_rules_find(&rules, "update_ratio")->per_lr = false;
    eval_run_init(&er, &rules);
    uint64_t seed = 7;
    double taken = 0;
    for (int64_t s = 1; s < 2000; s++) {
        double step = restarts_lr(s) * (fault && s >= fault ? 10 : 1);
        taken += step;
        cr_assert_geq(eval_feed_stored(&er, &b, &klr, (uint64_t)s, visible ? step : restarts_lr(s),
                                       true, 0, 0),
                      0);
        if (s % 10 == 0) {
            double u = noise01(&seed);
            cr_assert_geq(eval_feed_stored(&er, &b, &kur, (uint64_t)s, 4 * taken * (1 + 0.02 * u),
                                           true, 0, 0),
                          0);
            taken = 0;
        }
        eval_label_all(&er, &b);
        for (size_t i = 0; i < b.n; i++) {
            if (!b.ev[i].has_event || b.ev[i].tr.change != ALERT_CHANGE_TO_FIRING)
                continue;
            int64_t *at = strcmp(b.ev[i].t->key.name, "lr") == 0 ? &out.lr : &out.update_ratio;
            if (*at < 0)
                *at = b.ev[i].tr.step;
        }
        eval_batch_reset(&b);
    }
    eval_batch_free(&b);
    eval_run_clear(&er);
    return out;
}

/* The fifth held-out look's warm restarts paged both step-size rules at
 * every restart: the logged rate rose (z 75) and the update ratio with it
 * (3-4.7x its median). A rate back at the warm-up's peak is the schedule
 * (lr: within_peak), and so is an update that rose with the logged rate
 * (update_ratio: per_lr); a step 10 times the schedule's from step 1,270,
 * 20 steps after a restart, hidden or logged above the peak, still fires:
 * the update ratio at the first sketch whose steps are all faulty (1,280),
 * a logged rate at its third breach (1,272). */
Test(evaluate, warm_restarts_are_the_schedule)
{
    struct restart_fires healthy = run_restarts(0, false, true);
    cr_expect_eq(healthy.update_ratio, -1, "update_ratio fired at %lld",
                 (long long)healthy.update_ratio);
    cr_expect_eq(healthy.lr, -1, "lr fired at %lld", (long long)healthy.lr);
    /* Without the credit the first restart pages. */
    int64_t plain = run_restarts(0, false, false).update_ratio;
    cr_expect_eq(plain, 460, "%lld", (long long)plain);
    struct restart_fires hidden = run_restarts(1270, false, true);
    cr_expect_eq(hidden.update_ratio, 1280, "%lld", (long long)hidden.update_ratio);
    cr_expect_eq(hidden.lr, -1);
    struct restart_fires logged = run_restarts(1270, true, true);
    cr_expect_eq(logged.update_ratio, 1280, "%lld", (long long)logged.update_ratio);
    cr_expect_eq(logged.lr, 1272);
}

/* The same restarts seen by step_update_ratio, a sample every step (4 x
 * the step, 2% noise). A baseline of credited samples paged each restart
 * of the eleventh look's SGD run 32 steps after it (here at 486): once
 * half of the 64-step baseline was newer than the restart, the credit's
 * reference rate flipped to the new one while the baseline still held
 * the old level. The baseline keeps raw samples (detect_step_judged's
 * credit), so the reference rate and the samples move together. A hidden
 * 10x step from 1,270 fires on its fifth step. */
static int64_t run_restarts_per_step(int64_t fault)
{
    struct detect_rules rules;
    struct eval_run er;
    struct eval_batch b = {0};
    struct store_series_key klr = {"lr", -1, -1, 0, 0}, ks = {"step_update_ratio", -1, -1, 0, 0};
    int64_t fired = -1;
    detect_rules_default(&rules);
    eval_run_init(&er, &rules);
    uint64_t seed = 11;
    for (int64_t s = 1; s < 2000 && fired < 0; s++) {
        double step = restarts_lr(s) * (fault && s >= fault ? 10 : 1);
        double u = noise01(&seed);
        cr_assert_geq(eval_feed_stored(&er, &b, &klr, (uint64_t)s, restarts_lr(s), true, 0, 0), 0);
        cr_assert_geq(
            eval_feed_stored(&er, &b, &ks, (uint64_t)s, 4 * step * (1 + 0.02 * u), true, 0, 0), 0);
        label_and_note(&er, &b, &fired);
    }
    eval_batch_free(&b);
    eval_run_clear(&er);
    return fired;
}

Test(evaluate, warm_restarts_keep_a_per_step_baseline_consistent)
{
    int64_t healthy = run_restarts_per_step(0);
    cr_expect_eq(healthy, -1, "step_update_ratio fired at %lld", (long long)healthy);
    int64_t hidden = run_restarts_per_step(1270);
    cr_expect_eq(hidden, 1274, "%lld", (long long)hidden);
}

/* ---- detection inputs ------------------------------------------------------------ */

static const struct {
    struct store_series_key k;
    bool input;
    const char *rule;
    uint32_t lead; /* the run's lead rank (a local group's lowest) */
} input_cases[] = {
    {{"qk.d2.erank.min", 2, -1, 25, -1}, true, "qk.d2.erank", 0},
    {{"qk.d2.srank.min", 0, -1, 5, -1}, true, "qk.d2.srank", 0},
    {{"qk.cqk.max", 1, -1, 10, -1}, true, "qk.cqk", 0},
    {{"qk.d2.erank.mean", 2, -1, 25, -1}, false, NULL, 0}, /* not what is detected */
    {{"qk.d2.erank", 2, 3, 25, -1}, false, NULL, 0},       /* a head, not the layer */
    {{"qk.d1.erank.min", 2, -1, 25, -1}, false, NULL, 0},  /* Delta1: no rule */
    {{"router.zloss", 0, -1, 0, -1}, true, "router.zloss", 0},
    {{"router.kappa", 0, -1, 0, -1}, false, NULL, 0}, /* stored, no default rule */
    {{"loss", -1, -1, 0, 0}, true, "loss", 0},
    {{"loss", -1, -1, 0, 1}, false, NULL, 0}, /* rank 1's loss: not detected */
    {{"grad_norm", -1, -1, 0, 0}, true, "grad_norm", 0},
    {{"update_ratio", 3, -1, 0, 0}, true, "update_ratio", 0},
    {{"step_update_ratio", -1, -1, 0, 0}, true, "step_update_ratio", 0},
    {{"step_update_ratio", -1, -1, 0, 1}, false, NULL, 0}, /* rank 1's: not detected */
    {{"weight_norm", 3, -1, 0, 0}, true, "weight_norm", 0},
    {{"lr", -1, -1, 0, 0}, true, "lr", 0},
    /* A per-node daemon hearing ranks 4-7 detects rank 4's scalars. */
    {{"loss", -1, -1, 0, 4}, true, "loss", 4},
    {{"lr", -1, -1, 0, 4}, true, "lr", 4},
    {{"weight_norm", 3, -1, 0, 4}, true, "weight_norm", 4},
    {{"loss", -1, -1, 0, 0}, false, NULL, 4}, /* rank 0 is another node's */
    {{"router.zloss", 0, -1, 0, -1}, true, "router.zloss", 4},
};

Test(evaluate, detection_inputs)
{
    struct detect_rules rules;
    detect_rules_default(&rules);
    for (size_t i = 0; i < sizeof(input_cases) / sizeof(input_cases[0]); i++) {
        char rule[DETECT_NAME_MAX] = "";
        bool got =
            eval_input_rule(&rules, &input_cases[i].k, input_cases[i].lead, rule, sizeof(rule));
        cr_expect_eq(got, input_cases[i].input, "case %zu (%s)", i, input_cases[i].k.name);
        if (got)
            cr_expect_str_eq(rule, input_cases[i].rule, "case %zu", i);
    }
}

/* ---- labels ------------------------------------------------------------------------ */

/* A Delta2 series collapsing from step 400 and the learning rate jumping
 * at step `ur_from` (0: never), fed step by step from 200 (after
 * the start, detect_from_step 200) with the two series of a step in either
 * order and the events taken in batches of `batch` steps. Returns the label
 * of the first firing of each series. */
struct labels {
    enum alert_attribution d2, ur;
    int64_t d2_step, ur_step;
};

static struct labels run_pair(int64_t ur_from, bool ur_first, int batch)
{
    struct detect_rules rules;
    struct eval_run er;
    struct eval_batch b = {0};
    struct labels out = {ALERT_ATTR_NONE, ALERT_ATTR_NONE, -1, -1};
    struct store_series_key kd = {"qk.d2.srank.min", 1, -1, 5, -1};
    struct store_series_key ku = {"lr", -1, -1, 0, 0};
    detect_rules_default(&rules);
    eval_run_init(&er, &rules);
    struct eval_track *td = eval_track_get(&er, &kd, "qk.d2.srank");
    struct eval_track *tu = eval_track_get(&er, &ku, "lr");
    cr_assert(td && tu);
    uint64_t seed = 12345;
    for (int64_t s = 200; s < 700; s += 5) {
        double u = noise01(&seed);
        double d2 = s >= 400 ? 1.4 - 0.002 * (double)(s - 400) / 5 : 3.0 + 0.05 * u;
        /* A too-large step: the learning rate jumps tenfold at once. */
        double ur = ur_from && s >= ur_from ? 0.1 + 0.001 * u : 0.01 + 0.001 * u;
        for (int k = 0; k < 2; k++) {
            bool do_ur = (k == 0) == ur_first;
            cr_assert_geq(
                eval_feed(&er, &b, do_ur ? tu : td, (uint64_t)s, do_ur ? ur : d2, true, -1, 200, 0),
                0);
        }
        if ((s / 5) % batch == 0 || s + 5 >= 700) {
            eval_label_all(&er, &b);
            for (size_t i = 0; i < b.n; i++) {
                const struct eval_event *e = &b.ev[i];
                if (!e->has_event || e->tr.change != ALERT_CHANGE_TO_FIRING)
                    continue;
                if (e->t == td && out.d2_step < 0) {
                    out.d2 = e->attr;
                    out.d2_step = e->tr.step;
                }
                if (e->t == tu && out.ur_step < 0) {
                    out.ur = e->attr;
                    out.ur_step = e->tr.step;
                }
            }
            eval_batch_reset(&b);
        }
    }
    eval_batch_free(&b);
    eval_run_clear(&er);
    return out;
}

Test(evaluate, labels_by_mechanism_and_order_of_onset)
{
    static const struct {
        int64_t ur_from;
        enum alert_attribution d2, ur;
        const char *why;
    } cases[] = {
        {0, ALERT_ATTR_ATTENTION_NUMERICS, ALERT_ATTR_NONE, "Delta2 collapse alone"},
        {350, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER,
         "a too-large step first, then the collapse: it may be the step's consequence"},
        {500, ALERT_ATTR_ATTENTION_NUMERICS, ALERT_ATTR_COMBINED,
         "the collapse first, then the rate rises: a second fault, combined"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct labels ref = run_pair(cases[i].ur_from, false, 1);
        cr_expect_eq(ref.d2, cases[i].d2, "%s: Delta2 alert labelled %s", cases[i].why,
                     alert_attribution_name(ref.d2));
        cr_expect_eq(ref.ur, cases[i].ur, "%s: LR alert labelled %s", cases[i].why,
                     alert_attribution_name(ref.ur));
        /* The same labels and steps whatever the order within a step and
         * however the events are batched (the live stage batches by commit). */
        const struct {
            bool ur_first;
            int batch;
        } variants[] = {{true, 1}, {false, 7}, {true, 13}};
        for (size_t v = 0; v < sizeof(variants) / sizeof(variants[0]); v++) {
            struct labels got = run_pair(cases[i].ur_from, variants[v].ur_first, variants[v].batch);
            cr_expect(got.d2 == ref.d2 && got.ur == ref.ur && got.d2_step == ref.d2_step &&
                          got.ur_step == ref.ur_step,
                      "%s: variant %zu differs", cases[i].why, v);
        }
    }
}

/* The label of t's first transition to firing in b, into *got while that
 * is still -1. */
static void note_first_label(const struct eval_batch *b, const struct eval_track *t,
                             enum alert_attribution *got)
{
    for (size_t i = 0; i < b->n && (int)*got < 0; i++)
        if (b->ev[i].has_event && b->ev[i].t == t && b->ev[i].tr.change == ALERT_CHANGE_TO_FIRING)
            *got = b->ev[i].attr;
}

/* A symptom (`loss` or `grad_norm`) and c_qk (qk.cqk.max): the symptom
 * every step (about 2.0), c_qk every 10 steps (about 0.1). From step 400
 * the symptom spikes to 6 for six steps (a corrupted batch) or, `stays_up`,
 * jumps to 4 for good (harder data); c_qk rises to 0.5 from step `cqk_from`
 * on. Returns the label of the first firing of the symptom's incident, or
 * of the c_qk one when `of_cqk`; -1 when it never fired. */
static enum alert_attribution first_page_label(const char *symptom, bool stays_up, int64_t cqk_from,
                                               bool of_cqk)
{
    struct detect_rules rules;
    struct eval_run er;
    struct eval_batch b = {0};
    enum alert_attribution got = (enum alert_attribution) - 1;
    struct store_series_key kl = {"", -1, -1, 0, 0};
    struct store_series_key kc = {"qk.cqk.max", 0, -1, 10, -1};
    snprintf(kl.name, sizeof kl.name, "%s", symptom);
    detect_rules_default(&rules);
    eval_run_init(&er, &rules);
    struct eval_track *tl = eval_track_get(&er, &kl, symptom);
    struct eval_track *tc = eval_track_get(&er, &kc, "qk.cqk");
    cr_assert(tl && tc);
    uint64_t seed = 777;
    for (int64_t s = 1; s < 500; s++) {
        double u = noise01(&seed);
        double loss = 2.0 + 0.05 * u;
        if (stays_up && s >= 400)
            loss += 2.0;
        else if (!stays_up && s >= 400 && s <= 405)
            loss = 6.0;
        cr_assert_geq(eval_feed(&er, &b, tl, (uint64_t)s, loss, true, -1, 200, 0), 0);
        if (s % 10 == 0) {
            double cqk = s >= cqk_from ? 0.5 : 0.1 + 0.005 * u;
            cr_assert_geq(eval_feed(&er, &b, tc, (uint64_t)s, cqk, true, -1, 200, 0), 0);
        }
        eval_label_all(&er, &b);
        note_first_label(&b, of_cqk ? tc : tl, &got);
        eval_batch_reset(&b);
    }
    eval_batch_free(&b);
    eval_run_clear(&er);
    return got;
}

/* The first step qk.cqk.max over `window` steps fires when, from step 400,
 * it rises from about 0.07 to `level` for good (-1: never). */
static int64_t cqk_fires_at(int32_t window, double level)
{
    struct detect_rules rules;
    struct eval_run er;
    struct eval_batch b = {0};
    struct store_series_key k = {"qk.cqk.max", 1, -1, window, -1};
    detect_rules_default(&rules);
    eval_run_init(&er, &rules);
    struct eval_track *t = eval_track_get(&er, &k, "qk.cqk");
    cr_assert(t);
    uint64_t seed = 4242;
    int64_t fired = -1;
    for (int64_t s = 10; s <= 800 && fired < 0; s += 10) {
        double v = (s >= 400 ? level : 0.07) * (1 + 0.03 * noise01(&seed));
        cr_assert_geq(eval_feed(&er, &b, t, (uint64_t)s, v, true, -1, 100, 0), 0);
        eval_label_all(&er, &b);
        for (size_t i = 0; i < b.n; i++)
            if (b.ev[i].has_event && b.ev[i].tr.change == ALERT_CHANGE_TO_FIRING)
                fired = s;
        eval_batch_reset(&b);
    }
    eval_batch_free(&b);
    eval_run_clear(&er);
    return fired;
}

/* qk.cqk over a long window (DETECT_LONG_WINDOW) counts its z from
 * scale_rel_long: healthy attention forming late doubled a window-50 c_qk
 * for hundreds of steps (the fourteenth held-out look), while an attention
 * fault lifts it 3.5-14x. A window-10 series keeps scale_rel: a doubling
 * fires there. */
Test(evaluate, cqk_long_window_has_its_own_scale)
{
    static const struct {
        int32_t window;
        double level;
        bool fires;
    } cases[] = {
        {10, 0.14, true},
        {DETECT_LONG_WINDOW, 0.14, false},
        {DETECT_LONG_WINDOW, 0.16, false},
        {DETECT_LONG_WINDOW, 0.35, true},
        {100, 0.14, false},
        {25, 0.14, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t at = cqk_fires_at(cases[i].window, cases[i].level);
        cr_expect_eq(at >= 0, cases[i].fires, "window %d, level %g: fired at %lld",
                     (int)cases[i].window, cases[i].level, (long long)at);
        if (at >= 0)
            cr_expect_geq(at, 400, "window %d fired before the rise", (int)cases[i].window);
    }
}

/* Whether step_update_ratio fires in a run whose per-step update ratio
 * (about 0.001) and gradient norm (about 1) are multiplied from step 400 on
 * by sur_mult and grad_mult, the run's update following the gradient or
 * not. Both are fed as stored points of the lead rank. */
static bool sur_fires(bool follows_grad, double grad_mult, double sur_mult)
{
    struct detect_rules rules;
    struct eval_run er;
    struct eval_batch b = {0};
    struct store_series_key kg = {"grad_norm", -1, -1, 0, 0};
    struct store_series_key ku = {"step_update_ratio", -1, -1, 0, 0};
    detect_rules_default(&rules);
    eval_run_init(&er, &rules);
    er.update_follows_grad = follows_grad;
    uint64_t seed = 99;
    bool fired = false;
    for (int64_t s = 1; s <= 600 && !fired; s++) {
        double g = (s >= 400 ? grad_mult : 1.0) * (1 + 0.05 * noise01(&seed));
        double u = (s >= 400 ? sur_mult : 1.0) * 0.001 * (1 + 0.05 * noise01(&seed));
        cr_assert_geq(eval_feed_stored(&er, &b, &kg, (uint64_t)s, g, true, 0, 100), 0);
        cr_assert_geq(eval_feed_stored(&er, &b, &ku, (uint64_t)s, u, true, 0, 100), 0);
        eval_label_all(&er, &b);
        for (size_t i = 0; i < b.n; i++)
            if (b.ev[i].has_event && b.ev[i].tr.change == ALERT_CHANGE_TO_FIRING &&
                strcmp(b.ev[i].t->key.name, "step_update_ratio") == 0)
                fired = true;
        eval_batch_reset(&b);
    }
    eval_batch_free(&b);
    eval_run_clear(&er);
    return fired;
}

/* Under SGD (update_follows_grad) the step is the rate times the gradient:
 * an attention fault that quadruples the gradient quadruples the step, and
 * the square root of the gradient's rise is credited (4x / 2 = 2x, under
 * step_update_ratio's 2.5x). A rate fault steps up against a flat
 * gradient, and one that also lifts the gradient still fires (8x / 2).
 * An adaptive optimizer's run gets no such credit. */
Test(evaluate, sgd_credits_the_gradient_rise_table)
{
    static const struct {
        bool follows;
        double grad_mult, sur_mult;
        bool fires;
    } cases[] = {
        {true, 4, 4, false}, {false, 4, 4, true}, {true, 1, 4, true},
        {false, 1, 4, true}, {true, 4, 8, true},  {true, 1, 1, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        cr_expect_eq(sur_fires(cases[i].follows, cases[i].grad_mult, cases[i].sur_mult),
                     cases[i].fires, "case %zu: follows %d, gradient x%g, step x%g", i,
                     (int)cases[i].follows, cases[i].grad_mult, cases[i].sur_mult);
}

/* The optimizers whose step follows the gradient, by class name. */
Test(evaluate, optimizer_follows_grad_table)
{
    static const struct {
        const char *name;
        bool follows;
    } cases[] = {
        {"SGD", true},      {"sgd", true},     {"ASGD", true},  {"FusedSGD", true},
        {"SGDW", true},     {"AdamW", false},  {"Adam", false}, {"Lion", false},
        {"RMSprop", false}, {"SGDFoo", false}, {"", false},     {NULL, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        cr_expect_eq(eval_optimizer_follows_grad(cases[i].name), cases[i].follows, "%s",
                     cases[i].name ? cases[i].name : "(null)");
}

/* Muon and its variants orthogonalize each matrix's update (stage_hello
 * warns once per run: the Delta2 rules see little under it). */
Test(evaluate, optimizer_orthogonalizes_table)
{
    static const struct {
        const char *name;
        bool orthogonal;
    } cases[] = {
        {"Muon", true},
        {"muon", true},
        {"MuonWithAuxAdam", true},
        {"DistributedMuon", true},
        {"AdamW", false},
        {"SGD", false},
        {"Mu", false},
        {"", false},
        {NULL, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        cr_expect_eq(eval_optimizer_orthogonalizes(cases[i].name), cases[i].orthogonal, "%s",
                     cases[i].name ? cases[i].name : "(null)");
}

/* Attention evidence that opens while the loss has jumped (its incident
 * firing) is the jump's consequence: loss-spike. Open before the jump, it
 * is attention-numerics. */
Test(evaluate, attention_after_a_loss_jump_is_its_consequence)
{
    static const struct {
        int64_t cqk_from;
        enum alert_attribution want;
        const char *why;
    } cases[] = {
        {420, ALERT_ATTR_LOSS_SPIKE, "c_qk rises 20 steps after the loss jumped"},
        {360, ALERT_ATTR_ATTENTION_NUMERICS, "c_qk rose before the loss jumped"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        enum alert_attribution got = first_page_label("loss", true, cases[i].cqk_from, true);
        cr_expect_eq(got, cases[i].want, "%s: c_qk page labelled %s", cases[i].why,
                     (int)got < 0 ? "(no page)" : alert_attribution_name(got));
    }
}

/* A loss or gradient-norm page is explained only by mechanism evidence that
 * opened before it: a corrupted batch jolts the sketch that holds it, so a
 * c_qk breach opening with the spike is no cause (loss-spike), while one
 * open before the spike is (attention-numerics). */
Test(evaluate, a_spike_is_explained_only_by_earlier_evidence)
{
    static const struct {
        const char *symptom;
        int64_t cqk_from;
        enum alert_attribution want;
        const char *why;
    } cases[] = {
        {"loss", 10000, ALERT_ATTR_LOSS_SPIKE, "the spike alone"},
        {"loss", 400, ALERT_ATTR_LOSS_SPIKE, "c_qk opens at the spike's own step"},
        {"loss", 360, ALERT_ATTR_ATTENTION_NUMERICS, "c_qk open before the spike"},
        /* The gradient norm alone (no loss incident, so only the rule of
         * this test decides, not the loss-jump one). */
        {"grad_norm", 400, ALERT_ATTR_LOSS_SPIKE, "grad-norm spike with c_qk at its step"},
        {"grad_norm", 360, ALERT_ATTR_ATTENTION_NUMERICS, "c_qk open before the grad-norm spike"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        enum alert_attribution got =
            first_page_label(cases[i].symptom, false, cases[i].cqk_from, false);
        cr_expect_eq(got, cases[i].want, "%s: symptom page labelled %s", cases[i].why,
                     (int)got < 0 ? "(no page)" : alert_attribution_name(got));
    }
}

/* One single-sample fall of a Delta2 rank series to 1.3 (a relative breach
 * of size: the excess over rank one falls from about 2 to 0.3, under 30%
 * of it, above the rank-one floors). */
struct d2_dip {
    const char *rule; /* qk.d2.srank or qk.d2.erank */
    int32_t layer, window, rank;
    int64_t step;
};

/* The first step any Delta2 series fires at when every series of `dips`
 * (and layers 0 and 1's window-10 srank of rank 0) holds about 3 every 10
 * steps, except its one dip; -1: none by step 800. cross_layer_windows
 * `windows` on both rules. */
static int64_t dips_fire_at(const struct d2_dip *dips, size_t n, uint32_t windows)
{
    struct detect_rules rules;
    struct eval_run er;
    struct eval_batch b = {0};
    struct eval_track *t[12];
    const struct d2_dip *dip[12];
    size_t nt = 0;
    char v[16];
    detect_rules_default(&rules);
    snprintf(v, sizeof v, "%u", windows);
    cr_assert_eq(detect_rules_set(&rules, "qk.d2.srank", "cross_layer_windows", v, NULL), 0);
    cr_assert_eq(detect_rules_set(&rules, "qk.d2.erank", "cross_layer_windows", v, NULL), 0);
    eval_run_init(&er, &rules);
    static const struct d2_dip background[] = {{"qk.d2.srank", 0, 10, 0, -1},
                                               {"qk.d2.srank", 1, 10, 0, -1}};
    for (size_t i = 0; i < n + 2; i++) {
        const struct d2_dip *d = i < n ? &dips[i] : &background[i - n];
        struct store_series_key k = {"", d->layer, -1, d->window, d->rank};
        snprintf(k.name, sizeof k.name, "%s.min", d->rule);
        cr_assert_lt(nt, 12);
        dip[nt] = d;
        t[nt++] = eval_track_get(&er, &k, d->rule);
        cr_assert(t[nt - 1]);
    }
    uint64_t seed = 2718;
    int64_t fired = -1;
    for (int64_t s = 10; s <= 800 && fired < 0; s += 10) {
        for (size_t i = 0; i < nt; i++) {
            double x = dip[i]->step == s ? 1.3 : 3 * (1 + 0.02 * noise01(&seed));
            cr_assert_geq(eval_feed(&er, &b, t[i], (uint64_t)s, x, true, -1, 100, 0), 0);
        }
        label_and_note(&er, &b, &fired);
    }
    eval_batch_free(&b);
    eval_run_clear(&er);
    return fired;
}

/* A Delta2 breach of size confirmed by another layer's within two windows
 * fires at once (cross_layer_windows); a single one waits for its own
 * second sample, which a one-sample dip never gives. Nothing else
 * confirms: the same layer, the same sample, another window or rank, three
 * windows back, or the key set to 0. A deeper run needs one more other
 * layer for every 16 layers (EVAL_CROSS_LAYER_PER). */
Test(evaluate, d2_breaches_confirmed_across_layers)
{
    static const struct {
        const char *why;
        struct d2_dip dips[6];
        size_t n;
        uint32_t windows;
        int64_t want;
    } cases[] = {
        {"one layer's dip", {{"qk.d2.srank", 1, 10, 0, 500}}, 1, 2, -1},
        {"layer 1, then layer 0 two windows later",
         {{"qk.d2.srank", 1, 10, 0, 500}, {"qk.d2.srank", 0, 10, 0, 520}},
         2,
         2,
         520},
        {"layer 1, then layer 0 three windows later",
         {{"qk.d2.srank", 1, 10, 0, 500}, {"qk.d2.srank", 0, 10, 0, 530}},
         2,
         2,
         -1},
        {"three windows, the key at 3",
         {{"qk.d2.srank", 1, 10, 0, 500}, {"qk.d2.srank", 0, 10, 0, 530}},
         2,
         3,
         530},
        {"srank confirms erank",
         {{"qk.d2.srank", 1, 10, 0, 500}, {"qk.d2.erank", 2, 10, 0, 510}},
         2,
         2,
         510},
        {"two layers at one sample",
         {{"qk.d2.srank", 1, 10, 0, 500}, {"qk.d2.srank", 0, 10, 0, 500}},
         2,
         2,
         -1},
        {"the same layer twice, not in a row",
         {{"qk.d2.srank", 1, 10, 0, 500}, {"qk.d2.erank", 1, 10, 0, 520}},
         2,
         2,
         -1},
        {"another window",
         {{"qk.d2.srank", 1, 10, 0, 500}, {"qk.d2.srank", 0, 50, 0, 510}},
         2,
         2,
         -1},
        {"another rank",
         {{"qk.d2.srank", 1, 10, 0, 500}, {"qk.d2.srank", 0, 10, 1, 510}},
         2,
         2,
         -1},
        {"the key at 0",
         {{"qk.d2.srank", 1, 10, 0, 500}, {"qk.d2.srank", 0, 10, 0, 510}},
         2,
         0,
         -1},
        /* A 32-layer run (a series at layer 31 that never dips): three
         * other layers confirm, not one. */
        {"32 layers, one other layer",
         {{"qk.d2.srank", 31, 10, 0, -1},
          {"qk.d2.srank", 1, 10, 0, 500},
          {"qk.d2.srank", 0, 10, 0, 510}},
         3,
         2,
         -1},
        {"32 layers, three other layers",
         {{"qk.d2.srank", 31, 10, 0, -1},
          {"qk.d2.srank", 1, 10, 0, 500},
          {"qk.d2.srank", 2, 10, 0, 500},
          {"qk.d2.srank", 3, 10, 0, 510},
          {"qk.d2.srank", 0, 10, 0, 520}},
         5,
         2,
         520},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t got = dips_fire_at(cases[i].dips, cases[i].n, cases[i].windows);
        cr_expect_eq(got, cases[i].want, "%s: fired at %lld, want %lld", cases[i].why,
                     (long long)got, (long long)cases[i].want);
    }
}

/* The first step qk.d2.srank (layer 0, window 10) fires at in
 * first_firing_of's run: its Delta2 about 3 until `fall` and 1.3 from
 * there (a relative breach of size: the excess over rank one from 2 to
 * 0.3), the gradient norm about 1 until `rise` and `grad` times that from
 * there, early_grad_rise set to `key`; -1 when none fired by `until`. The
 * start of detection is at 900 (3 x the warm-up end). */
static int64_t early_fires_at(int64_t fall, int64_t rise, double grad, const char *key,
                              int64_t until)
{
    struct firing_run r = {
        "qk.d2.srank.min", "qk.d2.srank", 10, 3, 1.3, fall, until, rise, grad, key};
    return first_firing_of(&r);
}

/* Between the warm-up end (300) and the start (900) a Delta2 rank's
 * relative floor holds against its samples since the warm-up end, but
 * only while the gradient norm stands early_grad_rise (2) times its level
 * since then: an attention fault corrupts the backward pass, a healthy
 * change of the data (a longer sequence) moves Delta2 and not the
 * gradient. The gradient counts as risen once most of the last 5 steps
 * are (their median), and the breach fires on its second sample
 * (magnitude_persistence): the fall and the rise at 500 fire at 520. */
Test(evaluate, early_relative_floor_needs_the_gradient)
{
    static const struct {
        const char *why;
        int64_t fall, rise;
        double grad;
        const char *key;
        int64_t until, want;
    } cases[] = {
        {"collapse, gradient 4x", 500, 500, 4, "2", 1200, 520},
        {"collapse, gradient 4x two sketches later", 500, 520, 4, "2", 1200, 540},
        {"collapse, the gradient where it was", 500, 10000, 1, "2", 880, -1},
        {"collapse, gradient 1.5x", 500, 500, 1.5, "2", 880, -1},
        {"collapse, gradient 4x, the key off", 500, 500, 4, "none", 880, -1},
        {"no collapse, gradient 4x", 10000, 500, 4, "2", 1200, -1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t got = early_fires_at(cases[i].fall, cases[i].rise, cases[i].grad, cases[i].key,
                                     cases[i].until);
        cr_expect_eq(got, cases[i].want, "%s: fired at %lld, want %lld", cases[i].why,
                     (long long)got, (long long)cases[i].want);
    }
}

/* The label of the first `lr` page of a run with `layers` layers of Delta2
 * (qk.d2.srank.min, window 10, about 3 every 10 steps) whose logged rate
 * jumps 5x at step 401 for good (the page fires at 403, before the next
 * sketch), when the layers of `dips` fall to 1.3 (a breach of size) at
 * step 400, and with `twice` at 390 too (so their incidents fired at 400;
 * else they are pending). -1: no page by 450. */
static enum alert_attribution lr_page_label(int32_t layers, const int32_t *dips, size_t n_dips,
                                            bool twice)
{
    struct detect_rules rules;
    struct eval_run er;
    struct eval_batch b = {0};
    struct eval_track *d2[32];
    enum alert_attribution got = (enum alert_attribution) - 1;
    cr_assert_leq(layers, 32);
    detect_rules_default(&rules);
    eval_run_init(&er, &rules);
    struct store_series_key kl = {"lr", -1, -1, 0, 0};
    struct eval_track *tl = eval_track_get(&er, &kl, "lr");
    cr_assert(tl);
    for (int32_t l = 0; l < layers; l++) {
        struct store_series_key k = {"qk.d2.srank.min", l, -1, 10, -1};
        d2[l] = eval_track_get(&er, &k, "qk.d2.srank");
        cr_assert(d2[l]);
    }
    uint64_t seed = 4242;
    for (int64_t s = 1; s <= 450 && (int)got < 0; s++) {
        double lr = s <= 400 ? 1e-3 : 5e-3;
        cr_assert_geq(eval_feed(&er, &b, tl, (uint64_t)s, lr, true, -1, 200, 0), 0);
        for (int32_t l = 0; l < layers && s % 10 == 0; l++) {
            bool dip = false;
            for (size_t i = 0; i < n_dips; i++)
                dip = dip || (dips[i] == l && (s == 400 || (twice && s == 390)));
            double x = dip ? 1.3 : 3 * (1 + 0.02 * noise01(&seed));
            cr_assert_geq(eval_feed(&er, &b, d2[l], (uint64_t)s, x, true, -1, 200, 0), 0);
        }
        eval_label_all(&er, &b);
        note_first_label(&b, tl, &got);
        eval_batch_reset(&b);
    }
    eval_batch_free(&b);
    eval_run_clear(&er);
    return got;
}

/* A pending (unfired) Delta2 incident names a step-size page combined only
 * when open Delta2 incidents span 1 + layers / 16 layers (evaluate.c:
 * d2_pending_counts): one layer's lone dip in a deep model is noise. A
 * fired one always counts. */
Test(evaluate, pending_d2_evidence_needs_more_layers_at_depth)
{
    static const int32_t one[] = {3}, two[] = {3, 9};
    static const struct {
        int32_t layers;
        const int32_t *dips;
        size_t n;
        bool twice;
        enum alert_attribution want;
        const char *why;
    } cases[] = {
        {4, NULL, 0, false, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, "no dip"},
        {4, one, 1, false, ALERT_ATTR_COMBINED, "4 layers: one pending layer counts"},
        {15, one, 1, false, ALERT_ATTR_COMBINED, "15 layers: still one"},
        {24, one, 1, false, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, "24 layers: one is not enough"},
        {24, two, 2, false, ALERT_ATTR_COMBINED, "24 layers: two pending layers"},
        {24, one, 1, true, ALERT_ATTR_COMBINED, "24 layers: one fired incident"},
        {32, two, 2, false, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, "32 layers: three needed"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        enum alert_attribution got =
            lr_page_label(cases[i].layers, cases[i].dips, cases[i].n, cases[i].twice);
        cr_expect_eq(got, cases[i].want, "%s: lr page labelled %s", cases[i].why,
                     (int)got < 0 ? "(no page)" : alert_attribution_name(got));
    }
}
