#ifndef FORESHOCK_MONITOR_QK_H
#define FORESHOCK_MONITOR_QK_H

#include <stdbool.h>
#include <stddef.h>

#include "spectrum.h"

/* The QK bilinear decomposition monitors of one attention head
 * (docs/monitors.md sections 1.2 and 1.3). Pure: no libuv, SQLite,
 * threads or clocks; inputs in, a plain struct out. LAPACK/BLAS (OpenBLAS,
 * one thread, see monitor_init) do the dense work.
 *
 * Inputs. GA, GB are n x n, n = 2*dh, as upper triangles, row-major (row i
 * holds columns i..n-1, n(n+1)/2 values), in double, already summed over
 * the d-shards by the caller (monitor_tri_accumulate adds one wire shard).
 * Blocks: GA = [[Qdd, Qdw], [Qwd, Qww]], GB = [[Kww, Kwd], [Kdw, Kdd]].
 *
 * Outputs per head: the four spectra of docs/monitors.md 1.2, each reduced to
 * struct spectrum_scalars (spectrum.h), the four squared norms and c_qk:
 *   d2 = sigma^2(Delta2) = lambda(GA GB)          (2dh values)
 *   d1 = sigma^2(Delta1) = lambda(GA1 GB1)        (2dh values)
 *   d3 = sigma^2(Delta3) = lambda(Qdd Kdd)        (dh values)
 *   w  = sigma^2(K(t0))  = lambda(Qww Kww)        (dh values)
 *   c_qk = tr(Qdd Kdd) / (tr Qdd tr Kdd)
 * A spectrum is absent when its product is exactly zero (a frozen update:
 * d3 needs dWq and dWk, d2/d1 need one of them, w needs Wq and Wk), never 0
 * or NaN. Any non-finite input value sets `nonfinite` and nothing else.
 *
 * How lambda(G1 G2) is computed (G1, G2 symmetric PSD, m x m):
 *   G1 = P L L^T P^T by Cholesky (dpotrf); when G1 is singular or a pivot
 *   falls below m*eps*max(diag G1), by pivoted Cholesky (dpstrf), which
 *   drops the null directions and leaves L m x r, r = numerical rank.
 *   C = L^T P^T G2 P L (r x r, symmetric PSD; dtrmm, or dsymm+dgemm when
 *   r < m) has the eigenvalues of G1 G2 (plus zeros); lambda(C) by dsyev
 *   without vectors. This is docs/monitors.md's C = Lambda^1/2 V^T G2 V
 *   Lambda^1/2 with the Cholesky factor in place of V Lambda^1/2, and the
 *   pivoted factor is the singular-G1 fallback; it measured about 2.5x
 *   cheaper than the eigen route (tests/bench/bench_monitor.c).
 * For d2 and d1 the blocks are first balanced, GA' = D GA D,
 * GB' = D^-1 GB D^-1 with D = diag(I, s I), s = sqrt(tr Qdd / tr Qww):
 * a similarity, so lambda is unchanged. Cholesky itself does not care
 * about diagonal scaling, but the rank tolerance (relative to the largest
 * diagonal) does: at warm-up learning rates |dWq|/|Wq| ~ 1e-8, so the dWq
 * directions of an unbalanced GA sit 1e-16 below its Wq directions and
 * would be dropped as noise (measured: d2 off by 17 % of s_max without,
 * 3e-15 with; tests/unit/test_monitor_qk.c "tiny updates").
 * d1 reuses the factor of d2: with T, U of docs/monitors.md,
 * lambda(T GA T^T U GB U^T) = lambda(GA W GB W^T), W = T^T U = [[I,I],[0,I]]
 * (W B = [Wk + dWk; dWk]); W acts on blocks of the Gram, O(dh^2).
 * Which Gram is factored: GA, unless GB has a zero diagonal block and GA
 * does not (a frozen Wk), so that the factored side carries the rank
 * deficiency and C shrinks to dh x dh.
 *
 * GQA is the caller's business: it pairs each query head's GA with the GB
 * of the key head it reads. The math is the same. */

#define QK_MAX_DH 512u /* largest head dim accepted; equals FS_MAX_DH */
/* Largest triangle side monitor_tri_accumulate takes: 2 * QK_MAX_DH for the
 * attention Grams, and ROUTER_MAX_EXPERTS (monitor_router.h) for GR. */
#define MONITOR_TRI_MAX_N 1024u

enum qk_spectrum {
    QK_D2 = 0, /* first-order term Delta2 */
    QK_D1 = 1, /* full increment Delta1 = K(t) - K(t0) */
    QK_D3 = 2, /* second-order term Delta3 */
    QK_W = 3,  /* the weight operator K(t0) */
    QK_NSPECTRA = 4
};

struct qk_head {
    bool nonfinite; /* an input (or an overflowed result) was not finite */
    struct spectrum_scalars spec[QK_NSPECTRA];
    bool norms_present; /* false only when nonfinite */
    double q_delta_sq;  /* |dWq|_F^2 = tr Qdd */
    double q_sq;        /* |Wq|_F^2  = tr Qww */
    double k_sq;        /* |Wk|_F^2  = tr Kww */
    double k_delta_sq;  /* |dWk|_F^2 = tr Kdd */
    bool cqk_present;   /* needs tr Qdd > 0 and tr Kdd > 0 */
    double cqk;
};

struct qk_workspace;

/* Sets OpenBLAS to one thread: parallelism comes from our worker threads.
 * Call once from main() before any worker starts. Returns 0. */
int monitor_init(void);

/* Number of entries of an n x n upper triangle: n(n+1)/2. */
size_t monitor_tri_len(size_t n);

/* dst[k] += src[k] for the monitor_tri_len(n) entries of an upper triangle,
 * src as on the wire: float32 little-endian bytes, any alignment. The
 * caller owns both; dst is double so shard sums keep their precision.
 * Returns 0, -EINVAL (NULL pointer, or src_bytes != 4 * monitor_tri_len(n))
 * or -E2BIG (n > MONITOR_TRI_MAX_N).
 * Non-finite values are added as they are; the compute call flags them.
 * Any thread. */
int monitor_tri_accumulate(double *dst, size_t n, const void *src, size_t src_bytes);

/* A workspace for heads with dh <= max_dh: every buffer the hot path needs,
 * so qk_head_from_grams never allocates. About 5 * (2 max_dh)^2 doubles
 * (2.6 MB for dh 128). Create one per worker thread; a workspace is used by
 * one thread at a time. Returns 0, -EINVAL (max_dh 0 or above QK_MAX_DH,
 * NULL out) or -ENOMEM; on error *out is NULL. */
int qk_workspace_create(unsigned max_dh, struct qk_workspace **out);

/* Frees a workspace (NULL is fine). The thread that owns it. */
void qk_workspace_destroy(struct qk_workspace *ws);

/* The monitors of one head from its summed Grams (see the top comment).
 * ga, gb: monitor_tri_len(2*dh) doubles each, read only. `out` is always
 * written. Returns 0 (including the nonfinite case, flagged in out),
 * -EINVAL (NULL argument, dh 0 or above the workspace's max_dh) or -EDOM
 * (LAPACK did not converge on some spectrum: that one is absent, the rest
 * are valid). The thread that owns ws. */
int qk_head_from_grams(struct qk_workspace *ws, unsigned dh, const double *ga, const double *gb,
                       struct qk_head *out);

/* The raw spectrum behind out->spec[which] of the last qk_head_from_grams
 * on ws: eigenvalues of C, descending, negatives clamped to 0, before the
 * drop of spectrum.h step 3; *len values (0 when absent). Valid until the
 * next call on ws. For tests and for keeping raw spectra. */
const double *qk_workspace_spectrum(const struct qk_workspace *ws, enum qk_spectrum which,
                                    size_t *len);

/* A SpectrumSketch: spectra the trainer computed (sigma^2 values, any
 * order). A NULL or empty array is an absent spectrum. Lengths must not
 * exceed the nominal sizes (2dh for d2/d1, dh for d3/w); the drop floor
 * uses the nominal size, as the Gram path does. */
struct qk_spectra_in {
    unsigned dh;
    const float *d2;
    size_t n_d2;
    const float *d1;
    size_t n_d1;
    const float *d3;
    size_t n_d3;
    const float *w;
    size_t n_w;
    bool has_norms; /* the four squared norms below were sent */
    double q_delta_sq, q_sq, k_sq, k_delta_sq;
    bool has_cqk;
    double cqk;
};

/* The same struct qk_head from a spectrum sketch. c_qk: the sent value if
 * any, else sum(d3) / (q_delta_sq k_delta_sq) when norms and d3 were sent
 * (sum sigma^2(Delta3) = tr(Qdd Kdd)). Returns 0 (nonfinite flagged in
 * out), -EINVAL (NULL, dh 0 or above QK_MAX_DH, an array longer than its
 * nominal size). Pure, any thread. */
int qk_head_from_spectra(const struct qk_spectra_in *in, struct qk_head *out);

/* --- per-layer aggregation ------------------------------------------------ */

/* Scalars of one spectrum, in series order. */
enum qk_scalar {
    QK_ENTROPY2 = 0,
    QK_ENTROPY1,
    QK_ERANK2,
    QK_ERANK1,
    QK_SRANK,
    QK_FRO,
    QK_SMAX,
    QK_RANK,
    QK_NSCALARS
};

/* Series ids: spectrum * QK_NSCALARS + scalar, then the head-level ones. */
#define QK_SERIES(spectrum, scalar) ((unsigned)(spectrum)*QK_NSCALARS + (unsigned)(scalar))
enum {
    QK_SERIES_CQK = QK_NSPECTRA * QK_NSCALARS,
    QK_SERIES_Q_DELTA_SQ,
    QK_SERIES_Q_SQ,
    QK_SERIES_K_SQ,
    QK_SERIES_K_DELTA_SQ,
    QK_NSERIES
};

/* Series name ("qk.d2.entropy" for H_2, "qk.d2.erank" for exp(H_2),
 * "qk.d2.entropy1", "qk.d2.erank1", ".srank", ".fro", ".smax", ".rank",
 * "qk.cqk", "qk.norm.dq" ...), a static string; NULL when out of range. */
const char *qk_series_name(unsigned series);

/* The value of one series for one head: 0 and *value, -ENODATA when absent
 * (or nonfinite), -EINVAL for a bad id. Pure, any thread. */
int qk_head_value(const struct qk_head *head, unsigned series, double *value);

struct qk_agg {
    bool present;   /* at least one head had the series */
    unsigned count; /* heads that had it */
    double min, mean, max;
    size_t argmin; /* index into heads[] of the (first) minimum */
};

/* Per-layer min / mean / max / argmin over heads[0..n_heads) of every
 * series; absent heads are skipped. out has QK_NSERIES entries. Returns 0
 * or -EINVAL. Pure, any thread. */
int qk_layer_aggregate(const struct qk_head *heads, size_t n_heads, struct qk_agg *out);

#endif
