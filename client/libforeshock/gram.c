/* Gram sketches from weight matrices with BLAS (see foreshock.h). Pure:
 * inputs in, caller's outputs written, scratch freed. */
#include <cblas.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "foreshock.h"

size_t fsc_tri_len(size_t n)
{
    return n * (n + 1) / 2;
}

/* Row-major upper triangle of the square matrix c (n x n) into tri. */
static void pack_upper(const float *c, size_t n, float *tri)
{
    size_t k = 0;

    for (size_t i = 0; i < n; i++)
        for (size_t j = i; j < n; j++)
            tri[k++] = c[i * n + j];
}

int fsc_gram_upper(const float *x, size_t rows, size_t cols, float *tri_out)
{
    float *c;

    if (!x || !tri_out || rows < 1 || rows > FSC_MAX_GRAM_ROWS || cols < 1 ||
        cols > FSC_MAX_GRAM_COLS)
        return -EINVAL;
    c = malloc(rows * rows * sizeof(*c));
    if (!c)
        return -ENOMEM;
    /* C = X X^T; with beta = 0 BLAS does not read C, and only the upper
     * triangle is written, which is all pack_upper reads. */
    cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, (blasint)rows, (blasint)cols, 1.0f, x,
                (blasint)cols, 0.0f, c, (blasint)rows);
    pack_upper(c, rows, tri_out);
    free(c);
    return 0;
}

/* out rows [0, dh) = top rows, [dh, 2dh) = bottom rows; each source is dh x d.
 * A NULL `minus` means the block is `plus` itself, else plus - minus. */
static void stack(float *out, size_t dh, size_t d, const float *top_plus, const float *top_minus,
                  const float *bot_plus, const float *bot_minus)
{
    size_t n = dh * d;

    for (size_t i = 0; i < n; i++)
        out[i] = top_minus ? top_plus[i] - top_minus[i] : top_plus[i];
    for (size_t i = 0; i < n; i++)
        out[n + i] = bot_minus ? bot_plus[i] - bot_minus[i] : bot_plus[i];
}

int fsc_attention_grams(const float *wq, const float *wk, const float *wq0, const float *wk0,
                        size_t dh, size_t d, float *ga, float *gb)
{
    float *m;
    int rc;

    if (!wq || !wk || !wq0 || !wk0 || !ga || !gb || dh < 1 || dh > FSC_MAX_DH || d < 1 ||
        d > FSC_MAX_GRAM_COLS)
        return -EINVAL;
    m = malloc(2 * dh * d * sizeof(*m));
    if (!m)
        return -ENOMEM;
    /* A = [dWq ; Wq(t0)] with dWq = Wq(t) - Wq(t0) (docs/monitors.md 1.1). */
    stack(m, dh, d, wq, wq0, wq0, NULL);
    rc = fsc_gram_upper(m, 2 * dh, d, ga);
    if (rc == 0) {
        /* B = [Wk(t0) ; dWk]. */
        stack(m, dh, d, wk0, NULL, wk, wk0);
        rc = fsc_gram_upper(m, 2 * dh, d, gb);
    }
    free(m);
    return rc;
}

int fsc_router_gram(const float *wr, size_t n_experts, size_t d, float *gram_out)
{
    if (n_experts < 1 || n_experts > FSC_MAX_EXPERTS)
        return -EINVAL;
    return fsc_gram_upper(wr, n_experts, d, gram_out);
}
