/* Unit tests for daemon/monitor_router.c (docs/monitors.md 3.1, 3.2).
 *
 * References are computed in the test from the raw objects the statistics
 * summarise: 3.1 from a random router weight WR (E x d rows w_i: cosines,
 * the mean row, distances, the centred matrix, and sigma^2(WR) by
 * LAPACKE_dgesdd), 3.2 from random logits (softmax, H_t, logsumexp, top-k
 * per token). Tolerances: double GR 1e-10 relative (spectra 1e-12 * s_max);
 * GR through float32 wire bytes 1e-5 (spectra 1e-6 * s_max); token
 * statistics 1e-10 (the spread, a difference of moments, 1e-8). */
#include <criterion/criterion.h>
#include <errno.h>
#include <float.h>
#include <lapacke.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fstest.h"
#include "monitor_qk.h" /* monitor_tri_len, monitor_tri_accumulate */
#include "monitor_router.h"

static void assert_rel(double got, double want, double rel, const char *what, const char *name)
{
    double tol = rel * fmax(1.0, fabs(want));
    cr_assert(fabs(got - want) <= tol, "%s: %s got %.15g want %.15g", name, what, got, want);
}

/* ---- 3.1 weight side ------------------------------------------------------ */

enum wr_shape {
    WR_SHARED_MEAN, /* w_i = mu + noise: a clear mean row */
    WR_RANDOM,      /* no common direction */
    WR_ZERO_MEAN,   /* rows in +/- pairs: wbar = 0 exactly -> kappa absent */
    WR_ZERO_ROW,    /* expert 1 has all-zero weights */
    WR_ALL_ZERO,
};

struct wr_case {
    const char *name;
    unsigned e, d;
    enum wr_shape shape;
    unsigned shards; /* 1, or 3 uneven slices of d */
    bool f32;
    bool sim_present, kappa_present, spec_present;
};

static const struct wr_case wr_cases[] = {
    {"E8 d64 shared mean", 8, 64, WR_SHARED_MEAN, 1, false, true, true, true},
    {"E2 d16", 2, 16, WR_SHARED_MEAN, 1, false, true, true, true},
    {"E64 d256 random", 64, 256, WR_RANDOM, 1, false, true, true, true},
    {"E128 d96 (d < E)", 128, 96, WR_SHARED_MEAN, 1, false, true, true, true},
    {"E16 zero mean", 16, 64, WR_ZERO_MEAN, 1, false, true, false, true},
    {"E8 a zero row", 8, 32, WR_ZERO_ROW, 1, false, true, true, true},
    {"E1", 1, 16, WR_SHARED_MEAN, 1, false, false, true, true},
    {"E8 all zero", 8, 16, WR_ALL_ZERO, 1, false, false, false, false},
    {"E32 3 shards", 32, 128, WR_SHARED_MEAN, 3, false, true, true, true},
    {"E64 f32 wire 3 shards", 64, 256, WR_SHARED_MEAN, 3, true, true, true, true},
};

static double *wr_make(const struct wr_case *k, uint64_t *seed)
{
    size_t e = k->e, d = k->d;
    double *w = calloc(e * d, sizeof(*w)), *mu = malloc(d * sizeof(*mu));
    cr_assert(w && mu);
    for (size_t c = 0; c < d; c++)
        mu[c] = 2.0 * gauss(seed);
    if (k->shape == WR_ALL_ZERO)
        goto out;
    for (size_t i = 0; i < e; i++)
        for (size_t c = 0; c < d; c++) {
            double x = gauss(seed);
            if (k->shape == WR_SHARED_MEAN)
                x += mu[c];
            if (k->shape == WR_ZERO_MEAN && i % 2)
                x = -w[(i - 1) * d + c];
            w[i * d + c] = x;
        }
    if (k->shape == WR_ZERO_ROW)
        memset(w + 1 * d, 0, d * sizeof(*w));
out:
    free(mu);
    return w;
}

static void gr_make(const struct wr_case *k, const double *w, double *gr)
{
    size_t e = k->e, d = k->d, len = monitor_tri_len(e);
    memset(gr, 0, len * sizeof(*gr));
    size_t cuts[4] = {0, d, d, d};
    if (k->shards == 3) {
        cuts[1] = d / 5;
        cuts[2] = d / 2;
    }
    for (unsigned s = 0; s < k->shards; s++) {
        if (!k->f32) {
            gram_tri_add(w, e, d, cuts[s], cuts[s + 1], gr);
            continue;
        }
        double *part = calloc(len, sizeof(*part));
        cr_assert_not_null(part);
        gram_tri_add(w, e, d, cuts[s], cuts[s + 1], part);
        unsigned char *b = tri_to_f32le(part, len);
        cr_assert_eq(monitor_tri_accumulate(gr, e, b, len * 4), 0);
        free(part);
        free(b);
    }
}

struct wr_ref {
    bool sim_present;
    double sim, wbar_sq, kappa, centered_energy;
    double *spec; /* E values, descending, zero padded when d < E */
};

static double dot(const double *a, const double *b, size_t d)
{
    double s = 0;
    for (size_t c = 0; c < d; c++)
        s += a[c] * b[c];
    return s;
}

static struct wr_ref wr_reference(const double *w, size_t e, size_t d)
{
    struct wr_ref r = {0};
    double *wbar = calloc(d, sizeof(*wbar));
    cr_assert_not_null(wbar);
    for (size_t i = 0; i < e; i++)
        for (size_t c = 0; c < d; c++)
            wbar[c] += w[i * d + c] / (double)e;
    r.wbar_sq = dot(wbar, wbar, d);
    /* mean cosine over ordered pairs of non-zero rows */
    double sim = 0;
    size_t pairs = 0;
    for (size_t i = 0; i < e; i++)
        for (size_t j = 0; j < e; j++) {
            double ni = sqrt(dot(w + i * d, w + i * d, d)), nj = sqrt(dot(w + j * d, w + j * d, d));
            if (i == j || ni == 0 || nj == 0)
                continue;
            sim += dot(w + i * d, w + j * d, d) / (ni * nj);
            pairs++;
        }
    r.sim_present = pairs > 0;
    r.sim = pairs ? sim / (double)pairs : 0;
    double maxdist = 0, energy = 0;
    for (size_t i = 0; i < e; i++) {
        double s = 0;
        for (size_t c = 0; c < d; c++) {
            double x = w[i * d + c] - wbar[c];
            s += x * x;
        }
        energy += s;
        maxdist = fmax(maxdist, sqrt(s));
    }
    r.centered_energy = energy;
    r.kappa = r.wbar_sq > 0 ? maxdist / sqrt(r.wbar_sq) : 0;
    /* sigma^2(WR): WR row-major E x d is WR^T column-major d x E. */
    size_t mn = e < d ? e : d;
    double *a = malloc(e * d * sizeof(*a)), *s = malloc(mn * sizeof(*s));
    cr_assert(a && s);
    memcpy(a, w, e * d * sizeof(*a));
    lapack_int info = LAPACKE_dgesdd(LAPACK_COL_MAJOR, 'N', (lapack_int)d, (lapack_int)e, a,
                                     (lapack_int)d, s, NULL, 1, NULL, 1);
    cr_assert_eq(info, 0);
    r.spec = calloc(e, sizeof(*r.spec));
    cr_assert_not_null(r.spec);
    for (size_t i = 0; i < mn; i++)
        r.spec[i] = s[i] * s[i];
    free(a);
    free(s);
    free(wbar);
    return r;
}

Test(monitor_router, weight_side_against_direct_computation)
{
    struct router_workspace *ws;
    cr_assert_eq(router_workspace_create(128, &ws), 0);
    uint64_t seed = 99;
    for (size_t c = 0; c < sizeof wr_cases / sizeof wr_cases[0]; c++) {
        const struct wr_case *k = &wr_cases[c];
        double *w = wr_make(k, &seed);
        struct wr_ref ref = wr_reference(w, k->e, k->d);
        double *gr = malloc(monitor_tri_len(k->e) * sizeof(*gr));
        cr_assert_not_null(gr);
        gr_make(k, w, gr);
        struct router_weight out;
        int rc = router_weight_compute(ws, k->e, gr, &out);
        cr_assert_eq(rc, 0, "%s: rc %d", k->name, rc);
        cr_assert(!out.nonfinite && out.present, "%s", k->name);
        double tol = k->f32 ? 1e-5 : 1e-10;
        /* Quantities that are differences of near-equal sums (wbar_sq of
         * a zero-mean WR, the energy) are compared on the scale of tr GR. */
        double tr = 0;
        for (size_t i = 0; i < (size_t)k->e * k->d; i++)
            tr += w[i] * w[i];
        double scale = tr / k->e;
        cr_assert_eq(out.sim_present, k->sim_present, "%s: sim present", k->name);
        if (k->sim_present)
            assert_rel(out.sim, ref.sim, tol, "sim", k->name);
        cr_assert(fabs(out.wbar_sq - ref.wbar_sq) <= tol * fmax(scale, 1e-300),
                  "%s: wbar_sq %g vs %g", k->name, out.wbar_sq, ref.wbar_sq);
        cr_assert(fabs(out.centered_energy - ref.centered_energy) <= tol * fmax(tr, 1e-300),
                  "%s: centered energy %.15g vs %.15g", k->name, out.centered_energy,
                  ref.centered_energy);
        cr_assert_eq(out.kappa_present, k->kappa_present, "%s: kappa present", k->name);
        if (k->kappa_present)
            assert_rel(out.kappa, ref.kappa, k->f32 ? 1e-4 : 1e-9, "kappa", k->name);
        /* The spectrum, then its scalars. */
        size_t len;
        const double *spec = router_workspace_spectrum(ws, &len);
        struct spectrum_scalars want = ref_scalars(ref.spec, k->e, k->e);
        cr_assert_eq(out.spec.present, k->spec_present, "%s: spec present", k->name);
        cr_assert_eq(want.present, k->spec_present, "%s: reference spec present", k->name);
        if (k->spec_present) {
            cr_assert_eq(len, k->e, "%s", k->name);
            double stol = (k->f32 ? 1e-6 : 1e-12) * ref.spec[0];
            for (size_t i = 0; i < len; i++)
                cr_assert(fabs(spec[i] - ref.spec[i]) <= stol, "%s: lambda %zu %.15g vs %.15g",
                          k->name, i, spec[i], ref.spec[i]);
            if (!k->f32)
                cr_assert_eq(out.spec.rank, want.rank, "%s: rank", k->name);
            assert_rel(out.spec.erank2, want.erank2, tol, "erank2", k->name);
            assert_rel(out.spec.erank1, want.erank1, tol, "erank1", k->name);
            assert_rel(out.spec.entropy2, want.entropy2, tol, "entropy2", k->name);
            assert_rel(out.spec.srank, want.srank, tol, "srank", k->name);
        }
        free(gr);
        free(ref.spec);
        free(w);
    }
    router_workspace_destroy(ws);
}

Test(monitor_router, similarity_rises_as_rows_align)
{
    /* The large-LR symptom: rows drift towards a common direction. */
    struct router_workspace *ws;
    cr_assert_eq(router_workspace_create(16, &ws), 0);
    uint64_t seed = 4;
    double prev_sim = -2, prev_kappa = INFINITY;
    for (double a = 0.0; a <= 4.0; a += 1.0) {
        struct wr_case k = {"align", 16, 64, WR_RANDOM, 1, false, true, true, true};
        uint64_t s = seed;
        double *w = wr_make(&k, &s);
        for (size_t c = 0; c < 64; c++)
            for (size_t i = 0; i < 16; i++)
                w[i * 64 + c] += a * (c % 2 ? 1.0 : -1.0);
        double gr[136]; /* monitor_tri_len(16) */
        gr_make(&k, w, gr);
        struct router_weight out;
        cr_assert_eq(router_weight_compute(ws, 16, gr, &out), 0);
        cr_assert_gt(out.sim, prev_sim);
        cr_assert_lt(out.kappa, prev_kappa);
        prev_sim = out.sim;
        prev_kappa = out.kappa;
        free(w);
    }
    router_workspace_destroy(ws);
}

Test(monitor_router, weight_side_robustness)
{
    struct router_workspace *ws = (void *)1;
    cr_assert_eq(router_workspace_create(0, &ws), -EINVAL);
    cr_assert_null(ws);
    cr_assert_eq(router_workspace_create(ROUTER_MAX_EXPERTS + 1, &ws), -EINVAL);
    cr_assert_eq(router_workspace_create(4, &ws), 0);
    double gr[10] = {1, 0.5, 0, 0, 2, 0, 0, 3, 0, 4};
    struct router_weight out;
    cr_assert_eq(router_weight_compute(ws, 5, gr, &out), -EINVAL); /* above max */
    cr_assert_eq(router_weight_compute(ws, 0, gr, &out), -EINVAL);
    cr_assert_eq(router_weight_compute(ws, 4, NULL, &out), -EINVAL);
    cr_assert_eq(router_weight_compute(ws, 4, gr, NULL), -EINVAL);
    static const double bad[] = {NAN, INFINITY, -INFINITY};
    for (size_t i = 0; i < 3; i++) {
        double g[10];
        memcpy(g, gr, sizeof g);
        g[3 + i] = bad[i];
        cr_assert_eq(router_weight_compute(ws, 4, g, &out), 0);
        cr_assert(out.nonfinite && !out.present && !out.spec.present && !out.sim_present);
    }
    /* Huge finite entries: no overflow inside the solver, same shape. */
    struct router_weight unit, big;
    cr_assert_eq(router_weight_compute(ws, 4, gr, &unit), 0);
    double g[10];
    for (int i = 0; i < 10; i++)
        g[i] = gr[i] * 1e300;
    cr_assert_eq(router_weight_compute(ws, 4, g, &big), 0);
    cr_assert(!big.nonfinite && big.spec.present);
    assert_rel(big.spec.erank2, unit.spec.erank2, 1e-12, "erank2", "huge");
    assert_rel(big.sim, unit.sim, 1e-12, "sim", "huge");
    router_workspace_destroy(ws);
    router_workspace_destroy(NULL);
}

/* ---- 3.2 decision side ---------------------------------------------------- */

struct tok_case {
    const char *name;
    unsigned e, k; /* experts, top-k */
    unsigned tokens;
    double temp;    /* logit scale: large = confident routing */
    double bias0;   /* logit bias of expert 0: large = collapse onto it */
    unsigned ranks; /* token statistics summed over this many ranks */
};

static const struct tok_case tok_cases[] = {
    {"E8 top2 balanced", 8, 2, 2000, 1.0, 0.0, 1},
    {"E64 top8", 64, 8, 3000, 2.0, 0.0, 1},
    {"E16 top1 collapsed (dead experts)", 16, 1, 1000, 0.5, 8.0, 1},
    {"E8 top2 over 3 ranks", 8, 2, 2000, 1.5, 1.0, 3},
    {"E1", 1, 1, 100, 1.0, 0.0, 1},
    {"E128 top2 confident", 128, 2, 1500, 6.0, 0.0, 2},
};

struct tok_ref {
    double entropy_mean, entropy_spread, maxvio, load_entropy, balance, zloss;
    unsigned dead;
};

Test(monitor_router, decision_side_against_per_token_computation)
{
    uint64_t seed = 1234;
    for (size_t c = 0; c < sizeof tok_cases / sizeof tok_cases[0]; c++) {
        const struct tok_case *k = &tok_cases[c];
        size_t e = k->e, t_n = k->tokens;
        double *h = malloc(t_n * sizeof(*h)), *lse = malloc(t_n * sizeof(*lse));
        double *z = malloc(e * sizeof(*z)), *p = malloc(e * sizeof(*p));
        double *tot_p = calloc(e, sizeof(*tot_p));
        uint64_t *tot_load = calloc(e, sizeof(*tot_load));
        /* per-rank sums */
        uint64_t *load = calloc((size_t)k->ranks * e, sizeof(*load));
        double *sum_p = calloc((size_t)k->ranks * e, sizeof(*sum_p));
        double rank_h[3] = {0}, rank_h2[3] = {0}, rank_l2[3] = {0};
        uint64_t rank_n[3] = {0};
        cr_assert(h && lse && z && p && tot_p && tot_load && load && sum_p);
        for (size_t t = 0; t < t_n; t++) {
            unsigned r = (unsigned)(t % k->ranks);
            double zmax = -INFINITY;
            for (size_t i = 0; i < e; i++) {
                z[i] = k->temp * gauss(&seed) + (i == 0 ? k->bias0 : 0.0);
                zmax = fmax(zmax, z[i]);
            }
            double se = 0;
            for (size_t i = 0; i < e; i++)
                se += exp(z[i] - zmax);
            lse[t] = zmax + log(se);
            double pz = 0;
            for (size_t i = 0; i < e; i++) {
                p[i] = exp(z[i] - lse[t]);
                pz += p[i] * z[i];
                sum_p[r * e + i] += p[i];
                tot_p[i] += p[i];
            }
            h[t] = lse[t] - pz; /* H_t = logsumexp(z) - sum p z */
            /* top-k by repeated argmax */
            for (unsigned j = 0; j < k->k; j++) {
                size_t best = 0;
                for (size_t i = 1; i < e; i++)
                    if (z[i] > z[best])
                        best = i;
                load[r * e + best]++;
                tot_load[best]++;
                z[best] = -INFINITY;
            }
            rank_h[r] += h[t];
            rank_h2[r] += h[t] * h[t];
            rank_l2[r] += lse[t] * lse[t];
            rank_n[r]++;
        }
        /* The daemon's sum over ranks. */
        struct router_tokens in = {.n_experts = k->e};
        uint64_t *sum_load = calloc(e, sizeof(*sum_load));
        double *sum_sp = calloc(e, sizeof(*sum_sp));
        cr_assert(sum_load && sum_sp);
        for (unsigned r = 0; r < k->ranks; r++) {
            in.n_tok += rank_n[r];
            in.sum_h += rank_h[r];
            in.sum_h2 += rank_h2[r];
            in.sum_lse2 += rank_l2[r];
            for (size_t i = 0; i < e; i++) {
                sum_load[i] += load[r * e + i];
                sum_sp[i] += sum_p[r * e + i];
            }
        }
        in.load = sum_load;
        in.sum_p = sum_sp;

        /* Reference from the per-token arrays. */
        struct tok_ref ref = {0};
        for (size_t t = 0; t < t_n; t++) {
            ref.entropy_mean += h[t] / (double)t_n;
            ref.zloss += lse[t] * lse[t] / (double)t_n;
        }
        double var = 0;
        for (size_t t = 0; t < t_n; t++)
            var += (h[t] - ref.entropy_mean) * (h[t] - ref.entropy_mean) / (double)t_n;
        ref.entropy_spread = sqrt(var);
        double total = (double)t_n * k->k, mean = total / (double)e, lmax = 0;
        for (size_t i = 0; i < e; i++) {
            double f = (double)tot_load[i] / total;
            lmax = fmax(lmax, (double)tot_load[i]);
            if (tot_load[i] == 0)
                ref.dead++;
            else
                ref.load_entropy -= f * log(f);
            ref.balance += (double)e * f * (tot_p[i] / (double)t_n);
        }
        ref.maxvio = (lmax - mean) / mean;

        struct router_decision out;
        cr_assert_eq(router_decision_compute(&in, &out), 0, "%s", k->name);
        cr_assert(out.present && !out.nonfinite && out.load_present, "%s", k->name);
        assert_rel(out.entropy_mean, ref.entropy_mean, 1e-10, "entropy mean", k->name);
        assert_rel(out.entropy_spread, ref.entropy_spread, 1e-8, "entropy spread", k->name);
        assert_rel(out.zloss, ref.zloss, 1e-10, "zloss", k->name);
        assert_rel(out.maxvio, ref.maxvio, 1e-12, "maxvio", k->name);
        assert_rel(out.load_entropy, ref.load_entropy, 1e-12, "load entropy", k->name);
        assert_rel(out.balance, ref.balance, 1e-10, "balance", k->name);
        cr_assert_eq(out.dead_experts, ref.dead, "%s: dead %u want %u", k->name, out.dead_experts,
                     ref.dead);
        cr_assert_eq(out.norm_present, e >= 2, "%s", k->name);
        if (e >= 2) {
            assert_rel(out.entropy_norm, ref.entropy_mean / log((double)e), 1e-10, "entropy norm",
                       k->name);
            assert_rel(out.load_entropy_norm, ref.load_entropy / log((double)e), 1e-12,
                       "load entropy norm", k->name);
        }
        if (k->bias0 > 4)
            cr_assert_gt(out.dead_experts, 0, "%s: collapse should leave dead experts", k->name);
        free(h);
        free(lse);
        free(z);
        free(p);
        free(tot_p);
        free(tot_load);
        free(load);
        free(sum_p);
        free(sum_load);
        free(sum_sp);
    }
}

Test(monitor_router, decision_side_closed_forms_and_edges)
{
    /* Perfect balance: 4 experts, 10 tokens each, uniform p. */
    uint64_t load[4] = {10, 10, 10, 10};
    double sum_p[4] = {10, 10, 10, 10};
    struct router_tokens in = {.n_experts = 4,
                               .n_tok = 40,
                               .sum_h = 40 * log(4.0),
                               .sum_h2 = 40 * log(4.0) * log(4.0),
                               .sum_lse2 = 40 * 4.0,
                               .load = load,
                               .sum_p = sum_p};
    struct router_decision out;
    cr_assert_eq(router_decision_compute(&in, &out), 0);
    assert_rel(out.maxvio, 0.0, 1e-15, "maxvio", "balanced");
    assert_rel(out.balance, 1.0, 1e-15, "balance", "balanced");
    assert_rel(out.load_entropy_norm, 1.0, 1e-15, "load entropy", "balanced");
    assert_rel(out.entropy_norm, 1.0, 1e-15, "entropy norm", "balanced");
    cr_assert(out.entropy_spread < 1e-7, "spread %g", out.entropy_spread);
    assert_rel(out.zloss, 4.0, 1e-15, "zloss", "balanced");
    cr_assert_eq(out.dead_experts, 0);

    /* Collapse onto one expert. */
    uint64_t one[4] = {40, 0, 0, 0};
    double p1[4] = {40, 0, 0, 0};
    in.load = one;
    in.sum_p = p1;
    cr_assert_eq(router_decision_compute(&in, &out), 0);
    assert_rel(out.maxvio, 3.0, 1e-15, "maxvio", "collapsed");
    assert_rel(out.balance, 4.0, 1e-15, "balance", "collapsed");
    assert_rel(out.load_entropy, 0.0, 1e-15, "load entropy", "collapsed");
    cr_assert_eq(out.dead_experts, 3);

    /* No tokens: absent, not 0 or NaN. */
    in.n_tok = 0;
    cr_assert_eq(router_decision_compute(&in, &out), 0);
    cr_assert(!out.present && !out.load_present && !out.nonfinite);
    /* Tokens but no assignments: load-based values absent. */
    uint64_t none[4] = {0};
    in.n_tok = 40;
    in.load = none;
    cr_assert_eq(router_decision_compute(&in, &out), 0);
    cr_assert(out.present && !out.load_present);
    cr_assert_eq(out.dead_experts, 4);
    /* Non-finite sums. */
    in.load = load;
    in.sum_h = NAN;
    cr_assert_eq(router_decision_compute(&in, &out), 0);
    cr_assert(out.nonfinite && !out.present);
    in.sum_h = 1;
    double badp[4] = {1, INFINITY, 1, 1};
    in.sum_p = badp;
    cr_assert_eq(router_decision_compute(&in, &out), 0);
    cr_assert(out.nonfinite);
    /* Arguments. */
    in.sum_p = sum_p;
    in.n_experts = 0;
    cr_assert_eq(router_decision_compute(&in, &out), -EINVAL);
    in.n_experts = ROUTER_MAX_EXPERTS + 1;
    cr_assert_eq(router_decision_compute(&in, &out), -EINVAL);
    in.n_experts = 4;
    in.load = NULL;
    cr_assert_eq(router_decision_compute(&in, &out), -EINVAL);
    cr_assert_eq(router_decision_compute(NULL, &out), -EINVAL);
}
