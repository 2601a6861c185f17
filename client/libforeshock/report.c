/* Building reports (fsc_report_*) and serializing them for the replay
 * buffer. Pure: memory only.
 *
 * A report is the protobuf-c Report message itself plus ownership of every
 * block it points to. Each sketch lives in one malloc'd block: the message
 * struct first, then its payload, so freeing a sketch is one free(). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "foreshock.h"
#include "foreshock.pb-c.h"
#include "report_pack.h"

struct fsc_report {
    Foreshock__Report msg; /* arrays and scalars point into the blocks below */
    Foreshock__Scalars scalars;
    float *weight_norms;  /* owned, scalars.layer_weight_norm */
    float *update_ratios; /* owned, scalars.layer_update_ratio */
    size_t cap_attention, cap_router_gram, cap_router_tokens;
};

struct gram_block {
    Foreshock__AttentionSketch a;
    Foreshock__GramSketch g;
    uint8_t bytes[]; /* ga then gb */
};

struct spectrum_block {
    Foreshock__AttentionSketch a;
    Foreshock__SpectrumSketch s;
    float v[]; /* d2, d3, d1, w */
};

struct router_gram_block {
    Foreshock__RouterGram g;
    uint8_t bytes[];
};

struct router_tokens_block {
    Foreshock__RouterTokens t;
    uint64_t load[]; /* n_experts loads, then n_experts doubles (sum_p) */
};

fsc_report *fsc_report_new(uint64_t step)
{
    fsc_report *r = calloc(1, sizeof(*r));

    if (!r)
        return NULL;
    foreshock__report__init(&r->msg);
    foreshock__scalars__init(&r->scalars);
    r->msg.step = step;
    return r;
}

void fsc_report_free(fsc_report *r)
{
    if (!r)
        return;
    for (size_t i = 0; i < r->msg.n_attention; i++)
        free(r->msg.attention[i]); /* the block starts with the message */
    for (size_t i = 0; i < r->msg.n_router_gram; i++)
        free(r->msg.router_gram[i]);
    for (size_t i = 0; i < r->msg.n_router_tokens; i++)
        free(r->msg.router_tokens[i]);
    free(r->msg.attention);
    free(r->msg.router_gram);
    free(r->msg.router_tokens);
    free(r->weight_norms);
    free(r->update_ratios);
    free(r);
}

/* ---- scalars ---------------------------------------------------------------- */

static Foreshock__Scalars *scalars(fsc_report *r)
{
    r->msg.scalars = &r->scalars;
    return &r->scalars;
}

int fsc_report_set_loss(fsc_report *r, double loss)
{
    if (!r)
        return -EINVAL;
    scalars(r)->has_loss = 1;
    r->scalars.loss = loss;
    return 0;
}

int fsc_report_set_grad_norm(fsc_report *r, double grad_norm)
{
    if (!r)
        return -EINVAL;
    scalars(r)->has_grad_norm = 1;
    r->scalars.grad_norm = grad_norm;
    return 0;
}

int fsc_report_set_lr(fsc_report *r, double lr)
{
    if (!r || !isfinite(lr))
        return -EINVAL;
    scalars(r)->has_lr = 1;
    r->scalars.lr = lr;
    return 0;
}

int fsc_report_set_loss_scale(fsc_report *r, double loss_scale)
{
    if (!r || !isfinite(loss_scale))
        return -EINVAL;
    scalars(r)->has_loss_scale = 1;
    r->scalars.loss_scale = loss_scale;
    return 0;
}

int fsc_report_set_step_update_ratio(fsc_report *r, double ratio)
{
    if (!r || ratio < 0) /* NaN compares false: accepted, as the daemon does */
        return -EINVAL;
    scalars(r)->has_step_update_ratio = 1;
    r->scalars.step_update_ratio = ratio;
    return 0;
}

int fsc_report_set_step_time(fsc_report *r, double seconds)
{
    if (!r || !isfinite(seconds))
        return -EINVAL;
    scalars(r)->has_step_time_s = 1;
    r->scalars.step_time_s = seconds;
    return 0;
}

int fsc_report_set_time(fsc_report *r, double unix_seconds)
{
    if (!r || !isfinite(unix_seconds))
        return -EINVAL;
    r->msg.has_time_unix = 1;
    r->msg.time_unix = unix_seconds;
    return 0;
}

int fsc_report_set_tokens(fsc_report *r, uint64_t tokens)
{
    if (!r)
        return -EINVAL;
    scalars(r)->has_tokens = 1;
    r->scalars.tokens = tokens;
    return 0;
}

/* Values derived from weights (norms, sigma^2): >= 0, or non-finite (a
 * non-finite weight must reach the daemon's detector). */
static int nonneg_or_nonfinite(const float *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (isfinite(v[i]) && v[i] < 0)
            return 0;
    return 1;
}

static int nonneg_or_nonfinite_d(double x)
{
    return !isfinite(x) || x >= 0;
}

/* Replaces *owned with a copy of v[0..n). */
static int set_layer_values(fsc_report *r, float **owned, size_t *count, float **field,
                            const float *v, size_t n)
{
    float *copy = NULL;

    if (!r || n > FSC_MAX_LAYERS || (n && !v) || !nonneg_or_nonfinite(v, n))
        return -EINVAL;
    if (n) {
        copy = malloc(n * sizeof(*copy));
        if (!copy)
            return -ENOMEM;
        memcpy(copy, v, n * sizeof(*copy));
    }
    free(*owned);
    *owned = copy;
    *field = copy;
    *count = n;
    scalars(r);
    return 0;
}

int fsc_report_set_layer_weight_norms(fsc_report *r, const float *v, size_t n)
{
    if (!r)
        return -EINVAL;
    return set_layer_values(r, &r->weight_norms, &r->scalars.n_layer_weight_norm,
                            &r->scalars.layer_weight_norm, v, n);
}

int fsc_report_set_layer_update_ratios(fsc_report *r, const float *v, size_t n)
{
    if (!r)
        return -EINVAL;
    return set_layer_values(r, &r->update_ratios, &r->scalars.n_layer_update_ratio,
                            &r->scalars.layer_update_ratio, v, n);
}

/* ---- sketches ---------------------------------------------------------------- */

/* Makes room for one more pointer in *arr (count *n, capacity *cap). */
static int grow(void ***arr, size_t n, size_t *cap, size_t limit)
{
    void **p;
    size_t ncap;

    if (n >= limit)
        return -E2BIG;
    if (n < *cap)
        return 0;
    ncap = *cap ? *cap * 2 : 8;
    if (ncap > limit)
        ncap = limit;
    p = realloc(*arr, ncap * sizeof(*p));
    if (!p)
        return -ENOMEM;
    *arr = p;
    *cap = ncap;
    return 0;
}

static int check_head(uint32_t layer, uint32_t head, uint32_t kv_head, uint32_t window)
{
    if (layer >= FSC_MAX_LAYERS || head >= FSC_MAX_HEADS || window < 1 || window > FSC_MAX_WINDOW ||
        (kv_head != FSC_KV_HEAD_NONE && kv_head >= FSC_MAX_HEADS))
        return -EINVAL;
    return 0;
}

static int check_shard(uint32_t shard_index, uint32_t shard_count)
{
    if (shard_count < 1 || shard_count > FSC_MAX_SHARDS || shard_index >= shard_count)
        return -EINVAL;
    return 0;
}

static void init_attention(Foreshock__AttentionSketch *a, uint32_t layer, uint32_t head,
                           uint32_t kv_head, uint32_t window)
{
    foreshock__attention_sketch__init(a);
    a->layer = layer;
    a->head = head;
    a->window = window;
    if (kv_head != FSC_KV_HEAD_NONE) {
        a->has_kv_head = 1;
        a->kv_head = kv_head;
    }
}

static int push_attention(fsc_report *r, Foreshock__AttentionSketch *a)
{
    int rc = grow((void ***)&r->msg.attention, r->msg.n_attention, &r->cap_attention,
                  FSC_MAX_ATTENTION_PER_REPORT);

    if (rc < 0)
        return rc;
    r->msg.attention[r->msg.n_attention++] = a;
    return 0;
}

int fsc_report_add_attention_gram(fsc_report *r, uint32_t layer, uint32_t head, uint32_t kv_head,
                                  uint32_t window, uint32_t dh, uint32_t shard_index,
                                  uint32_t shard_count, const float *ga_upper,
                                  const float *gb_upper)
{
    struct gram_block *b;
    size_t tri, nbytes;
    int rc;

    if (!r || !ga_upper || !gb_upper || dh < 1 || dh > FSC_MAX_DH)
        return -EINVAL;
    if ((rc = check_head(layer, head, kv_head, window)) < 0 ||
        (rc = check_shard(shard_index, shard_count)) < 0)
        return rc;
    if (r->msg.n_attention >= FSC_MAX_ATTENTION_PER_REPORT)
        return -E2BIG;
    tri = fsc_tri_len(2 * (size_t)dh);
    nbytes = tri * sizeof(float);
    b = malloc(sizeof(*b) + 2 * nbytes);
    if (!b)
        return -ENOMEM;
    init_attention(&b->a, layer, head, kv_head, window);
    foreshock__gram_sketch__init(&b->g);
    b->g.dh = dh;
    b->g.has_shard_index = 1;
    b->g.shard_index = shard_index;
    b->g.has_shard_count = 1;
    b->g.shard_count = shard_count;
    fsc_floats_to_le(ga_upper, tri, b->bytes);
    fsc_floats_to_le(gb_upper, tri, b->bytes + nbytes);
    b->g.ga = (ProtobufCBinaryData){.len = nbytes, .data = b->bytes};
    b->g.gb = (ProtobufCBinaryData){.len = nbytes, .data = b->bytes + nbytes};
    b->a.kind_case = FORESHOCK__ATTENTION_SKETCH__KIND_GRAM;
    b->a.gram = &b->g;
    if ((rc = push_attention(r, &b->a)) < 0)
        free(b);
    return rc;
}

static int check_spectrum(const struct fsc_spectrum *s)
{
    if (!s || !s->d2 || !s->d3 || s->n_d3 < 1 || s->n_d3 > FSC_MAX_DH || s->n_d2 != 2 * s->n_d3)
        return -EINVAL;
    if ((s->n_d1 && (!s->d1 || s->n_d1 != s->n_d2)) || (s->n_w && (!s->w || s->n_w != s->n_d3)))
        return -EINVAL;
    if (!nonneg_or_nonfinite(s->d2, s->n_d2) || !nonneg_or_nonfinite(s->d3, s->n_d3) ||
        !nonneg_or_nonfinite(s->d1, s->n_d1) || !nonneg_or_nonfinite(s->w, s->n_w))
        return -EINVAL;
    if (!nonneg_or_nonfinite_d(s->q_delta_sq) || !nonneg_or_nonfinite_d(s->q_sq) ||
        !nonneg_or_nonfinite_d(s->k_sq) || !nonneg_or_nonfinite_d(s->k_delta_sq) ||
        !nonneg_or_nonfinite_d(s->cqk))
        return -EINVAL;
    /* c_qk is a ratio in [0, 1] (docs/monitors.md 1.2); allow rounding. */
    if ((s->has & FSC_SPECTRUM_HAS_CQK) && isfinite(s->cqk) && s->cqk > 1.0 + 1e-6)
        return -EINVAL;
    return 0;
}

/* Copies n floats to *cursor, points *field there, advances the cursor. */
static void place(float **cursor, const float *v, size_t n, float **field, size_t *count)
{
    if (n)
        memcpy(*cursor, v, n * sizeof(float));
    *field = n ? *cursor : NULL;
    *count = n;
    *cursor += n;
}

int fsc_report_add_attention_spectrum(fsc_report *r, uint32_t layer, uint32_t head,
                                      uint32_t kv_head, uint32_t window,
                                      const struct fsc_spectrum *s)
{
    struct spectrum_block *b;
    float *cur;
    size_t nvals;
    int rc;

    if (!r || (rc = check_spectrum(s)) < 0 || (rc = check_head(layer, head, kv_head, window)) < 0)
        return -EINVAL;
    if (r->msg.n_attention >= FSC_MAX_ATTENTION_PER_REPORT)
        return -E2BIG;
    nvals = s->n_d2 + s->n_d3 + s->n_d1 + s->n_w;
    b = malloc(sizeof(*b) + nvals * sizeof(float));
    if (!b)
        return -ENOMEM;
    init_attention(&b->a, layer, head, kv_head, window);
    foreshock__spectrum_sketch__init(&b->s);
    cur = b->v;
    place(&cur, s->d2, s->n_d2, &b->s.d2, &b->s.n_d2);
    place(&cur, s->d3, s->n_d3, &b->s.d3, &b->s.n_d3);
    place(&cur, s->d1, s->n_d1, &b->s.d1, &b->s.n_d1);
    place(&cur, s->w, s->n_w, &b->s.w, &b->s.n_w);
    b->s.has_q_delta_sq = !!(s->has & FSC_SPECTRUM_HAS_Q_DELTA_SQ);
    b->s.q_delta_sq = s->q_delta_sq;
    b->s.has_q_sq = !!(s->has & FSC_SPECTRUM_HAS_Q_SQ);
    b->s.q_sq = s->q_sq;
    b->s.has_k_sq = !!(s->has & FSC_SPECTRUM_HAS_K_SQ);
    b->s.k_sq = s->k_sq;
    b->s.has_k_delta_sq = !!(s->has & FSC_SPECTRUM_HAS_K_DELTA_SQ);
    b->s.k_delta_sq = s->k_delta_sq;
    b->s.has_cqk = !!(s->has & FSC_SPECTRUM_HAS_CQK);
    b->s.cqk = s->cqk;
    b->a.kind_case = FORESHOCK__ATTENTION_SKETCH__KIND_SPECTRUM;
    b->a.spectrum = &b->s;
    if ((rc = push_attention(r, &b->a)) < 0)
        free(b);
    return rc;
}

int fsc_report_add_router_gram(fsc_report *r, uint32_t layer, uint32_t n_experts,
                               uint32_t shard_index, uint32_t shard_count, const float *gram_upper)
{
    struct router_gram_block *b;
    size_t tri;
    int rc;

    if (!r || !gram_upper || layer >= FSC_MAX_LAYERS || n_experts < 1 ||
        n_experts > FSC_MAX_EXPERTS || check_shard(shard_index, shard_count) < 0)
        return -EINVAL;
    if ((rc = grow((void ***)&r->msg.router_gram, r->msg.n_router_gram, &r->cap_router_gram,
                   FSC_MAX_ROUTER_PER_REPORT)) < 0)
        return rc;
    tri = fsc_tri_len(n_experts);
    b = malloc(sizeof(*b) + tri * sizeof(float));
    if (!b)
        return -ENOMEM;
    foreshock__router_gram__init(&b->g);
    b->g.layer = layer;
    b->g.n_experts = n_experts;
    b->g.has_shard_index = 1;
    b->g.shard_index = shard_index;
    b->g.has_shard_count = 1;
    b->g.shard_count = shard_count;
    fsc_floats_to_le(gram_upper, tri, b->bytes);
    b->g.gram = (ProtobufCBinaryData){.len = tri * sizeof(float), .data = b->bytes};
    r->msg.router_gram[r->msg.n_router_gram++] = &b->g;
    return 0;
}

int fsc_report_add_router_tokens(fsc_report *r, uint32_t layer, uint32_t n_experts, uint64_t n_tok,
                                 double sum_h, double sum_h2, double sum_lse2, const uint64_t *load,
                                 const double *sum_p)
{
    struct router_tokens_block *b;
    double *p;
    int rc;

    if (!r || !load || !sum_p || layer >= FSC_MAX_LAYERS || n_experts < 1 ||
        n_experts > FSC_MAX_EXPERTS || !isfinite(sum_h) || !isfinite(sum_h2) ||
        !isfinite(sum_lse2) || sum_h2 < 0 || sum_lse2 < 0)
        return -EINVAL;
    for (uint32_t i = 0; i < n_experts; i++)
        if (!isfinite(sum_p[i]) || sum_p[i] < 0)
            return -EINVAL;
    if ((rc = grow((void ***)&r->msg.router_tokens, r->msg.n_router_tokens, &r->cap_router_tokens,
                   FSC_MAX_ROUTER_PER_REPORT)) < 0)
        return rc;
    b = malloc(sizeof(*b) + 2 * (size_t)n_experts * sizeof(uint64_t));
    if (!b)
        return -ENOMEM;
    foreshock__router_tokens__init(&b->t);
    b->t.layer = layer;
    b->t.n_experts = n_experts;
    b->t.n_tok = n_tok;
    b->t.sum_h = sum_h;
    b->t.sum_h2 = sum_h2;
    b->t.sum_lse2 = sum_lse2;
    memcpy(b->load, load, n_experts * sizeof(uint64_t));
    p = (double *)(void *)(b->load + n_experts);
    memcpy(p, sum_p, n_experts * sizeof(double));
    b->t.n_load = n_experts;
    b->t.load = b->load;
    b->t.n_sum_p = n_experts;
    b->t.sum_p = p;
    r->msg.router_tokens[r->msg.n_router_tokens++] = &b->t;
    return 0;
}

/* ---- serialization ------------------------------------------------------------- */

int fsc_report_pack_msg(const Foreshock__Report *msg, size_t max_bytes, struct fsc_entry **out)
{
    Foreshock__Report m = *msg;
    struct fsc_entry *e;
    size_t n;

    /* What the daemon refuses in any report, its placeholder included (the
     * placeholder keeps step and time, io.c): queued, it would be resent
     * for ever. SQLite integers are signed 64-bit. */
    if (m.step > INT64_MAX || (m.has_time_unix && !isfinite(m.time_unix)))
        return -ERANGE;
    /* Packed with seq = 1, whose field is exactly the two bytes 08 01: they
     * are cut off here and the real seq is written in front at send time. */
    m.seq = 1;
    n = foreshock__report__get_packed_size(&m);
    if (n - 2 > max_bytes)
        return -EMSGSIZE;
    e = malloc(sizeof(*e) + n);
    if (!e)
        return -ENOMEM;
    if (foreshock__report__pack(&m, e->data) != n || e->data[0] != 0x08 || e->data[1] != 0x01) {
        free(e);
        return -EPROTO;
    }
    e->next = NULL;
    e->seq = 0;
    e->placeholder = 0;
    e->body = e->data + 2;
    e->len = n - 2;
    *out = e;
    return 0;
}

int fsc_report_pack(const fsc_report *r, uint64_t seq, size_t max_bytes, struct fsc_entry **out)
{
    int rc = fsc_report_pack_msg(&r->msg, max_bytes, out);

    if (rc == 0)
        (*out)->seq = seq;
    return rc;
}
