/* The MoE router monitors of one layer: similarity, conditioning and routing
 * statistics from the router Gram and token sums. See monitor_router.h. */
#include "monitor_router.h"
#include "eigen.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

struct router_workspace {
    unsigned max_experts;
    double *g;    /* GR, full, column-major */
    double *spec; /* descending, clamped */
    size_t spec_len;
    struct monitor_eig eig; /* dsyev output and work */
};

void router_workspace_destroy(struct router_workspace *ws)
{
    if (!ws)
        return;
    free(ws->g);
    free(ws->spec);
    monitor_eig_free(&ws->eig);
    free(ws);
}

int router_workspace_create(unsigned max_experts, struct router_workspace **out)
{
    if (!out)
        return -EINVAL;
    *out = NULL;
    if (max_experts == 0 || max_experts > ROUTER_MAX_EXPERTS)
        return -EINVAL;
    struct router_workspace *ws = calloc(1, sizeof(*ws));
    if (!ws)
        return -ENOMEM;
    size_t e = max_experts;
    ws->max_experts = max_experts;
    ws->g = malloc(e * e * sizeof(double));
    ws->spec = malloc(e * sizeof(double));
    if (!ws->g || !ws->spec)
        goto fail;
    if (monitor_eig_init(&ws->eig, e, ws->g) < 0)
        goto fail;
    *out = ws;
    return 0;
fail:
    router_workspace_destroy(ws);
    return -ENOMEM;
}

int router_weight_compute(struct router_workspace *ws, unsigned n_experts, const double *gr,
                          struct router_weight *out)
{
    if (!out)
        return -EINVAL;
    *out = (struct router_weight){0};
    if (!ws || !gr || n_experts == 0 || n_experts > ws->max_experts)
        return -EINVAL;
    ws->spec_len = 0;
    size_t e = n_experts, len = e * (e + 1) / 2;
    for (size_t k = 0; k < len; k++)
        if (!isfinite(gr[k])) {
            out->nonfinite = true;
            return 0;
        }
    /* Unpack: row i of the row-major upper triangle is column i, rows
     * i..e-1, of the column-major lower triangle; mirror the rest. */
    double *g = ws->g;
    const double *row = gr;
    for (size_t i = 0; i < e; i++) {
        memcpy(g + i + i * e, row, (e - i) * sizeof(double));
        for (size_t j = i + 1; j < e; j++)
            g[i + j * e] = row[j - i];
        row += e - i;
    }

    double tr = 0.0, total = 0.0, sim = 0.0;
    size_t pairs = 0;
    for (size_t i = 0; i < e; i++) {
        double gii = g[i + i * e];
        tr += gii;
        for (size_t j = 0; j < e; j++)
            total += g[i + j * e];
        for (size_t j = i + 1; j < e; j++) {
            double gjj = g[j + j * e];
            if (!(gii > 0.0 && gjj > 0.0))
                continue;
            /* sqrt of each: gii * gjj may overflow where the cosine does not */
            sim += g[j + i * e] / (sqrt(gii) * sqrt(gjj));
            pairs++;
        }
    }
    if (!isfinite(tr) || !isfinite(total) || !isfinite(sim)) {
        out->nonfinite = true; /* finite entries, overflowing sums */
        return 0;
    }
    /* Each unordered pair stands for both ordered ones: same mean. */
    out->sim_present = pairs > 0;
    if (out->sim_present)
        out->sim = sim / (double)pairs;
    double ed = (double)e;
    out->present = true;
    out->wbar_sq = total / (ed * ed);
    out->centered_energy = fmax(0.0, tr - total / ed);
    if (tr > 0.0 && out->wbar_sq > ROUTER_WBAR_REL_TOL * tr / ed) {
        double dmax = 0.0;
        for (size_t i = 0; i < e; i++) {
            double rowsum = 0.0;
            for (size_t j = 0; j < e; j++)
                rowsum += g[j + i * e];
            double d2 = g[i + i * e] - 2.0 * rowsum / ed + out->wbar_sq;
            if (d2 > dmax)
                dmax = d2;
        }
        out->kappa_present = true;
        out->kappa = sqrt(dmax / out->wbar_sq);
    }

    /* lambda(GR / max diag), scaled back: no overflow inside dsyev. */
    double gmax = 0.0;
    for (size_t i = 0; i < e; i++)
        gmax = fmax(gmax, g[i + i * e]);
    if (!(gmax > 0.0))
        return 0; /* WR = 0: no spectrum */
    for (size_t k = 0; k < e * e; k++)
        g[k] /= gmax;
    if (monitor_eig_solve(&ws->eig, e, g) < 0)
        return -EDOM;
    for (size_t i = 0; i < e; i++) {
        double x = ws->eig.w[e - 1 - i] * gmax;
        if (!isfinite(x)) {
            out->nonfinite = true;
            return 0;
        }
        ws->spec[i] = x > 0.0 ? x : 0.0;
    }
    ws->spec_len = e;
    spectrum_scalars_f64(ws->spec, e, e, &out->spec);
    return 0;
}

const double *router_workspace_spectrum(const struct router_workspace *ws, size_t *len)
{
    if (len)
        *len = ws ? ws->spec_len : 0;
    return ws ? ws->spec : NULL;
}

int router_decision_compute(const struct router_tokens *in, struct router_decision *out)
{
    if (!out)
        return -EINVAL;
    *out = (struct router_decision){0};
    if (!in || !in->load || !in->sum_p || in->n_experts == 0 || in->n_experts > ROUTER_MAX_EXPERTS)
        return -EINVAL;
    size_t e = in->n_experts;
    bool finite = isfinite(in->sum_h) && isfinite(in->sum_h2) && isfinite(in->sum_lse2);
    for (size_t i = 0; i < e && finite; i++)
        finite = isfinite(in->sum_p[i]);
    if (!finite) {
        out->nonfinite = true;
        return 0;
    }
    if (in->n_tok == 0)
        return 0;
    double n = (double)in->n_tok, ed = (double)e;
    out->present = true;
    out->entropy_mean = in->sum_h / n;
    out->entropy_spread = sqrt(fmax(0.0, in->sum_h2 / n - out->entropy_mean * out->entropy_mean));
    out->zloss = in->sum_lse2 / n;
    out->norm_present = e >= 2;
    if (out->norm_present)
        out->entropy_norm = out->entropy_mean / log(ed);

    double total = 0.0, lmax = 0.0;
    for (size_t i = 0; i < e; i++) {
        double l = (double)in->load[i];
        total += l;
        if (l > lmax)
            lmax = l;
        if (in->load[i] == 0)
            out->dead_experts++;
    }
    if (!(total > 0.0))
        return 0;
    out->load_present = true;
    double mean = total / ed;
    out->maxvio = (lmax - mean) / mean;
    double h = 0.0, bal = 0.0;
    for (size_t i = 0; i < e; i++) {
        double f = (double)in->load[i] / total;
        if (f > 0.0)
            h -= f * log(f);
        bal += f * (in->sum_p[i] / n);
    }
    out->load_entropy = h;
    if (out->norm_present)
        out->load_entropy_norm = h / log(ed);
    out->balance = ed * bal;
    return 0;
}
