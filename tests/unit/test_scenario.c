/* Verified signatures of `foreshock simulate --scenario ...`.
 *
 * Each case runs 2-4 simulated ranks in-process (client/cli/simrank.c and
 * scenario.c, the code the CLI runs) and evaluates what they send the way
 * the daemon will: attention Grams summed over the d-shards of (step,
 * layer, head, window) -> qk_head_from_grams (Gram route), or each head's
 * spectrum sketch -> qk_head_from_spectra (spectrum route: synthesised
 * spectra, whole heads per rank) -> per (layer, window) the min
 * over heads of qk.d2.erank / qk.d2.entropy / qk.d2.srank and the max of
 * qk.cqk; router Grams summed over shards -> router.similarity and
 * router.centered_energy; token statistics summed over ranks ->
 * router.maxvio, router.load_entropy, router.zloss; loss, grad_norm and
 * the per-layer weight_norm / update_ratio of rank 0. Every series goes
 * through detect_step with the rule detect_rules_default() gives its name
 * and then alert_step, as the loop thread does. The assertions are the
 * task's contract: healthy fires nothing; attention-numerics fires the
 * Delta2 family before diverge_step and no router or weight-norm rule;
 * lr-spike fires a router-weight or weight-norm rule before diverge_step
 * and no Delta2 rule; combined fires both; and the attribution of the open
 * alerts one step before diverge_step names the fault.
 *
 * The generator sources are compiled into this test directly (below), so
 * the test needs nothing from CMake beyond what every unit test gets. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alert.h"
#include "detect.h"
#include "evaluate.h"
#include "monitor_qk.h"
#include "monitor_router.h"

/* The generators, exactly as foreshock_cli builds them. */
#include "../../client/cli/scenario.c"
#include "../../client/cli/simrank.c"

#define T_MAX_LAYERS 4
#define T_MAX_HEADS 8
#define T_MAX_DH 16
#define T_MAX_EXPERTS 8
#define T_MAX_STEPS 512
#define T_NO_STEP INT64_MAX

/* ---- one tracked series: detector state + alert lifecycle ------------------------- */

struct series {
    const char *name;
    const struct detect_rule *rule;
    struct detect_state ds;
    struct alert_state as;
    struct alert_scope scope;
    int64_t first_fire;
    double fire_value, fire_median, fire_z;
};

static void series_init(struct series *s, const struct detect_rules *rules, const char *name,
                        int32_t layer, int32_t window)
{
    memset(s, 0, sizeof(*s));
    s->name = name;
    s->rule = detect_rules_match(rules, name);
    cr_assert(s->rule, "no default rule matches %s", name);
    detect_state_init(&s->ds);
    alert_state_init(&s->as);
    s->scope = ALERT_SCOPE_NONE;
    s->scope.layer = layer;
    s->scope.window = window;
    s->first_fire = T_NO_STEP;
}

static void series_feed(struct series *s, int64_t step, double v, bool present)
{
    struct detect_verdict dv;
    struct alert_transition tr;

    cr_assert_eq(detect_step(&s->ds, s->rule, step, v, present, 0, &dv), 0);
    cr_assert_eq(alert_step(&s->as, s->rule, &s->scope, &dv, step, (double)step, &tr), 0);
    if (tr.change == ALERT_CHANGE_TO_FIRING && s->first_fire == T_NO_STEP) {
        s->first_fire = step;
        s->fire_value = v;
        s->fire_median = dv.median;
        s->fire_z = dv.z;
    }
}

/* ---- the daemon side ------------------------------------------------------------------ */

enum { A_ERANK, A_ENTROPY, A_SRANK, A_CQK, A_N };
enum { R_SIM, R_CENTRED, R_ZLOSS, R_MAXVIO, R_LOADENT, R_N };
enum { W_NORM, W_RATIO, W_N };
static const char *const a_names[A_N] = {"qk.d2.erank", "qk.d2.entropy", "qk.d2.srank", "qk.cqk"};
static const char *const r_names[R_N] = {"router.similarity", "router.centered_energy",
                                         "router.zloss", "router.maxvio", "router.load_entropy"};
static const char *const w_names[W_N] = {"weight_norm", "update_ratio"};

struct harness {
    struct sim_params p;
    const struct scenario *sc;
    struct detect_rules rules;
    struct qk_workspace *qk;
    struct router_workspace *rw;
    /* Per step, summed over ranks. */
    double ga[T_MAX_LAYERS][T_MAX_HEADS][(2 * T_MAX_DH) * (2 * T_MAX_DH + 1) / 2];
    double gb[T_MAX_LAYERS][T_MAX_HEADS][(2 * T_MAX_DH) * (2 * T_MAX_DH + 1) / 2];
    unsigned att_shards[T_MAX_LAYERS][T_MAX_HEADS];
    struct qk_head spec[T_MAX_LAYERS][T_MAX_HEADS]; /* spectrum route: the daemon's result */
    double gr[T_MAX_LAYERS][T_MAX_EXPERTS * (T_MAX_EXPERTS + 1) / 2];
    unsigned gr_shards[T_MAX_LAYERS];
    uint64_t n_tok[T_MAX_LAYERS], load[T_MAX_LAYERS][T_MAX_EXPERTS];
    double sum_h[T_MAX_LAYERS], sum_h2[T_MAX_LAYERS], sum_lse2[T_MAX_LAYERS];
    double sum_p[T_MAX_LAYERS][T_MAX_EXPERTS];
    unsigned tok_ranks[T_MAX_LAYERS];
    bool have_scalars, have_norms;
    double loss, grad_norm, lr;
    float norm[T_MAX_LAYERS], ratio[T_MAX_LAYERS];
    /* Detector series. */
    struct series att[T_MAX_LAYERS][A_N], rt[T_MAX_LAYERS][R_N], wn[T_MAX_LAYERS][W_N];
    struct series loss_s, grad_s, lr_s;
    uint64_t lr_start; /* the lr series is fed from the daemon's progress start on */
    /* Traces for the report: deepest layer's min erank, first MoE layer. */
    double erank[T_MAX_STEPS], sim[T_MAX_STEPS], centred[T_MAX_STEPS], hbar[T_MAX_STEPS],
        maxvio[T_MAX_STEPS], wnorm[T_MAX_STEPS], uratio[T_MAX_STEPS], loss_trace[T_MAX_STEPS];
    uint32_t cur_rank;
    bool attr_set; /* attr_before holds the label at diverge_step - 1 */
    enum alert_attribution attr_before;
};

static int h_scalars(void *ctx, uint64_t step, const struct sim_scalars *s)
{
    struct harness *h = ctx;
    (void)step;
    if (h->cur_rank == 0) { /* the daemon reads loss and grad norm from rank 0 */
        h->have_scalars = true;
        h->loss = s->loss;
        h->grad_norm = s->grad_norm;
        h->lr = s->lr;
    }
    return 0;
}

static int h_attention(void *ctx, uint64_t step, uint32_t layer, uint32_t head, uint32_t kv_head,
                       uint32_t window, uint32_t dh, uint32_t shard, uint32_t shards,
                       const float *ga, const float *gb)
{
    struct harness *h = ctx;
    size_t n = 2 * (size_t)dh, bytes = monitor_tri_len(n) * sizeof(float);
    (void)step;
    cr_assert(h->p.route == SIM_ROUTE_GRAM);
    cr_assert(layer < h->p.layers && head < h->p.heads && dh == h->p.dh);
    cr_assert_eq(kv_head, sim_group(&h->p) > 1 ? head / sim_group(&h->p) : FSC_KV_HEAD_NONE);
    cr_assert(window == h->p.window && shard == h->cur_rank && shards == h->p.ranks);
    /* As on the wire: float32 shards added into double. */
    cr_assert_eq(monitor_tri_accumulate(h->ga[layer][head], n, ga, bytes), 0);
    cr_assert_eq(monitor_tri_accumulate(h->gb[layer][head], n, gb, bytes), 0);
    h->att_shards[layer][head]++;
    return 0;
}

/* As the daemon does with a SpectrumSketch (run.c add_attention). */
static int h_spectrum(void *ctx, uint64_t step, uint32_t layer, uint32_t head, uint32_t kv_head,
                      uint32_t window, const struct fsc_spectrum *s)
{
    struct harness *h = ctx;
    uint32_t h0, h1;
    (void)step;
    cr_assert(h->p.route == SIM_ROUTE_SPECTRUM);
    cr_assert(layer < h->p.layers && head < h->p.heads && window == h->p.window);
    sim_rank_heads(&h->p, h->cur_rank, &h0, &h1);
    cr_assert(head >= h0 && head < h1, "rank %u sent head %u outside its block [%u, %u)",
              h->cur_rank, head, h0, h1);
    cr_assert_eq(kv_head, sim_group(&h->p) > 1 ? head / sim_group(&h->p) : FSC_KV_HEAD_NONE);
    cr_assert(s->n_d2 == 2 * (size_t)h->p.dh && s->n_d1 == s->n_d2 && s->n_d3 == h->p.dh &&
              s->n_w == h->p.dh);
    struct qk_spectra_in in = {.dh = h->p.dh,
                               .d2 = s->d2,
                               .n_d2 = s->n_d2,
                               .d1 = s->d1,
                               .n_d1 = s->n_d1,
                               .d3 = s->d3,
                               .n_d3 = s->n_d3,
                               .w = s->w,
                               .n_w = s->n_w,
                               .has_norms = (s->has & 15u) == 15u,
                               .q_delta_sq = s->q_delta_sq,
                               .q_sq = s->q_sq,
                               .k_sq = s->k_sq,
                               .k_delta_sq = s->k_delta_sq,
                               .has_cqk = (s->has & FSC_SPECTRUM_HAS_CQK) != 0,
                               .cqk = s->cqk};
    cr_assert(in.has_norms && in.has_cqk && s->cqk >= 0 && s->cqk <= 1);
    cr_assert_eq(qk_head_from_spectra(&in, &h->spec[layer][head]), 0);
    h->att_shards[layer][head]++;
    return 0;
}

static int h_router_gram(void *ctx, uint64_t step, uint32_t layer, uint32_t e, uint32_t shard,
                         uint32_t shards, const float *gr)
{
    struct harness *h = ctx;
    (void)step;
    cr_assert(layer < h->p.layers && e == h->p.experts && shard == h->cur_rank &&
              shards == h->p.ranks);
    cr_assert_eq(monitor_tri_accumulate(h->gr[layer], e, gr, monitor_tri_len(e) * sizeof(float)),
                 0);
    h->gr_shards[layer]++;
    return 0;
}

static int h_router_tokens(void *ctx, uint64_t step, uint32_t layer, uint32_t e,
                           const struct sim_tokens *t)
{
    struct harness *h = ctx;
    (void)step;
    cr_assert(layer < h->p.layers && e == h->p.experts);
    h->n_tok[layer] += t->n_tok;
    h->sum_h[layer] += t->sum_h;
    h->sum_h2[layer] += t->sum_h2;
    h->sum_lse2[layer] += t->sum_lse2;
    for (uint32_t i = 0; i < e; i++) {
        h->load[layer][i] += t->load[i];
        h->sum_p[layer][i] += t->sum_p[i];
    }
    h->tok_ranks[layer]++;
    return 0;
}

static int h_layer_norms(void *ctx, uint64_t step, const float *norm, const float *ratio,
                         size_t layers)
{
    struct harness *h = ctx;
    (void)step;
    cr_assert_eq(layers, h->p.layers);
    if (h->cur_rank == 0) { /* weight_norm / update_ratio from rank 0 */
        h->have_norms = true;
        memcpy(h->norm, norm, layers * sizeof(float));
        memcpy(h->ratio, ratio, layers * sizeof(float));
    }
    return 0;
}

static void harness_begin_step(struct harness *h)
{
    memset(h->ga, 0, sizeof(h->ga));
    memset(h->gb, 0, sizeof(h->gb));
    memset(h->att_shards, 0, sizeof(h->att_shards));
    memset(h->gr, 0, sizeof(h->gr));
    memset(h->gr_shards, 0, sizeof(h->gr_shards));
    memset(h->n_tok, 0, sizeof(h->n_tok));
    memset(h->load, 0, sizeof(h->load));
    memset(h->sum_h, 0, sizeof(h->sum_h));
    memset(h->sum_h2, 0, sizeof(h->sum_h2));
    memset(h->sum_lse2, 0, sizeof(h->sum_lse2));
    memset(h->sum_p, 0, sizeof(h->sum_p));
    memset(h->tok_ranks, 0, sizeof(h->tok_ranks));
    h->have_scalars = h->have_norms = false;
}

/* Everything the daemon derives from one complete step. */
static void harness_evaluate(struct harness *h, uint64_t step)
{
    const struct sim_params *p = &h->p;
    int64_t t = (int64_t)step;

    cr_assert(h->have_scalars, "step %llu: no scalars from rank 0", (unsigned long long)step);
    series_feed(&h->loss_s, t, h->loss, true);
    series_feed(&h->grad_s, t, h->grad_norm, true);
    if (step >= h->lr_start)
        series_feed(&h->lr_s, t, h->lr, true);
    h->loss_trace[step] = h->loss;
    for (uint32_t l = 0; l < p->layers; l++) {
        struct qk_head heads[T_MAX_HEADS];
        struct qk_agg agg[QK_NSERIES];
        unsigned got = h->att_shards[l][0];

        for (uint32_t hd = 0; hd < p->heads; hd++)
            cr_assert_eq(h->att_shards[l][hd], got, "incomplete attention reduction");
        if (got) {
            /* Gram route: every rank a shard of every head; spectrum route:
             * each head from exactly one rank. */
            unsigned want = p->route == SIM_ROUTE_SPECTRUM ? 1 : p->ranks;
            cr_assert_eq(got, want, "layer %u: %u of %u shards", l, got, want);
            for (uint32_t hd = 0; hd < p->heads; hd++) {
                if (p->route == SIM_ROUTE_SPECTRUM) {
                    heads[hd] = h->spec[l][hd];
                } else {
                    int rc =
                        qk_head_from_grams(h->qk, p->dh, h->ga[l][hd], h->gb[l][hd], &heads[hd]);
                    cr_assert_eq(rc, 0, "qk_head_from_grams: %d", rc);
                }
                cr_assert(!heads[hd].nonfinite);
            }
            cr_assert_eq(qk_layer_aggregate(heads, p->heads, agg), 0);
            const struct qk_agg *e2 = &agg[QK_SERIES(QK_D2, QK_ERANK2)],
                                *h2 = &agg[QK_SERIES(QK_D2, QK_ENTROPY2)],
                                *sr = &agg[QK_SERIES(QK_D2, QK_SRANK)], *cq = &agg[QK_SERIES_CQK];
            series_feed(&h->att[l][A_ERANK], t, e2->min, e2->present);
            series_feed(&h->att[l][A_ENTROPY], t, h2->min, h2->present);
            series_feed(&h->att[l][A_SRANK], t, sr->min, sr->present);
            series_feed(&h->att[l][A_CQK], t, cq->max, cq->present);
            if (l == p->layers - 1)
                h->erank[step] = e2->present ? e2->min : NAN;
        }
        if (sim_is_moe(p, l)) {
            struct router_weight w;
            struct router_decision dd;
            uint32_t first = 0;
            while (!sim_is_moe(p, first))
                first++;
            cr_assert_eq(h->tok_ranks[l], p->ranks, "router tokens incomplete");
            struct router_tokens in = {.n_experts = p->experts,
                                       .n_tok = h->n_tok[l],
                                       .sum_h = h->sum_h[l],
                                       .sum_h2 = h->sum_h2[l],
                                       .sum_lse2 = h->sum_lse2[l],
                                       .load = h->load[l],
                                       .sum_p = h->sum_p[l]};
            cr_assert_eq(router_decision_compute(&in, &dd), 0);
            cr_assert(dd.present && dd.load_present && !dd.nonfinite);
            series_feed(&h->rt[l][R_ZLOSS], t, dd.zloss, true);
            series_feed(&h->rt[l][R_MAXVIO], t, dd.maxvio, true);
            series_feed(&h->rt[l][R_LOADENT], t, dd.load_entropy, true);
            if (l == first) {
                h->hbar[step] = dd.entropy_mean;
                h->maxvio[step] = dd.maxvio;
            }
            if (h->gr_shards[l]) {
                cr_assert_eq(h->gr_shards[l], p->ranks);
                cr_assert_eq(router_weight_compute(h->rw, p->experts, h->gr[l], &w), 0);
                cr_assert(w.present && w.sim_present && !w.nonfinite);
                series_feed(&h->rt[l][R_SIM], t, w.sim, true);
                series_feed(&h->rt[l][R_CENTRED], t, w.centered_energy, true);
                if (l == first) {
                    h->sim[step] = w.sim;
                    h->centred[step] = w.centered_energy;
                }
            }
        }
        if (h->have_norms) {
            series_feed(&h->wn[l][W_NORM], t, h->norm[l], true);
            series_feed(&h->wn[l][W_RATIO], t, h->ratio[l], true);
            if (l == p->layers - 1) {
                h->wnorm[step] = h->norm[l];
                h->uratio[step] = h->ratio[l];
            }
        }
    }
}

/* First firing step per family (T_NO_STEP: never). */
static void family_first(const struct harness *h, int64_t first[DETECT_FAMILY_COUNT],
                         const char *names[DETECT_FAMILY_COUNT])
{
    for (int f = 0; f < DETECT_FAMILY_COUNT; f++) {
        first[f] = T_NO_STEP;
        names[f] = "-";
    }
    const struct series *all = &h->att[0][0];
    size_t n_att = sizeof(h->att) / sizeof(h->att[0][0]);
    for (size_t i = 0; i < n_att; i++)
        if (all[i].rule && all[i].first_fire < first[all[i].rule->family]) {
            first[all[i].rule->family] = all[i].first_fire;
            names[all[i].rule->family] = all[i].name;
        }
    all = &h->rt[0][0];
    for (size_t i = 0; i < sizeof(h->rt) / sizeof(h->rt[0][0]); i++)
        if (all[i].rule && all[i].first_fire < first[all[i].rule->family]) {
            first[all[i].rule->family] = all[i].first_fire;
            names[all[i].rule->family] = all[i].name;
        }
    all = &h->wn[0][0];
    for (size_t i = 0; i < sizeof(h->wn) / sizeof(h->wn[0][0]); i++)
        if (all[i].rule && all[i].first_fire < first[all[i].rule->family]) {
            first[all[i].rule->family] = all[i].first_fire;
            names[all[i].rule->family] = all[i].name;
        }
    const struct series *sc[3] = {&h->loss_s, &h->grad_s, &h->lr_s};
    for (int i = 0; i < 3; i++)
        if (sc[i]->first_fire < first[sc[i]->rule->family]) {
            first[sc[i]->rule->family] = sc[i]->first_fire;
            names[sc[i]->rule->family] = sc[i]->name;
        }
}

/* The attribution label of every open alert, as the daemon computes it. */
static enum alert_attribution harness_attribution(const struct harness *h)
{
    struct alert_evidence e;
    alert_evidence_init(&e);
    const struct series *groups[3] = {&h->att[0][0], &h->rt[0][0], &h->wn[0][0]};
    const size_t counts[3] = {sizeof(h->att) / sizeof(h->att[0][0]),
                              sizeof(h->rt) / sizeof(h->rt[0][0]),
                              sizeof(h->wn) / sizeof(h->wn[0][0])};
    for (int g = 0; g < 3; g++)
        for (size_t i = 0; i < counts[g]; i++)
            if (groups[g][i].rule)
                alert_evidence_add(&e, &groups[g][i].as, groups[g][i].rule->family);
    alert_evidence_add(&e, &h->loss_s.as, h->loss_s.rule->family);
    alert_evidence_add(&e, &h->grad_s.as, h->grad_s.rule->family);
    alert_evidence_add(&e, &h->lr_s.as, h->lr_s.rule->family);
    return alert_attribute(&e);
}

/* Median of the finite trace values in [from, to). */
static double trace_median(const double *v, uint64_t from, uint64_t to)
{
    double tmp[T_MAX_STEPS];
    size_t n = 0;
    for (uint64_t i = from; i < to && i < T_MAX_STEPS; i++)
        if (isfinite(v[i]))
            tmp[n++] = v[i];
    if (!n)
        return NAN;
    for (size_t i = 1; i < n; i++) /* insertion sort: n is small */
        for (size_t j = i; j > 0 && tmp[j - 1] > tmp[j]; j--) {
            double x = tmp[j];
            tmp[j] = tmp[j - 1];
            tmp[j - 1] = x;
        }
    return n % 2 ? tmp[n / 2] : 0.5 * (tmp[n / 2 - 1] + tmp[n / 2]);
}

/* The last finite trace value before `before`. */
static double trace_last(const double *v, uint64_t before)
{
    for (uint64_t i = before; i-- > 0;)
        if (i < T_MAX_STEPS && isfinite(v[i]))
            return v[i];
    return NAN;
}

/* A step for messages: -1 for never. */
static long long shown(int64_t step)
{
    return step == T_NO_STEP ? -1 : (long long)step;
}

/* ---- the cases -------------------------------------------------------------------------- */

enum expect {
    EXPECT_QUIET,     /* nothing fires, ever */
    EXPECT_NUMERICS,  /* Delta2 before diverge; no router / weight-norm rule */
    EXPECT_OPTIMIZER, /* router weight or weight norm before diverge; no Delta2 rule */
    EXPECT_COMBINED,  /* both before diverge */
};

/* Criterion copies parameters into a fresh process image: no pointers. */
struct sc_case {
    char label[32];
    char scenario[24];
    uint32_t ranks, layers, heads, dh, d, sketch_every, experts, tokens;
    uint64_t steps, seed;
    enum expect expect;
    enum alert_attribution attribution; /* of the open alerts at diverge_step - 1 */
    uint32_t kv_heads;                  /* 0: plain multi-head */
    enum sim_route route;
};

static struct sc_case cases[] = {
    {"healthy-moe", "healthy", 3, 2, 4, 16, 96, 5, 8, 128, 400, 1, EXPECT_QUIET, ALERT_ATTR_NONE, 0,
     SIM_ROUTE_GRAM},
    /* Sketch series leave warm-up (20 samples) at step 40, exactly where the
     * lr warm-up turns into the cosine decay. */
    {"healthy-k2", "healthy", 2, 2, 4, 16, 64, 2, 8, 128, 400, 2, EXPECT_QUIET, ALERT_ATTR_NONE, 0,
     SIM_ROUTE_GRAM},
    {"healthy-dense", "healthy", 4, 3, 4, 16, 128, 5, 0, 0, 400, 3, EXPECT_QUIET, ALERT_ATTR_NONE,
     0, SIM_ROUTE_GRAM},
    {"attention-numerics", "attention-numerics", 3, 2, 4, 16, 96, 5, 8, 128, 400, 4,
     EXPECT_NUMERICS, ALERT_ATTR_ATTENTION_NUMERICS, 0, SIM_ROUTE_GRAM},
    {"attention-numerics-dense", "attention-numerics", 2, 3, 4, 16, 64, 5, 0, 0, 400, 5,
     EXPECT_NUMERICS, ALERT_ATTR_ATTENTION_NUMERICS, 0, SIM_ROUTE_GRAM},
    {"lr-spike", "lr-spike", 3, 2, 4, 16, 96, 5, 8, 128, 400, 6, EXPECT_OPTIMIZER,
     ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, 0, SIM_ROUTE_GRAM},
    {"combined", "combined", 4, 2, 4, 16, 128, 5, 8, 128, 400, 7, EXPECT_COMBINED,
     ALERT_ATTR_COMBINED, 0, SIM_ROUTE_GRAM},
    /* Grouped-query attention: 8 query heads read 2 key heads. */
    {"healthy-gqa", "healthy", 3, 2, 8, 16, 96, 5, 8, 128, 400, 8, EXPECT_QUIET, ALERT_ATTR_NONE, 2,
     SIM_ROUTE_GRAM},
    {"attention-numerics-gqa", "attention-numerics", 2, 3, 8, 16, 64, 5, 0, 0, 400, 9,
     EXPECT_NUMERICS, ALERT_ATTR_ATTENTION_NUMERICS, 2, SIM_ROUTE_GRAM},
    /* The spectrum route: the same signatures from synthesised spectra. */
    {"healthy-spectrum", "healthy", 3, 2, 8, 16, 96, 5, 8, 128, 400, 10, EXPECT_QUIET,
     ALERT_ATTR_NONE, 2, SIM_ROUTE_SPECTRUM},
    {"healthy-spectrum-dense", "healthy", 4, 3, 4, 16, 128, 5, 0, 0, 400, 11, EXPECT_QUIET,
     ALERT_ATTR_NONE, 0, SIM_ROUTE_SPECTRUM},
    {"attention-numerics-spectrum", "attention-numerics", 3, 3, 8, 16, 96, 5, 0, 0, 400, 12,
     EXPECT_NUMERICS, ALERT_ATTR_ATTENTION_NUMERICS, 2, SIM_ROUTE_SPECTRUM},
    {"lr-spike-spectrum", "lr-spike", 3, 2, 8, 16, 96, 5, 8, 128, 400, 13, EXPECT_OPTIMIZER,
     ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, 2, SIM_ROUTE_SPECTRUM},
    {"combined-spectrum", "combined", 4, 2, 8, 16, 128, 5, 8, 128, 400, 14, EXPECT_COMBINED,
     ALERT_ATTR_COMBINED, 4, SIM_ROUTE_SPECTRUM},
};

static void run_case(const struct sc_case *c, struct harness *h)
{
    struct sim_rank *ranks[4] = {0};
    struct sim_sink sink = {.ctx = h,
                            .scalars = h_scalars,
                            .attention = h_attention,
                            .spectrum = h_spectrum,
                            .router_gram = h_router_gram,
                            .router_tokens = h_router_tokens,
                            .layer_norms = h_layer_norms};
    char err[256];

    cr_assert(c->ranks <= 4 && c->layers <= T_MAX_LAYERS && c->heads <= T_MAX_HEADS &&
              c->dh <= T_MAX_DH && c->experts <= T_MAX_EXPERTS && c->steps <= T_MAX_STEPS);
    h->sc = scenario_find(c->scenario);
    cr_assert(h->sc, "%s: no scenario", c->scenario);
    h->p = (struct sim_params){.steps = c->steps,
                               .seed = c->seed,
                               .ranks = c->ranks,
                               .layers = c->layers,
                               .heads = c->heads,
                               .kv_heads = c->kv_heads,
                               .route = c->route,
                               .dh = c->dh,
                               .d = c->d,
                               .sketch_every = c->sketch_every,
                               .window = c->sketch_every,
                               .sketches = 1,
                               .layer_norms = 1,
                               .experts = c->experts,
                               .top_k = SIM_UINT32_UNSET,
                               .tokens = c->tokens ? c->tokens : SIM_UINT32_UNSET};
    cr_assert_eq(sim_params_resolve(h->sc, &h->p, SIM_NEVER, SIM_NEVER, err, sizeof(err)), 0, "%s",
                 err);
    detect_rules_default(&h->rules);
    cr_assert_eq(qk_workspace_create(c->dh, &h->qk), 0);
    cr_assert_eq(router_workspace_create(T_MAX_EXPERTS, &h->rw), 0);
    for (uint32_t l = 0; l < c->layers; l++) {
        int32_t win = (int32_t)h->p.window;
        for (int i = 0; i < A_N; i++)
            series_init(&h->att[l][i], &h->rules, a_names[i], (int32_t)l, win);
        if (sim_is_moe(&h->p, l))
            for (int i = 0; i < R_N; i++)
                series_init(&h->rt[l][i], &h->rules, r_names[i], (int32_t)l, 0);
        for (int i = 0; i < W_N; i++)
            series_init(&h->wn[l][i], &h->rules, w_names[i], (int32_t)l, 0);
    }
    series_init(&h->loss_s, &h->rules, "loss", -1, 0);
    series_init(&h->grad_s, &h->rules, "grad_norm", -1, 0);
    series_init(&h->lr_s, &h->rules, "lr", -1, 0);
    /* The daemon starts detection at EVAL_START_WARMUPS x the end of the LR
     * warm-up (the simulator's: 10% of the steps), at least EVAL_START_MIN;
     * the learning rate rising during warm-up is not a fault. */
    h->lr_start = EVAL_START_WARMUPS * (c->steps / 10);
    if (h->lr_start < EVAL_START_MIN)
        h->lr_start = EVAL_START_MIN;
    for (size_t i = 0; i < T_MAX_STEPS; i++)
        h->erank[i] = h->sim[i] = h->centred[i] = h->hbar[i] = h->maxvio[i] = h->wnorm[i] =
            h->uratio[i] = h->loss_trace[i] = NAN;

    for (uint32_t r = 0; r < c->ranks; r++)
        cr_assert_eq(sim_rank_create(h->sc, &h->p, r, &ranks[r]), 0);
    for (uint64_t step = 0; step < c->steps; step++) {
        harness_begin_step(h);
        for (uint32_t r = 0; r < c->ranks; r++) {
            h->cur_rank = r;
            int rc = sim_rank_step(ranks[r], step, &sink);
            cr_assert_eq(rc, 0, "rank %u step %llu: %d", r, (unsigned long long)step, rc);
        }
        harness_evaluate(h, step);
        if (step + 1 == h->p.diverge_step) {
            h->attr_before = harness_attribution(h);
            h->attr_set = true;
        }
    }
    for (uint32_t r = 0; r < c->ranks; r++)
        sim_rank_destroy(ranks[r]);
    qk_workspace_destroy(h->qk);
    router_workspace_destroy(h->rw);
}

ParameterizedTestParameters(scenario, signatures)
{
    return cr_make_param_array(struct sc_case, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(struct sc_case *c, scenario, signatures, .timeout = 240)
{
    struct harness *h = calloc(1, sizeof(*h));
    int64_t first[DETECT_FAMILY_COUNT];
    const char *who[DETECT_FAMILY_COUNT];

    cr_assert(h);
    run_case(c, h);
    family_first(h, first, who);
    const struct sim_params *p = &h->p;
    int64_t fault = p->fault_step == SIM_NEVER ? -1 : (int64_t)p->fault_step;
    int64_t diverge = p->diverge_step == SIM_NEVER ? -1 : (int64_t)p->diverge_step;

    /* diverge_step is what the ground-truth line says: the first step whose
     * loss exceeds 10x the healthy loss or is not finite. */
    int64_t seen = -1;
    for (uint64_t s = 0; s < p->steps; s++)
        if (!isfinite(h->loss_trace[s]) || h->loss_trace[s] > 10.0 * sim_healthy_loss(p, s)) {
            seen = (int64_t)s;
            break;
        }
    cr_expect_eq(seen, diverge < (int64_t)p->steps ? diverge : -1,
                 "%s: loss first exceeds 10x healthy at %lld, diverge_step %lld", c->label,
                 (long long)seen, (long long)diverge);

    fprintf(stderr,
            "%-25s fault=%lld diverge=%lld | erank2 min/heads (layer %u) %.2f -> %.2f | "
            "sim %.3f -> %.3f | centred %.3f -> %.3f | Hbar %.3f -> %.3f | maxvio %.3f -> %.3f | "
            "|W| %.4f -> %.4f | ratio %.2e -> %.2e | first fire: d2 %lld (%s) router-w %lld (%s) "
            "wnorm %lld (%s) balance %lld (%s) loss %lld (%s)\n",
            c->label, (long long)fault, (long long)diverge, p->layers - 1,
            trace_median(h->erank, 0, fault < 0 ? p->steps : (uint64_t)fault),
            trace_last(h->erank, diverge < 0 ? p->steps : (uint64_t)diverge),
            trace_median(h->sim, 0, fault < 0 ? p->steps : (uint64_t)fault),
            trace_last(h->sim, diverge < 0 ? p->steps : (uint64_t)diverge),
            trace_median(h->centred, 0, fault < 0 ? p->steps : (uint64_t)fault),
            trace_last(h->centred, diverge < 0 ? p->steps : (uint64_t)diverge),
            trace_median(h->hbar, 0, fault < 0 ? p->steps : (uint64_t)fault),
            trace_last(h->hbar, diverge < 0 ? p->steps : (uint64_t)diverge),
            trace_median(h->maxvio, 0, fault < 0 ? p->steps : (uint64_t)fault),
            trace_last(h->maxvio, diverge < 0 ? p->steps : (uint64_t)diverge),
            trace_median(h->wnorm, 0, fault < 0 ? p->steps : (uint64_t)fault),
            trace_last(h->wnorm, diverge < 0 ? p->steps : (uint64_t)diverge),
            trace_median(h->uratio, 0, fault < 0 ? p->steps : (uint64_t)fault),
            trace_last(h->uratio, diverge < 0 ? p->steps : (uint64_t)diverge), shown(first[0]),
            who[0], shown(first[1]), who[1], shown(first[2]), who[2], shown(first[3]), who[3],
            shown(first[4]), who[4]);

    int64_t d2 = first[DETECT_FAMILY_ATTENTION_D2];
    int64_t optim = first[DETECT_FAMILY_ROUTER_WEIGHT] < first[DETECT_FAMILY_WEIGHT_NORM]
                        ? first[DETECT_FAMILY_ROUTER_WEIGHT]
                        : first[DETECT_FAMILY_WEIGHT_NORM];
    switch (c->expect) {
    case EXPECT_QUIET:
        for (int f = 0; f < DETECT_FAMILY_COUNT; f++)
            cr_expect_eq(first[f], T_NO_STEP, "%s: %s fired at step %lld", c->label, who[f],
                         (long long)first[f]);
        break;
    case EXPECT_NUMERICS:
        cr_expect(d2 > fault && d2 < diverge,
                  "%s: Delta2 first fired at %lld (-1: never), "
                  "fault %lld, diverge %lld",
                  c->label, shown(d2), (long long)fault, (long long)diverge);
        cr_expect_eq(optim, T_NO_STEP, "%s: an optimizer rule fired at %lld", c->label,
                     shown(optim));
        cr_expect_eq(first[DETECT_FAMILY_ROUTER_BALANCE], T_NO_STEP, "%s: %s fired", c->label,
                     who[DETECT_FAMILY_ROUTER_BALANCE]);
        break;
    case EXPECT_OPTIMIZER:
        cr_expect(optim > fault && optim < diverge,
                  "%s: optimizer family first fired at %lld "
                  "(-1: never), fault %lld, diverge %lld",
                  c->label, shown(optim), (long long)fault, (long long)diverge);
        cr_expect_eq(d2, T_NO_STEP, "%s: %s fired at %lld", c->label,
                     who[DETECT_FAMILY_ATTENTION_D2], (long long)d2);
        break;
    case EXPECT_COMBINED:
        cr_expect(d2 > fault && d2 < diverge, "%s: Delta2 first fired at %lld (-1: never)",
                  c->label, shown(d2));
        cr_expect(optim > fault && optim < diverge,
                  "%s: optimizer family first fired at %lld (-1: never)", c->label, shown(optim));
        break;
    }
    if (c->expect != EXPECT_QUIET) {
        /* Loss and grad norm look normal until the loss starts to diverge. */
        cr_expect(first[DETECT_FAMILY_SCALAR_LOSS] >= diverge - SIM_DIVERGE_LEAD,
                  "%s: %s fired at %lld, before the divergence (%lld)", c->label,
                  who[DETECT_FAMILY_SCALAR_LOSS], (long long)first[DETECT_FAMILY_SCALAR_LOSS],
                  (long long)diverge);
        /* The label the daemon would put on the page one step before the
         * loss diverges. */
        cr_expect(h->attr_set, "%s: the run ended before diverge_step", c->label);
        cr_expect_eq(h->attr_before, c->attribution, "%s: attribution %s, expected %s", c->label,
                     alert_attribution_name(h->attr_before),
                     alert_attribution_name(c->attribution));
    }
    free(h);
}

/* ---- defaults and refusals of sim_params_resolve ------------------------------------------ */

struct resolve_case {
    char label[40];
    char scenario[24];
    uint64_t steps;
    uint32_t sketch_every, experts, top_k;
    uint64_t fault, diverge_after; /* SIM_NEVER: not given */
    int rc;                        /* expected return */
    uint64_t want_fault, want_diverge;
    uint32_t want_ramp, want_experts, want_top_k;
};

static struct resolve_case resolve_cases[] = {
    /* 40 % of the steps; max(30 % of the 240 left = 72, 6 K = 30); ramp 72 / 2. */
    {"defaults", "attention-numerics", 400, 5, SIM_UINT32_UNSET, SIM_UINT32_UNSET, SIM_NEVER,
     SIM_NEVER, 0, 160, 232, 36, 0, 0},
    /* 30 % of 60 = 18 < 6 K = 60: diverge_step past the run. */
    {"short run", "lr-spike", 100, 10, SIM_UINT32_UNSET, SIM_UINT32_UNSET, SIM_NEVER, SIM_NEVER, 0,
     40, 100, 30, 8, 2},
    {"given", "combined", 1000, 10, 16, 4, 300, 40, 0, 300, 340, 20, 16, 4},
    {"ramp cap", "combined", 10000, 10, SIM_UINT32_UNSET, SIM_UINT32_UNSET, 5000, 900, 0, 5000,
     5900, SIM_MAX_RAMP, 8, 2},
    {"ramp floor", "attention-numerics", 100, 10, 0, SIM_UINT32_UNSET, 50, 1, 0, 50, 51, 1, 0, 0},
    {"dense lr-spike", "lr-spike", 100, 10, 0, SIM_UINT32_UNSET, SIM_NEVER, SIM_NEVER, 0, 40, 100,
     30, 0, 0},
    {"healthy", "healthy", 100, 10, SIM_UINT32_UNSET, SIM_UINT32_UNSET, SIM_NEVER, SIM_NEVER, 0,
     SIM_NEVER, SIM_NEVER, 0, 0, 0},
    {"healthy + fault", "healthy", 100, 10, 0, 1, 10, SIM_NEVER, -EINVAL, 0, 0, 0, 0, 0},
    {"healthy + diverge", "healthy", 100, 10, 0, 1, SIM_NEVER, 10, -EINVAL, 0, 0, 0, 0, 0},
    {"fault past the end", "lr-spike", 100, 10, 8, 2, 100, SIM_NEVER, -EINVAL, 0, 0, 0, 0, 0},
    {"one expert", "lr-spike", 100, 10, 1, 1, SIM_NEVER, SIM_NEVER, -EINVAL, 0, 0, 0, 0, 0},
    {"top-k above experts", "healthy", 100, 10, 4, 5, SIM_NEVER, SIM_NEVER, -EINVAL, 0, 0, 0, 0, 0},
};

ParameterizedTestParameters(scenario, resolve)
{
    return cr_make_param_array(struct resolve_case, resolve_cases,
                               sizeof(resolve_cases) / sizeof(resolve_cases[0]));
}

ParameterizedTest(struct resolve_case *c, scenario, resolve)
{
    const struct scenario *sc = scenario_find(c->scenario);
    struct sim_params p = {.steps = c->steps,
                           .ranks = 1,
                           .layers = 2,
                           .heads = 2,
                           .dh = 4,
                           .d = 8,
                           .sketch_every = c->sketch_every,
                           .window = c->sketch_every,
                           .experts = c->experts,
                           .top_k = c->top_k,
                           .tokens = SIM_UINT32_UNSET};
    char err[256] = "";

    cr_assert(sc);
    int rc = sim_params_resolve(sc, &p, c->fault, c->diverge_after, err, sizeof(err));
    cr_assert_eq(rc, c->rc, "%s: rc %d (%s)", c->label, rc, err);
    if (rc < 0) {
        cr_expect(err[0], "%s: no reason given", c->label);
        return;
    }
    cr_expect_eq(p.fault_step, c->want_fault, "%s: fault %llu", c->label,
                 (unsigned long long)p.fault_step);
    cr_expect_eq(p.diverge_step, c->want_diverge, "%s: diverge %llu", c->label,
                 (unsigned long long)p.diverge_step);
    cr_expect_eq(p.ramp, c->want_ramp, "%s: ramp %u", c->label, p.ramp);
    cr_expect_eq(p.experts, c->want_experts, "%s: experts %u", c->label, p.experts);
    if (p.experts)
        cr_expect_eq(p.top_k, c->want_top_k, "%s: top_k %u", c->label, p.top_k);
    cr_expect_eq(p.tokens, SIM_DEFAULT_TOKENS);
}

/* The loss crosses 10x its healthy value exactly at diverge_step for any
 * noise the simulator can draw (|noise| < SIM_LOSS_NOISE), and is NaN once
 * the run has overflowed. */
Test(scenario, divergence_crosses_tenfold_at_diverge_step)
{
    const struct scenario *sc = scenario_find("lr-spike");
    struct sim_params p = {.steps = 1000, .fault_step = 300, .diverge_step = 400};
    const double hi = 1 + SIM_LOSS_NOISE, lo = 1 - SIM_LOSS_NOISE;

    cr_assert(sc);
    for (uint64_t t = 0; t < p.diverge_step; t++)
        cr_expect(sim_divergence(sc, &p, t) * hi < 10.0, "step %llu: factor %g",
                  (unsigned long long)t, sim_divergence(sc, &p, t));
    for (uint64_t t = 0; t + SIM_DIVERGE_LEAD < p.diverge_step; t++)
        cr_expect_eq(sim_divergence(sc, &p, t), 1.0, "step %llu", (unsigned long long)t);
    for (uint64_t t = p.diverge_step; t < p.diverge_step + SIM_DIVERGE_NAN_AFTER; t++)
        cr_expect(sim_divergence(sc, &p, t) * lo > 10.0, "step %llu: factor %g",
                  (unsigned long long)t, sim_divergence(sc, &p, t));
    for (uint64_t t = p.diverge_step + SIM_DIVERGE_NAN_AFTER; t < p.steps; t++)
        cr_expect(isnan(sim_divergence(sc, &p, t)), "step %llu", (unsigned long long)t);
    cr_expect_eq(sim_divergence(scenario_find("healthy"), &p, 500), 1.0);
}

/* Every rank holds the same router (the layer's stream), its shard Gram
 * covers its own columns, and the shards add up to the whole Gram. Uneven
 * shards: d = 10 over 3 ranks is 4 + 3 + 3 columns. */
Test(scenario, router_replicas_and_shards)
{
    const struct scenario *sc = scenario_find("lr-spike");
    struct sim_params p = {.steps = 50,
                           .seed = 9,
                           .ranks = 3,
                           .layers = 2,
                           .heads = 1,
                           .dh = 2,
                           .d = 10,
                           .sketch_every = 5,
                           .window = 5,
                           .sketches = 1,
                           .experts = SIM_UINT32_UNSET,
                           .top_k = SIM_UINT32_UNSET,
                           .tokens = 16};
    struct sim_rank *r[3];
    struct sim_sink none = {0};
    char err[128];
    size_t cols = 0;

    cr_assert(sc);
    cr_assert_eq(sim_params_resolve(sc, &p, 20, 10, err, sizeof(err)), 0, "%s", err);
    for (uint32_t i = 0; i < 3; i++)
        cr_assert_eq(sim_rank_create(sc, &p, i, &r[i]), 0);
    for (uint64_t t = 0; t < 25; t++) /* through the fault: overshoot updates too */
        for (uint32_t i = 0; i < 3; i++)
            cr_assert_eq(sim_rank_step(r[i], t, &none), 0);
    cr_expect_eq(sim_rank_step(r[0], 30, &none), -EINVAL, "a skipped step must be refused");
    for (uint32_t i = 0; i < 3; i++) {
        cr_expect_eq(r[i]->c0, cols, "rank %u starts at column %zu", i, r[i]->c0);
        cols += r[i]->ds;
        cr_assert_eq(r[i]->n_moe, 2);
        for (uint32_t m = 0; m < 2; m++)
            cr_expect(
                !memcmp(r[i]->rt[m].obs, r[0]->rt[m].obs, (size_t)p.experts * p.d * sizeof(float)),
                "rank %u holds a different router %u", i, m);
    }
    cr_expect_eq(cols, p.d);
    /* Shard Grams (float, as sent) sum to the Gram of the whole router. */
    size_t e = p.experts, tri = fsc_tri_len(e);
    double sum[SIM_DEFAULT_EXPERTS * (SIM_DEFAULT_EXPERTS + 1) / 2] = {0};
    float part[SIM_DEFAULT_EXPERTS * (SIM_DEFAULT_EXPERTS + 1) / 2];
    for (uint32_t i = 0; i < 3; i++) {
        struct sim_router *t = &r[i]->rt[1];
        for (size_t x = 0; x < e; x++)
            memcpy(t->shard + x * r[i]->ds, t->obs + x * p.d + r[i]->c0, r[i]->ds * sizeof(float));
        cr_assert_eq(fsc_router_gram(t->shard, e, r[i]->ds, part), 0);
        for (size_t k = 0; k < tri; k++)
            sum[k] += part[k];
    }
    const float *w = r[0]->rt[1].obs;
    for (size_t i = 0, k = 0; i < e; i++)
        for (size_t j = i; j < e; j++, k++) {
            double g = 0;
            for (size_t c = 0; c < p.d; c++)
                g += (double)w[i * p.d + c] * w[j * p.d + c];
            cr_expect(fabs(sum[k] - g) <= 1e-5 * (1 + fabs(g)), "GR[%zu][%zu] %g vs %g", i, j,
                      sum[k], g);
        }
    for (uint32_t i = 0; i < 3; i++)
        sim_rank_destroy(r[i]);
}

/* ---- the shapes simulate accepts (sim_params_check) ------------------------------------------ */

struct shape_case {
    char label[48];
    uint32_t ranks, layers, heads, kv_heads, dh, d, window, experts;
    enum sim_route route;
    uint32_t replay_mb;
    int rc;          /* expected return */
    char reason[40]; /* a word the refusal must contain */
    int split_heads; /* gram route: whole heads per rank */
};

static struct shape_case shape_cases[] = {
    /* Full shapes on the spectrum route: no attention weights are held. */
    {"7B spectrum, 8 ranks", 8, 32, 32, 8, 128, 4096, 10, 0, SIM_ROUTE_SPECTRUM, 64, 0, "", 0},
    {"7B spectrum, 1 rank", 1, 32, 32, 8, 128, 4096, 10, 0, SIM_ROUTE_SPECTRUM, 64, 0, "", 0},
    {"70B spectrum, 8 ranks", 8, 80, 64, 8, 128, 8192, 10, 0, SIM_ROUTE_SPECTRUM, 64, 0, "", 0},
    {"70B spectrum, 1 rank", 1, 80, 64, 8, 128, 8192, 10, 0, SIM_ROUTE_SPECTRUM, 64, 0, "", 0},
    {"70B spectrum, 1024 ranks", 1024, 80, 64, 8, 128, 8192, 10, 0, SIM_ROUTE_SPECTRUM, 64, 0, "",
     0},
    {"70B spectrum MoE, 8 ranks", 8, 80, 64, 8, 128, 8192, 10, 8, SIM_ROUTE_SPECTRUM, 64, 0, "", 0},
    /* 16 MB per report: not with an 8 MiB replay buffer. */
    {"70B spectrum, 1 rank, small replay", 1, 80, 64, 8, 128, 8192, 10, 0, SIM_ROUTE_SPECTRUM, 8,
     -EINVAL, "replay", 0},
    /* The Gram route holds the weights: a rank holding a slice of d of every
     * head sends a report over a frame for the 7B shape (269 MB), and 70B
     * weights are too many; the largest 7B-like shape that fits still runs.
     * With the heads split over 8 ranks the 7B shape runs (34 MB reports);
     * on one rank its weights are too many. */
    {"7B gram, 8 ranks", 8, 32, 32, 8, 128, 4096, 10, 0, SIM_ROUTE_GRAM, 64, -EINVAL, "frame", 0},
    {"7B gram, 8 ranks, split heads", 8, 32, 32, 8, 128, 4096, 10, 0, SIM_ROUTE_GRAM, 64, 0, "", 1},
    {"7B gram, 1 rank, split heads", 1, 32, 32, 8, 128, 4096, 10, 0, SIM_ROUTE_GRAM, 64, -EINVAL,
     "floats", 1},
    {"70B gram, 8 ranks, split heads", 8, 80, 64, 8, 128, 8192, 10, 0, SIM_ROUTE_GRAM, 64, -EINVAL,
     "floats", 1},
    {"gram split heads, more ranks than d", 64, 2, 4, 0, 16, 32, 10, 0, SIM_ROUTE_GRAM, 64, 0, "",
     1},
    {"70B gram, 8 ranks", 8, 80, 64, 8, 128, 8192, 10, 0, SIM_ROUTE_GRAM, 64, -EINVAL, "floats", 0},
    {"7B gram, 32 ranks (frame)", 32, 32, 32, 8, 128, 4096, 10, 0, SIM_ROUTE_GRAM, 64, -EINVAL,
     "frame", 0},
    {"7B-like gram, 32 x 7 heads", 8, 32, 7, 0, 128, 4096, 10, 0, SIM_ROUTE_GRAM, 64, 0, "", 0},
    {"GQA gram, 2 of 8 key heads", 4, 2, 8, 2, 16, 128, 10, 0, SIM_ROUTE_GRAM, 64, 0, "", 0},
    /* Key heads must divide the query heads. */
    {"kv-heads 7 of 32", 8, 32, 32, 7, 128, 4096, 10, 0, SIM_ROUTE_SPECTRUM, 64, -EINVAL, "divide",
     0},
    {"kv-heads above heads", 1, 2, 4, 8, 16, 64, 10, 0, SIM_ROUTE_GRAM, 64, -EINVAL, "divide", 0},
    /* d is split over the ranks only where it is sharded. */
    {"gram, more ranks than d", 64, 2, 4, 0, 16, 32, 10, 0, SIM_ROUTE_GRAM, 64, -EINVAL, "--d", 0},
    {"spectrum dense, more ranks than d", 64, 2, 4, 0, 16, 32, 10, 0, SIM_ROUTE_SPECTRUM, 64, 0, "",
     0},
    {"spectrum MoE, more ranks than d", 64, 2, 4, 0, 16, 32, 10, 8, SIM_ROUTE_SPECTRUM, 64, -EINVAL,
     "--d", 0},
    {"window of 63 sketches", 1, 2, 4, 0, 16, 64, 630, 0, SIM_ROUTE_SPECTRUM, 64, -EINVAL,
     "--window", 0},
};

ParameterizedTestParameters(scenario, shapes)
{
    return cr_make_param_array(struct shape_case, shape_cases,
                               sizeof(shape_cases) / sizeof(shape_cases[0]));
}

ParameterizedTest(struct shape_case *c, scenario, shapes)
{
    const struct scenario *sc = scenario_find(c->experts ? "lr-spike" : "healthy");
    struct sim_params p = {.steps = 1000,
                           .seed = 1,
                           .ranks = c->ranks,
                           .layers = c->layers,
                           .heads = c->heads,
                           .kv_heads = c->kv_heads,
                           .route = c->route,
                           .split_heads = c->split_heads,
                           .dh = c->dh,
                           .d = c->d,
                           .sketch_every = 10,
                           .window = c->window,
                           .sketches = 1,
                           .layer_norms = 1,
                           .experts = c->experts,
                           .top_k = SIM_UINT32_UNSET,
                           .tokens = SIM_UINT32_UNSET};
    char err[256] = "";

    cr_assert(sc);
    cr_assert_eq(sim_params_resolve(sc, &p, SIM_NEVER, SIM_NEVER, err, sizeof(err)), 0, "%s", err);
    int rc = sim_params_check(&p, (size_t)c->replay_mb << 20, err, sizeof(err));
    cr_expect_eq(rc, c->rc, "%s: rc %d (%s)", c->label, rc, err);
    if (c->rc < 0)
        cr_expect(strstr(err, c->reason), "%s: the refusal '%s' does not say '%s'", c->label, err,
                  c->reason);
    if (rc == 0 && c->route == SIM_ROUTE_SPECTRUM) {
        /* What the check let through must also be creatable, cheaply: one
         * head's spectra, no weights (routers aside). */
        struct sim_rank *r = NULL;
        cr_assert_eq(sim_rank_create(sc, &p, c->ranks - 1, &r), 0, "%s", c->label);
        cr_expect(!r->wq && !r->wk && !r->snap_q && !r->snap_k);
        sim_rank_destroy(r);
    }
    if (rc == 0 && c->split_heads && sim_rank_floats(&p) < (1u << 20)) {
        /* The last rank, which may hold no head: created all the same. */
        struct sim_rank *r = NULL;
        cr_expect_eq(sim_rank_create(sc, &p, c->ranks - 1, &r), 0, "%s", c->label);
        sim_rank_destroy(r);
    }
}

/* Spectrum route: every query head of a layer is held by exactly one rank,
 * in contiguous blocks, rank 0's never empty. */
struct heads_case {
    uint32_t heads, ranks, rank, h0, h1;
};

static struct heads_case heads_cases[] = {
    {32, 8, 0, 0, 4},   {32, 8, 7, 28, 32},    {64, 8, 3, 24, 32}, {5, 2, 0, 0, 3},
    {5, 2, 1, 3, 5},    {4, 8, 0, 0, 1},       {4, 8, 1, 1, 1},    {4, 8, 2, 1, 2},
    {1, 1024, 0, 0, 1}, {1, 1024, 1023, 1, 1},
};

ParameterizedTestParameters(scenario, rank_heads)
{
    return cr_make_param_array(struct heads_case, heads_cases,
                               sizeof(heads_cases) / sizeof(heads_cases[0]));
}

ParameterizedTest(struct heads_case *c, scenario, rank_heads)
{
    struct sim_params p = {.heads = c->heads, .ranks = c->ranks};
    uint32_t h0, h1, next = 0;

    sim_rank_heads(&p, c->rank, &h0, &h1);
    cr_expect(h0 == c->h0 && h1 == c->h1,
              "%u heads over %u ranks, rank %u: [%u, %u), want "
              "[%u, %u)",
              c->heads, c->ranks, c->rank, h0, h1, c->h0, c->h1);
    for (uint32_t r = 0; r < c->ranks; r++) {
        sim_rank_heads(&p, r, &h0, &h1);
        cr_assert(h0 == next && h1 >= h0, "rank %u: [%u, %u) after %u", r, h0, h1, next);
        next = h1;
    }
    cr_expect_eq(next, c->heads, "the blocks cover %u of %u heads", next, c->heads);
}

struct route_case {
    char name[16];
    int rc;
    enum sim_route route;
};

static struct route_case route_cases[] = {
    {"gram", 0, SIM_ROUTE_GRAM},           {"spectrum", 0, SIM_ROUTE_SPECTRUM},
    {"Spectrum", -EINVAL, SIM_ROUTE_GRAM}, {"", -EINVAL, SIM_ROUTE_GRAM},
    {"spectra", -EINVAL, SIM_ROUTE_GRAM},
};

ParameterizedTestParameters(scenario, route_names)
{
    return cr_make_param_array(struct route_case, route_cases,
                               sizeof(route_cases) / sizeof(route_cases[0]));
}

ParameterizedTest(struct route_case *c, scenario, route_names)
{
    enum sim_route r = SIM_ROUTE_GRAM;
    cr_expect_eq(sim_route_parse(c->name, &r), c->rc, "'%s'", c->name);
    if (c->rc == 0) {
        cr_expect_eq(r, c->route, "'%s'", c->name);
        cr_expect_str_eq(sim_route_name(r), c->name);
    }
}

/* With GQA the Gram route pairs each query head with its key head: the GB
 * a query head sends is its group's, identical across the group, and the
 * spectrum route names the same key head. */
Test(scenario, gqa_pairs_query_heads_with_their_key_head)
{
    const struct scenario *sc = scenario_find("healthy");
    struct sim_params p = {.steps = 20,
                           .seed = 3,
                           .ranks = 1,
                           .layers = 1,
                           .heads = 6,
                           .kv_heads = 2,
                           .dh = 4,
                           .d = 24,
                           .sketch_every = 5,
                           .window = 5,
                           .sketches = 1,
                           .experts = 0,
                           .top_k = SIM_UINT32_UNSET,
                           .tokens = SIM_UINT32_UNSET};
    struct sim_rank *r = NULL;
    char err[128];
    size_t tri = fsc_tri_len(8);
    float gb[6][36], ga[36];

    cr_assert(sc);
    cr_assert_eq(sim_params_resolve(sc, &p, SIM_NEVER, SIM_NEVER, err, sizeof(err)), 0);
    cr_assert_eq(sim_params_check(&p, 64u << 20, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(sim_rank_create(sc, &p, 0, &r), 0);
    cr_expect_eq(r->all_k * 3, r->all_q, "2 key heads for 6 query heads");
    struct sim_sink none = {0};
    for (uint64_t t = 0; t < 10; t++)
        cr_assert_eq(sim_rank_step(r, t, &none), 0);
    for (uint32_t h = 0; h < 6; h++) {
        size_t off = (size_t)h * r->block, koff = (size_t)(h / 3) * r->block;
        size_t slot = (size_t)((10 / 5) % r->nsnap);
        cr_assert_eq(advance(r, 10), 0);
        cr_assert_eq(fsc_attention_grams(r->wq + off, r->wk + koff,
                                         r->snap_q + slot * r->all_q + off,
                                         r->snap_k + slot * r->all_k + koff, 4, r->ds, ga, gb[h]),
                     0);
    }
    for (uint32_t h = 0; h < 6; h++)
        cr_expect(!memcmp(gb[h], gb[h - h % 3], tri * sizeof(float)),
                  "query head %u sends another GB than its group's first head", h);
    cr_expect(memcmp(gb[0], gb[3], tri * sizeof(float)), "the two key heads are the same");
    sim_rank_destroy(r);
}

/* ---- split heads: a head's Grams do not depend on who holds it ------------------------------ */

#define SPLIT_STEPS 40
#define SPLIT_HEADS 6
#define SPLIT_LAYERS 2
#define SPLIT_TRI 36 /* fsc_tri_len(2 dh), dh 4 */

struct split_sink {
    uint32_t rank;
    /* per (sketch step / 10, layer, head): ga, gb, and who sent it */
    float g[SPLIT_STEPS / 10 + 1][SPLIT_LAYERS][SPLIT_HEADS][2][SPLIT_TRI];
    int sent[SPLIT_STEPS / 10 + 1][SPLIT_LAYERS][SPLIT_HEADS];
    uint32_t kv[SPLIT_LAYERS][SPLIT_HEADS];
    int bad_shard;
};

static int split_put(void *ctx, uint64_t step, uint32_t layer, uint32_t head, uint32_t kv_head,
                     uint32_t window, uint32_t dh, uint32_t shard, uint32_t shards, const float *ga,
                     const float *gb)
{
    struct split_sink *s = ctx;
    (void)window, (void)dh;
    if (shard != 0 || shards != 1)
        s->bad_shard = 1;
    memcpy(s->g[step / 10][layer][head][0], ga, sizeof(s->g[0][0][0][0]));
    memcpy(s->g[step / 10][layer][head][1], gb, sizeof(s->g[0][0][0][0]));
    s->sent[step / 10][layer][head]++;
    s->kv[layer][head] = kv_head;
    return 0;
}

/* 6 query heads reading 2 key heads, held by 1 rank and by 4 (blocks of
 * 2, 2, 1, 1 heads: the second rank's heads 2 and 3 read both key heads,
 * so key head 0 lives on two ranks): every head is sent by exactly one
 * rank, whole (shard 0 of 1), and its Grams are the same bytes either way,
 * under healthy updates and under the attention fault (whose coherent
 * update depends on the weights it moves). */
struct split_case {
    char scenario[24];
};

static struct split_case split_cases[] = {{"healthy"}, {"attention-numerics"}};

ParameterizedTestParameters(scenario, split_heads_same_grams)
{
    return cr_make_param_array(struct split_case, split_cases,
                               sizeof(split_cases) / sizeof(split_cases[0]));
}

ParameterizedTest(struct split_case *c, scenario, split_heads_same_grams)
{
    const struct scenario *sc = scenario_find(c->scenario);
    static struct split_sink one, many;
    struct sim_params p1 = {.steps = SPLIT_STEPS,
                            .seed = 7,
                            .ranks = 1,
                            .layers = SPLIT_LAYERS,
                            .heads = SPLIT_HEADS,
                            .kv_heads = 2,
                            .split_heads = 1,
                            .dh = 4,
                            .d = 24,
                            .sketch_every = 10,
                            .window = 10,
                            .sketches = 1,
                            .layer_norms = 1,
                            .experts = 0,
                            .top_k = SIM_UINT32_UNSET,
                            .tokens = SIM_UINT32_UNSET};
    struct sim_params p4;
    char err[256];

    cr_assert(sc);
    cr_assert_eq(sim_params_resolve(sc, &p1, sc->faulty ? 12 : SIM_NEVER,
                                    sc->faulty ? 20 : SIM_NEVER, err, sizeof(err)),
                 0, "%s", err);
    p4 = p1;
    p4.ranks = 4;
    cr_assert_eq(sim_params_check(&p1, 64u << 20, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(sim_params_check(&p4, 64u << 20, err, sizeof(err)), 0, "%s", err);
    memset(&one, 0, sizeof(one));
    memset(&many, 0, sizeof(many));
    for (uint32_t n = 0; n < 2; n++) {
        const struct sim_params *p = n ? &p4 : &p1;
        struct split_sink *out = n ? &many : &one;
        for (uint32_t rk = 0; rk < p->ranks; rk++) {
            struct sim_rank *r = NULL;
            struct sim_sink sink = {.ctx = out, .attention = split_put};
            cr_assert_eq(sim_rank_create(sc, p, rk, &r), 0);
            for (uint64_t t = 0; t < SPLIT_STEPS; t++)
                cr_assert_eq(sim_rank_step(r, t, &sink), 0, "rank %u step %llu", rk,
                             (unsigned long long)t);
            sim_rank_destroy(r);
        }
    }
    cr_expect(!one.bad_shard && !many.bad_shard, "a whole head was sent as a shard of d");
    for (uint32_t k = 1; k < SPLIT_STEPS / 10; k++)
        for (uint32_t l = 0; l < SPLIT_LAYERS; l++)
            for (uint32_t h = 0; h < SPLIT_HEADS; h++) {
                cr_expect(one.sent[k][l][h] == 1 && many.sent[k][l][h] == 1,
                          "step %u layer %u head %u sent %d times by 1 rank, %d by 4", k * 10, l, h,
                          one.sent[k][l][h], many.sent[k][l][h]);
                cr_expect(!memcmp(one.g[k][l][h], many.g[k][l][h], sizeof(one.g[k][l][h])),
                          "step %u layer %u head %u: other Grams on 4 ranks than on 1", k * 10, l,
                          h);
                cr_expect_eq(many.kv[l][h], h / 3, "head %u read key head %u", h, many.kv[l][h]);
            }
    /* Different heads are different: a mix-up would not pass unseen. */
    cr_expect(memcmp(one.g[1][0][0], one.g[1][0][1], sizeof(one.g[1][0][0])));
    cr_expect(memcmp(one.g[1][0][0], one.g[1][1][0], sizeof(one.g[1][0][0])));
}
