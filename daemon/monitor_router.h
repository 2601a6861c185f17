#ifndef FORESHOCK_MONITOR_ROUTER_H
#define FORESHOCK_MONITOR_ROUTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "spectrum.h"

/* MoE router monitors of one layer (docs/monitors.md section 3). Pure: no
 * libuv, SQLite, threads or clocks. The router weight WR is E x d, row w_i
 * per expert; logits z = WR x, p = softmax(z) over all E experts.
 *
 * 3.1 weight side, from GR = WR WR^T (E x E, upper triangle row-major as in
 * monitor_qk.h, in double, summed over d-shards with monitor_tri_accumulate):
 *   sim    = mean over ordered pairs i != j of GR_ij / sqrt(GR_ii GR_jj);
 *            pairs with a zero row (GR_ii = 0, cosine undefined) are left
 *            out of the mean; absent when no pair is left (E < 2).
 *   wbar_sq = |wbar|^2 = 1^T GR 1 / E^2
 *   kappa  = max_i |w_i - wbar| / |wbar|, |w_i - wbar|^2 = GR_ii
 *            - 2 (GR 1)_i / E + 1^T GR 1 / E^2 (clamped at 0). Absent when
 *            |wbar| ~ 0, defined as wbar_sq <= ROUTER_WBAR_REL_TOL * tr GR / E
 *            (|wbar| at most 1e-3 of the RMS row norm). Why 1e-6: GR arrives
 *            as float32, each entry off by up to 2^-24 relative, so 1^T GR 1
 *            is off by up to ~6e-8 * E tr GR; at the tolerance that is < 6 %
 *            of wbar_sq, below it kappa would be rounding noise.
 *   centered_energy = |Wc|_F^2 = tr GR - 1^T GR 1 / E (clamped at 0)
 *   spec   = scalars (spectrum.h) of lambda(GR) = sigma^2(WR), m = E.
 *
 * 3.2 decision side, from token statistics summed over ranks:
 *   entropy_mean   = Hbar = sum_H / n_tok                     (nats)
 *   entropy_norm   = Hbar / ln E                               (E >= 2)
 *   entropy_spread = the population standard deviation of the per-token
 *                    routing entropy H_t over the n_tok tokens:
 *                    sqrt(max(0, sum_H2 / n_tok - Hbar^2))     (nats)
 *   maxvio         = (max_e load_e - mean load) / mean load, mean over E
 *   load_entropy   = -sum_e f_e ln f_e, f_e = load_e / sum load, 0 ln 0 = 0
 *                    (nats: the entropy of the top-k assignment shares;
 *                    ln E when balanced, 0 when one expert takes all)
 *   load_entropy_norm = load_entropy / ln E                    (E >= 2)
 *   dead_experts   = count of e with load_e = 0
 *   balance        = E sum_e f_e P_e, P_e = sum_p_e / n_tok (Switch aux
 *                    loss term; 1 when balanced)
 *   zloss          = sum_lse2 / n_tok
 */

#define ROUTER_MAX_EXPERTS 1024u /* equals FS_MAX_EXPERTS */
#define ROUTER_WBAR_REL_TOL 1e-6 /* kappa absent below this wbar_sq / (tr GR / E) */

struct router_weight {
    bool nonfinite; /* a non-finite GR entry: nothing else is set */
    bool present;   /* wbar_sq and centered_energy are valid */
    bool sim_present;
    double sim;
    double wbar_sq;
    bool kappa_present;
    double kappa;
    double centered_energy;
    struct spectrum_scalars spec;
};

struct router_workspace;

/* A workspace for E <= max_experts (two E x E doubles and LAPACK work), so
 * router_weight_compute never allocates. One thread at a time. Returns 0,
 * -EINVAL (0 or above ROUTER_MAX_EXPERTS, NULL out) or -ENOMEM. */
int router_workspace_create(unsigned max_experts, struct router_workspace **out);

/* Frees a workspace (NULL is fine). The thread that owns it. */
void router_workspace_destroy(struct router_workspace *ws);

/* Section 3.1 from GR (monitor_tri_len(E) doubles, read only). `out` is
 * always written. Returns 0 (nonfinite flagged in out), -EINVAL (NULL, E 0
 * or above the workspace's size) or -EDOM (dsyev did not converge: spec
 * absent, the rest valid). The thread that owns ws. */
int router_weight_compute(struct router_workspace *ws, unsigned n_experts, const double *gr,
                          struct router_weight *out);

/* lambda(GR) of the last router_weight_compute, descending, negatives
 * clamped to 0; *len values. Valid until the next call on ws. */
const double *router_workspace_spectrum(const struct router_workspace *ws, size_t *len);

/* Token statistics of one layer and step, summed over ranks. */
struct router_tokens {
    unsigned n_experts;
    uint64_t n_tok;
    double sum_h, sum_h2, sum_lse2;
    const uint64_t *load; /* n_experts top-k assignment counts */
    const double *sum_p;  /* n_experts sums of p_te over tokens */
};

struct router_decision {
    bool nonfinite; /* a non-finite input sum: nothing else is set */
    bool present;   /* n_tok > 0: entropy_*, dead_experts, zloss valid */
    double entropy_mean;
    double entropy_spread;
    bool norm_present; /* E >= 2: entropy_norm (and load_entropy_norm) */
    double entropy_norm;
    bool load_present; /* present and sum load > 0: maxvio, load_entropy*, balance */
    double maxvio;
    double load_entropy;
    double load_entropy_norm;
    double balance;
    unsigned dead_experts;
    double zloss;
};

/* Section 3.2. `out` is always written. Returns 0 (nonfinite flagged),
 * -EINVAL (NULL, n_experts 0 or above ROUTER_MAX_EXPERTS, NULL arrays).
 * Pure, any thread. */
int router_decision_compute(const struct router_tokens *in, struct router_decision *out);

#endif
