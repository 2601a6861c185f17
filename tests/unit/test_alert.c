/* Unit tests for daemon/alert.c: lifecycle, identity, attribution, and the
 * detector + lifecycle together on synthetic series, with simulated
 * restarts. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "alert.h"
#include "detect.h"
#include "fstest.h"
#include "log.h"

/* ---- lifecycle on synthetic verdicts ---------------------------------------
 * Input letters: B breach (z), X non-finite, N normal, A absent.
 * Output letters per sample: P to_pending, F to_firing, R to_resolved,
 * I to_inactive, '.' none. */

static const struct lifecycle_case {
    const char *in, *out;
    uint32_t persistence, resolve_after;
} lifecycle_cases[] = {
    {"BBB", "P.F", 3, 5},
    {"BN", "PI", 3, 5},
    {"BBN", "P.I", 3, 5},
    {"BBNBBB", "P.IP.F", 3, 5},
    {"BBBNNNNN", "P.F....R", 3, 5},
    {"BBBNNNNBNNNNN", "P.F.........R", 3, 5},
    {"BBBNNNNNB", "P.F....RP", 3, 5},
    {"BBBNNNNNBBB", "P.F....RP.F", 3, 5},
    {"BBBNNNNNBN", "P.F....RPI", 3, 5},
    {"X", "F", 3, 5},
    {"BX", "PF", 3, 5},
    {"BBBX", "P.F.", 3, 5},
    {"XNNNNN", "F....R", 3, 5},
    {"BABAB", "P...F", 3, 5},
    {"BBBNANANANAN", "P.F........R", 3, 5},
    {"AAA", "...", 3, 5},
    {"NNN", "...", 3, 5},
    {"B", "F", 1, 5},
    {"BN", "FR", 1, 1},
    {"BNB", "FRF", 1, 1},
    {"BBBBBBB", "P.....F", 7, 5},
    {"BBNN", "PF.R", 2, 2},
};

static struct detect_verdict verdict_for(char c, double value)
{
    struct detect_verdict v = {0};
    v.present = c != 'A';
    v.value = value;
    v.median = 10;
    v.mad = 1;
    v.z = (c == 'B') ? -9 : 0.1;
    if (c == 'B') {
        v.breach = true;
        v.breach_kind = DETECT_BREACH_Z;
    } else if (c == 'X') {
        v.breach = true;
        v.non_finite = true;
        v.breach_kind = DETECT_BREACH_NONFINITE;
        v.value = NAN;
    }
    return v;
}

static char change_letter(enum alert_change c)
{
    switch (c) {
    case ALERT_CHANGE_NONE:
        return '.';
    case ALERT_CHANGE_TO_PENDING:
        return 'P';
    case ALERT_CHANGE_TO_FIRING:
        return 'F';
    case ALERT_CHANGE_TO_RESOLVED:
        return 'R';
    case ALERT_CHANGE_TO_INACTIVE:
        return 'I';
    case ALERT_CHANGE_TO_SUPERSEDED:
        return 'S'; /* never from alert_step */
    }
    return '?';
}

Test(alert_lifecycle, table)
{
    for (size_t i = 0; i < sizeof lifecycle_cases / sizeof lifecycle_cases[0]; i++) {
        const struct lifecycle_case *c = &lifecycle_cases[i];
        struct detect_rule r = rule_named("qk.d2.erank");
        r.persistence = c->persistence;
        r.resolve_after = c->resolve_after;
        struct alert_state st;
        alert_state_init(&st);
        /* Window 1: every sample is an independent window (the windowed
         * persistence has its own table below). */
        struct alert_scope scope = {.layer = 3, .head = 1, .window = 1, .rank = -1};
        char got[64] = {0};
        size_t n = strlen(c->in);
        cr_assert_lt(n, sizeof got);
        for (size_t k = 0; k < n; k++) {
            struct detect_verdict v = verdict_for(c->in[k], (double)k);
            struct alert_transition tr;
            cr_assert_eq(alert_step(&st, &r, &scope, &v, (int64_t)(1000 + k), 5.0 + k, &tr), 0);
            got[k] = change_letter(tr.change);
            cr_assert_eq(tr.to, st.state);
            if (tr.change != ALERT_CHANGE_NONE) {
                cr_assert_neq(tr.from, tr.to);
                cr_assert_eq(st.since, 5.0 + k);
            }
        }
        cr_assert_str_eq(got, c->out, "case %zu (%s): got %s want %s", i, c->in, got, c->out);
    }
}

/* Persistence over overlapping windows: samples `spacing` steps apart of a
 * Delta over `window` steps must span (persistence - 1) windows, so three
 * samples of one transient a window long never confirm it. Letters as
 * above; scalars (window 0) count samples only. */
static const struct {
    const char *in, *out;
    int32_t window;
    int64_t spacing;
    uint32_t persistence;
} windowed_cases[] = {
    {"BBB", "P.F", 25, 25, 3},                              /* disjoint windows: samples suffice */
    {"BBBBBBBBBBB", "P.........F", 25, 5, 3},               /* 50 steps after the first breach */
    {"BBBBBBNBBBBBBBBBBB", "P.....IP.........F", 25, 5, 3}, /* a normal sample restarts */
    {"BBBBBB", "P.....", 25, 5, 3},  /* a 25-step transient: never confirmed */
    {"BBBBBB", "P....F", 50, 10, 2}, /* one more window */
    {"BBB", "P.F", 0, 5, 3},         /* a scalar: samples only */
    {"BBB", "P.F", 5, 10, 3},        /* gaps between windows */
    {"BX", "PF", 25, 5, 3},          /* non-finite pages at once */
};

Test(alert_lifecycle, windowed_persistence)
{
    for (size_t i = 0; i < sizeof windowed_cases / sizeof windowed_cases[0]; i++) {
        struct detect_rule r = rule_named("qk.d2.erank");
        r.persistence = windowed_cases[i].persistence;
        struct alert_state st;
        alert_state_init(&st);
        struct alert_scope scope = {
            .layer = 0, .head = -1, .window = windowed_cases[i].window, .rank = -1};
        char got[64] = {0};
        size_t n = strlen(windowed_cases[i].in);
        for (size_t k = 0; k < n; k++) {
            struct detect_verdict v = verdict_for(windowed_cases[i].in[k], (double)k);
            struct alert_transition tr;
            int64_t step = 100 + (int64_t)k * windowed_cases[i].spacing;
            cr_assert_eq(alert_step(&st, &r, &scope, &v, step, 0, &tr), 0);
            got[k] = change_letter(tr.change);
        }
        cr_assert_str_eq(got, windowed_cases[i].out, "case %zu (%s, window %d every %lld)", i,
                         windowed_cases[i].in, windowed_cases[i].window,
                         (long long)windowed_cases[i].spacing);
    }
}

/* Non-finite values per rule (nonfinite_persistence): the loss pages at
 * once; the gradient norm of a loss scaler's skipped overflows (an inf for
 * a step, a burst of three) does not, 32 in a row does. Letters as above,
 * one sample a step. */
static const struct {
    const char *rule, *in, *out;
} nonfinite_cases[] = {
    {"loss", "NX", ".F"},
    {"grad_norm", "NXN", ".PI"},
    {"grad_norm", "NXXXNN", ".P..I."},
    {"grad_norm", "XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX",
     "P"
     ".............................."
     "F"},
    {"grad_norm", "XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXN",
     "P"
     ".............................."
     "I"},
};

Test(alert_lifecycle, nonfinite_persistence_by_rule)
{
    for (size_t i = 0; i < sizeof nonfinite_cases / sizeof nonfinite_cases[0]; i++) {
        struct detect_rule r = rule_named(nonfinite_cases[i].rule);
        struct alert_state st;
        alert_state_init(&st);
        struct alert_scope scope = {.layer = -1, .head = -1, .window = 0, .rank = 0};
        char got[64] = {0};
        size_t n = strlen(nonfinite_cases[i].in);
        cr_assert_lt(n, sizeof got);
        for (size_t k = 0; k < n; k++) {
            struct detect_verdict v = verdict_for(nonfinite_cases[i].in[k], (double)k);
            struct alert_transition tr;
            cr_assert_eq(alert_step(&st, &r, &scope, &v, 100 + (int64_t)k, 0, &tr), 0);
            got[k] = change_letter(tr.change);
            if (tr.change == ALERT_CHANGE_TO_FIRING)
                cr_assert_eq(tr.severity, DETECT_SEVERITY_CRITICAL, "case %zu", i);
        }
        cr_assert_str_eq(got, nonfinite_cases[i].out, "case %zu (%s %s)", i,
                         nonfinite_cases[i].rule, nonfinite_cases[i].in);
    }
}

Test(alert_lifecycle, evidence_on_firing_and_resolve)
{
    struct detect_rule r = rule_named("qk.d2.erank");
    struct alert_state st;
    alert_state_init(&st);
    struct alert_scope scope = {.layer = 7, .head = 2, .window = 1, .rank = -1};
    struct alert_transition tr;
    struct detect_verdict b = verdict_for('B', 1.25), n = verdict_for('N', 20);
    b.median = 19.5;
    b.mad = 0.25;
    b.z = -49.9;

    alert_step(&st, &r, &scope, &b, 500, 1.0, &tr);
    cr_assert_eq(tr.change, ALERT_CHANGE_TO_PENDING);
    cr_assert_eq(tr.first_breach_step, 500);
    cr_assert_eq(tr.fired_step, -1);
    alert_step(&st, &r, &scope, &b, 501, 2.0, &tr);
    alert_step(&st, &r, &scope, &b, 502, 3.0, &tr);
    cr_assert_eq(tr.change, ALERT_CHANGE_TO_FIRING);
    cr_assert_eq(tr.from, ALERT_PENDING);
    cr_assert_eq(tr.to, ALERT_FIRING);
    cr_assert_str_eq(tr.rule, "qk.d2.erank");
    cr_assert_eq(tr.family, DETECT_FAMILY_ATTENTION_D2);
    cr_assert_eq(tr.severity, DETECT_SEVERITY_WARNING);
    cr_assert_eq(tr.breach_kind, DETECT_BREACH_Z);
    cr_assert_eq(tr.scope.layer, 7);
    cr_assert_eq(tr.scope.head, 2);
    cr_assert_eq(tr.scope.window, 1);
    cr_assert_eq(tr.scope.rank, -1);
    cr_assert_eq(tr.step, 502);
    cr_assert_eq(tr.time, 3.0);
    cr_assert_eq(tr.value, 1.25);
    cr_assert_eq(tr.median, 19.5);
    cr_assert_eq(tr.mad, 0.25);
    cr_assert_eq(tr.z, -49.9);
    cr_assert_eq(tr.first_breach_step, 500);
    cr_assert_eq(tr.fired_step, 502);
    cr_assert_eq(tr.incident, 1);
    cr_assert(alert_is_open(&st));

    for (int i = 0; i < 5; i++)
        alert_step(&st, &r, &scope, &n, 503 + i, 4.0 + i, &tr);
    cr_assert_eq(tr.change, ALERT_CHANGE_TO_RESOLVED);
    cr_assert_eq(tr.step, 507);
    cr_assert_eq(tr.first_breach_step, 500);
    cr_assert_eq(tr.fired_step, 502);
    cr_assert_eq(st.resolved_step, 507);
    cr_assert_not(alert_is_open(&st));

    /* A new incident gets a new number and forgets the old steps. */
    alert_step(&st, &r, &scope, &b, 600, 9.0, &tr);
    cr_assert_eq(tr.change, ALERT_CHANGE_TO_PENDING);
    cr_assert_eq(tr.first_breach_step, 600);
    cr_assert_eq(tr.fired_step, -1);
    alert_step(&st, &r, &scope, &b, 601, 9.0, &tr);
    alert_step(&st, &r, &scope, &b, 602, 9.0, &tr);
    cr_assert_eq(tr.incident, 2);
}

Test(alert_lifecycle, nonfinite_is_critical_even_for_warning_rules)
{
    struct detect_rule r = rule_named("loss");
    cr_assert_eq(r.severity, DETECT_SEVERITY_WARNING);
    struct alert_state st;
    alert_state_init(&st);
    struct alert_scope scope = ALERT_SCOPE_NONE;
    struct alert_transition tr;
    struct detect_verdict x = verdict_for('X', 0);
    alert_step(&st, &r, &scope, &x, 42, 0, &tr);
    cr_assert_eq(tr.change, ALERT_CHANGE_TO_FIRING);
    cr_assert_eq(tr.severity, DETECT_SEVERITY_CRITICAL);
    cr_assert(tr.non_finite);
    cr_assert_eq(tr.breach_kind, DETECT_BREACH_NONFINITE);
    struct alert_evidence e;
    alert_evidence_init(&e);
    cr_assert(alert_evidence_add(&e, &st, r.family));
    cr_assert(e.nonfinite);
    cr_assert_eq(e.first[DETECT_FAMILY_SCALAR_LOSS], 42);
    /* The next incident, from a plain breach, is back to the rule's severity. */
    struct detect_verdict n = verdict_for('N', 1), b = verdict_for('B', 9);
    for (int i = 0; i < 5; i++)
        alert_step(&st, &r, &scope, &n, 43 + i, 0, &tr);
    cr_assert_eq(tr.change, ALERT_CHANGE_TO_RESOLVED);
    alert_evidence_init(&e);
    cr_assert_not(alert_evidence_add(&e, &st, r.family), "a resolved alert is no evidence");
    cr_assert_eq(e.first[DETECT_FAMILY_SCALAR_LOSS], -1);
    alert_step(&st, &r, &scope, &b, 60, 0, &tr);
    cr_assert_eq(tr.change, ALERT_CHANGE_TO_PENDING); /* persistence 3 */
    alert_step(&st, &r, &scope, &b, 61, 0, &tr);
    alert_step(&st, &r, &scope, &b, 62, 0, &tr);
    cr_assert_eq(tr.change, ALERT_CHANGE_TO_FIRING);
    cr_assert_eq(tr.severity, DETECT_SEVERITY_WARNING);
    alert_evidence_init(&e);
    cr_assert(alert_evidence_add(&e, &st, r.family));
    cr_assert_not(e.nonfinite);
    cr_assert_eq(e.first[DETECT_FAMILY_SCALAR_LOSS], 60);
}

Test(alert_lifecycle, null_arguments)
{
    struct detect_rule r = rule_named("loss");
    struct alert_state st;
    alert_state_init(&st);
    struct alert_scope scope = ALERT_SCOPE_NONE;
    struct detect_verdict v = verdict_for('N', 1);
    struct alert_transition tr;
    cr_assert_eq(alert_step(NULL, &r, &scope, &v, 0, 0, &tr), -EINVAL);
    cr_assert_eq(alert_step(&st, NULL, &scope, &v, 0, 0, &tr), -EINVAL);
    cr_assert_eq(alert_step(&st, &r, NULL, &v, 0, 0, &tr), -EINVAL);
    cr_assert_eq(alert_step(&st, &r, &scope, NULL, 0, 0, &tr), -EINVAL);
    cr_assert_eq(alert_step(&st, &r, &scope, &v, 0, 0, NULL), -EINVAL);
    cr_assert_not(alert_is_open(NULL));
}

/* ---- attribution ----------------------------------------------------------- */

/* Evidence as first-breach steps per family (-1: none open), in the
 * order attention_d2, router_weight, weight_norm, router_balance,
 * scalar_loss, step_size (enum detect_family). */
#define _ -1
static const struct {
    int64_t first[DETECT_FAMILY_COUNT];
    bool nonfinite;
    enum alert_attribution want;
    const char *why;
} attribution_cases[] = {
    {{_, _, _, _, _, _}, false, ALERT_ATTR_NONE, "nothing open"},
    {{100, _, _, _, _, _}, false, ALERT_ATTR_ATTENTION_NUMERICS, "Delta2 alone"},
    {{100, _, 90, _, _, _},
     false,
     ALERT_ATTR_ATTENTION_NUMERICS,
     "weight norms grow under the attention fault: no optimizer evidence"},
    {{100, _, 90, 95, 120, _}, false, ALERT_ATTR_ATTENTION_NUMERICS, "symptoms follow"},
    {{100, _, _, _, _, 130},
     false,
     ALERT_ATTR_COMBINED,
     "the learning rate rises after the Delta2 collapse: a second, independent fault"},
    {{100, 140, _, _, _, _},
     false,
     ALERT_ATTR_ATTENTION_NUMERICS,
     "router growth after the Delta2 collapse: the model degrading"},
    {{100, 140, _, _, _, 160}, false, ALERT_ATTR_COMBINED, "router growth, then the rate rises"},
    {{100, _, _, _, _, 60},
     false,
     ALERT_ATTR_OPTIMIZER_HYPERPARAMETER,
     "too large a step first, then Delta2: the collapse may be its consequence"},
    /* At once: the step size explains both (a too-large step collapses
     * Delta2 within a sketch; the reverse does not happen). */
    {{100, 100, _, _, _, _}, false, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, "both at once"},
    {{100, _, _, _, _, 100},
     false,
     ALERT_ATTR_OPTIMIZER_HYPERPARAMETER,
     "rate and collapse at once"},
    {{100, 80, _, _, _, 130}, false, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, "router first"},
    {{_, 50, _, _, _, _}, false, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, "router weights"},
    {{_, _, _, _, _, 50}, false, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, "update ratio"},
    {{_, 70, 40, 60, 80, 50}, false, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, "with symptoms"},
    {{_, _, 40, _, _, _}, false, ALERT_ATTR_NONE, "weight growth alone names no mechanism"},
    {{_, _, 40, 60, _, _}, false, ALERT_ATTR_ROUTER_BALANCE, "balance"},
    {{_, _, _, 60, 30, _}, false, ALERT_ATTR_ROUTER_BALANCE, "balance before loss"},
    {{_, _, _, _, 30, _}, false, ALERT_ATTR_LOSS_SPIKE, "loss alone"},
    {{_, _, _, _, 30, _}, true, ALERT_ATTR_NON_FINITE, "NaN loss"},
    {{100, 80, 90, 95, 120, 60}, true, ALERT_ATTR_NON_FINITE, "NaN explains everything"},
};
#undef _

Test(alert_attribution, table)
{
    for (size_t i = 0; i < sizeof attribution_cases / sizeof attribution_cases[0]; i++) {
        struct alert_evidence e;
        alert_evidence_init(&e);
        memcpy(e.first, attribution_cases[i].first, sizeof e.first);
        e.nonfinite = attribution_cases[i].nonfinite;
        enum alert_attribution got = alert_attribute(&e);
        cr_assert_eq(got, attribution_cases[i].want, "case %zu (%s): got %s", i,
                     attribution_cases[i].why, alert_attribution_name(got));
    }
}

/* alert_evidence_add keeps the earliest open incident of each family and
 * ignores closed ones, whatever order alerts are added in. */
Test(alert_attribution, evidence_keeps_the_earliest_open_incident)
{
    struct alert_state a, b, closed;
    alert_state_init(&a);
    alert_state_init(&b);
    alert_state_init(&closed);
    a.state = ALERT_FIRING;
    a.first_breach_step = 120;
    b.state = ALERT_PENDING;
    b.first_breach_step = 90;
    closed.state = ALERT_RESOLVED;
    closed.first_breach_step = 10;
    const struct alert_state *orders[2][3] = {{&a, &b, &closed}, {&closed, &b, &a}};
    for (int o = 0; o < 2; o++) {
        struct alert_evidence e;
        alert_evidence_init(&e);
        for (int i = 0; i < 3; i++)
            alert_evidence_add(&e, orders[o][i], DETECT_FAMILY_ATTENTION_D2);
        cr_assert_eq(e.first[DETECT_FAMILY_ATTENTION_D2], 90, "order %d", o);
        cr_assert_eq(e.first[DETECT_FAMILY_ROUTER_WEIGHT], -1);
    }
}

Test(alert_attribution, every_evidence_set_is_labelled_consistently)
{
    /* Every family set, each open family at step 10 or 20, with and without
     * a non-finite value: invariants stated independently of the
     * implementation's if-chain. */
    for (uint32_t m = 0; m < (1u << DETECT_FAMILY_COUNT); m++) {
        for (uint32_t late = 0; late < (1u << DETECT_FAMILY_COUNT); late++) {
            if (late & ~m)
                continue;
            for (int nf = 0; nf < 2; nf++) {
                struct alert_evidence e;
                alert_evidence_init(&e);
                for (unsigned f = 0; f < DETECT_FAMILY_COUNT; f++)
                    if (m & (1u << f))
                        e.first[f] = (late & (1u << f)) ? 20 : 10;
                e.nonfinite = nf;
                int64_t d2 = e.first[DETECT_FAMILY_ATTENTION_D2];
                int64_t rw = e.first[DETECT_FAMILY_ROUTER_WEIGHT];
                int64_t lr = e.first[DETECT_FAMILY_STEP_SIZE];
                int64_t opt = rw < 0 ? lr : lr < 0 ? rw : (rw < lr ? rw : lr);
                bool rb = e.first[DETECT_FAMILY_ROUTER_BALANCE] >= 0;
                bool ls = e.first[DETECT_FAMILY_SCALAR_LOSS] >= 0;
                enum alert_attribution want = nf ? ALERT_ATTR_NON_FINITE
                                              : d2 >= 0 && opt >= 0
                                                  ? (opt <= d2 ? ALERT_ATTR_OPTIMIZER_HYPERPARAMETER
                                                     : lr >= 0 ? ALERT_ATTR_COMBINED
                                                               : ALERT_ATTR_ATTENTION_NUMERICS)
                                              : d2 >= 0  ? ALERT_ATTR_ATTENTION_NUMERICS
                                              : opt >= 0 ? ALERT_ATTR_OPTIMIZER_HYPERPARAMETER
                                              : rb       ? ALERT_ATTR_ROUTER_BALANCE
                                              : ls       ? ALERT_ATTR_LOSS_SPIKE
                                                         : ALERT_ATTR_NONE;
                enum alert_attribution a = alert_attribute(&e);
                cr_assert_eq(a, want, "families %#x late %#x nf %d", m, late, nf);
                cr_assert_str_neq(alert_attribution_name(a), "unknown");
            }
        }
    }
    cr_assert_str_eq(alert_attribution_name((enum alert_attribution)77), "unknown");
}

/* ---- identity ---------------------------------------------------------------- */

Test(alert_identity, key_format_is_stable)
{
    char key[ALERT_KEY_MAX], dedup[ALERT_DEDUP_MAX];
    struct alert_scope scope = {.layer = 3, .head = 5, .window = 100, .rank = -1};
    int n = alert_key("run-7", "qk.d2.erank", &scope, key, sizeof key);
    cr_assert_str_eq(key, "run=run-7,rule=qk.d2.erank,layer=3,head=5,window=100,rank=-1");
    cr_assert_eq(n, (int)strlen(key));
    cr_assert_eq(alert_dedup_key(key, dedup, sizeof dedup), 0);
    /* Pinned (FNV-1a 64 of the key, computed outside the code under test):
     * a change here breaks dedup across an upgrade. */
    cr_assert_str_eq(dedup, "fs-5b05534ee1ee37ea");
    cr_assert_eq(strlen(dedup), 19);
    cr_assert_eq(strncmp(dedup, "fs-", 3), 0);
    /* Same inputs, same keys, every time (no process state involved). */
    char key2[ALERT_KEY_MAX], dedup2[ALERT_DEDUP_MAX];
    alert_key("run-7", "qk.d2.erank", &scope, key2, sizeof key2);
    alert_dedup_key(key2, dedup2, sizeof dedup2);
    cr_assert_str_eq(key, key2);
    cr_assert_str_eq(dedup, dedup2);

    struct alert_scope none = ALERT_SCOPE_NONE;
    alert_key("r", "loss", &none, key, sizeof key);
    cr_assert_str_eq(key, "run=r,rule=loss,layer=-1,head=-1,window=0,rank=-1");
}

Test(alert_identity, keys_distinct_across_scopes_runs_rules)
{
    static const struct {
        const char *run, *rule;
        struct alert_scope scope;
    } ids[] = {
        {"run", "qk.d2.erank", {3, 5, 100, -1}},
        {"run", "qk.d2.erank", {3, 5, 10, -1}},
        {"run", "qk.d2.erank", {3, 4, 100, -1}},
        {"run", "qk.d2.erank", {5, 3, 100, -1}},
        {"run", "qk.d2.erank", {-1, -1, 0, -1}},
        {"run", "qk.d2.erank", {-1, -1, 0, 0}},
        {"run", "qk.d2.srank", {3, 5, 100, -1}},
        {"run2", "qk.d2.erank", {3, 5, 100, -1}},
        {"run,rule=qk.d2.erank", "x", {3, 5, 100, -1}},
        {"run", "x,rule=qk.d2.erank", {3, 5, 100, -1}},
        {"a%2C", "b", {-1, -1, 0, -1}},
        {"a,", "b", {-1, -1, 0, -1}},
        {"loss", "run", {-1, -1, 0, 1}},
        {"loss", "run", {-1, -1, 0, 2}},
    };
    enum { N = sizeof ids / sizeof ids[0] };
    char keys[N][ALERT_KEY_MAX], dedups[N][ALERT_DEDUP_MAX];
    for (size_t i = 0; i < N; i++) {
        cr_assert_gt(alert_key(ids[i].run, ids[i].rule, &ids[i].scope, keys[i], ALERT_KEY_MAX), 0);
        cr_assert_eq(alert_dedup_key(keys[i], dedups[i], ALERT_DEDUP_MAX), 0);
    }
    for (size_t i = 0; i < N; i++)
        for (size_t j = 0; j < i; j++) {
            cr_assert_str_neq(keys[i], keys[j], "%zu vs %zu", i, j);
            cr_assert_str_neq(dedups[i], dedups[j], "%zu vs %zu", i, j);
        }
    cr_assert_str_eq(keys[8], "run=run%2Crule%3Dqk.d2.erank,rule=x,layer=3,head=5,window=100,"
                              "rank=-1");
}

Test(alert_identity, key_limits)
{
    char run[ALERT_RUN_MAX + 2];
    memset(run, ',', sizeof run);
    run[ALERT_RUN_MAX] = '\0'; /* longest accepted, every byte escaped */
    char rule[DETECT_NAME_MAX];
    memset(rule, '=', sizeof rule);
    rule[DETECT_NAME_MAX - 1] = '\0';
    struct alert_scope big = {
        .layer = INT32_MIN, .head = INT32_MIN, .window = INT32_MIN, .rank = INT32_MIN};
    char key[ALERT_KEY_MAX];
    int n = alert_key(run, rule, &big, key, sizeof key);
    cr_assert_gt(n, 0, "ALERT_KEY_MAX must fit the worst case (rc %d)", n);
    cr_assert_eq((size_t)n, strlen(key));
    cr_assert_eq(alert_key(run, rule, &big, key, (size_t)n), -ENOSPC);
    cr_assert_eq(key[0], '\0');
    cr_assert_eq(alert_key(run, rule, &big, key, (size_t)n + 1), n);
    cr_assert_eq(alert_key(run, rule, &big, key, 0), -ENOSPC);

    run[ALERT_RUN_MAX] = ',';
    run[ALERT_RUN_MAX + 1] = '\0';
    cr_assert_eq(alert_key(run, "loss", &big, key, sizeof key), -EINVAL);
    char longrule[DETECT_NAME_MAX + 1];
    memset(longrule, 'r', sizeof longrule);
    longrule[DETECT_NAME_MAX] = '\0';
    cr_assert_eq(alert_key("run", longrule, &big, key, sizeof key), -EINVAL);
    cr_assert_eq(alert_key(NULL, "loss", &big, key, sizeof key), -EINVAL);

    char dedup[ALERT_DEDUP_MAX];
    cr_assert_eq(alert_dedup_key("k", dedup, ALERT_DEDUP_MAX - 1), -ENOSPC);
    cr_assert_eq(alert_dedup_key(NULL, dedup, sizeof dedup), -EINVAL);
}

/* ---- alert state blobs --------------------------------------------------------- */

Test(alert_state, encode_decode_roundtrip_and_rejects)
{
    struct detect_rule r = rule_named("qk.d2.erank");
    struct alert_state st;
    alert_state_init(&st);
    struct alert_scope scope = ALERT_SCOPE_NONE;
    struct alert_transition tr;
    struct detect_verdict b = verdict_for('B', 1), x = verdict_for('X', 0);
    alert_step(&st, &r, &scope, &b, 10, 123.5, &tr);
    alert_step(&st, &r, &scope, &x, 11, 124.5, &tr);
    cr_assert_eq(st.state, ALERT_FIRING);

    uint8_t blob[ALERT_STATE_ENCODED_BYTES];
    cr_assert_eq(alert_state_encode(&st, blob, sizeof blob - 1), -ENOSPC);
    cr_assert_eq(alert_state_encode(&st, blob, sizeof blob), ALERT_STATE_ENCODED_BYTES);
    struct alert_state back;
    cr_assert_eq(alert_state_decode(&back, blob, sizeof blob), 0);
    cr_assert_eq(back.state, st.state);
    cr_assert_eq(back.severity, st.severity);
    cr_assert_eq(back.breach_kind, st.breach_kind);
    cr_assert_eq(back.nonfinite, st.nonfinite);
    cr_assert_eq(back.breach_run, st.breach_run);
    cr_assert_eq(back.normal_run, st.normal_run);
    cr_assert_eq(back.first_breach_step, 10);
    cr_assert_eq(back.fired_step, 11);
    cr_assert_eq(back.resolved_step, -1);
    cr_assert_eq(back.since, 124.5);
    cr_assert_eq(back.incidents, 1);

    static const struct {
        size_t offset;
        uint8_t value;
        int rc;
    } cases[] = {
        {0, 'X', -EINVAL},           /* magic */
        {4, 9, -ENOTSUP},            /* version */
        {6, 4, -EINVAL},             /* state out of range */
        {7, 2, -EINVAL},             /* severity out of range */
        {8, 9, -EINVAL},             /* breach kind out of range */
        {9, 2, -EINVAL},             /* flags */
        {10, 1, -EINVAL},            /* reserved */
        {6, ALERT_PENDING, -EINVAL}, /* pending with breach_run... (see below) */
    };
    struct alert_state sentinel;
    memset(&sentinel, 0x5A, sizeof sentinel);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        uint8_t bad[ALERT_STATE_ENCODED_BYTES];
        memcpy(bad, blob, sizeof bad);
        bad[cases[c].offset] = cases[c].value;
        if (c == 7) /* pending with no breach run is impossible */
            memset(bad + 12, 0, 4);
        back = sentinel;
        cr_assert_eq(alert_state_decode(&back, bad, sizeof bad), cases[c].rc, "case %zu", c);
        cr_assert(memcmp(&back, &sentinel, sizeof back) == 0, "case %zu touched state", c);
    }
    cr_assert_eq(alert_state_decode(&back, blob, sizeof blob - 1), -EINVAL);
    cr_assert_eq(alert_state_decode(&back, blob, 0), -EINVAL);
}

/* One name table per enum, in its module: every value's name parses back
 * to it, for the attribution (alert.c), the severity (detect.c) and the
 * log level (log.c); other text, a prefix or a longer word does not. */
Test(alert_names, names_round_trip)
{
    for (int a = 0; a < ALERT_ATTR_COUNT; a++) {
        const char *name = alert_attribution_name((enum alert_attribution)a);
        enum alert_attribution back = (enum alert_attribution) - 1;
        cr_assert_str_neq(name, "unknown");
        cr_assert_eq(alert_attribution_parse(name, strlen(name), &back), 0, "%s", name);
        cr_assert_eq(back, a, "%s", name);
    }
    enum alert_attribution a;
    cr_assert_eq(alert_attribution_parse("loss-spike.critical", 10, &a), 0);
    cr_assert_eq(a, ALERT_ATTR_LOSS_SPIKE);
    static const char *const bad[] = {"", "loss", "loss-spikes", "Loss-spike", "unknown"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        cr_assert_eq(alert_attribution_parse(bad[i], strlen(bad[i]), &a), -EINVAL, "%s", bad[i]);
    cr_assert_eq(alert_attribution_parse(NULL, 0, &a), -EINVAL);

    for (int s = 0; s <= DETECT_SEVERITY_CRITICAL; s++) {
        const char *name = detect_severity_name((enum detect_severity)s);
        enum detect_severity back = (enum detect_severity) - 1;
        cr_assert_str_eq(name, detect_severity_names[s]);
        cr_assert_eq(detect_severity_parse(name, strlen(name), &back), 0, "%s", name);
        cr_assert_eq(back, s, "%s", name);
    }
    cr_assert_null(detect_severity_names[DETECT_SEVERITY_CRITICAL + 1]);
    enum detect_severity sv;
    cr_assert_eq(detect_severity_parse("warn", 4, &sv), -EINVAL);
    cr_assert_eq(detect_severity_parse("critical!", 9, &sv), -EINVAL);
    cr_assert_str_eq(detect_severity_name((enum detect_severity)5), "unknown");

    for (int l = LOG_LEVEL_DEBUG; l <= LOG_LEVEL_ERROR; l++) {
        enum log_level back;
        cr_assert_str_eq(log_level_name((enum log_level)l), log_level_names[l]);
        cr_assert_eq(log_level_parse(log_level_names[l], &back), 0);
        cr_assert_eq(back, l);
    }
    cr_assert_null(log_level_names[LOG_LEVEL_ERROR + 1]);
    enum log_level lv;
    cr_assert_eq(log_level_parse("verbose", &lv), -EINVAL);
}

Test(alert_names, names)
{
    cr_assert_str_eq(alert_state_name(ALERT_INACTIVE), "inactive");
    cr_assert_str_eq(alert_state_name(ALERT_PENDING), "pending");
    cr_assert_str_eq(alert_state_name(ALERT_FIRING), "firing");
    cr_assert_str_eq(alert_state_name(ALERT_RESOLVED), "resolved");
    cr_assert_str_eq(alert_state_name((enum alert_state_id)9), "unknown");
    cr_assert_str_eq(alert_change_name(ALERT_CHANGE_TO_RESOLVED), "to_resolved");
    cr_assert_str_eq(alert_change_name(ALERT_CHANGE_TO_INACTIVE), "to_inactive");
    /* Pinned numbers. */
    cr_assert_eq(ALERT_INACTIVE, 0);
    cr_assert_eq(ALERT_PENDING, 1);
    cr_assert_eq(ALERT_FIRING, 2);
    cr_assert_eq(ALERT_RESOLVED, 3);
}

/* ---- scenarios: detector + lifecycle + attribution, with restarts ---------------
 * Every series is deterministic: uniform noise from a per-series xorshift. */

typedef double (*gen_fn)(int64_t step, double noise, bool *present);

static double erank_healthy(int64_t s, double u, bool *p)
{
    (void)s;
    (void)p;
    return 20 + 0.5 * u;
}
/* Two samples far beyond z but above 30% of the excess over rank one
 * (the relative floor): not a breach of size, so 3 are needed. */
static double erank_dip2(int64_t s, double u, bool *p)
{
    return (s == 100 || s == 101) ? 8.0 : erank_healthy(s, u, p);
}
/* Two samples near rank one (5% of the excess): a collapse of size. */
static double erank_drop2(int64_t s, double u, bool *p)
{
    return (s == 100 || s == 101) ? 2.0 : erank_healthy(s, u, p);
}
/* A noise-wide head (srank 3 +- 1.2, robust SD 0.9) dipping twice to 1.5:
 * below its relative floor (1 + 0.3 x 2 = 1.6) but within 2.5 robust SDs
 * of its median (DETECT_SIZE_NOISE_Z), where its own noise reaches: not a
 * breach of size, so two do not fire. The same dips on a quiet head do
 * (erank_drop2). */
static double srank_noisy_dip2(int64_t s, double u, bool *p)
{
    (void)p;
    return (s == 100 || s == 101) ? 1.5 : 3.0 + 1.2 * u;
}
/* The gradient norm of a noise-dominated run: a batch halved at step 100
 * lifts it by sqrt(2) for good (healthy), a fault lifts it 2.5x. */
static double gn_batch_halved(int64_t s, double u, bool *p)
{
    (void)p;
    return (s >= 100 ? 0.56 * 1.41 : 0.56) * (1 + 0.05 * u);
}
static double gn_fault(int64_t s, double u, bool *p)
{
    (void)p;
    return (s >= 100 ? 0.56 * 2.5 : 0.56) * (1 + 0.05 * u);
}
static double erank_dip1(int64_t s, double u, bool *p)
{
    return s == 100 ? 2.0 : erank_healthy(s, u, p);
}
/* Collapse towards rank 1 (below the 1.2 floor) for 30 steps, then recovery. */
static double erank_collapse(int64_t s, double u, bool *p)
{
    return (s >= 120 && s < 150) ? 1.1 + 0.05 * u : erank_healthy(s, u, p);
}
static double erank_collapse_from_100(int64_t s, double u, bool *p)
{
    return s >= 100 ? 1.1 + 0.05 * u : erank_healthy(s, u, p);
}
/* A layer's update-to-weight ratio: flat around 0.04, then the effective
 * step triples at step 100 (a too-large LR the logged rate does not show),
 * or rises by 60% (about what the attention fault does: z-sized, not a
 * multiple). */
static double ur_triple(int64_t s, double u, bool *p)
{
    (void)p;
    return (s >= 100 ? 0.13 : 0.04) * (1 + 0.05 * u);
}
static double ur_rise60(int64_t s, double u, bool *p)
{
    (void)p;
    return (s >= 100 ? 0.064 : 0.04) * (1 + 0.05 * u);
}
/* step_update_ratio, one sample a step. An optimizer whose moments were
 * reset at step 100: its first steps move at the full rate and settle
 * (4.5x, 3.6x, 3.2x, 2.5x the baseline, then below 2.5x: four breaching
 * steps, one short of the five that fire). */
static double sur_reset(int64_t s, double u, bool *p)
{
    static const double after[] = {4.5, 3.6, 3.2, 2.5, 2.0, 1.6, 1.3};
    (void)p;
    if (s >= 100 && s < 100 + (int64_t)(sizeof after / sizeof after[0]))
        return 0.004 * after[s - 100];
    return 0.004 * (1 + 0.05 * u);
}
/* One outsized step (a single huge gradient under SGD): 10x, once. */
static double sur_one(int64_t s, double u, bool *p)
{
    (void)p;
    return s == 100 ? 0.04 : 0.004 * (1 + 0.05 * u);
}
/* A hidden 2.7x jump of the rate at step 100 (a 3x jump's steps under
 * noise: the eleventh look's AdamW run read 2.7-3.1x). */
static double sur_jump27(int64_t s, double u, bool *p)
{
    (void)p;
    return (s >= 100 ? 0.0108 : 0.004) * (1 + 0.05 * u);
}
/* Steps twice the baseline for good (a logged re-warm-up's peak reached
 * 2.0x on the eleventh look's AdamW MoE). */
static double sur_double(int64_t s, double u, bool *p)
{
    (void)p;
    return (s >= 100 ? 0.008 : 0.004) * (1 + 0.05 * u);
}
/* A hidden 10x jump of the rate at step 100: every later step 10x. */
static double sur_jump(int64_t s, double u, bool *p)
{
    (void)p;
    return (s >= 100 ? 0.04 : 0.004) * (1 + 0.05 * u);
}
static double erank_nan(int64_t s, double u, bool *p)
{
    return s == 50 ? NAN : erank_healthy(s, u, p);
}
/* A z collapse (above the floor) with a zero-update step (absent) in it. */
static double erank_gap(int64_t s, double u, bool *p)
{
    if (s == 101)
        *p = false;
    return s >= 100 ? 8.0 + 0.1 * u : erank_healthy(s, u, p);
}
/* Router centered energy grows steadily under Adam. */
static double energy_trend(int64_t s, double u, bool *p)
{
    (void)p;
    return 100 + 0.5 * (double)s + u;
}
/* Router similarity: flat, then a steep ramp from step 100 (too large LR). */
static double sim_ramp(int64_t s, double u, bool *p)
{
    (void)p;
    double x = 0.05 + 0.001 * u;
    return s >= 100 ? x + 0.01 * (double)(s - 99) : x;
}
static double loss_spike(int64_t s, double u, bool *p)
{
    (void)p;
    return s == 80 ? 50.0 : 2.0 + 0.01 * u;
}
static double loss_rise(int64_t s, double u, bool *p)
{
    (void)p;
    return s >= 80 ? 50.0 + u : 2.0 + 0.01 * u;
}
static double maxvio_jump(int64_t s, double u, bool *p)
{
    (void)p;
    return s >= 100 ? 2.0 + 0.01 * u : 0.2 + 0.01 * u;
}

#define MAX_SERIES 3
#define MAX_LOG 16

struct expect {
    int series;
    int64_t step;
    enum alert_change change;
    enum alert_attribution attr; /* checked on TO_FIRING only */
    enum detect_severity severity;
};

struct scenario {
    const char *name;
    int64_t steps;
    int64_t detect_from;
    int nseries;
    struct {
        const char *rule;
        gen_fn gen;
    } series[MAX_SERIES];
    int nexpect;
    struct expect expect[MAX_LOG];
};

#define W DETECT_SEVERITY_WARNING
#define C DETECT_SEVERITY_CRITICAL
#define TP ALERT_CHANGE_TO_PENDING
#define TF ALERT_CHANGE_TO_FIRING
#define TR ALERT_CHANGE_TO_RESOLVED
#define TI ALERT_CHANGE_TO_INACTIVE

static const struct scenario scenarios[] = {
    {"transient z-sized dip of two samples does not fire",
     200,
     0,
     1,
     {{"qk.d2.erank", erank_dip2}},
     2,
     {{0, 100, TP, 0, W}, {0, 102, TI, 0, W}}},
    {"transient dip of one sample does not fire",
     200,
     0,
     1,
     {{"qk.d2.erank", erank_dip1}},
     2,
     {{0, 100, TP, 0, W}, {0, 101, TI, 0, W}}},
    {"healthy noisy series never alerts", 400, 0, 1, {{"qk.d2.erank", erank_healthy}}, 0, {{0}}},
    /* Below the rank-one floor: breaches of size, so two fire it
     * (magnitude_persistence). */
    {"sustained collapse fires at the persistence count and resolves",
     200,
     0,
     1,
     {{"qk.d2.erank", erank_collapse}},
     3,
     {{0, 120, TP, 0, W}, {0, 121, TF, ALERT_ATTR_ATTENTION_NUMERICS, W}, {0, 154, TR, 0, W}}},
    {"detect_from_step delays the same collapse",
     200,
     130,
     1,
     {{"qk.d2.erank", erank_collapse}},
     3,
     {{0, 130, TP, 0, W}, {0, 131, TF, ALERT_ATTR_ATTENTION_NUMERICS, W}, {0, 154, TR, 0, W}}},
    {"detect_from_step after the collapse: nothing",
     200,
     150,
     1,
     {{"qk.d2.erank", erank_collapse}},
     0,
     {{0}}},
    {"NaN fires at once, critical, non-finite",
     100,
     0,
     1,
     {{"qk.d2.erank", erank_nan}},
     2,
     {{0, 50, TF, ALERT_ATTR_NON_FINITE, C}, {0, 55, TR, 0, C}}},
    {"absent sample neither breaks nor extends a breach run",
     120,
     0,
     1,
     {{"qk.d2.erank", erank_gap}},
     2,
     {{0, 100, TP, 0, W}, {0, 103, TF, ALERT_ATTR_ATTENTION_NUMERICS, W}}},
    {"steady router energy trend does not fire",
     1000,
     0,
     1,
     {{"router.centered_energy", energy_trend}},
     0,
     {{0}}},
    {"router similarity ramp: optimizer-hyperparameter",
     130,
     0,
     1,
     {{"router.similarity", sim_ramp}},
     2,
     {{0, 100, TP, 0, W}, {0, 102, TF, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, W}}},
    {"Delta2 collapse with router ramp at once: optimizer-hyperparameter",
     130,
     0,
     3,
     {{"qk.d2.erank", erank_collapse_from_100},
      {"router.similarity", sim_ramp},
      {"router.centered_energy", energy_trend}},
     4,
     {{0, 100, TP, 0, W},
      {1, 100, TP, 0, W},
      {0, 101, TF, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, W},
      {1, 102, TF, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, W}}},
    {"Delta2 collapse with healthy router: attention-numerics",
     130,
     0,
     2,
     {{"qk.d2.erank", erank_collapse_from_100}, {"router.similarity", erank_healthy}},
     2,
     {{0, 100, TP, 0, W}, {0, 101, TF, ALERT_ATTR_ATTENTION_NUMERICS, W}}},
    {"the update ratio tripling names a too-large step",
     130,
     0,
     1,
     {{"update_ratio", ur_triple}},
     1,
     /* one breach fires it (DETECT_STEP_PERSISTENCE) */
     {{0, 100, TF, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, W}}},
    /* step_update_ratio: five breaching steps in a row
     * (DETECT_STEP_UPDATE_PERSISTENCE). */
    {"a step 10x too large from step 100 fires on its fifth step",
     130,
     0,
     1,
     {{"step_update_ratio", sur_jump}},
     2,
     {{0, 100, TP, 0, W}, {0, 104, TF, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, W}}},
    {"a step 2.7x too large from step 100 fires on its fifth step",
     130,
     0,
     1,
     {{"step_update_ratio", sur_jump27}},
     2,
     {{0, 100, TP, 0, W}, {0, 104, TF, ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, W}}},
    {"steps held at twice the baseline do not alert",
     130,
     0,
     1,
     {{"step_update_ratio", sur_double}},
     0,
     {{0}}},
    {"an optimizer reset's four outsized steps do not page",
     130,
     0,
     1,
     {{"step_update_ratio", sur_reset}},
     2,
     {{0, 100, TP, 0, W}, {0, 104, TI, 0, W}}},
    {"one outsized step does not page",
     130,
     0,
     1,
     {{"step_update_ratio", sur_one}},
     2,
     {{0, 100, TP, 0, W}, {0, 101, TI, 0, W}}},
    {"the update ratio rising 60% (z far beyond 5) does not alert",
     200,
     0,
     1,
     {{"update_ratio", ur_rise60}},
     0,
     {{0}}},
    {"a one-step loss spike does not page",
     120,
     0,
     1,
     {{"loss", loss_spike}},
     2,
     {{0, 80, TP, 0, W}, {0, 81, TI, 0, W}}},
    {"a sustained loss rise fires on its third step",
     120,
     0,
     1,
     {{"loss", loss_rise}},
     2,
     {{0, 80, TP, 0, W}, {0, 82, TF, ALERT_ATTR_LOSS_SPIKE, W}}},
    {"MaxVio jump alone: router-balance",
     130,
     0,
     2,
     {{"router.maxvio", maxvio_jump}, {"loss", loss_spike}},
     4,
     {{1, 80, TP, 0, W},
      {1, 81, TI, 0, W},
      {0, 100, TP, 0, W},
      {0, 102, TF, ALERT_ATTR_ROUTER_BALANCE, W}}},
    {"two dips to the relative floor within a noisy head's own noise do not fire",
     200,
     0,
     1,
     {{"qk.d2.srank", srank_noisy_dip2}},
     2,
     {{0, 100, TP, 0, W}, {0, 102, TI, 0, W}}},
    {"a batch halved lifts the gradient norm 41% for good: no page",
     200,
     0,
     1,
     {{"grad_norm", gn_batch_halved}},
     0,
     {{0}}},
    {"a gradient norm 2.5x its level pages on its third step",
     120,
     0,
     1,
     {{"grad_norm", gn_fault}},
     2,
     {{0, 100, TP, 0, W}, {0, 102, TF, ALERT_ATTR_LOSS_SPIKE, W}}},
    {"two samples collapsed to near rank one fire (magnitude_persistence)",
     200,
     0,
     1,
     {{"qk.d2.erank", erank_drop2}},
     3,
     {{0, 100, TP, 0, W}, {0, 101, TF, ALERT_ATTR_ATTENTION_NUMERICS, W}, {0, 106, TR, 0, W}}},
};

struct logged {
    int series;
    struct alert_transition tr;
    enum alert_attribution attr;
};

static bool transition_eq(const struct alert_transition *a, const struct alert_transition *b)
{
    return a->change == b->change && a->from == b->from && a->to == b->to &&
           strcmp(a->rule, b->rule) == 0 && a->family == b->family && a->severity == b->severity &&
           a->breach_kind == b->breach_kind && memcmp(&a->scope, &b->scope, sizeof a->scope) == 0 &&
           a->step == b->step && same_double(a->time, b->time) && same_double(a->value, b->value) &&
           same_double(a->median, b->median) && same_double(a->mad, b->mad) &&
           same_double(a->z, b->z) && a->non_finite == b->non_finite &&
           a->first_breach_step == b->first_breach_step && a->fired_step == b->fired_step &&
           a->incident == b->incident;
}

/* Runs a scenario; when cut >= 0, every state is encoded, wiped and decoded
 * before step `cut` (a daemon restart). Returns the number of transitions. */
static int run_scenario(const struct scenario *sc, int64_t cut, struct logged *log)
{
    struct detect_rule rules[MAX_SERIES];
    struct detect_state det[MAX_SERIES];
    struct alert_state al[MAX_SERIES];
    uint64_t seed[MAX_SERIES];
    for (int i = 0; i < sc->nseries; i++) {
        rules[i] = rule_named(sc->series[i].rule);
        detect_state_init(&det[i]);
        alert_state_init(&al[i]);
        seed[i] = 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1);
    }
    int n = 0;
    for (int64_t s = 0; s < sc->steps; s++) {
        if (s == cut) {
            for (int i = 0; i < sc->nseries; i++) {
                uint8_t db[DETECT_STATE_ENCODED_MAX], ab[ALERT_STATE_ENCODED_BYTES];
                int dn = detect_state_encode(&det[i], db, sizeof db);
                int an = alert_state_encode(&al[i], ab, sizeof ab);
                cr_assert_gt(dn, 0);
                cr_assert_eq(an, ALERT_STATE_ENCODED_BYTES);
                memset(&det[i], 0xC3, sizeof det[i]);
                memset(&al[i], 0xC3, sizeof al[i]);
                cr_assert_eq(detect_state_decode(&det[i], db, (size_t)dn), 0);
                cr_assert_eq(alert_state_decode(&al[i], ab, (size_t)an), 0);
            }
        }
        int first = n;
        for (int i = 0; i < sc->nseries; i++) {
            bool present = true;
            double x = sc->series[i].gen(s, uniform(&seed[i]), &present);
            struct detect_verdict v;
            struct alert_transition tr;
            struct alert_scope scope = {.layer = i, .head = -1, .window = 1, .rank = -1};
            cr_assert_eq(detect_step(&det[i], &rules[i], s, x, present, sc->detect_from, &v), 0);
            cr_assert_eq(alert_step(&al[i], &rules[i], &scope, &v, s, 1e9 + (double)s, &tr), 0);
            if (tr.change != ALERT_CHANGE_NONE) {
                cr_assert_lt(n, MAX_LOG, "%s: too many transitions", sc->name);
                log[n].series = i;
                log[n].tr = tr;
                log[n].attr = ALERT_ATTR_NONE;
                n++;
            }
        }
        /* Attribution over the run once the step's samples are all in. */
        struct alert_evidence ev;
        alert_evidence_init(&ev);
        for (int i = 0; i < sc->nseries; i++)
            alert_evidence_add(&ev, &al[i], rules[i].family);
        for (int k = first; k < n; k++)
            if (log[k].tr.change == ALERT_CHANGE_TO_FIRING)
                log[k].attr = alert_attribute(&ev);
    }
    return n;
}

static void check_expected(const struct scenario *sc, const struct logged *log, int n)
{
    for (int k = 0; k < n && k < sc->nexpect; k++) {
        const struct expect *e = &sc->expect[k];
        cr_assert_eq(log[k].series, e->series, "%s #%d series", sc->name, k);
        cr_assert_eq(log[k].tr.step, e->step, "%s #%d: %s at step %lld, want %lld", sc->name, k,
                     alert_change_name(log[k].tr.change), (long long)log[k].tr.step,
                     (long long)e->step);
        cr_assert_eq(log[k].tr.change, e->change, "%s #%d: %s, want %s", sc->name, k,
                     alert_change_name(log[k].tr.change), alert_change_name(e->change));
        cr_assert_eq(log[k].tr.severity, e->severity, "%s #%d severity", sc->name, k);
        if (e->change == ALERT_CHANGE_TO_FIRING)
            cr_assert_eq(log[k].attr, e->attr, "%s #%d: %s, want %s", sc->name, k,
                         alert_attribution_name(log[k].attr), alert_attribution_name(e->attr));
    }
    cr_assert_eq(n, sc->nexpect, "%s: %d transitions, want %d (first extra: %s at %lld)", sc->name,
                 n, sc->nexpect,
                 n > sc->nexpect ? alert_change_name(log[sc->nexpect].tr.change) : "-",
                 n > sc->nexpect ? (long long)log[sc->nexpect].tr.step : -1LL);
}

Test(alert_scenarios, expected_transitions)
{
    for (size_t i = 0; i < sizeof scenarios / sizeof scenarios[0]; i++) {
        struct logged log[MAX_LOG];
        int n = run_scenario(&scenarios[i], -1, log);
        check_expected(&scenarios[i], log, n);
    }
}

Test(alert_scenarios, fired_evidence_is_complete)
{
    const struct scenario *sc = &scenarios[3]; /* sustained collapse */
    struct logged log[MAX_LOG];
    int n = run_scenario(sc, -1, log);
    cr_assert_eq(n, 3);
    const struct alert_transition *f = &log[1].tr;
    cr_assert_eq(f->change, ALERT_CHANGE_TO_FIRING);
    cr_assert_eq(f->breach_kind, DETECT_BREACH_FLOOR);
    cr_assert_leq(f->value, 1.5);
    cr_assert_float_eq(f->median, 20, 0.5);
    cr_assert_gt(f->mad, 0);
    cr_assert_lt(f->z, -5);
    cr_assert_eq(f->first_breach_step, 120);
    cr_assert_eq(f->fired_step, 121);
    cr_assert_eq(f->scope.layer, 0);
    cr_assert_eq(f->scope.window, 1);
    cr_assert_str_eq(f->rule, "qk.d2.erank");
}

Test(alert_scenarios, restart_anywhere_changes_nothing)
{
    for (size_t i = 0; i < sizeof scenarios / sizeof scenarios[0]; i++) {
        const struct scenario *sc = &scenarios[i];
        struct logged plain[MAX_LOG];
        int n = run_scenario(sc, -1, plain);
        /* Every step near the action, sparser through long quiet stretches. */
        for (int64_t cut = 0; cut <= sc->steps; cut += (cut < 200 ? 1 : 17)) {
            struct logged again[MAX_LOG];
            int m = run_scenario(sc, cut, again);
            cr_assert_eq(m, n, "%s: restart at %lld: %d transitions vs %d", sc->name,
                         (long long)cut, m, n);
            for (int k = 0; k < n; k++) {
                cr_assert_eq(again[k].series, plain[k].series);
                cr_assert_eq(again[k].attr, plain[k].attr);
                cr_assert(transition_eq(&again[k].tr, &plain[k].tr),
                          "%s: restart at %lld: transition %d differs", sc->name, (long long)cut,
                          k);
            }
        }
    }
}

/* A breach of size that another layer confirms (detect_verdict.confirmed,
 * set by evaluate.c from cross_layer_windows) fires on its first sample;
 * the flag does not shorten a z-score breach, and without it a breach of
 * size waits for its second sample (magnitude_persistence). */
Test(alert_lifecycle, confirmed_breach_of_size_fires_at_once)
{
    static const struct {
        enum detect_breach_kind kind;
        bool confirmed;
        enum alert_state_id want;
    } cases[] = {
        {DETECT_BREACH_RELATIVE, true, ALERT_FIRING},
        {DETECT_BREACH_FLOOR, true, ALERT_FIRING},
        {DETECT_BREACH_RELATIVE, false, ALERT_PENDING},
        {DETECT_BREACH_Z, true, ALERT_PENDING},
        {DETECT_BREACH_RELATIVE_IN_NOISE, true, ALERT_PENDING},
    };
    struct detect_rule rule = rule_named("qk.d2.srank");
    struct alert_scope scope = {.layer = 1, .head = -1, .window = 10, .rank = 0};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct alert_state st;
        struct alert_transition tr;
        alert_state_init(&st);
        struct detect_verdict v = {.present = true,
                                   .breach = true,
                                   .breach_kind = cases[i].kind,
                                   .confirmed = cases[i].confirmed,
                                   .value = 1.3,
                                   .median = 3,
                                   .mad = 0.05};
        cr_assert_eq(alert_step(&st, &rule, &scope, &v, 500, 0, &tr), 0);
        cr_expect_eq(st.state, cases[i].want, "case %zu: state %d", i, (int)st.state);
    }
}
