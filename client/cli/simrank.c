/* One simulated trainer rank: weights, routers and tokens evolve as the
 * scenario says, and each step becomes scalars and sketches handed to a
 * sink (simulate.h). Pure: no I/O, no clock, no threads.
 *
 * Attention: the rank holds its slice of the model dimension d (FSDP-style
 * shard_index = rank, shard_count = ranks) of every head's Wq and Wk (dh x
 * d_shard, PyTorch [out, in] layout). They are advanced lazily, only at
 * steps where a sketch, a window-base snapshot or a layer norm needs them,
 * by the accumulated update of the steps in between. A sketch at step t
 * with window W needs the weights at t - W; those are kept in a small ring
 * of snapshots.
 *
 * Routers: an FSDP trainer gathers the whole router weight WR (E x d) for
 * the forward pass, so every rank holds all of it, advanced every step from
 * a per-layer random stream that is the same on every rank. A rank sends
 * the partial Gram of its d-slice (the shards sum to GR = WR WR^T) every
 * sketch_every steps, and every step the statistics of its own tokens:
 * x ~ N(0, I_d), z = WR x, drawn as z = L xi with GR = L L^T (the same
 * distribution at E^2 instead of E d per token).
 *
 * What a rank observes of a router is its trajectory (the scenario's
 * updates) plus a fresh jitter every step, SIM_ROUTER_JITTER of a row's
 * norm: the minibatch noise of the last updates that the balance loss pulls
 * back. Without it the router series would be pure random walks, smooth
 * from sample to sample, and a robust z-score against their own recent past
 * reads a walk that speeds up (the end of the lr warm-up) as a breach. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "foreshock.h"
#include "simulate.h"

#define SIM_LOSS_SCALE 65536.0
#define SIM_TRAIN_TOKENS (8 * 2048) /* the tokens scalar: 8 sequences of 2048 */
#define CHOL_JITTER_TRIES 8
#define TAG_ROUTER_INIT 0x7257u /* sim_seed_mix stream of a layer's router */

struct sim_router {
    uint32_t layer;
    float *wr;       /* experts x d, the whole router weight (trajectory) */
    float *obs;      /* experts x d, what this step observes: wr + jitter */
    float *shard;    /* experts x ds, this rank's columns */
    float *gr_tri;   /* fsc_tri_len(experts): partial Gram */
    double *chol;    /* experts x experts: lower Cholesky factor of GR */
    double *z;       /* experts: one token's logits */
    double *sum_p;   /* experts */
    uint64_t *load;  /* experts */
    uint32_t *top;   /* top_k indices */
    struct sim_rng rng; /* the layer's stream, the same on every rank */
};

struct sim_rank {
    const struct scenario *sc;
    const struct sim_params *p;
    uint32_t rank, nsnap, n_moe;
    size_t ds, c0, block;       /* shard columns, first column, floats per head block */
    float *wq, *wk;             /* layers*heads blocks each */
    float *snap_q, *snap_k;     /* nsnap copies of wq, wk */
    float *ga, *gb;             /* one head's Gram triangles */
    float *norm, *ratio;        /* per layer */
    uint64_t w_step;            /* the step wq, wk correspond to */
    uint64_t next;              /* the step sim_rank_step expects */
    struct sim_router *rt;      /* n_moe */
    struct sim_rng rng;         /* the rank's own */
};

/* a * b + c, or 0 with *overflow set. */
static size_t mul_add(size_t a, size_t b, size_t c, int *overflow)
{
    if ((a && b > SIZE_MAX / a) || a * b > SIZE_MAX - c) {
        *overflow = 1;
        return 0;
    }
    return a * b + c;
}

size_t sim_rank_floats(const struct sim_params *p)
{
    int of = 0;
    size_t ds, n, moe = 0, nsnap;

    if (!p->sketches || !p->ranks || !p->sketch_every)
        return 0;
    ds = (p->d + p->ranks - 1) / p->ranks;
    nsnap = (size_t)p->window / p->sketch_every + 2;
    for (uint32_t l = 0; l < p->layers; l++)
        moe += (size_t)sim_is_moe(p, l);
    /* wq, wk and their nsnap snapshots. */
    n = mul_add((size_t)p->layers * p->heads, p->dh, 0, &of);
    n = mul_add(n, ds, 0, &of);
    n = mul_add(n, 2 * (nsnap + 1), 0, &of);
    /* Per MoE layer: WR and its observation (E x d each), a shard (E x ds). */
    n = mul_add(mul_add(moe, p->experts, 0, &of), 2 * (size_t)p->d + ds, n, &of);
    return of ? 0 : n;
}

static void router_free(struct sim_router *t)
{
    free(t->wr);
    free(t->obs);
    free(t->shard);
    free(t->gr_tri);
    free(t->chol);
    free(t->z);
    free(t->sum_p);
    free(t->load);
    free(t->top);
}

void sim_rank_destroy(struct sim_rank *r)
{
    if (!r)
        return;
    free(r->wq);
    free(r->wk);
    free(r->snap_q);
    free(r->snap_k);
    free(r->ga);
    free(r->gb);
    free(r->norm);
    free(r->ratio);
    for (uint32_t i = 0; r->rt && i < r->n_moe; i++)
        router_free(&r->rt[i]);
    free(r->rt);
    free(r);
}

static int router_init(struct sim_rank *r, struct sim_router *t, uint32_t layer)
{
    const struct sim_params *p = r->p;
    size_t e = p->experts;
    double init = 1.0 / sqrt((double)p->d);

    t->layer = layer;
    t->wr = malloc(e * p->d * sizeof(*t->wr));
    t->obs = malloc(e * p->d * sizeof(*t->obs));
    t->shard = malloc(e * r->ds * sizeof(*t->shard));
    t->gr_tri = malloc(fsc_tri_len(e) * sizeof(*t->gr_tri));
    t->chol = malloc(e * e * sizeof(*t->chol));
    t->z = malloc(e * sizeof(*t->z));
    t->sum_p = malloc(e * sizeof(*t->sum_p));
    t->load = malloc(e * sizeof(*t->load));
    t->top = malloc(p->top_k * sizeof(*t->top));
    if (!t->wr || !t->obs || !t->shard || !t->gr_tri || !t->chol || !t->z || !t->sum_p || !t->load || !t->top)
        return -ENOMEM;
    /* Every rank draws the same WR: the layer's stream, not the rank's. */
    sim_rng_seed(&t->rng, sim_seed_mix(p->seed, TAG_ROUTER_INIT, layer, 0));
    for (size_t i = 0; i < e * p->d; i++)
        t->wr[i] = (float)(init * sim_normal(&t->rng));
    return 0;
}

int sim_rank_create(const struct scenario *sc, const struct sim_params *p, uint32_t rank,
                    struct sim_rank **out)
{
    struct sim_rank *r;
    size_t all, tri;
    double init = 1.0 / sqrt((double)p->d);
    int rc = -ENOMEM;

    *out = NULL;
    if (!sc || !p || rank >= p->ranks || p->d < p->ranks || !p->sketch_every || !p->window ||
        p->dh > SIM_MAX_DH || (p->sketches && !sim_rank_floats(p)))
        return -EINVAL;
    r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    r->sc = sc;
    r->p = p;
    r->rank = rank;
    r->ds = p->d / p->ranks + (rank < p->d % p->ranks ? 1 : 0);
    r->c0 = (size_t)rank * (p->d / p->ranks) + (rank < p->d % p->ranks ? rank : p->d % p->ranks);
    r->block = (size_t)p->dh * r->ds;
    r->nsnap = p->window / p->sketch_every + 2;
    sim_rng_seed(&r->rng, p->seed * 0x2545f4914f6cdd1dull + rank);
    if (!p->sketches) {
        *out = r;
        return 0;
    }
    all = (size_t)p->layers * p->heads * r->block;
    tri = fsc_tri_len(2 * (size_t)p->dh);
    r->wq = malloc(all * sizeof(float));
    r->wk = malloc(all * sizeof(float));
    r->snap_q = malloc(all * r->nsnap * sizeof(float));
    r->snap_k = malloc(all * r->nsnap * sizeof(float));
    r->ga = malloc(tri * sizeof(float));
    r->gb = malloc(tri * sizeof(float));
    r->norm = malloc(p->layers * sizeof(float));
    r->ratio = malloc(p->layers * sizeof(float));
    if (!r->wq || !r->wk || !r->snap_q || !r->snap_k || !r->ga || !r->gb || !r->norm || !r->ratio)
        goto fail;
    for (size_t i = 0; i < all; i++) {
        r->wq[i] = (float)(init * sim_normal(&r->rng));
        r->wk[i] = (float)(init * sim_normal(&r->rng));
    }
    for (uint32_t l = 0; l < p->layers; l++)
        r->n_moe += (uint32_t)sim_is_moe(p, l);
    if (r->n_moe) {
        uint32_t k = 0;
        r->rt = calloc(r->n_moe, sizeof(*r->rt));
        if (!r->rt)
            goto fail;
        for (uint32_t l = 0; l < p->layers; l++)
            if (sim_is_moe(p, l) && (rc = router_init(r, &r->rt[k++], l)) < 0)
                goto fail;
    }
    *out = r;
    return 0;
fail:
    sim_rank_destroy(r);
    return rc;
}

/* ---- attention ---------------------------------------------------------------------- */

/* Brings the attention weights from w_step to `step`. */
static int advance(struct sim_rank *r, uint64_t step)
{
    const struct sim_params *p = r->p;
    int rc;

    if (step <= r->w_step)
        return 0;
    for (uint32_t l = 0; l < p->layers; l++)
        for (uint32_t h = 0; h < p->heads; h++) {
            size_t off = ((size_t)l * p->heads + h) * r->block;
            if ((rc = r->sc->attn_update(r->sc, p, &r->rng, l, h, 0, r->w_step, step, r->wq + off,
                                         p->dh, r->ds)) < 0 ||
                (rc = r->sc->attn_update(r->sc, p, &r->rng, l, h, 1, r->w_step, step, r->wk + off,
                                         p->dh, r->ds)) < 0)
                return rc;
        }
    r->w_step = step;
    return 0;
}

/* Sketch and snapshot duties of `step`. */
static int attention_step(struct sim_rank *r, uint64_t step, const struct sim_sink *sink)
{
    const struct sim_params *p = r->p;
    uint64_t k = p->sketch_every, w = p->window;
    int sketch = step % k == 0 && step >= w, snap = (step + w) % k == 0;
    size_t all = (size_t)p->layers * p->heads * r->block;
    int rc;

    if (!sketch && !snap)
        return 0;
    if ((rc = advance(r, step)) < 0)
        return rc;
    if (sketch) {
        size_t slot = (size_t)((step / k) % r->nsnap) * all;
        for (uint32_t l = 0; l < p->layers; l++)
            for (uint32_t h = 0; h < p->heads; h++) {
                size_t off = ((size_t)l * p->heads + h) * r->block;
                rc = fsc_attention_grams(r->wq + off, r->wk + off, r->snap_q + slot + off,
                                         r->snap_k + slot + off, p->dh, r->ds, r->ga, r->gb);
                if (rc == 0 && sink->attention)
                    rc = sink->attention(sink->ctx, step, l, h, (uint32_t)w, p->dh, r->rank,
                                         p->ranks, r->ga, r->gb);
                if (rc < 0)
                    return rc;
            }
    }
    if (snap) {
        /* Needed at step + w; slots of pending snapshots never collide
         * because nsnap > w / k + 1. */
        size_t slot = (size_t)(((step + w) / k) % r->nsnap) * all;
        memcpy(r->snap_q + slot, r->wq, all * sizeof(float));
        memcpy(r->snap_k + slot, r->wk, all * sizeof(float));
    }
    return 0;
}

/* Per layer |W| of this rank's Wq and Wk shards, and the update-to-weight
 * ratio of this step: the norm of the step's update (every scenario gives
 * a step the norm of sim_step_sd per element) over |W|. */
static int norms_step(struct sim_rank *r, uint64_t step, const struct sim_sink *sink)
{
    const struct sim_params *p = r->p;
    size_t per_layer = (size_t)p->heads * r->block;
    double upd = sim_step_sd(r->sc, p, step) * sqrt(2.0 * (double)per_layer);
    int rc;

    if ((rc = advance(r, step)) < 0)
        return rc;
    for (uint32_t l = 0; l < p->layers; l++) {
        const float *q = r->wq + l * per_layer, *kk = r->wk + l * per_layer;
        double s = 0;
        for (size_t i = 0; i < per_layer; i++)
            s += (double)q[i] * q[i] + (double)kk[i] * kk[i];
        r->norm[l] = (float)sqrt(s);
        r->ratio[l] = s > 0 ? (float)(upd / sqrt(s)) : 0.0f;
    }
    return sink->layer_norms ? sink->layer_norms(sink->ctx, step, r->norm, r->ratio, p->layers) : 0;
}

/* ---- routers ------------------------------------------------------------------------ */

/* Lower Cholesky factor of GR = obs obs^T (double), with a growing diagonal
 * jitter when GR is singular (E > d, or rows that became parallel). */
static int router_factor(const struct sim_params *p, struct sim_router *t)
{
    size_t e = p->experts, d = p->d;
    double *g = t->chol, tr = 0, jitter = 0;

    for (int attempt = 0; attempt < CHOL_JITTER_TRIES; attempt++) {
        int ok = 1;
        for (size_t i = 0; i < e; i++)
            for (size_t j = 0; j <= i; j++) {
                double s = 0;
                for (size_t c = 0; c < d; c++)
                    s += (double)t->obs[i * d + c] * t->obs[j * d + c];
                g[i * e + j] = s + (i == j ? jitter : 0);
                if (i == j && attempt == 0)
                    tr += s;
            }
        /* In place, row by row: g[i][j] for j <= i becomes L[i][j]. */
        for (size_t i = 0; i < e && ok; i++)
            for (size_t j = 0; j <= i; j++) {
                double s = g[i * e + j];
                for (size_t c = 0; c < j; c++)
                    s -= g[i * e + c] * g[j * e + c];
                if (i == j) {
                    if (!(s > 0)) {
                        ok = 0;
                        break;
                    }
                    g[i * e + i] = sqrt(s);
                } else {
                    g[i * e + j] = s / g[j * e + j];
                }
            }
        if (ok)
            return 0;
        jitter = (jitter > 0 ? jitter * 100 : 1e-12) * (tr > 0 ? tr / (double)e : 1.0);
    }
    return -EDOM;
}

/* Routes p->tokens tokens of this rank through the layer's router. */
static void router_tokens(struct sim_rank *r, struct sim_router *t, struct sim_tokens *out)
{
    const struct sim_params *p = r->p;
    size_t e = p->experts, k = p->top_k;
    double *z = t->z, xi[64];

    memset(out, 0, sizeof(*out));
    memset(t->sum_p, 0, e * sizeof(*t->sum_p));
    memset(t->load, 0, e * sizeof(*t->load));
    for (uint32_t n = 0; n < p->tokens; n++) {
        double m = -HUGE_VAL, s = 0, pz = 0, lse, h;
        /* z = L xi, in chunks of xi so the stack stays small. */
        for (size_t i = 0; i < e; i++)
            z[i] = 0;
        for (size_t c0 = 0; c0 < e; c0 += 64) {
            size_t cn = e - c0 < 64 ? e - c0 : 64;
            for (size_t c = 0; c < cn; c++)
                xi[c] = sim_normal(&r->rng);
            for (size_t i = c0; i < e; i++)
                for (size_t c = 0; c < cn && c0 + c <= i; c++)
                    z[i] += t->chol[i * e + c0 + c] * xi[c];
        }
        for (size_t i = 0; i < e; i++)
            m = z[i] > m ? z[i] : m;
        for (size_t i = 0; i < e; i++)
            s += exp(z[i] - m);
        lse = m + log(s);
        for (size_t i = 0; i < e; i++) {
            double pi = exp(z[i] - lse);
            t->sum_p[i] += pi;
            pz += pi * z[i];
        }
        h = lse - pz;
        out->sum_h += h;
        out->sum_h2 += h * h;
        out->sum_lse2 += lse * lse;
        /* Top-k by selection: k is small. */
        for (size_t j = 0; j < k; j++) {
            size_t best = e;
            for (size_t i = 0; i < e; i++) {
                int taken = 0;
                for (size_t q = 0; q < j; q++)
                    taken |= t->top[q] == i;
                if (!taken && (best == e || z[i] > z[best]))
                    best = i;
            }
            t->top[j] = (uint32_t)best;
            t->load[best]++;
        }
    }
    out->n_tok = p->tokens;
    out->load = t->load;
    out->sum_p = t->sum_p;
}

static int routers_step(struct sim_rank *r, uint64_t step, const struct sim_sink *sink)
{
    const struct sim_params *p = r->p;
    size_t e = p->experts;
    double jitter = SIM_ROUTER_JITTER / sqrt((double)p->d);
    struct sim_tokens tk;
    int rc;

    for (uint32_t i = 0; i < r->n_moe; i++) {
        struct sim_router *t = &r->rt[i];
        /* WR(step) = WR(step - 1) + the update of step - 1. */
        if (step > 0 &&
            (rc = r->sc->router_update(r->sc, p, &t->rng, t->layer, step - 1, t->wr, e, p->d)) < 0)
            return rc;
        /* The same jitter on every rank: the layer's stream. */
        for (size_t x = 0; x < e * p->d; x++)
            t->obs[x] = t->wr[x] + (float)(jitter * sim_normal(&t->rng));
        if ((rc = router_factor(p, t)) < 0)
            return rc;
        router_tokens(r, t, &tk);
        if (sink->router_tokens && (rc = sink->router_tokens(sink->ctx, step, t->layer,
                                                             (uint32_t)e, &tk)) < 0)
            return rc;
        if (step % p->sketch_every == 0) {
            for (size_t x = 0; x < e; x++)
                memcpy(t->shard + x * r->ds, t->obs + x * p->d + r->c0, r->ds * sizeof(float));
            if ((rc = fsc_router_gram(t->shard, e, r->ds, t->gr_tri)) < 0)
                return rc;
            if (sink->router_gram && (rc = sink->router_gram(sink->ctx, step, t->layer, (uint32_t)e,
                                                             r->rank, p->ranks, t->gr_tri)) < 0)
                return rc;
        }
    }
    return 0;
}

/* ---- a step --------------------------------------------------------------------------- */

int sim_rank_step(struct sim_rank *r, uint64_t step, const struct sim_sink *sink)
{
    const struct sim_params *p = r->p;
    struct sim_scalars s;
    double div = sim_divergence(r->sc, p, step);
    int rc;

    if (step != r->next || step >= p->steps)
        return -EINVAL;
    r->next = step + 1;
    /* Bounded (triangular) noise: a healthy run must never look like a
     * spike to a robust z-score, and the loss must cross 10x its healthy
     * value exactly at diverge_step. */
    s.loss = sim_healthy_loss(p, step) * (1.0 + SIM_LOSS_NOISE * sim_triangular(&r->rng)) * div;
    s.grad_norm =
        sim_healthy_grad_norm(p, step) * (1.0 + SIM_GRAD_NOISE * sim_triangular(&r->rng)) * div;
    s.lr = r->sc->lr(p, step);
    s.loss_scale = SIM_LOSS_SCALE;
    s.tokens = SIM_TRAIN_TOKENS;
    s.step_time = 0.25 + 0.01 * fabs(sim_triangular(&r->rng));
    if (sink->scalars && (rc = sink->scalars(sink->ctx, step, &s)) < 0)
        return rc;
    if (!p->sketches)
        return 0;
    if ((rc = routers_step(r, step, sink)) < 0 || (rc = attention_step(r, step, sink)) < 0)
        return rc;
    if (p->layer_norms && step % p->sketch_every == 0 && (rc = norms_step(r, step, sink)) < 0)
        return rc;
    return 0;
}
