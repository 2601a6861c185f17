/* libforeshock Gram helpers against a naive double-precision reference. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "foreshock.h"
#include "fstest.h"

static uint64_t rng_state;

static float urand(void)
{
    return (float)(uniform01(&rng_state) * 2.0 - 1.0);
}

static float *random_matrix(size_t rows, size_t cols)
{
    float *m = malloc(rows * cols * sizeof(*m));
    cr_assert(m);
    for (size_t i = 0; i < rows * cols; i++)
        m[i] = urand();
    return m;
}

/* Upper triangle of X X^T in double, packed like fsc_gram_upper. */
static double *naive_gram(const float *x, size_t rows, size_t cols)
{
    double *t = calloc(fsc_tri_len(rows), sizeof(*t)), *xd = malloc(rows * cols * sizeof(*xd));
    cr_assert(t && xd);
    for (size_t i = 0; i < rows * cols; i++)
        xd[i] = (double)x[i];
    gram_tri_add(xd, rows, cols, 0, cols, t);
    free(xd);
    return t;
}

/* Index of (i, j), i <= j, in a packed upper triangle of an n x n matrix. */
static size_t tri_index(size_t n, size_t i, size_t j)
{
    return i * n - i * (i - 1) / 2 + (j - i);
}

/* Float32 accumulation: compare against the Cauchy-Schwarz scale of each
 * entry, sqrt(G_ii G_jj), with a tolerance far below any indexing error. */
static void expect_close(const float *got, const double *ref, size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++)
        for (size_t j = i; j < n; j++) {
            size_t k = tri_index(n, i, j);
            double scale = sqrt(ref[tri_index(n, i, i)] * ref[tri_index(n, j, j)]) + 1e-12;
            cr_assert(fabs((double)got[k] - ref[k]) <= 1e-5 * scale,
                      "%s: entry (%zu,%zu) got %.9g want %.9g", what, i, j, (double)got[k], ref[k]);
        }
}

Test(client_gram, tri_len)
{
    static const struct {
        size_t n, want;
    } cases[] = {{0, 0}, {1, 1}, {2, 3}, {64, 2080}, {256, 32896}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        cr_expect_eq(fsc_tri_len(cases[i].n), cases[i].want, "n=%zu", cases[i].n);
}

Test(client_gram, upper_matches_naive_for_many_shapes)
{
    static const struct {
        size_t rows, cols;
    } cases[] = {
        {1, 1}, {1, 9}, {7, 1}, {5, 3}, {3, 17}, {17, 5}, {64, 256}, {128, 33}, {33, 128},
    };
    rng_state = 42;
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        size_t r = cases[c].rows, k = cases[c].cols;
        float *x = random_matrix(r, k);
        float *got = malloc(fsc_tri_len(r) * sizeof(*got));
        double *ref = naive_gram(x, r, k);
        char what[64];
        snprintf(what, sizeof(what), "%zux%zu", r, k);
        cr_assert_eq(fsc_gram_upper(x, r, k, got), 0, "%s", what);
        expect_close(got, ref, r, what);
        free(x);
        free(got);
        free(ref);
    }
}

Test(client_gram, upper_rejects_bad_arguments)
{
    float x[4] = {1, 2, 3, 4}, out[3];
    static const struct {
        int null_x, null_out;
        size_t rows, cols;
    } cases[] = {
        {1, 0, 2, 2}, {0, 1, 2, 2}, {0, 0, 0, 2}, {0, 0, 2, 0}, {0, 0, FSC_MAX_GRAM_ROWS + 1, 2},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        cr_expect_eq(fsc_gram_upper(cases[i].null_x ? NULL : x, cases[i].rows, cases[i].cols,
                                    cases[i].null_out ? NULL : out),
                     -EINVAL, "case %zu", i);
}

/* A = [Wq - Wq0 ; Wq0], B = [Wk0 ; Wk - Wk0], built here in double. */
static void reference_attention(const float *wq, const float *wk, const float *wq0,
                                const float *wk0, size_t dh, size_t d, double **ga, double **gb)
{
    float *a = malloc(2 * dh * d * sizeof(*a)), *b = malloc(2 * dh * d * sizeof(*b));
    cr_assert(a && b);
    for (size_t i = 0; i < dh * d; i++) {
        a[i] = wq[i] - wq0[i];
        a[dh * d + i] = wq0[i];
        b[i] = wk0[i];
        b[dh * d + i] = wk[i] - wk0[i];
    }
    *ga = naive_gram(a, 2 * dh, d);
    *gb = naive_gram(b, 2 * dh, d);
    free(a);
    free(b);
}

Test(client_gram, attention_grams_match_definition)
{
    static const struct {
        size_t dh, d;
    } cases[] = {{1, 1}, {2, 3}, {4, 64}, {16, 8}, {32, 96}};
    rng_state = 7;
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        size_t dh = cases[c].dh, d = cases[c].d, n = 2 * dh;
        float *wq = random_matrix(dh, d), *wk = random_matrix(dh, d);
        float *wq0 = random_matrix(dh, d), *wk0 = random_matrix(dh, d);
        float *ga = malloc(fsc_tri_len(n) * sizeof(float)),
              *gb = malloc(fsc_tri_len(n) * sizeof(float));
        double *rga, *rgb;
        reference_attention(wq, wk, wq0, wk0, dh, d, &rga, &rgb);
        cr_assert_eq(fsc_attention_grams(wq, wk, wq0, wk0, dh, d, ga, gb), 0);
        expect_close(ga, rga, n, "GA");
        expect_close(gb, rgb, n, "GB");
        free(wq), free(wk), free(wq0), free(wk0), free(ga), free(gb), free(rga), free(rgb);
    }
}

/* Shards of the model dimension: partial Grams add up to the full one,
 * which is what lets the daemon reduce FSDP shards (docs/monitors.md 1.1). */
Test(client_gram, attention_grams_are_additive_over_d_shards)
{
    const size_t dh = 8, d = 48, shards = 3, ds = d / shards, n = 2 * dh, tri = fsc_tri_len(n);
    float *w[4], *part[4], *full_ga = malloc(tri * sizeof(float)),
                           *full_gb = malloc(tri * sizeof(float));
    double *sum_ga = calloc(tri, sizeof(double)), *sum_gb = calloc(tri, sizeof(double));
    float *ga = malloc(tri * sizeof(float)), *gb = malloc(tri * sizeof(float));

    rng_state = 99;
    for (int m = 0; m < 4; m++) {
        w[m] = random_matrix(dh, d);
        part[m] = malloc(dh * ds * sizeof(float));
    }
    cr_assert_eq(fsc_attention_grams(w[0], w[1], w[2], w[3], dh, d, full_ga, full_gb), 0);
    for (size_t s = 0; s < shards; s++) {
        for (int m = 0; m < 4; m++)
            for (size_t r = 0; r < dh; r++)
                memcpy(part[m] + r * ds, w[m] + r * d + s * ds, ds * sizeof(float));
        cr_assert_eq(fsc_attention_grams(part[0], part[1], part[2], part[3], dh, ds, ga, gb), 0);
        for (size_t k = 0; k < tri; k++) {
            sum_ga[k] += ga[k];
            sum_gb[k] += gb[k];
        }
    }
    expect_close(full_ga, sum_ga, n, "sum of GA shards");
    expect_close(full_gb, sum_gb, n, "sum of GB shards");
    for (int m = 0; m < 4; m++)
        free(w[m]), free(part[m]);
    free(full_ga), free(full_gb), free(sum_ga), free(sum_gb), free(ga), free(gb);
}

Test(client_gram, attention_grams_reject_bad_dh)
{
    float w[4] = {0}, out[64];
    cr_expect_eq(fsc_attention_grams(w, w, w, w, 0, 2, out, out), -EINVAL);
    cr_expect_eq(fsc_attention_grams(w, w, w, w, FSC_MAX_DH + 1, 2, out, out), -EINVAL);
    cr_expect_eq(fsc_attention_grams(NULL, w, w, w, 1, 2, out, out), -EINVAL);
}

Test(client_gram, router_gram_matches_naive)
{
    const size_t e = 16, d = 40;
    float *wr, *got = malloc(fsc_tri_len(e) * sizeof(float));
    double *ref;
    rng_state = 3;
    wr = random_matrix(e, d);
    ref = naive_gram(wr, e, d);
    cr_assert_eq(fsc_router_gram(wr, e, d, got), 0);
    expect_close(got, ref, e, "GR");
    cr_expect_eq(fsc_router_gram(wr, FSC_MAX_EXPERTS + 1, d, got), -EINVAL);
    free(wr), free(got), free(ref);
}
