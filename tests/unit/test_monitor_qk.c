/* Unit tests for daemon/monitor_qk.c (docs/monitors.md 1.2, 1.3).
 *
 * The reference is independent of the module's route: the test draws dense
 * Wq, Wk, dWq, dWk (dh x d, PyTorch [out, in]) in double, forms Delta2,
 * Delta3, Delta1 = Delta2 + Delta3 and K(t0) = Wq^T Wk explicitly (d x d),
 * takes their singular values with LAPACKE_dgesdd, and evaluates the 1.3
 * formulas itself in long double. The module only sees GA = A A^T and
 * GB = B B^T, which the test also forms itself (A = [dWq; Wq],
 * B = [Wk; dWk]).
 *
 * Tolerances (stated, per input path):
 *   double Grams:  spectra |got - ref| <= 1e-12 * s_max(ref); scalars
 *                  1e-10 relative (absolute below 1); measured errors are
 *                  ~5e-15 * s_max;
 *   float32 Grams (as on the wire, summed into double): spectra 1e-6 *
 *                  s_max, scalars 1e-5 relative (measured ~1e-8); the rank
 *                  is not compared (float rounding lifts exact zeros above
 *                  the drop floor).
 */
#include <cblas.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <float.h>
#include <lapacke.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fstest.h"
#include "monitor_qk.h"

#define SPEC_TOL_F64 1e-12
#define SCALAR_TOL_F64 1e-10
#define SPEC_TOL_F32 1e-6
#define SCALAR_TOL_F32 1e-5

/* ---- the weights of one head and the reference --------------------------- */

struct head_w {
    size_t dh, d;
    double *wq, *wk, *dwq, *dwk; /* dh x d, row-major */
};

static struct head_w head_make(size_t dh, size_t d, double delta, bool frozen_q, bool frozen_k,
                               uint64_t *seed)
{
    struct head_w w = {.dh = dh, .d = d};
    w.wq = randn(dh * d, 1.0, seed);
    w.wk = randn(dh * d, 1.0, seed);
    w.dwq = randn(dh * d, frozen_q ? 0.0 : delta, seed);
    w.dwk = randn(dh * d, frozen_k ? 0.0 : delta, seed);
    return w;
}

static void head_free(struct head_w *w)
{
    free(w->wq);
    free(w->wk);
    free(w->dwq);
    free(w->dwk);
}

/* out (d x d) += X^T Y for dh x d row-major X, Y. */
static void add_xty(const double *x, const double *y, size_t dh, size_t d, double *out)
{
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)d, (int)d, (int)dh, 1.0, x, (int)d, y,
                (int)d, 1.0, out, (int)d);
}

/* sigma^2 of a d x d matrix (destroyed), descending, into s[d]. */
static void sq_singular_values(double *m, size_t d, double *s)
{
    double *u = NULL, *vt = NULL;
    /* column-major view of the row-major matrix: its transpose, same sigma */
    lapack_int info = LAPACKE_dgesdd(LAPACK_COL_MAJOR, 'N', (lapack_int)d, (lapack_int)d, m,
                                     (lapack_int)d, s, u, 1, vt, 1);
    cr_assert_eq(info, 0, "dgesdd info %d", (int)info);
    for (size_t i = 0; i < d; i++)
        s[i] *= s[i];
}

struct reference {
    double *spec[QK_NSPECTRA]; /* d values each, descending */
    double q_delta_sq, q_sq, k_sq, k_delta_sq;
    double delta3_fro_sq; /* |Delta3|_F^2 summed from the explicit matrix */
};

static double sum_sq(const double *x, size_t len)
{
    double s = 0;
    for (size_t i = 0; i < len; i++)
        s += x[i] * x[i];
    return s;
}

static struct reference reference_make(const struct head_w *w)
{
    size_t d = w->d, dh = w->dh, dd = d * d;
    struct reference r = {0};
    double *d2 = calloc(dd, sizeof(*d2)), *d3 = calloc(dd, sizeof(*d3));
    double *d1 = malloc(dd * sizeof(*d1)), *k0 = calloc(dd, sizeof(*k0));
    cr_assert(d2 && d3 && d1 && k0);
    add_xty(w->dwq, w->wk, dh, d, d2); /* Delta2 = dWq^T Wk + Wq^T dWk */
    add_xty(w->wq, w->dwk, dh, d, d2);
    add_xty(w->dwq, w->dwk, dh, d, d3); /* Delta3 = dWq^T dWk */
    add_xty(w->wq, w->wk, dh, d, k0);   /* K(t0) = Wq^T Wk */
    for (size_t i = 0; i < dd; i++)
        d1[i] = d2[i] + d3[i]; /* Delta1 = K(t) - K(t0) = Delta2 + Delta3 */
    r.delta3_fro_sq = sum_sq(d3, dd);
    double *mats[QK_NSPECTRA] = {[QK_D2] = d2, [QK_D1] = d1, [QK_D3] = d3, [QK_W] = k0};
    for (int k = 0; k < QK_NSPECTRA; k++) {
        r.spec[k] = malloc(d * sizeof(double));
        cr_assert_not_null(r.spec[k]);
        sq_singular_values(mats[k], d, r.spec[k]);
        free(mats[k]);
    }
    r.q_delta_sq = sum_sq(w->dwq, dh * d);
    r.q_sq = sum_sq(w->wq, dh * d);
    r.k_sq = sum_sq(w->wk, dh * d);
    r.k_delta_sq = sum_sq(w->dwk, dh * d);
    return r;
}

static void reference_free(struct reference *r)
{
    for (int k = 0; k < QK_NSPECTRA; k++)
        free(r->spec[k]);
}

/* ---- Grams as the trainer would send them -------------------------------- */

/* Upper triangles (row-major) of GA = A A^T and GB = B B^T over the columns
 * [c0, c1) of d, accumulated into ga, gb (n(n+1)/2 doubles each). */
static void grams_add(const struct head_w *w, size_t c0, size_t c1, double *ga, double *gb)
{
    size_t dh = w->dh, d = w->d, half = dh * d;
    double *a = malloc(2 * half * sizeof(*a)), *b = malloc(2 * half * sizeof(*b));
    cr_assert(a && b);
    /* A = [dWq; Wq], B = [Wk; dWk] */
    memcpy(a, w->dwq, half * sizeof(*a));
    memcpy(a + half, w->wq, half * sizeof(*a));
    memcpy(b, w->wk, half * sizeof(*b));
    memcpy(b + half, w->dwk, half * sizeof(*b));
    gram_tri_add(a, 2 * dh, d, c0, c1, ga);
    gram_tri_add(b, 2 * dh, d, c0, c1, gb);
    free(a);
    free(b);
}

/* The Grams over `shards` uneven slices of d; f32: each shard goes through
 * float32 wire bytes and monitor_tri_accumulate, as the daemon sums them. */
static void grams_make(const struct head_w *w, unsigned shards, bool f32, double *ga, double *gb)
{
    size_t n = 2 * w->dh, len = monitor_tri_len(n);
    memset(ga, 0, len * sizeof(*ga));
    memset(gb, 0, len * sizeof(*gb));
    /* Uneven cuts: 1/6, 1/2 of d (3 shards), else one piece. */
    size_t cuts[4] = {0, w->d, w->d, w->d};
    if (shards == 3) {
        cuts[1] = w->d / 6;
        cuts[2] = w->d / 2;
    }
    for (unsigned s = 0; s < shards; s++) {
        if (!f32) {
            grams_add(w, cuts[s], cuts[s + 1], ga, gb);
            continue;
        }
        double *pa = calloc(len, sizeof(*pa)), *pb = calloc(len, sizeof(*pb));
        cr_assert(pa && pb);
        grams_add(w, cuts[s], cuts[s + 1], pa, pb);
        unsigned char *wa = tri_to_f32le(pa, len), *wb = tri_to_f32le(pb, len);
        cr_assert_eq(monitor_tri_accumulate(ga, n, wa, len * 4), 0);
        cr_assert_eq(monitor_tri_accumulate(gb, n, wb, len * 4), 0);
        free(pa);
        free(pb);
        free(wa);
        free(wb);
    }
}

/* ---- comparisons ---------------------------------------------------------- */

static void assert_rel(double got, double want, double rel, const char *what, const char *name)
{
    double tol = rel * fmax(1.0, fabs(want));
    cr_assert(fabs(got - want) <= tol, "%s: %s got %.15g want %.15g", name, what, got, want);
}

static void assert_scalars(const struct spectrum_scalars *got, const struct spectrum_scalars *want,
                           double rel, bool check_rank, const char *name)
{
    cr_assert_eq(got->present, want->present, "%s: present %d want %d", name, got->present,
                 want->present);
    if (!want->present)
        return;
    if (check_rank)
        cr_assert_eq(got->rank, want->rank, "%s: rank %u want %u", name, got->rank, want->rank);
    assert_rel(got->entropy2, want->entropy2, rel, "entropy2", name);
    assert_rel(got->entropy1, want->entropy1, rel, "entropy1", name);
    assert_rel(got->erank2, want->erank2, rel, "erank2", name);
    assert_rel(got->erank1, want->erank1, rel, "erank1", name);
    assert_rel(got->srank, want->srank, rel, "srank", name);
    cr_assert(fabs(got->fro - want->fro) <= rel * want->fro, "%s: fro %.15g want %.15g", name,
              got->fro, want->fro);
    cr_assert(fabs(got->smax - want->smax) <= rel * want->smax, "%s: smax %.15g want %.15g", name,
              got->smax, want->smax);
}

/* Sorted spectra agree entry by entry to tol * s_max; whichever is longer
 * has only values below that beyond the other. */
static void assert_spectrum(const double *got, size_t glen, const double *want, size_t wlen,
                            double tol, const char *name)
{
    double smax = wlen ? want[0] : 0;
    double lim = tol * smax;
    size_t n = glen > wlen ? glen : wlen;
    for (size_t i = 0; i < n; i++) {
        double g = i < glen ? got[i] : 0, w = i < wlen ? want[i] : 0;
        cr_assert(fabs(g - w) <= lim, "%s: value %zu got %.15g want %.15g (s_max %.6g)", name, i, g,
                  w, smax);
    }
}

static const char *const spec_name[QK_NSPECTRA] = {"d2", "d1", "d3", "w"};
static const size_t spec_nominal[QK_NSPECTRA] = {2, 2, 1, 1}; /* x dh */

/* Runs the module on (ga, gb) and checks everything against ref. */
static void check_head(struct qk_workspace *ws, const struct head_w *w, const double *ga,
                       const double *gb, const struct reference *ref, bool f32,
                       struct qk_head *out_head, const char *name)
{
    struct qk_head h;
    int rc = qk_head_from_grams(ws, (unsigned)w->dh, ga, gb, &h);
    cr_assert_eq(rc, 0, "%s: rc %d", name, rc);
    cr_assert(!h.nonfinite, "%s", name);
    double stol = f32 ? SPEC_TOL_F32 : SPEC_TOL_F64, ctol = f32 ? SCALAR_TOL_F32 : SCALAR_TOL_F64;
    for (int k = 0; k < QK_NSPECTRA; k++) {
        char what[128];
        snprintf(what, sizeof what, "%s %s", name, spec_name[k]);
        size_t len;
        const double *got = qk_workspace_spectrum(ws, (enum qk_spectrum)k, &len);
        cr_assert_not_null(got);
        assert_spectrum(got, len, ref->spec[k], w->d, stol, what);
        struct spectrum_scalars want = ref_scalars(ref->spec[k], w->d, spec_nominal[k] * w->dh);
        assert_scalars(&h.spec[k], &want, ctol, !f32, what);
    }
    cr_assert(h.norms_present, "%s", name);
    double ntol = f32 ? 1e-6 : 1e-12;
    assert_rel(h.q_delta_sq, ref->q_delta_sq, ntol, "|dWq|^2", name);
    assert_rel(h.q_sq, ref->q_sq, ntol, "|Wq|^2", name);
    assert_rel(h.k_sq, ref->k_sq, ntol, "|Wk|^2", name);
    assert_rel(h.k_delta_sq, ref->k_delta_sq, ntol, "|dWk|^2", name);
    bool cqk_defined = ref->q_delta_sq > 0 && ref->k_delta_sq > 0;
    cr_assert_eq(h.cqk_present, cqk_defined, "%s: cqk present", name);
    if (cqk_defined) {
        /* c_qk against |Delta3|_F^2 / (|dWq|^2 |dWk|^2), all direct. */
        double want = ref->delta3_fro_sq / (ref->q_delta_sq * ref->k_delta_sq);
        assert_rel(h.cqk, want, f32 ? 1e-4 : 1e-10, "cqk", name);
        cr_assert(h.cqk >= 0 && h.cqk <= 1, "%s: cqk %g", name, h.cqk);
    }
    if (out_head)
        *out_head = h;
}

/* ---- the table ------------------------------------------------------------ */

struct qk_case {
    const char *name;
    unsigned dh, d;
    double delta; /* scale of dWq, dWk against W ~ N(0, 1) */
    bool frozen_q, frozen_k;
    unsigned shards; /* 1 or 3 (uneven) */
    bool f32;        /* Grams through float32 wire bytes */
    /* which spectra must be present: d2, d1, d3, w */
    bool present[QK_NSPECTRA];
};

#define ALL                                                                                        \
    {                                                                                              \
        true, true, true, true                                                                     \
    }

static const struct qk_case cases[] = {
    {"dh4 d16", 4, 16, 1.0, false, false, 1, false, ALL},
    {"dh16 d64", 16, 64, 0.5, false, false, 1, false, ALL},
    {"dh64 d256", 64, 256, 0.1, false, false, 1, false, ALL},
    {"dh128 d512", 128, 512, 0.1, false, false, 1, false, ALL},
    {"dh64 d96 (d < 2dh: singular Grams)", 64, 96, 0.3, false, false, 1, false, ALL},
    {"dh4 d3 (d < dh)", 4, 3, 1.0, false, false, 1, false, ALL},
    {"small updates 1e-3", 16, 64, 1e-3, false, false, 1, false, ALL},
    {"small updates 1e-4 dh64", 64, 256, 1e-4, false, false, 1, false, ALL},
    /* warm-up learning rates: |dW| / |W| ~ 1e-8 puts tr Qdd / tr Qww at
     * 1e-16, below any rank tolerance relative to the whole Gram */
    {"tiny updates 1e-8", 16, 64, 1e-8, false, false, 1, false, ALL},
    {"tiny updates 1e-10, d < 2dh", 16, 24, 1e-10, false, false, 1, false, ALL},
    {"frozen dWq = 0", 16, 64, 0.1, true, false, 1, false, {true, true, false, true}},
    {"frozen dWk = 0", 16, 64, 0.1, false, true, 1, false, {true, true, false, true}},
    {"frozen both", 16, 64, 0.1, true, true, 1, false, {false, false, false, true}},
    {"frozen dWq = 0, d < 2dh", 16, 24, 0.1, true, false, 1, false, {true, true, false, true}},
    {"frozen dWk = 0 dh64", 64, 256, 1e-3, false, true, 1, false, {true, true, false, true}},
    {"3 uneven shards", 16, 64, 0.5, false, false, 3, false, ALL},
    {"3 uneven shards dh64", 64, 256, 0.1, false, false, 3, false, ALL},
    {"f32 wire dh16", 16, 64, 0.1, false, false, 1, true, ALL},
    {"f32 wire 3 shards dh64", 64, 256, 0.1, false, false, 3, true, ALL},
    {"f32 wire dh128", 128, 512, 0.1, false, false, 1, true, ALL},
    {"f32 wire frozen dWk", 16, 64, 0.1, false, true, 1, true, {true, true, false, true}},
};

Test(monitor_qk, against_dense_svd_reference, .timeout = 240)
{
    monitor_init();
    struct qk_workspace *ws;
    cr_assert_eq(qk_workspace_create(128, &ws), 0);
    uint64_t seed = 7;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const struct qk_case *k = &cases[c];
        struct head_w w = head_make(k->dh, k->d, k->delta, k->frozen_q, k->frozen_k, &seed);
        struct reference ref = reference_make(&w);
        size_t len = monitor_tri_len(2 * (size_t)k->dh);
        double *ga = malloc(len * sizeof(*ga)), *gb = malloc(len * sizeof(*gb));
        cr_assert(ga && gb);
        grams_make(&w, k->shards, k->f32, ga, gb);
        struct qk_head h;
        check_head(ws, &w, ga, gb, &ref, k->f32, &h, k->name);
        for (int s = 0; s < QK_NSPECTRA; s++)
            cr_assert_eq(h.spec[s].present, k->present[s], "%s: %s present %d", k->name,
                         spec_name[s], h.spec[s].present);
        free(ga);
        free(gb);
        reference_free(&ref);
        head_free(&w);
    }
    qk_workspace_destroy(ws);
}

/* Shard sums equal the unsharded Grams' result (double path). */
Test(monitor_qk, sharded_equals_unsharded)
{
    struct qk_workspace *ws;
    cr_assert_eq(qk_workspace_create(32, &ws), 0);
    uint64_t seed = 11;
    struct head_w w = head_make(32, 100, 0.2, false, false, &seed);
    size_t len = monitor_tri_len(64);
    double *ga1 = malloc(len * 8), *gb1 = malloc(len * 8), *ga3 = malloc(len * 8),
           *gb3 = malloc(len * 8);
    cr_assert(ga1 && gb1 && ga3 && gb3);
    grams_make(&w, 1, false, ga1, gb1);
    grams_make(&w, 3, false, ga3, gb3);
    struct qk_head h1, h3;
    cr_assert_eq(qk_head_from_grams(ws, 32, ga1, gb1, &h1), 0);
    double keep[QK_NSPECTRA][64];
    size_t keep_len[QK_NSPECTRA];
    for (int k = 0; k < QK_NSPECTRA; k++) {
        const double *s = qk_workspace_spectrum(ws, (enum qk_spectrum)k, &keep_len[k]);
        memcpy(keep[k], s, keep_len[k] * sizeof(double));
    }
    cr_assert_eq(qk_head_from_grams(ws, 32, ga3, gb3, &h3), 0);
    for (int k = 0; k < QK_NSPECTRA; k++) {
        size_t l3;
        const double *s3 = qk_workspace_spectrum(ws, (enum qk_spectrum)k, &l3);
        assert_spectrum(s3, l3, keep[k], keep_len[k], 1e-12, spec_name[k]);
        assert_scalars(&h3.spec[k], &h1.spec[k], 1e-10, true, spec_name[k]);
    }
    assert_rel(h3.cqk, h1.cqk, 1e-12, "cqk", "shards");
    free(ga1);
    free(gb1);
    free(ga3);
    free(gb3);
    head_free(&w);
    qk_workspace_destroy(ws);
}

/* GQA: two query heads read one key head; each pairs its own GA with the
 * shared GB and matches its own dense reference. */
Test(monitor_qk, gqa_two_query_heads_share_wk)
{
    struct qk_workspace *ws;
    cr_assert_eq(qk_workspace_create(16, &ws), 0);
    uint64_t seed = 23;
    struct head_w h1 = head_make(16, 64, 0.3, false, false, &seed);
    struct head_w h2 = head_make(16, 64, 0.3, false, false, &seed);
    /* the second query head reads the first one's key head */
    memcpy(h2.wk, h1.wk, 16 * 64 * sizeof(double));
    memcpy(h2.dwk, h1.dwk, 16 * 64 * sizeof(double));
    struct head_w *heads[2] = {&h1, &h2};
    size_t len = monitor_tri_len(32);
    double *gb_shared = NULL;
    struct qk_head out[2];
    for (int i = 0; i < 2; i++) {
        struct reference ref = reference_make(heads[i]);
        double *ga = malloc(len * 8), *gb = malloc(len * 8);
        cr_assert(ga && gb);
        grams_make(heads[i], 1, false, ga, gb);
        if (!gb_shared) {
            gb_shared = gb;
        } else {
            cr_assert_arr_eq(gb, gb_shared, len * 8, "GB must be the shared key head's");
            free(gb);
        }
        check_head(ws, heads[i], ga, gb_shared, &ref, false, &out[i],
                   i ? "gqa head 2" : "gqa head 1");
        free(ga);
        reference_free(&ref);
    }
    /* Different query heads: different spectra, same key norms. */
    cr_assert_neq(out[0].spec[QK_D2].entropy2, out[1].spec[QK_D2].entropy2);
    cr_assert_eq(out[0].k_sq, out[1].k_sq);
    free(gb_shared);
    head_free(&h1);
    head_free(&h2);
    qk_workspace_destroy(ws);
}

/* ---- spectrum sketches ---------------------------------------------------- */

Test(monitor_qk, spectrum_sketch_equals_gram_path)
{
    struct qk_workspace *ws;
    cr_assert_eq(qk_workspace_create(32, &ws), 0);
    uint64_t seed = 31;
    struct head_w w = head_make(32, 128, 0.05, false, false, &seed);
    struct reference ref = reference_make(&w);
    size_t len = monitor_tri_len(64);
    double *ga = malloc(len * 8), *gb = malloc(len * 8);
    cr_assert(ga && gb);
    grams_make(&w, 1, false, ga, gb);
    struct qk_head g;
    cr_assert_eq(qk_head_from_grams(ws, 32, ga, gb, &g), 0);

    /* What a trainer would send: the top nominal-count sigma^2 of the
     * dense reference, as float, plus the norms; c_qk left to the daemon. */
    float sk[QK_NSPECTRA][64];
    for (int k = 0; k < QK_NSPECTRA; k++)
        for (size_t i = 0; i < spec_nominal[k] * 32; i++)
            sk[k][i] = (float)ref.spec[k][i];
    struct qk_spectra_in in = {
        .dh = 32,
        .d2 = sk[QK_D2],
        .n_d2 = 64,
        .d1 = sk[QK_D1],
        .n_d1 = 64,
        .d3 = sk[QK_D3],
        .n_d3 = 32,
        .w = sk[QK_W],
        .n_w = 32,
        .has_norms = true,
        .q_delta_sq = ref.q_delta_sq,
        .q_sq = ref.q_sq,
        .k_sq = ref.k_sq,
        .k_delta_sq = ref.k_delta_sq,
    };
    struct qk_head s;
    cr_assert_eq(qk_head_from_spectra(&in, &s), 0);
    for (int k = 0; k < QK_NSPECTRA; k++)
        assert_scalars(&s.spec[k], &g.spec[k], 1e-6, true, spec_name[k]);
    cr_assert(s.cqk_present);
    assert_rel(s.cqk, g.cqk, 1e-6, "cqk from sum(d3)", "sketch");
    assert_rel(s.q_sq, g.q_sq, 1e-12, "q_sq", "sketch");

    /* A sent c_qk wins; missing d1/w are absent; order does not matter. */
    in.has_cqk = true;
    in.cqk = 0.25;
    in.d1 = NULL;
    in.n_w = 0;
    float rev[64];
    for (int i = 0; i < 64; i++)
        rev[i] = sk[QK_D2][63 - i];
    in.d2 = rev;
    cr_assert_eq(qk_head_from_spectra(&in, &s), 0);
    cr_assert_eq(s.cqk, 0.25);
    cr_assert(!s.spec[QK_D1].present);
    cr_assert(!s.spec[QK_W].present);
    assert_scalars(&s.spec[QK_D2], &g.spec[QK_D2], 1e-6, true, "reversed d2");

    /* Limits and non-finite values. */
    in.n_d2 = 65;
    cr_assert_eq(qk_head_from_spectra(&in, &s), -EINVAL);
    in.n_d2 = 64;
    rev[5] = NAN;
    cr_assert_eq(qk_head_from_spectra(&in, &s), 0);
    cr_assert(s.nonfinite);
    cr_assert(!s.spec[QK_D2].present && !s.spec[QK_D3].present && !s.cqk_present);
    in.dh = QK_MAX_DH + 1;
    cr_assert_eq(qk_head_from_spectra(&in, &s), -EINVAL);

    free(ga);
    free(gb);
    reference_free(&ref);
    head_free(&w);
    qk_workspace_destroy(ws);
}

/* ---- robustness ----------------------------------------------------------- */

struct bad_case {
    const char *name;
    bool in_gb;
    size_t at;
    double value;
    bool nonfinite;
};

static const struct bad_case bad_cases[] = {
    {"NaN in GA", false, 0, NAN, true},
    {"NaN in GB off-diagonal", true, 5, NAN, true},
    {"+Inf in GA", false, 17, INFINITY, true},
    {"-Inf in GB", true, 40, -INFINITY, true},
};

Test(monitor_qk, nonfinite_input_flags_and_has_no_spectrum)
{
    struct qk_workspace *ws;
    cr_assert_eq(qk_workspace_create(8, &ws), 0);
    uint64_t seed = 5;
    struct head_w w = head_make(8, 32, 0.1, false, false, &seed);
    size_t len = monitor_tri_len(16);
    double *ga = malloc(len * 8), *gb = malloc(len * 8);
    cr_assert(ga && gb);
    for (size_t c = 0; c < sizeof bad_cases / sizeof bad_cases[0]; c++) {
        grams_make(&w, 1, false, ga, gb);
        (bad_cases[c].in_gb ? gb : ga)[bad_cases[c].at] = bad_cases[c].value;
        struct qk_head h;
        cr_assert_eq(qk_head_from_grams(ws, 8, ga, gb, &h), 0, "%s", bad_cases[c].name);
        cr_assert_eq(h.nonfinite, bad_cases[c].nonfinite, "%s", bad_cases[c].name);
        for (int k = 0; k < QK_NSPECTRA; k++)
            cr_assert(!h.spec[k].present, "%s: %s", bad_cases[c].name, spec_name[k]);
        cr_assert(!h.cqk_present && !h.norms_present, "%s", bad_cases[c].name);
        double v;
        cr_assert_eq(qk_head_value(&h, QK_SERIES(QK_D2, QK_ERANK2), &v), -ENODATA);
    }
    free(ga);
    free(gb);
    head_free(&w);
    qk_workspace_destroy(ws);
}

Test(monitor_qk, zero_and_extreme_grams_do_not_crash)
{
    struct qk_workspace *ws;
    cr_assert_eq(qk_workspace_create(8, &ws), 0);
    size_t len = monitor_tri_len(16);
    double *ga = calloc(len, 8), *gb = calloc(len, 8);
    cr_assert(ga && gb);
    struct qk_head h;
    cr_assert_eq(qk_head_from_grams(ws, 8, ga, gb, &h), 0);
    cr_assert(!h.nonfinite && h.norms_present && !h.cqk_present);
    for (int k = 0; k < QK_NSPECTRA; k++)
        cr_assert(!h.spec[k].present, "all-zero: %s", spec_name[k]);

    /* Huge but finite Grams: same spectra shape as a unit-scale copy. */
    uint64_t seed = 3;
    struct head_w w = head_make(8, 32, 0.5, false, false, &seed);
    grams_make(&w, 1, false, ga, gb);
    struct qk_head unit, big;
    cr_assert_eq(qk_head_from_grams(ws, 8, ga, gb, &unit), 0);
    for (size_t i = 0; i < len; i++) {
        ga[i] *= 1e150;
        gb[i] *= 1e-150;
    }
    cr_assert_eq(qk_head_from_grams(ws, 8, ga, gb, &big), 0);
    for (int k = 0; k < QK_NSPECTRA; k++)
        assert_scalars(&big.spec[k], &unit.spec[k], 1e-8, true, spec_name[k]);
    /* Products beyond DBL_MAX: flagged, never a crash or a NaN value. */
    for (size_t i = 0; i < len; i++) {
        ga[i] *= 1e150;
        gb[i] *= 1e300;
    }
    cr_assert_eq(qk_head_from_grams(ws, 8, ga, gb, &big), 0);
    cr_assert(big.nonfinite);
    for (int k = 0; k < QK_NSPECTRA; k++)
        if (big.spec[k].present)
            cr_assert(isfinite(big.spec[k].entropy2) && isfinite(big.spec[k].smax));

    /* A Gram that is not PSD (corrupt input): any answer, no crash. */
    grams_make(&w, 1, false, ga, gb);
    for (size_t i = 0; i < len; i++)
        ga[i] = -ga[i];
    int rc = qk_head_from_grams(ws, 8, ga, gb, &h);
    cr_assert(rc == 0 || rc == -EDOM, "rc %d", rc);
    free(ga);
    free(gb);
    head_free(&w);
    qk_workspace_destroy(ws);
}

Test(monitor_qk, arguments_and_limits)
{
    struct qk_workspace *ws = (void *)1;
    cr_assert_eq(qk_workspace_create(0, &ws), -EINVAL);
    cr_assert_null(ws);
    cr_assert_eq(qk_workspace_create(QK_MAX_DH + 1, &ws), -EINVAL);
    cr_assert_eq(qk_workspace_create(4, NULL), -EINVAL);
    cr_assert_eq(qk_workspace_create(4, &ws), 0);
    double ga[36], gb[36]; /* monitor_tri_len(2 * 4) */
    memset(ga, 0, sizeof ga);
    memset(gb, 0, sizeof gb);
    struct qk_head h;
    cr_assert_eq(qk_head_from_grams(ws, 5, ga, gb, &h), -EINVAL); /* above max_dh */
    cr_assert_eq(qk_head_from_grams(ws, 0, ga, gb, &h), -EINVAL);
    cr_assert_eq(qk_head_from_grams(ws, 4, NULL, gb, &h), -EINVAL);
    cr_assert_eq(qk_head_from_grams(NULL, 4, ga, gb, &h), -EINVAL);
    cr_assert_eq(qk_head_from_grams(ws, 4, ga, gb, NULL), -EINVAL);
    cr_assert_eq(qk_head_from_grams(ws, 4, ga, gb, &h), 0);
    qk_workspace_destroy(ws);
    qk_workspace_destroy(NULL);
}

/* ---- wire accumulation ---------------------------------------------------- */

Test(monitor_qk, tri_accumulate_reads_little_endian_float32)
{
    cr_assert_eq(monitor_tri_len(0), 0);
    cr_assert_eq(monitor_tri_len(1), 1);
    cr_assert_eq(monitor_tri_len(4), 10);
    /* 1.0f = 0x3f800000, -2.5f = 0xc0200000, 0.1f = 0x3dcccccd; 1 byte of
     * offset so the source is misaligned. */
    unsigned char buf[1 + 12] = {0xEE, 0x00, 0x00, 0x80, 0x3f, 0x00, 0x00,
                                 0x20, 0xc0, 0xcd, 0xcc, 0xcc, 0x3d};
    double dst[3] = {10.0, 0.0, 1.0};
    cr_assert_eq(monitor_tri_accumulate(dst, 2, buf + 1, 12), 0);
    cr_assert_eq(dst[0], 11.0);
    cr_assert_eq(dst[1], -2.5);
    cr_assert_eq(dst[2], 1.0 + (double)0.1f);
    cr_assert_eq(monitor_tri_accumulate(dst, 2, buf + 1, 11), -EINVAL);
    cr_assert_eq(monitor_tri_accumulate(dst, 3, buf + 1, 12), -EINVAL);
    cr_assert_eq(monitor_tri_accumulate(NULL, 2, buf + 1, 12), -EINVAL);
    cr_assert_eq(monitor_tri_accumulate(dst, MONITOR_TRI_MAX_N + 1, buf, 12), -E2BIG);
}

/* ---- per-layer aggregation ------------------------------------------------ */

static struct qk_head fake_head(double erank2, bool d2_present, double cqk, bool cqk_present)
{
    struct qk_head h = {0};
    h.spec[QK_D2].present = d2_present;
    h.spec[QK_D2].erank2 = erank2;
    h.spec[QK_D2].rank = 3;
    h.cqk_present = cqk_present;
    h.cqk = cqk;
    h.norms_present = true;
    h.q_sq = erank2;
    return h;
}

Test(monitor_qk, layer_aggregate_min_mean_max_argmin)
{
    struct qk_head heads[5] = {
        fake_head(4.0, true, 0.1, true),  fake_head(2.0, true, 0.0, false), /* cqk absent */
        fake_head(1.0, false, 0.3, true),                                   /* d2 absent: skipped */
        fake_head(2.0, true, 0.2, true), /* ties keep the first argmin */
        fake_head(6.0, true, 0.05, true),
    };
    heads[4].nonfinite = true; /* a nonfinite head counts for nothing */
    struct qk_agg agg[QK_NSERIES];
    cr_assert_eq(qk_layer_aggregate(heads, 5, agg), 0);
    const struct qk_agg *e = &agg[QK_SERIES(QK_D2, QK_ERANK2)];
    cr_assert(e->present);
    cr_assert_eq(e->count, 3);
    cr_assert_eq(e->min, 2.0);
    cr_assert_eq(e->argmin, 1);
    cr_assert_eq(e->max, 4.0);
    cr_assert_float_eq(e->mean, 8.0 / 3.0, 1e-15);
    const struct qk_agg *c = &agg[QK_SERIES_CQK];
    cr_assert_eq(c->count, 3);
    cr_assert_eq(c->min, 0.1);
    cr_assert_eq(c->argmin, 0);
    cr_assert_eq(c->max, 0.3);
    cr_assert(!agg[QK_SERIES(QK_D3, QK_ERANK2)].present);
    cr_assert_eq(agg[QK_SERIES(QK_D2, QK_RANK)].max, 3.0);
    cr_assert_eq(agg[QK_SERIES_Q_SQ].count, 4);
    cr_assert_eq(qk_layer_aggregate(NULL, 2, agg), -EINVAL);
    cr_assert_eq(qk_layer_aggregate(NULL, 0, agg), 0);
    cr_assert(!agg[QK_SERIES_CQK].present);
}

struct name_case {
    unsigned series;
    const char *name;
};

static const struct name_case names[] = {
    {QK_SERIES(QK_D2, QK_ENTROPY2), "qk.d2.entropy"},
    {QK_SERIES(QK_D2, QK_ERANK2), "qk.d2.erank"},
    {QK_SERIES(QK_D2, QK_SRANK), "qk.d2.srank"},
    {QK_SERIES(QK_D2, QK_FRO), "qk.d2.fro"},
    {QK_SERIES(QK_D1, QK_ENTROPY1), "qk.d1.entropy1"},
    {QK_SERIES(QK_D3, QK_ERANK1), "qk.d3.erank1"},
    {QK_SERIES(QK_W, QK_ENTROPY2), "qk.w.entropy"},
    {QK_SERIES(QK_W, QK_RANK), "qk.w.rank"},
    {QK_SERIES_CQK, "qk.cqk"},
    {QK_SERIES_K_DELTA_SQ, "qk.norm.dk"},
};

Test(monitor_qk, series_names)
{
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        cr_assert_str_eq(qk_series_name(names[i].series), names[i].name);
    for (unsigned s = 0; s < QK_NSERIES; s++) {
        cr_assert_not_null(qk_series_name(s), "series %u has no name", s);
        for (unsigned t = 0; t < s; t++)
            cr_assert_str_neq(qk_series_name(s), qk_series_name(t));
    }
    cr_assert_null(qk_series_name(QK_NSERIES));
    double v;
    struct qk_head h = {0};
    cr_assert_eq(qk_head_value(&h, QK_NSERIES, &v), -EINVAL);
}
