/* One simulated trainer rank: weights, routers and tokens evolve as the
 * scenario says, and each step becomes scalars and sketches handed to a
 * sink (simulate.h). Pure: no I/O, no clock, no threads.
 *
 * Attention, Gram route: the rank holds its slice of the model dimension d
 * (FSDP-style shard_index = rank, shard_count = ranks) of every query
 * head's Wq and every key head's Wk (dh x d_shard, PyTorch [out, in]
 * layout; with GQA query head h reads key head h / (heads / kv_heads)).
 * They are advanced lazily, only at steps where a sketch, a window-base
 * snapshot or a layer norm needs them, by the accumulated update of the
 * steps in between. A sketch at step t with window W needs the weights at
 * t - W; those are kept in a small ring of snapshots.
 *
 * Attention, Gram route with split_heads (tensor-parallel style): the rank
 * holds all of d of the query heads sim_rank_heads gives it and of the key
 * heads they read, and sends whole Grams (shard 0 of 1). Each weight block
 * (layer, query head or key head) draws its initial values and its updates
 * from a stream of its own (TAG_W_BLOCK), so a head's Grams are the same
 * whichever rank holds it and however many ranks there are: a run split
 * over N ranks stores the monitors of the same run on one rank. A key head
 * read by the blocks of two ranks is held, identically, by both.
 *
 * Attention, spectrum route: the rank holds whole query heads
 * (sim_rank_heads) and sends, per head, the spectra a trainer would have
 * solved from its Grams. A 70B model's Q/K weights are 1.3e10 floats and
 * its per-sketch eigenvalue work is minutes of CPU, so they are synthesised
 * from what the scenario's updates make of them (for d >> dh, rows of
 * random matrices are nearly orthogonal, and the spectra are Marchenko-
 * Pastur-like bulks around their mean plus, under attention-numerics, one
 * coherent value), at O(dh) per head. spectrum_head says how.
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "foreshock.h"
#include "simulate.h"

#define SIM_LOSS_SCALE 65536.0
#define SIM_TRAIN_TOKENS (8 * 2048) /* the tokens scalar: 8 sequences of 2048 */
#define CHOL_JITTER_TRIES 8
#define TAG_ROUTER_INIT 0x7257u /* sim_seed_mix stream of a layer's router */
#define TAG_W_SHAPE 0x5753u     /* spectrum route: a head's K(t0) spectrum shape */
#define TAG_W_BLOCK 0x5742u     /* split_heads: a weight block's stream */

struct sim_router {
    uint32_t layer;
    float *wr;          /* experts x d, the whole router weight (trajectory) */
    float *obs;         /* experts x d, what this step observes: wr + jitter */
    float *shard;       /* experts x ds, this rank's columns */
    float *gr_tri;      /* fsc_tri_len(experts): partial Gram */
    double *chol;       /* experts x experts: lower Cholesky factor of GR */
    double *z;          /* experts: one token's logits */
    double *sum_p;      /* experts */
    uint64_t *load;     /* experts */
    uint32_t *top;      /* top_k indices */
    struct sim_rng rng; /* the layer's stream, the same on every rank */
};

struct sim_rank {
    const struct scenario *sc;
    const struct sim_params *p;
    uint32_t rank, nsnap, n_moe;
    uint32_t kv, group;  /* key heads per layer, query heads per key head */
    uint32_t h0, h1;     /* spectrum route, split_heads: the query heads held */
    uint32_t k0;         /* the first key head held (0 unless split_heads) */
    uint32_t nq, nk;     /* query and key blocks held per layer */
    size_t ds, c0;       /* this rank's slice of d: columns, first column */
    size_t cols, block;  /* attention: columns (ds, or d with split_heads), floats
                          * per head block (dh x cols) */
    size_t all_q, all_k; /* floats of wq (layers*nq blocks), wk (layers*nk blocks) */
    float *wq, *wk;
    struct sim_rng *brng;   /* split_heads: layers*(nq+nk) block streams, Q's then K's */
    float *snap_q, *snap_k; /* nsnap copies of wq, wk */
    float *spec;            /* spectrum route: 6 dh floats, one head's spectra */
    double acc;             /* sum of sim_step_sd(s)^2 over s < next */
    float *ga, *gb;         /* one head's Gram triangles */
    float *norm, *ratio;    /* per layer */
    uint64_t w_step;        /* the step wq, wk correspond to */
    uint64_t next;          /* the step sim_rank_step expects */
    struct sim_router *rt;  /* n_moe */
    struct sim_rng rng;     /* the rank's own */
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

static uint32_t kv_heads(const struct sim_params *p)
{
    return p->heads / sim_group(p);
}

/* Whether ranks hold whole heads (and d is not split for attention). */
static int whole_heads(const struct sim_params *p)
{
    return p->route == SIM_ROUTE_SPECTRUM || p->split_heads;
}

/* The key heads [*k0, *k1) that query heads [h0, h1) read (none for none). */
static void key_heads(const struct sim_params *p, uint32_t h0, uint32_t h1, uint32_t *k0,
                      uint32_t *k1)
{
    uint32_t g = sim_group(p);

    *k0 = h0 / g;
    *k1 = h1 > h0 ? (h1 - 1) / g + 1 : *k0;
}

/* Snapshots of the weights in the ring: the weights at t - window for each
 * sketch step t. The ones pending at once are those for the sketch steps
 * in (t, t + window], ceil(window / sketch_every) consecutive ones, so as
 * many slots never collide; attention_step reads step t's slot before it
 * writes the slot of t + window, which may be the same one. */
static uint32_t snapshots(const struct sim_params *p)
{
    return (p->window + p->sketch_every - 1) / p->sketch_every;
}

size_t sim_rank_floats(const struct sim_params *p)
{
    int of = 0;
    size_t ds, n, moe = 0, nsnap;

    if (!p->sketches || !p->ranks || !p->sketch_every)
        return 0;
    ds = (p->d + p->ranks - 1) / p->ranks;
    nsnap = snapshots(p);
    for (uint32_t l = 0; l < p->layers; l++)
        moe += (size_t)sim_is_moe(p, l);
    if (p->route == SIM_ROUTE_SPECTRUM) {
        n = 6 * (size_t)p->dh; /* one head's spectra */
    } else {
        /* wq (heads), wk (kv heads) and their nsnap snapshots; with
         * split_heads the most blocks any rank holds, all of d each. */
        size_t blocks = (size_t)p->heads + kv_heads(p), cols = ds;
        if (p->split_heads) {
            blocks = 0;
            cols = p->d;
            for (uint32_t rk = 0; rk < p->ranks; rk++) {
                uint32_t h0, h1, k0, k1;
                sim_rank_heads(p, rk, &h0, &h1);
                key_heads(p, h0, h1, &k0, &k1);
                if ((size_t)(h1 - h0) + (k1 - k0) > blocks)
                    blocks = (size_t)(h1 - h0) + (k1 - k0);
            }
        }
        n = mul_add((size_t)p->layers * blocks, p->dh, 0, &of);
        n = mul_add(n, cols, 0, &of);
        n = mul_add(n, nsnap + 1, 0, &of);
    }
    /* Per MoE layer: WR and its observation (E x d each), a shard (E x ds). */
    n = mul_add(mul_add(moe, p->experts, 0, &of), 2 * (size_t)p->d + ds, n, &of);
    return of ? 0 : n;
}

void sim_rank_heads(const struct sim_params *p, uint32_t rank, uint32_t *h0, uint32_t *h1)
{
    uint64_t h = p->heads, n = p->ranks ? p->ranks : 1;

    /* ceil(rank h / n): block boundaries rounded up, so rank 0 starts at 0
     * and ends at ceil(h / n) >= 1. */
    *h0 = (uint32_t)(((uint64_t)rank * h + n - 1) / n);
    *h1 = (uint32_t)(((uint64_t)(rank + 1) * h + n - 1) / n);
    if (*h0 > p->heads)
        *h0 = p->heads;
    if (*h1 > p->heads)
        *h1 = p->heads;
}

size_t sim_report_bytes(const struct sim_params *p)
{
    int of = 0;
    size_t n_moe = 0, per_head, heads, n;

    for (uint32_t l = 0; l < p->layers; l++)
        n_moe += (size_t)sim_is_moe(p, l);
    heads = p->heads;
    if (whole_heads(p)) {
        uint32_t h0, h1;
        sim_rank_heads(p, 0, &h0, &h1); /* rank 0 holds the largest block */
        heads = h1 - h0;
    }
    if (p->route == SIM_ROUTE_SPECTRUM)
        per_head = 6 * (size_t)p->dh * 4 + 128; /* spectra, five doubles, framing */
    else
        per_head = fsc_tri_len(2 * (size_t)p->dh) * 8 + 64; /* two float triangles */
    n = mul_add(mul_add(p->layers, heads, 0, &of), per_head, 4096, &of);
    n = mul_add(n_moe, fsc_tri_len(p->experts) * 4 + (size_t)p->experts * 16 + 64, n, &of);
    return of ? 0 : n;
}

int sim_params_check(const struct sim_params *p, size_t replay_bytes, char *err, size_t errlen)
{
    size_t floats, bytes;
    int sharded = !whole_heads(p) || p->experts;

    if (p->kv_heads && (p->kv_heads > p->heads || p->heads % p->kv_heads)) {
        snprintf(err, errlen,
                 "--kv-heads %u must divide --heads %u (each key head serves the "
                 "same number of query heads)",
                 p->kv_heads, p->heads);
        return -EINVAL;
    }
    if (!p->sketches) {
        if (p->d < p->ranks) /* as before: the scalars-only run keeps the check */
            goto few_columns;
        return 0;
    }
    if (sharded && p->d < p->ranks)
        goto few_columns;
    if (p->window / p->sketch_every + 2 > SIM_MAX_SNAPSHOTS) {
        snprintf(err, errlen, "--window %u is more than %d x --sketch-every", p->window,
                 SIM_MAX_SNAPSHOTS - 2);
        return -EINVAL;
    }
    floats = sim_rank_floats(p);
    if (!floats || floats > SIM_MAX_FLOATS_PER_RANK) {
        snprintf(err, errlen, "simulated weights would need more than %zu floats per rank%s",
                 SIM_MAX_FLOATS_PER_RANK,
                 p->route == SIM_ROUTE_GRAM
                     ? " (--split-heads holds 1/ranks of the heads per rank; the spectrum "
                       "route, --route spectrum, holds no attention weights)"
                     : "");
        return -EINVAL;
    }
    bytes = sim_report_bytes(p);
    if (!bytes || bytes > SIM_MAX_REPORT_BYTES || bytes > replay_bytes) {
        snprintf(err, errlen,
                 "a sketch report (%u x %u heads, dh %u, route %s%s, experts %u) "
                 "would not fit in a frame or the replay buffer%s",
                 p->layers, p->heads, p->dh, sim_route_name(p->route),
                 p->split_heads ? ", heads split" : "", p->experts,
                 whole_heads(p) ? "" : " (--split-heads sends each rank's heads only)");
        return -EINVAL;
    }
    return 0;
few_columns:
    snprintf(err, errlen, "--d %u must be at least --ranks %u (each rank holds a slice)", p->d,
             p->ranks);
    return -EINVAL;
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
    free(r->spec);
    free(r->brng);
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
    if (!t->wr || !t->obs || !t->shard || !t->gr_tri || !t->chol || !t->z || !t->sum_p ||
        !t->load || !t->top)
        return -ENOMEM;
    /* Every rank draws the same WR: the layer's stream, not the rank's. */
    sim_rng_seed(&t->rng, sim_seed_mix(p->seed, TAG_ROUTER_INIT, layer, 0));
    for (size_t i = 0; i < e * p->d; i++)
        t->wr[i] = (float)(init * sim_normal(&t->rng));
    return 0;
}

/* The stream of block i of layer l (split_heads): i < nq is query head
 * h0 + i, then key head k0 + i - nq. */
static uint64_t block_seed(const struct sim_rank *r, uint32_t l, uint32_t i)
{
    uint64_t id = i < r->nq ? 2 * (uint64_t)(r->h0 + i) : 2 * (uint64_t)(r->k0 + i - r->nq) + 1;
    return sim_seed_mix(r->p->seed, TAG_W_BLOCK, l, id);
}

/* split_heads: each block's stream, and its initial weights from it. */
static int blocks_init(struct sim_rank *r)
{
    const struct sim_params *p = r->p;
    double init = 1.0 / sqrt((double)p->d);
    uint32_t per = r->nq + r->nk;

    if (!(r->brng = malloc(((size_t)p->layers * per + 1) * sizeof(*r->brng))))
        return -ENOMEM;
    for (uint32_t l = 0; l < p->layers; l++)
        for (uint32_t i = 0; i < per; i++) {
            struct sim_rng *g = &r->brng[(size_t)l * per + i];
            float *w = i < r->nq ? r->wq + ((size_t)l * r->nq + i) * r->block
                                 : r->wk + ((size_t)l * r->nk + i - r->nq) * r->block;
            sim_rng_seed(g, block_seed(r, l, i));
            for (size_t j = 0; j < r->block; j++)
                w[j] = (float)(init * sim_normal(g));
        }
    return 0;
}

int sim_rank_create(const struct scenario *sc, const struct sim_params *p, uint32_t rank,
                    struct sim_rank **out)
{
    struct sim_rank *r;
    size_t tri;
    double init = 1.0 / sqrt((double)p->d);
    int rc = -ENOMEM;

    *out = NULL;
    if (!sc || !p || rank >= p->ranks || !p->sketch_every || !p->window || p->dh > SIM_MAX_DH ||
        (p->sketches && !sim_rank_floats(p)) ||
        (p->kv_heads && (p->kv_heads > p->heads || p->heads % p->kv_heads)))
        return -EINVAL;
    /* d is split over the ranks wherever it is: the Gram route's attention
     * weights unless split_heads, and the routers' Grams on both routes. */
    if (p->d < p->ranks && (!whole_heads(p) || p->experts))
        return -EINVAL;
    r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    r->sc = sc;
    r->p = p;
    r->rank = rank;
    r->ds = p->d / p->ranks + (rank < p->d % p->ranks ? 1 : 0);
    r->c0 = (size_t)rank * (p->d / p->ranks) + (rank < p->d % p->ranks ? rank : p->d % p->ranks);
    r->nsnap = snapshots(p);
    r->group = sim_group(p);
    r->kv = p->heads / r->group;
    sim_rank_heads(p, rank, &r->h0, &r->h1);
    if (p->split_heads) {
        uint32_t k1;
        key_heads(p, r->h0, r->h1, &r->k0, &k1);
        r->nq = r->h1 - r->h0;
        r->nk = k1 - r->k0;
        r->cols = p->d;
    } else {
        r->h0 = p->route == SIM_ROUTE_SPECTRUM ? r->h0 : 0;
        r->h1 = p->route == SIM_ROUTE_SPECTRUM ? r->h1 : p->heads;
        r->nq = p->heads;
        r->nk = r->kv;
        r->cols = r->ds;
    }
    r->block = (size_t)p->dh * r->cols;
    sim_rng_seed(&r->rng, p->seed * 0x2545f4914f6cdd1dull + rank);
    if (!p->sketches) {
        *out = r;
        return 0;
    }
    r->norm = malloc(p->layers * sizeof(float));
    r->ratio = malloc(p->layers * sizeof(float));
    if (!r->norm || !r->ratio)
        goto fail;
    if (p->route == SIM_ROUTE_SPECTRUM) {
        if (!(r->spec = malloc(6 * (size_t)p->dh * sizeof(float))))
            goto fail;
    } else {
        r->all_q = (size_t)p->layers * r->nq * r->block;
        r->all_k = (size_t)p->layers * r->nk * r->block;
        tri = fsc_tri_len(2 * (size_t)p->dh);
        /* A rank beyond the heads (split_heads) holds none: 1 float each. */
        r->wq = malloc((r->all_q ? r->all_q : 1) * sizeof(float));
        r->wk = malloc((r->all_k ? r->all_k : 1) * sizeof(float));
        r->snap_q = malloc((r->all_q ? r->all_q * r->nsnap : 1) * sizeof(float));
        r->snap_k = malloc((r->all_k ? r->all_k * r->nsnap : 1) * sizeof(float));
        r->ga = malloc(tri * sizeof(float));
        r->gb = malloc(tri * sizeof(float));
        if (!r->wq || !r->wk || !r->snap_q || !r->snap_k || !r->ga || !r->gb)
            goto fail;
        if (p->split_heads) {
            if ((rc = blocks_init(r)) < 0)
                goto fail;
            goto routers;
        }
        /* Draw order as before GQA existed: element by element, Wq's then
         * Wk's (the group's first query head draws its key head's). */
        for (size_t i = 0; i < (size_t)p->layers * p->heads; i++) {
            size_t kb = (i / p->heads) * r->kv + (i % p->heads) / r->group;
            for (size_t j = 0; j < r->block; j++) {
                r->wq[i * r->block + j] = (float)(init * sim_normal(&r->rng));
                if ((i % p->heads) % r->group == 0)
                    r->wk[kb * r->block + j] = (float)(init * sim_normal(&r->rng));
                else
                    (void)sim_normal(&r->rng); /* Wq as in the MHA run of the seed */
            }
        }
    }
routers:
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

    if (step <= r->w_step || p->route == SIM_ROUTE_SPECTRUM)
        return 0;
    if (p->split_heads) {
        /* Each block from its own stream; a key head moves as its group's
         * first query head says (the scenario's convention). */
        uint32_t per = r->nq + r->nk;
        for (uint32_t l = 0; l < p->layers; l++)
            for (uint32_t i = 0; i < per; i++) {
                int is_k = i >= r->nq;
                uint32_t h = is_k ? (r->k0 + i - r->nq) * r->group : r->h0 + i;
                float *w = is_k ? r->wk + ((size_t)l * r->nk + i - r->nq) * r->block
                                : r->wq + ((size_t)l * r->nq + i) * r->block;
                if ((rc = r->sc->attn_update(r->sc, p, &r->brng[(size_t)l * per + i], l, h, is_k,
                                             r->w_step, step, w, p->dh, r->cols)) < 0)
                    return rc;
            }
        r->w_step = step;
        return 0;
    }
    for (uint32_t l = 0; l < p->layers; l++)
        for (uint32_t h = 0; h < p->heads; h++) {
            size_t off = ((size_t)l * p->heads + h) * r->block;
            size_t koff = ((size_t)l * r->kv + h / r->group) * r->block;
            if ((rc = r->sc->attn_update(r->sc, p, &r->rng, l, h, 0, r->w_step, step, r->wq + off,
                                         p->dh, r->cols)) < 0)
                return rc;
            /* A key head moves once, with its group's first query head. */
            if (h % r->group == 0 &&
                (rc = r->sc->attn_update(r->sc, p, &r->rng, l, h, 1, r->w_step, step, r->wk + koff,
                                         p->dh, r->cols)) < 0)
                return rc;
        }
    r->w_step = step;
    return 0;
}

/* ---- spectrum route ---------------------------------------------------------------- */

/* n values s_i = m (1 + sqrt(lambda) g_i)^2 / (1 + lambda), g_i ~ N(0, 1):
 * a bulk of mean m whose spread is a Marchenko-Pastur law's at aspect
 * ratio lambda (support (1 +- sqrt(lambda))^2 m). Returns their sum. */
static double bulk(struct sim_rng *rng, double lambda, double m, size_t n, float *out)
{
    double sl = sqrt(lambda), scale = m / (1.0 + lambda), sum = 0;

    for (size_t i = 0; i < n; i++) {
        double g = 1.0 + sl * sim_normal(rng), v = scale * g * g;
        out[i] = (float)v;
        sum += (double)out[i];
    }
    return sum;
}

/* Update statistics of one side (Q or K) of a head over the window [t0, t):
 * the random part's per-element variance and the coherent amplitude. */
struct win_stats {
    double vr;  /* sum (1 - a^2) sd^2 */
    double amp; /* sum a sd */
    double v;   /* sum sd^2 */
};

static struct win_stats window_stats(const struct sim_rank *r, uint32_t layer, uint32_t head,
                                     uint64_t t0, uint64_t t)
{
    struct win_stats w = {0};

    for (uint64_t s = t0; s < t; s++) {
        double sd = sim_step_sd(r->sc, r->p, s);
        double a = r->sc->coherent ? r->sc->coherent(r->p, layer, head, s) : 0.0;
        w.vr += (1.0 - a * a) * sd * sd;
        w.amp += a * sd;
        w.v += sd * sd;
    }
    return w;
}

/* One query head's spectra at sketch step t (window w = p->window), as the
 * trainer would solve them from its Grams (docs/monitors.md 1.2), for the
 * weights attn_walk / attn_numerics make. With d >> dh the rows of W are
 * nearly orthogonal with squared norm c = 1 + d sum_{s < t0} sd^2 (|W|
 * grows like the healthy walk: the coherent part is norm-neutral), dW's
 * random part has per-element variance vr, and its coherent part is
 * A c_n u (u'^T W), c_n = sqrt(dh d) (scenario.c). Then
 *   Delta2:  2dh values, a bulk of mean d (vq ck + vk cq) / 2 at aspect
 *            2dh / d, plus the coherent rank-one value (Aq + Ak)^2 dh d cq ck
 *            (both sides push along the same x y^T);
 *   Delta1 = Delta2 + Delta3: the same with the bulk's mean raised by
 *            Delta3's energy;
 *   Delta3:  dh values, a bulk of mean d^2 vq vk at aspect dh / d (the
 *            coherent parts are orthogonal, u_q _|_ u_k);
 *   K(t0):   dh values, a bulk of mean cq ck, its shape fixed per head;
 *   norms:   |dWq|^2 = dh d (vq + Aq^2 cq), |Wq|^2 = dh cq, likewise K;
 *   c_qk   = sum sigma^2(Delta3) / (|dWq|^2 |dWk|^2), about 1/dh.
 * Random numbers: the rank's stream, and for K(t0) a per-head one. */
static void spectrum_head(struct sim_rank *r, uint32_t layer, uint32_t head, uint64_t t,
                          struct fsc_spectrum *out)
{
    const struct sim_params *p = r->p;
    size_t dh = p->dh;
    double d = p->d, ddh = (double)dh;
    uint64_t t0 = t - p->window;
    uint32_t first = head - head % r->group; /* the key side's head (scenario.h) */
    struct win_stats q = window_stats(r, layer, head, t0, t);
    struct win_stats k = window_stats(r, layer, first, t0, t);
    /* r->acc is the sum over s < t; the window's part is q.v. */
    double c = 1.0 + d * (r->acc - q.v);
    double l2 = fmin(1.0, 2.0 * ddh / d), l1 = fmin(1.0, ddh / d);
    double m2 = d * (q.vr * c + k.vr * c) / 2.0, m3 = d * d * q.vr * k.vr;
    double coh = (q.amp + k.amp) * (q.amp + k.amp) * ddh * d * c * c;
    float *d2 = r->spec, *d1 = d2 + 2 * dh, *d3 = d1 + 2 * dh, *w = d3 + dh;
    struct sim_rng hr;
    double sum3;

    bulk(&r->rng, l2, m2, 2 * dh, d2);
    d2[0] = (float)((double)d2[0] + coh);
    bulk(&r->rng, l2, m2 + m3 / 2.0, 2 * dh, d1);
    d1[0] = (float)((double)d1[0] + coh);
    sum3 = bulk(&r->rng, l1, m3, dh, d3);
    sim_rng_seed(&hr, sim_seed_mix(p->seed, TAG_W_SHAPE, layer, head));
    bulk(&hr, l1, c * c, dh, w);
    *out = (struct fsc_spectrum){.d2 = d2,
                                 .n_d2 = 2 * dh,
                                 .d3 = d3,
                                 .n_d3 = dh,
                                 .d1 = d1,
                                 .n_d1 = 2 * dh,
                                 .w = w,
                                 .n_w = dh,
                                 .q_delta_sq = ddh * d * (q.vr + q.amp * q.amp * c),
                                 .q_sq = ddh * c,
                                 .k_sq = ddh * c,
                                 .k_delta_sq = ddh * d * (k.vr + k.amp * k.amp * c),
                                 .has = FSC_SPECTRUM_HAS_Q_DELTA_SQ | FSC_SPECTRUM_HAS_Q_SQ |
                                        FSC_SPECTRUM_HAS_K_SQ | FSC_SPECTRUM_HAS_K_DELTA_SQ};
    if (out->q_delta_sq > 0 && out->k_delta_sq > 0) {
        out->cqk = fmin(1.0, sum3 / (out->q_delta_sq * out->k_delta_sq));
        out->has |= FSC_SPECTRUM_HAS_CQK;
    }
}

static int spectrum_step(struct sim_rank *r, uint64_t step, const struct sim_sink *sink)
{
    const struct sim_params *p = r->p;
    struct fsc_spectrum s;
    int rc;

    for (uint32_t l = 0; l < p->layers; l++)
        for (uint32_t h = r->h0; h < r->h1; h++) {
            spectrum_head(r, l, h, step, &s);
            if (sink->spectrum &&
                (rc = sink->spectrum(sink->ctx, step, l, h,
                                     r->group > 1 ? h / r->group : FSC_KV_HEAD_NONE, p->window,
                                     &s)) < 0)
                return rc;
        }
    return 0;
}

/* Sketch and snapshot duties of `step`. */
static int attention_step(struct sim_rank *r, uint64_t step, const struct sim_sink *sink)
{
    const struct sim_params *p = r->p;
    uint64_t k = p->sketch_every, w = p->window;
    int sketch = step % k == 0 && step >= w, snap = (step + w) % k == 0;
    int rc;

    if (p->route == SIM_ROUTE_SPECTRUM)
        return sketch ? spectrum_step(r, step, sink) : 0;
    if (!sketch && !snap)
        return 0;
    if ((rc = advance(r, step)) < 0)
        return rc;
    if (sketch) {
        size_t qslot = (size_t)((step / k) % r->nsnap) * r->all_q;
        size_t kslot = (size_t)((step / k) % r->nsnap) * r->all_k;
        /* Whole heads are shard 0 of 1; d-slices shard `rank` of `ranks`. */
        uint32_t shard = p->split_heads ? 0 : r->rank, shards = p->split_heads ? 1 : p->ranks;
        for (uint32_t l = 0; l < p->layers; l++)
            for (uint32_t h = r->h0; h < r->h1; h++) {
                size_t off = ((size_t)l * r->nq + h - r->h0) * r->block;
                size_t koff = ((size_t)l * r->nk + h / r->group - r->k0) * r->block;
                rc = fsc_attention_grams(r->wq + off, r->wk + koff, r->snap_q + qslot + off,
                                         r->snap_k + kslot + koff, p->dh, r->cols, r->ga, r->gb);
                if (rc == 0 && sink->attention)
                    rc = sink->attention(sink->ctx, step, l, h,
                                         r->group > 1 ? h / r->group : FSC_KV_HEAD_NONE,
                                         (uint32_t)w, p->dh, shard, shards, r->ga, r->gb);
                if (rc < 0)
                    return rc;
            }
    }
    if (snap) {
        /* Needed at step + w; slots of pending snapshots never collide
         * because nsnap > w / k + 1. */
        size_t slot = (size_t)(((step + w) / k) % r->nsnap);
        memcpy(r->snap_q + slot * r->all_q, r->wq, r->all_q * sizeof(float));
        memcpy(r->snap_k + slot * r->all_k, r->wk, r->all_k * sizeof(float));
    }
    return 0;
}

/* Per layer |W| of this rank's Wq and Wk (shards, or whole heads on the
 * spectrum route), and the update-to-weight ratio of this step: the norm of
 * the step's update (every scenario gives a step the norm of sim_step_sd
 * per element) over |W|. The spectrum route holds no weights: |W|^2 is its
 * expectation, elements x (1/d + sum_{s < step} sd^2). */
static int norms_step(struct sim_rank *r, uint64_t step, const struct sim_sink *sink)
{
    const struct sim_params *p = r->p;
    size_t per_q = (size_t)r->nq * r->block, per_k = (size_t)r->nk * r->block;
    double sd = sim_step_sd(r->sc, p, step);
    int rc;

    if (p->route == SIM_ROUTE_SPECTRUM) {
        uint32_t nq = r->h1 - r->h0, nk = nq ? (r->h1 - 1) / r->group - r->h0 / r->group + 1 : 0;
        double n = (double)(nq + nk) * p->dh * p->d, s = n * (1.0 / p->d + r->acc);
        for (uint32_t l = 0; l < p->layers; l++) {
            r->norm[l] = (float)sqrt(s);
            r->ratio[l] = s > 0 ? (float)(sd * sqrt(n) / sqrt(s)) : 0.0f;
        }
        return sink->layer_norms ? sink->layer_norms(sink->ctx, step, r->norm, r->ratio, p->layers)
                                 : 0;
    }
    double upd = sd * sqrt((double)(per_q + per_k));
    if ((rc = advance(r, step)) < 0)
        return rc;
    for (uint32_t l = 0; l < p->layers; l++) {
        const float *q = r->wq + l * per_q, *kk = r->wk + l * per_k;
        double s = 0;
        for (size_t i = 0; i < per_q; i++)
            s += (double)q[i] * q[i];
        for (size_t i = 0; i < per_k; i++)
            s += (double)kk[i] * kk[i];
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
        if (sink->router_tokens &&
            (rc = sink->router_tokens(sink->ctx, step, t->layer, (uint32_t)e, &tk)) < 0)
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
    /* Sent with the layer norms (the weight side of a step), every step:
     * the step's update over the weights' expected norm, per element
     * sd / sqrt(1/d + the updates so far), as norms_step's spectrum route
     * has it (the same for every layer and rank). */
    s.step_update_ratio = NAN;
    if (p->sketches && p->layer_norms)
        s.step_update_ratio = sim_step_sd(r->sc, p, step) / sqrt(1.0 / p->d + r->acc);
    if (sink->scalars && (rc = sink->scalars(sink->ctx, step, &s)) < 0)
        return rc;
    if (!p->sketches)
        return 0;
    if ((rc = routers_step(r, step, sink)) < 0 || (rc = attention_step(r, step, sink)) < 0)
        return rc;
    if (p->layer_norms && step % p->sketch_every == 0 && (rc = norms_step(r, step, sink)) < 0)
        return rc;
    r->acc += sim_step_sd(r->sc, p, step) * sim_step_sd(r->sc, p, step);
    return 0;
}
