/* The QK monitors of one attention head: balancing, the Delta1/Delta2/Delta3
 * spectra through Cholesky and TRMM (or the eigen route for singular Grams),
 * and their scalars. See monitor_qk.h for the contract. */
#include "monitor_qk.h"
#include "eigen.h"

#include <cblas.h>
#include <errno.h>
#include <float.h>
#include <lapacke.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* All matrices here are full (both triangles), column-major, leading
 * dimension = their side, unless a comment says otherwise. */

struct qk_workspace {
    unsigned max_dh;
    bool pivoted;    /* the last factor() permuted (dpstrf) */
    size_t nmax;     /* 2 * max_dh */
    double *g1, *g2; /* the two Grams, unpacked (and balanced) */
    double *f;       /* Cholesky factor L */
    double *c, *t;   /* C and scratch */
    double *spec[QK_NSPECTRA];
    size_t spec_len[QK_NSPECTRA];
    struct monitor_eig eig; /* dsyev output and work; dpstrf's work too */
    lapack_int *piv;        /* 1-based, LAPACK's */
    lapack_int rank;        /* of the last factor() */
    double fscale;          /* the last factor() is of G1 / fscale */
};

int monitor_init(void)
{
    openblas_set_num_threads(1);
    return 0;
}

size_t monitor_tri_len(size_t n)
{
    return n * (n + 1) / 2;
}

int monitor_tri_accumulate(double *dst, size_t n, const void *src, size_t src_bytes)
{
    if (!dst || !src)
        return -EINVAL;
    if (n > MONITOR_TRI_MAX_N)
        return -E2BIG;
    size_t len = monitor_tri_len(n);
    if (src_bytes != len * 4)
        return -EINVAL;
    const unsigned char *b = src;
    for (size_t k = 0; k < len; k++, b += 4) {
        /* Little-endian on the wire whatever the host order is. */
        uint32_t u =
            (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
        float x;
        memcpy(&x, &u, sizeof x);
        dst[k] += (double)x;
    }
    return 0;
}

void qk_workspace_destroy(struct qk_workspace *ws)
{
    if (!ws)
        return;
    free(ws->g1);
    free(ws->g2);
    free(ws->f);
    free(ws->c);
    free(ws->t);
    free(ws->spec[0]);
    monitor_eig_free(&ws->eig);
    free(ws->piv);
    free(ws);
}

int qk_workspace_create(unsigned max_dh, struct qk_workspace **out)
{
    if (!out)
        return -EINVAL;
    *out = NULL;
    if (max_dh == 0 || max_dh > QK_MAX_DH)
        return -EINVAL;
    struct qk_workspace *ws = calloc(1, sizeof(*ws));
    if (!ws)
        return -ENOMEM;
    size_t n = 2 * (size_t)max_dh, nn = n * n;
    ws->max_dh = max_dh;
    ws->nmax = n;
    ws->g1 = malloc(nn * sizeof(double));
    ws->g2 = malloc(nn * sizeof(double));
    ws->f = malloc(nn * sizeof(double));
    ws->c = malloc(nn * sizeof(double));
    ws->t = malloc(nn * sizeof(double));
    ws->spec[0] = malloc(4 * n * sizeof(double));
    ws->piv = malloc(n * sizeof(lapack_int));
    if (!ws->g1 || !ws->g2 || !ws->f || !ws->c || !ws->t || !ws->spec[0] || !ws->piv)
        goto fail;
    for (int k = 1; k < QK_NSPECTRA; k++)
        ws->spec[k] = ws->spec[0] + (size_t)k * n;

    if (monitor_eig_init(&ws->eig, n, ws->c) < 0)
        goto fail;
    *out = ws;
    return 0;
fail:
    qk_workspace_destroy(ws);
    return -ENOMEM;
}

/* --- dense helpers ---------------------------------------------------------- */

static bool all_finite(const double *x, size_t len)
{
    for (size_t k = 0; k < len; k++)
        if (!isfinite(x[k]))
            return false;
    return true;
}

/* Row i of a row-major upper triangle holds columns i..n-1; that is column
 * i, rows i..n-1, of the column-major lower triangle: one contiguous copy. */
static void tri_unpack(const double *tri, size_t n, double *g)
{
    const double *row = tri;
    for (size_t i = 0; i < n; i++) {
        memcpy(g + i + i * n, row, (n - i) * sizeof(double));
        for (size_t j = i + 1; j < n; j++)
            g[i + j * n] = row[j - i];
        row += n - i;
    }
}

/* Pointer to block (bi, bj) of side h in an n x n matrix g. */
static double *block(double *g, size_t n, size_t h, int bi, int bj)
{
    return g + (size_t)bi * h + (size_t)bj * h * n;
}

static double block_trace(const double *g, size_t n, size_t h, int b)
{
    double s = 0.0;
    for (size_t i = 0; i < h; i++) {
        size_t k = (size_t)b * h + i;
        s += g[k + k * n];
    }
    return s;
}

/* dst (ld m) = a * the m x m submatrix src (leading dimension ld). */
static void copy_scaled(const double *src, size_t ld, size_t m, double a, double *dst)
{
    for (size_t j = 0; j < m; j++)
        for (size_t i = 0; i < m; i++)
            dst[i + j * m] = a * src[i + j * ld];
}

/* Factors the m x m matrix g (leading dimension ld): P^T G P = fscale L L^T
 * with L (ws->f) m x rank lower trapezoidal, upper part zeroed, P = I
 * unless ws->pivoted (then ws->piv). rank 0 when G has no positive
 * diagonal. Returns 0 or -EDOM. */
static int factor(struct qk_workspace *ws, const double *g, size_t ld, size_t m)
{
    double *f = ws->f;
    double dmax = 0.0;
    for (size_t i = 0; i < m; i++)
        if (g[i + i * ld] > dmax)
            dmax = g[i + i * ld];
    ws->rank = 0;
    ws->fscale = dmax;
    if (!(dmax > 0.0))
        return 0;
    /* Factor G / max diag: entries are then <= 1 in magnitude, so the
     * products below cannot overflow whatever the scale of the input. */
    copy_scaled(g, ld, m, 1.0 / dmax, f);
    /* dpstrf's own default tolerance, also used to judge dpotrf's pivots:
     * a pivot below it is rounding noise, not a direction of G. */
    double tol = (double)m * DBL_EPSILON;
    lapack_int info = LAPACKE_dpotrf_work(LAPACK_COL_MAJOR, 'L', (lapack_int)m, f, (lapack_int)m);
    if (info < 0)
        return -EDOM;
    if (info == 0) {
        bool deficient = false;
        for (size_t i = 0; i < m && !deficient; i++)
            deficient = f[i + i * m] * f[i + i * m] < tol;
        if (!deficient) {
            ws->pivoted = false;
            ws->rank = (lapack_int)m;
            return 0;
        }
    }
    /* Singular or nearly so: pivoted Cholesky finds the rank and leaves
     * the null directions out of L. */
    copy_scaled(g, ld, m, 1.0 / dmax, f);
    lapack_int rank = 0;
    info = LAPACKE_dpstrf_work(LAPACK_COL_MAJOR, 'L', (lapack_int)m, f, (lapack_int)m, ws->piv,
                               &rank, tol, ws->eig.work);
    if (info < 0)
        return -EDOM;
    for (lapack_int j = 0; j < rank; j++)
        for (lapack_int i = 0; i < j; i++)
            f[i + (size_t)j * m] = 0.0;
    ws->pivoted = true;
    ws->rank = rank;
    return 0;
}

/* Eigenvalues of C = L^T P^T G P L with the last factor(); g is m x m with
 * leading dimension ld. Writes ws->rank values, descending, negatives
 * clamped to 0, to out; *len = that count. Returns 0, -EDOM (dsyev did not
 * converge) or -ERANGE (a non-finite eigenvalue: overflow). */
static int project(struct qk_workspace *ws, const double *g, size_t ld, size_t m, double *out,
                   size_t *len)
{
    size_t r = (size_t)ws->rank;
    *len = 0;
    if (r == 0)
        return 0;
    double *t = ws->t, *c = ws->c, *f = ws->f, *a;
    double gmax = 0.0;
    for (size_t i = 0; i < m; i++)
        if (g[i + i * ld] > gmax)
            gmax = g[i + i * ld];
    if (!(gmax > 0.0))
        return 0; /* G2 = 0 (or not PSD): the product has no spectrum */
    /* c (or t) = P^T (G / gmax) P: (P^T G P)_ij = G(piv_i, piv_j). */
    double inv = 1.0 / gmax, *pg = r == m ? c : t;
    if (!ws->pivoted) {
        copy_scaled(g, ld, m, inv, pg);
    } else {
        for (size_t j = 0; j < m; j++) {
            const double *col = g + (size_t)(ws->piv[j] - 1) * ld;
            for (size_t i = 0; i < m; i++)
                pg[i + j * m] = inv * col[ws->piv[i] - 1];
        }
    }
    if (r == m) {
        /* C = L^T (G L), L square lower triangular: two dtrmm. */
        cblas_dtrmm(CblasColMajor, CblasRight, CblasLower, CblasNoTrans, CblasNonUnit, (int)m,
                    (int)m, 1.0, f, (int)m, c, (int)m);
        cblas_dtrmm(CblasColMajor, CblasLeft, CblasLower, CblasTrans, CblasNonUnit, (int)m, (int)m,
                    1.0, f, (int)m, c, (int)m);
        a = c;
    } else {
        /* L is m x r trapezoidal: X = G L (m x r), C = L^T X (r x r). */
        cblas_dsymm(CblasColMajor, CblasLeft, CblasLower, (int)m, (int)r, 1.0, t, (int)m, f, (int)m,
                    0.0, c, (int)m);
        cblas_dgemm(CblasColMajor, CblasTrans, CblasNoTrans, (int)r, (int)r, (int)m, 1.0, f, (int)m,
                    c, (int)m, 0.0, t, (int)r);
        a = t;
    }
    if (monitor_eig_solve(&ws->eig, r, a) < 0)
        return -EDOM;
    /* Undo both normalisations; only this last product can overflow. */
    double scale = ws->fscale * gmax;
    for (size_t i = 0; i < r; i++) {
        double x = ws->eig.w[r - 1 - i] * scale;
        if (!isfinite(x))
            return -ERANGE;
        out[i] = x > 0.0 ? x : 0.0;
    }
    *len = r;
    return 0;
}

/* lambda(G1 G2) of two m x m blocks into spectrum slot k. */
static int pair_spectrum(struct qk_workspace *ws, const double *g1, const double *g2, size_t ld,
                         size_t m, enum qk_spectrum k)
{
    int rc = factor(ws, g1, ld, m);
    if (rc == 0)
        rc = project(ws, g2, ld, m, ws->spec[k], &ws->spec_len[k]);
    return rc;
}

/* G <- D G D (sign +1) or D^-1 G D^-1 (sign -1), D = diag(I, s I). */
static void balance(double *g, size_t n, size_t h, double s, int sign)
{
    double a = sign > 0 ? s : 1.0 / s, a2 = a * a;
    for (size_t j = 0; j < h; j++)
        for (size_t i = h; i < n; i++)
            g[i + j * n] *= a;
    for (size_t j = h; j < n; j++) {
        for (size_t i = 0; i < h; i++)
            g[i + j * n] *= a;
        for (size_t i = h; i < n; i++)
            g[i + j * n] *= a2;
    }
}

/* GB' <- W' GB' W'^T, W' = [[I, sI], [0, I]] (the balanced W). With
 * GB' = [[P, Q], [Q^T, R]]: [[P + s(Q + Q^T) + s^2 R, Q + sR], [., R]]. */
static void w_left(double *g, size_t n, size_t h, double s)
{
    double *p = block(g, n, h, 0, 0), *q = block(g, n, h, 0, 1);
    double *qt = block(g, n, h, 1, 0), *r = block(g, n, h, 1, 1);
    for (size_t j = 0; j < h; j++)
        for (size_t i = 0; i < h; i++)
            p[i + j * n] += s * (q[i + j * n] + qt[i + j * n]) + s * s * r[i + j * n];
    for (size_t j = 0; j < h; j++)
        for (size_t i = 0; i < h; i++) {
            q[i + j * n] += s * r[i + j * n];
            qt[i + j * n] += s * r[i + j * n];
        }
}

/* GA' <- W'^T GA' W'. With GA' = [[P, Q], [Q^T, R]]:
 * [[P, sP + Q], [., s^2 P + s(Q + Q^T) + R]]. */
static void w_right(double *g, size_t n, size_t h, double s)
{
    double *p = block(g, n, h, 0, 0), *q = block(g, n, h, 0, 1);
    double *qt = block(g, n, h, 1, 0), *r = block(g, n, h, 1, 1);
    for (size_t j = 0; j < h; j++)
        for (size_t i = 0; i < h; i++)
            r[i + j * n] += s * s * p[i + j * n] + s * (q[i + j * n] + qt[i + j * n]);
    for (size_t j = 0; j < h; j++)
        for (size_t i = 0; i < h; i++) {
            q[i + j * n] += s * p[i + j * n];
            qt[i + j * n] += s * p[i + j * n];
        }
}

static void head_absent(struct qk_head *out)
{
    *out = (struct qk_head){0};
}

/* Keeps the first error code. */
static void note(int *rc, int r)
{
    if (*rc == 0 && r != 0)
        *rc = r;
}

int qk_head_from_grams(struct qk_workspace *ws, unsigned dh, const double *ga, const double *gb,
                       struct qk_head *out)
{
    if (!out)
        return -EINVAL;
    head_absent(out);
    if (!ws || !ga || !gb || dh == 0 || dh > ws->max_dh)
        return -EINVAL;
    for (int k = 0; k < QK_NSPECTRA; k++)
        ws->spec_len[k] = 0;
    size_t h = dh, n = 2 * h, len = monitor_tri_len(n);
    if (!all_finite(ga, len) || !all_finite(gb, len)) {
        out->nonfinite = true;
        return 0;
    }
    double *g1 = ws->g1, *g2 = ws->g2;
    tri_unpack(ga, n, g1);
    tri_unpack(gb, n, g2);

    double qd = block_trace(g1, n, h, 0), qw = block_trace(g1, n, h, 1);
    double kw = block_trace(g2, n, h, 0), kd = block_trace(g2, n, h, 1);
    if (!isfinite(qd) || !isfinite(qw) || !isfinite(kw) || !isfinite(kd)) {
        out->nonfinite = true; /* finite entries, overflowing sums */
        return 0;
    }
    out->norms_present = true;
    out->q_delta_sq = qd;
    out->q_sq = qw;
    out->k_sq = kw;
    out->k_delta_sq = kd;

    bool frozen_q = !(qd > 0.0), frozen_k = !(kd > 0.0);
    int rc = 0, r;
    bool ran[QK_NSPECTRA] = {false};
    if (!frozen_q && !frozen_k) {
        /* tr(Qdd Kdd) = sum_ij Qdd_ij Kdd_ij, both symmetric; each factor
         * divided by its trace first (|Qdd_ij| <= tr Qdd): no overflow. */
        const double *qdd = block(g1, n, h, 0, 0), *kdd = block(g2, n, h, 1, 1);
        double s = 0.0;
        for (size_t j = 0; j < h; j++)
            for (size_t i = 0; i < h; i++)
                s += (qdd[i + j * n] / qd) * (kdd[i + j * n] / kd);
        out->cqk = s;
        out->cqk_present = isfinite(out->cqk);
        r = pair_spectrum(ws, block(g1, n, h, 0, 0), block(g2, n, h, 1, 1), n, h, QK_D3);
        note(&rc, r);
        ran[QK_D3] = true;
    }
    if (qw > 0.0 && kw > 0.0) {
        r = pair_spectrum(ws, block(g1, n, h, 1, 1), block(g2, n, h, 0, 0), n, h, QK_W);
        note(&rc, r);
        ran[QK_W] = true;
    }
    if (!frozen_q || !frozen_k) {
        double s = (!frozen_q && qw > 0.0) ? sqrt(qd / qw) : 1.0;
        if (s != 1.0) {
            balance(g1, n, h, s, +1);
            balance(g2, n, h, s, -1);
        }
        bool factor_b = (frozen_k || !(kw > 0.0)) && !frozen_q && qw > 0.0;
        double *gf = factor_b ? g2 : g1, *go = factor_b ? g1 : g2;
        r = factor(ws, gf, n, n);
        if (r == 0) {
            r = project(ws, go, n, n, ws->spec[QK_D2], &ws->spec_len[QK_D2]);
            note(&rc, r);
            if (factor_b)
                w_right(g1, n, h, s);
            else
                w_left(g2, n, h, s);
            r = project(ws, go, n, n, ws->spec[QK_D1], &ws->spec_len[QK_D1]);
        }
        note(&rc, r);
        ran[QK_D2] = ran[QK_D1] = true;
    }

    static const unsigned nominal[QK_NSPECTRA] = {2, 2, 1, 1};
    for (int k = 0; k < QK_NSPECTRA; k++) {
        if (!ran[k])
            continue;
        spectrum_scalars_f64(ws->spec[k], ws->spec_len[k], nominal[k] * h, &out->spec[k]);
    }
    if (rc == -ERANGE) {
        out->nonfinite = true;
        rc = 0;
    }
    return rc;
}

const double *qk_workspace_spectrum(const struct qk_workspace *ws, enum qk_spectrum which,
                                    size_t *len)
{
    if (len)
        *len = 0;
    if (!ws || (unsigned)which >= QK_NSPECTRA)
        return NULL;
    if (len)
        *len = ws->spec_len[which];
    return ws->spec[which];
}

/* --- spectrum sketches ------------------------------------------------------ */

static bool floats_finite(const float *x, size_t len)
{
    for (size_t k = 0; k < len; k++)
        if (!isfinite(x[k]))
            return false;
    return true;
}

int qk_head_from_spectra(const struct qk_spectra_in *in, struct qk_head *out)
{
    if (!out)
        return -EINVAL;
    head_absent(out);
    if (!in || in->dh == 0 || in->dh > QK_MAX_DH)
        return -EINVAL;
    size_t h = in->dh;
    const float *v[QK_NSPECTRA] = {in->d2, in->d1, in->d3, in->w};
    size_t len[QK_NSPECTRA] = {in->n_d2, in->n_d1, in->n_d3, in->n_w};
    size_t nominal[QK_NSPECTRA] = {2 * h, 2 * h, h, h};
    bool finite = true;
    for (int k = 0; k < QK_NSPECTRA; k++) {
        if (!v[k])
            len[k] = 0;
        if (len[k] > nominal[k])
            return -EINVAL;
        finite = finite && floats_finite(v[k], len[k]);
    }
    if (in->has_norms)
        finite = finite && isfinite(in->q_delta_sq) && isfinite(in->q_sq) && isfinite(in->k_sq) &&
                 isfinite(in->k_delta_sq);
    if (in->has_cqk)
        finite = finite && isfinite(in->cqk);
    if (!finite) {
        out->nonfinite = true;
        return 0;
    }
    for (int k = 0; k < QK_NSPECTRA; k++)
        spectrum_scalars_f32(v[k], len[k], nominal[k], &out->spec[k]);
    if (in->has_norms) {
        out->norms_present = true;
        out->q_delta_sq = in->q_delta_sq;
        out->q_sq = in->q_sq;
        out->k_sq = in->k_sq;
        out->k_delta_sq = in->k_delta_sq;
    }
    if (in->has_cqk) {
        out->cqk_present = true;
        out->cqk = in->cqk;
    } else if (in->has_norms && in->q_delta_sq > 0.0 && in->k_delta_sq > 0.0 && len[QK_D3] > 0) {
        double s = 0.0;
        for (size_t i = 0; i < len[QK_D3]; i++)
            s += (double)in->d3[i];
        out->cqk_present = true;
        out->cqk = s / (in->q_delta_sq * in->k_delta_sq);
    }
    return 0;
}

/* --- per-layer aggregation -------------------------------------------------- */

#define QK_NAME(sp, sc)                                                                            \
    [QK_SERIES(sp, QK_ENTROPY2)] = "qk." sc ".entropy",                                            \
                   [QK_SERIES(sp, QK_ENTROPY1)] = "qk." sc ".entropy1",                            \
                   [QK_SERIES(sp, QK_ERANK2)] = "qk." sc ".erank",                                 \
                   [QK_SERIES(sp, QK_ERANK1)] = "qk." sc ".erank1",                                \
                   [QK_SERIES(sp, QK_SRANK)] = "qk." sc ".srank",                                  \
                   [QK_SERIES(sp, QK_FRO)] = "qk." sc ".fro",                                      \
                   [QK_SERIES(sp, QK_SMAX)] = "qk." sc ".smax",                                    \
                   [QK_SERIES(sp, QK_RANK)] = "qk." sc ".rank"

static const char *const series_names[QK_NSERIES] = {
    QK_NAME(QK_D2, "d2"),
    QK_NAME(QK_D1, "d1"),
    QK_NAME(QK_D3, "d3"),
    QK_NAME(QK_W, "w"),
    [QK_SERIES_CQK] = "qk.cqk",
    [QK_SERIES_Q_DELTA_SQ] = "qk.norm.dq",
    [QK_SERIES_Q_SQ] = "qk.norm.q",
    [QK_SERIES_K_SQ] = "qk.norm.k",
    [QK_SERIES_K_DELTA_SQ] = "qk.norm.dk",
};

const char *qk_series_name(unsigned series)
{
    return series < QK_NSERIES ? series_names[series] : NULL;
}

int qk_head_value(const struct qk_head *head, unsigned series, double *value)
{
    if (!head || !value || series >= QK_NSERIES)
        return -EINVAL;
    if (head->nonfinite)
        return -ENODATA;
    if (series < QK_SERIES_CQK) {
        const struct spectrum_scalars *s = &head->spec[series / QK_NSCALARS];
        if (!s->present)
            return -ENODATA;
        switch ((enum qk_scalar)(series % QK_NSCALARS)) {
        case QK_ENTROPY2:
            *value = s->entropy2;
            break;
        case QK_ENTROPY1:
            *value = s->entropy1;
            break;
        case QK_ERANK2:
            *value = s->erank2;
            break;
        case QK_ERANK1:
            *value = s->erank1;
            break;
        case QK_SRANK:
            *value = s->srank;
            break;
        case QK_FRO:
            *value = s->fro;
            break;
        case QK_SMAX:
            *value = s->smax;
            break;
        case QK_RANK:
            *value = (double)s->rank;
            break;
        default:
            return -EINVAL;
        }
        return 0;
    }
    if (series == QK_SERIES_CQK) {
        if (!head->cqk_present)
            return -ENODATA;
        *value = head->cqk;
        return 0;
    }
    if (!head->norms_present)
        return -ENODATA;
    switch (series) {
    case QK_SERIES_Q_DELTA_SQ:
        *value = head->q_delta_sq;
        break;
    case QK_SERIES_Q_SQ:
        *value = head->q_sq;
        break;
    case QK_SERIES_K_SQ:
        *value = head->k_sq;
        break;
    default:
        *value = head->k_delta_sq;
        break;
    }
    return 0;
}

int qk_layer_aggregate(const struct qk_head *heads, size_t n_heads, struct qk_agg *out)
{
    if (!out || (n_heads > 0 && !heads))
        return -EINVAL;
    for (unsigned s = 0; s < QK_NSERIES; s++) {
        struct qk_agg a = {0};
        double sum = 0.0;
        for (size_t i = 0; i < n_heads; i++) {
            double x;
            if (qk_head_value(&heads[i], s, &x) != 0)
                continue;
            if (a.count == 0 || x < a.min) {
                a.min = x;
                a.argmin = i;
            }
            if (a.count == 0 || x > a.max)
                a.max = x;
            sum += x;
            a.count++;
        }
        a.present = a.count > 0;
        if (a.present)
            a.mean = sum / a.count;
        out[s] = a;
    }
    return 0;
}
