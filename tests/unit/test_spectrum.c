/* Unit tests for daemon/spectrum.c: scalars from a spectrum (docs/monitors.md 1.3).
 * References: closed forms for hand-made spectra, and a direct evaluation of
 * the formulas (in long double, over a spectrum the test cleans itself) for
 * random ones. */
#include <criterion/criterion.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "fstest.h"
#include "spectrum.h"

#define TOL 1e-12 /* relative, closed forms in double */

static void assert_close(double got, double want, double rel, const char *what)
{
    double tol = rel * fmax(1.0, fabs(want));
    cr_assert(fabs(got - want) <= tol, "%s: got %.17g want %.17g", what, got, want);
}

/* ---- closed forms --------------------------------------------------------- */

struct closed_case {
    const char *name;
    double s[6];
    size_t count, m;
    unsigned rank;
    double h2, h1, srank, fro, smax;
};

/* {4, 1}: p2 = (0.8, 0.2), p1 = (2/3, 1/3); H = -sum p ln p. */
#define H41_2 0.5004024235381879
#define H41_1 0.6365141682948128
#define UNCHECKED (-1.0) /* entropies / fro not asserted in this case */

static const struct closed_case closed[] = {
    {"one value", {9.0}, 1, 1, 1, 0.0, 0.0, 1.0, 3.0, 3.0},
    {"uniform 4",
     {2, 2, 2, 2},
     4,
     4,
     4,
     1.3862943611198906,
     1.3862943611198906,
     4.0,
     2.8284271247461903,
     1.4142135623730951},
    {"4 and 1", {1.0, 4.0}, 2, 2, 2, H41_2, H41_1, 1.25, 2.2360679774997898, 2.0},
    {"zeros and tiny negatives dropped",
     {4.0, 0.0, -1e-18, 1.0, 0.0},
     5,
     5,
     2,
     H41_2,
     H41_1,
     1.25,
     2.2360679774997898,
     2.0},
    /* 1e-20 < 1 * 3 * eps: dropped, so the rank is 1 */
    {"below the floor dropped", {1.0, 1e-20, 0.0}, 3, 3, 1, 0.0, 0.0, 1.0, 1.0, 1.0},
    /* the floor uses m, not count: 1e-14 > 1*2*eps (kept), < 1*64*eps (dropped) */
    {"floor from matrix size, kept",
     {1.0, 1e-14},
     2,
     2,
     2,
     UNCHECKED,
     UNCHECKED,
     1.0 + 1e-14,
     UNCHECKED,
     1.0},
    {"floor from matrix size, dropped", {1.0, 1e-14}, 2, 64, 1, 0.0, 0.0, 1.0, 1.0, 1.0},
    {"huge values do not overflow",
     {1e300, 1e300},
     2,
     2,
     2,
     0.6931471805599453,
     0.6931471805599453,
     2.0,
     1.4142135623730951e150,
     1e150},
};

Test(spectrum, closed_forms)
{
    for (size_t c = 0; c < sizeof closed / sizeof closed[0]; c++) {
        const struct closed_case *k = &closed[c];
        double h2 = k->h2, h1 = k->h1;
        struct spectrum_scalars out;
        int rc = spectrum_scalars_f64(k->s, k->count, k->m, &out);
        cr_assert_eq(rc, 0, "%s: rc %d", k->name, rc);
        cr_assert(out.present, "%s", k->name);
        cr_assert_eq(out.rank, k->rank, "%s: rank %u", k->name, out.rank);
        if (h2 >= 0) {
            assert_close(out.entropy2, h2, TOL, k->name);
            assert_close(out.entropy1, h1, TOL, k->name);
            assert_close(out.erank2, exp(h2), TOL, k->name);
            assert_close(out.erank1, exp(h1), TOL, k->name);
        }
        assert_close(out.srank, k->srank, TOL, k->name);
        if (k->fro >= 0)
            cr_assert(fabs(out.fro - k->fro) <= TOL * k->fro, "%s: fro %.17g", k->name, out.fro);
        cr_assert(fabs(out.smax - k->smax) <= TOL * k->smax, "%s: smax %.17g", k->name, out.smax);
    }
}

/* ---- absent and errors ---------------------------------------------------- */

struct absent_case {
    const char *name;
    double s[3];
    size_t count;
    int rc;
};

static const struct absent_case absent[] = {
    {"empty", {0}, 0, 0},
    {"all zero", {0, 0, 0}, 3, 0},
    {"only negatives", {-1, -2, 0}, 3, 0},
    {"nan", {1, NAN, 2}, 3, -EDOM},
    {"inf", {1, INFINITY, 2}, 3, -EDOM},
    {"-inf", {-INFINITY, 1, 2}, 3, -EDOM},
};

Test(spectrum, absent_not_zero_not_nan)
{
    for (size_t c = 0; c < sizeof absent / sizeof absent[0]; c++) {
        struct spectrum_scalars out = {.present = true, .rank = 7};
        int rc = spectrum_scalars_f64(absent[c].s, absent[c].count, 3, &out);
        cr_assert_eq(rc, absent[c].rc, "%s: rc %d", absent[c].name, rc);
        cr_assert(!out.present, "%s", absent[c].name);
        cr_assert_eq(out.rank, 0, "%s", absent[c].name);
    }
}

Test(spectrum, bad_arguments)
{
    struct spectrum_scalars out;
    cr_assert_eq(spectrum_scalars_f64(NULL, 3, 3, &out), -EINVAL);
    cr_assert_eq(spectrum_scalars_f64(NULL, 0, 3, &out), 0);
    cr_assert(!out.present);
    double s[2] = {1, 2};
    cr_assert_eq(spectrum_scalars_f64(s, 2, 2, NULL), -EINVAL);
    cr_assert_eq(spectrum_scalars_f64(s, SPECTRUM_MAX_VALUES + 1u, 2, &out), -E2BIG);
    cr_assert_eq(spectrum_scalars_f64(s, 2, SPECTRUM_MAX_VALUES + 1u, &out), -E2BIG);
}

/* ---- random spectra against a direct evaluation -------------------------- */

/* The formulas of docs/monitors.md 1.3, long double, values already cleaned. */
static void direct(const double *s, size_t n, struct spectrum_scalars *ref)
{
    long double sum = 0, sumsig = 0, mx = 0;
    for (size_t i = 0; i < n; i++) {
        sum += s[i];
        sumsig += sqrtl(s[i]);
        if (s[i] > mx)
            mx = s[i];
    }
    long double h2 = 0, h1 = 0;
    for (size_t i = 0; i < n; i++) {
        long double p2 = s[i] / sum, p1 = sqrtl(s[i]) / sumsig;
        h2 -= p2 * logl(p2);
        h1 -= p1 * logl(p1);
    }
    ref->present = true;
    ref->rank = (unsigned)n;
    ref->entropy2 = (double)h2;
    ref->entropy1 = (double)h1;
    ref->erank2 = (double)expl(h2);
    ref->erank1 = (double)expl(h1);
    ref->srank = (double)(sum / mx);
    ref->fro = (double)sqrtl(sum);
    ref->smax = (double)sqrtl(mx);
}

static void assert_scalars(const struct spectrum_scalars *got, const struct spectrum_scalars *want,
                           double rel, const char *what)
{
    cr_assert(got->present == want->present, "%s: present", what);
    cr_assert_eq(got->rank, want->rank, "%s: rank %u vs %u", what, got->rank, want->rank);
    assert_close(got->entropy2, want->entropy2, rel, what);
    assert_close(got->entropy1, want->entropy1, rel, what);
    assert_close(got->erank2, want->erank2, rel, what);
    assert_close(got->erank1, want->erank1, rel, what);
    assert_close(got->srank, want->srank, rel, what);
    cr_assert(fabs(got->fro - want->fro) <= rel * want->fro, "%s: fro", what);
    cr_assert(fabs(got->smax - want->smax) <= rel * want->smax, "%s: smax", what);
}

Test(spectrum, random_against_direct_and_f32_equals_f64)
{
    static const size_t sizes[] = {1, 2, 7, 64, 256, 1024};
    uint64_t seed = 42;
    for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++) {
        size_t n = sizes[c];
        double *s = malloc(n * sizeof(*s));
        float *f = malloc(n * sizeof(*f));
        double *fd = malloc(n * sizeof(*fd));
        cr_assert(s && f && fd);
        /* Decaying spectrum over many orders of magnitude, all kept. */
        for (size_t i = 0; i < n; i++) {
            s[i] = exp(-10.0 * uniform01(&seed)) * (1.0 + uniform01(&seed));
            f[i] = (float)s[i];
            fd[i] = (double)f[i];
        }
        struct spectrum_scalars got, want;
        cr_assert_eq(spectrum_scalars_f64(s, n, n, &got), 0);
        direct(s, n, &want);
        assert_scalars(&got, &want, 1e-12, "f64");
        /* The f32 entry widens each value: equal to f64 on the widened data. */
        cr_assert_eq(spectrum_scalars_f32(f, n, n, &got), 0);
        direct(fd, n, &want);
        assert_scalars(&got, &want, 1e-12, "f32");
        /* Order does not matter. */
        for (size_t i = 0; i + 1 < n; i += 2) {
            double t = s[i];
            s[i] = s[i + 1];
            s[i + 1] = t;
        }
        struct spectrum_scalars swapped;
        cr_assert_eq(spectrum_scalars_f64(s, n, n, &swapped), 0);
        direct(s, n, &want);
        assert_scalars(&swapped, &want, 1e-12, "swapped");
        free(s);
        free(f);
        free(fd);
    }
}

Test(spectrum, rank_one_collapse_lowers_every_scalar)
{
    /* The signal the monitors exist for: the same energy, concentrated. */
    double spread[8], collapsed[8];
    for (int i = 0; i < 8; i++) {
        spread[i] = 1.0;
        collapsed[i] = i == 0 ? 1.0 : 1e-4;
    }
    struct spectrum_scalars a, b;
    cr_assert_eq(spectrum_scalars_f64(spread, 8, 8, &a), 0);
    cr_assert_eq(spectrum_scalars_f64(collapsed, 8, 8, &b), 0);
    cr_assert_gt(a.entropy2, b.entropy2);
    cr_assert_gt(a.erank2, b.erank2);
    cr_assert_gt(a.erank1, b.erank1);
    cr_assert_gt(a.srank, b.srank);
    cr_assert(b.erank2 >= 1.0 && b.erank2 < 1.01, "erank2 %g", b.erank2);
    assert_close(a.erank2, 8.0, TOL, "uniform erank");
}
