/* Frame decoding with a capped allocator, and validation against limits. */
#include "decode.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fs_limits.h"

#define E_VERSION FORESHOCK__ERROR_CODE__ERROR_PROTOCOL_VERSION
#define E_MALFORMED FORESHOCK__ERROR_CODE__ERROR_MALFORMED
#define E_TOO_LARGE FORESHOCK__ERROR_CODE__ERROR_TOO_LARGE
#define E_LIMIT FORESHOCK__ERROR_CODE__ERROR_LIMIT

void decode_limits_default(struct decode_limits *lim, uint32_t max_frame_bytes)
{
    *lim = (struct decode_limits){
        .max_frame_bytes = max_frame_bytes,
        .max_world_size = FS_MAX_WORLD_SIZE,
        .max_layers = FS_MAX_LAYERS,
        .max_heads = FS_MAX_HEADS,
        .max_dh = FS_MAX_DH,
        .max_experts = FS_MAX_EXPERTS,
        .max_window = FS_MAX_WINDOW,
        .max_shards = FS_MAX_SHARDS,
        .max_attention_per_report = FS_MAX_ATTENTION_PER_REPORT,
        .max_router_per_report = FS_MAX_ROUTER_PER_REPORT,
        .max_run_id_len = FS_MAX_RUN_ID_LEN,
        .max_spectrum_len = FS_MAX_SPECTRUM_LEN,
        .max_token_len = FS_MAX_TOKEN_LEN,
    };
}

static int fail(struct fs_err *err, int code, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

_Static_assert(FS_MAX_ERROR_MESSAGE <= FS_ERR_MSG_MAX, "an Error message must fit in fs_err");

/* The message goes to the peer in an Error frame as it is: cut it at the
 * protocol's FS_MAX_ERROR_MESSAGE (bytes with NUL). */
static int fail(struct fs_err *err, int code, int rc, const char *fmt, ...)
{
    err->code = code;
    va_list ap;
    va_start(ap, fmt);
    fs_err_vset(err, rc, fmt, ap);
    va_end(ap);
    err->msg[FS_MAX_ERROR_MESSAGE - 1] = '\0';
    return rc;
}

int decode_prefix(const uint8_t hdr[DECODE_PREFIX_BYTES], const struct decode_limits *lim,
                  uint32_t *len, struct fs_err *err)
{
    uint32_t n = (uint32_t)hdr[0] << 24 | (uint32_t)hdr[1] << 16 | (uint32_t)hdr[2] << 8 | hdr[3];
    if (n == 0)
        return fail(err, E_TOO_LARGE, -EMSGSIZE, "frame length 0");
    if (n > lim->max_frame_bytes)
        return fail(err, E_TOO_LARGE, -EMSGSIZE, "frame length %u exceeds max_frame_bytes %u", n,
                    lim->max_frame_bytes);
    *len = n;
    return 0;
}

/* --- capped allocator ---------------------------------------------------------
 * Memory comes from malloc, so decode_frame_free can use protobuf-c's default
 * (system) allocator and the cap state need not outlive the unpack. */
struct cap_state {
    size_t used;
    size_t cap;
    int exceeded;
};

static void *cap_alloc(void *data, size_t size)
{
    struct cap_state *st = data;
    if (size > st->cap - st->used) {
        st->exceeded = 1;
        return NULL;
    }
    void *p = malloc(size ? size : 1);
    if (p)
        st->used += size;
    return p;
}

static void cap_free(void *data, void *p)
{
    (void)data;
    free(p);
}

/* --- validation helpers ------------------------------------------------------ */

static int is_finite(double x)
{
    return isfinite(x);
}

/* Reads little-endian float32 values regardless of host byte order. */
static float le_float(const uint8_t *p)
{
    uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static uint64_t count_nonfinite_le(const ProtobufCBinaryData *b)
{
    uint64_t n = 0;
    for (size_t i = 0; i + 4 <= b->len; i += 4)
        n += !isfinite(le_float(b->data + i));
    return n;
}

int decode_run_id_valid(const char *s, size_t max_len)
{
    size_t n = 0;
    for (; s[n]; n++) {
        char c = s[n];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                 c == '.' || c == '_' || c == ':' || c == '-';
        if (!ok || n >= max_len)
            return 0;
    }
    return n >= 1;
}

/* Triangle bytes of an n x n symmetric matrix, float32; 0 on overflow
 * (n is bounded by the limits long before that). */
static uint64_t tri_bytes(uint64_t n)
{
    return n * (n + 1) / 2 * 4;
}

/* Spectrum values: sigma^2 >= 0, or non-finite (flagged, accepted). */
static int check_spectrum(const float *v, size_t n, size_t max, const char *what,
                          struct decode_info *info, struct fs_err *err)
{
    if (n > max)
        return fail(err, E_LIMIT, -EINVAL, "spectrum %s has %zu values, limit %zu", what, n, max);
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(v[i]))
            info->nonfinite_sketch_values++;
        else if (v[i] < 0)
            return fail(err, E_MALFORMED, -EINVAL, "spectrum %s[%zu] = %g is negative", what, i,
                        (double)v[i]);
    }
    return 0;
}

static int check_nonneg_opt(int has, double x, const char *what, struct decode_info *info,
                            struct fs_err *err)
{
    if (!has)
        return 0;
    if (!isfinite(x))
        info->nonfinite_sketch_values++;
    else if (x < 0)
        return fail(err, E_MALFORMED, -EINVAL, "spectrum %s = %g is negative", what, x);
    return 0;
}

static int check_gram(const Foreshock__GramSketch *g, const struct decode_limits *lim,
                      struct decode_info *info, struct fs_err *err)
{
    if (g->dh < 1 || g->dh > lim->max_dh)
        return fail(err, E_MALFORMED, -EINVAL, "gram dh %u outside 1..%u", g->dh, lim->max_dh);
    uint32_t count = g->has_shard_count ? g->shard_count : 1;
    uint32_t index = g->has_shard_index ? g->shard_index : 0;
    if (count < 1 || count > lim->max_shards || index >= count)
        return fail(err, E_MALFORMED, -EINVAL, "gram shard %u of %u is invalid", index, count);
    uint64_t want = tri_bytes(2ull * g->dh);
    if (g->ga.len != want || g->gb.len != want)
        return fail(err, E_MALFORMED, -EINVAL,
                    "gram with dh %u needs %llu bytes each in ga and gb, got %zu and %zu", g->dh,
                    (unsigned long long)want, g->ga.len, g->gb.len);
    info->nonfinite_sketch_values += count_nonfinite_le(&g->ga) + count_nonfinite_le(&g->gb);
    return 0;
}

static int check_spectrum_sketch(const Foreshock__SpectrumSketch *s,
                                 const struct decode_limits *lim, struct decode_info *info,
                                 struct fs_err *err)
{
    size_t two =
        2u * lim->max_dh < lim->max_spectrum_len ? 2u * lim->max_dh : lim->max_spectrum_len;
    size_t one = lim->max_dh < lim->max_spectrum_len ? lim->max_dh : lim->max_spectrum_len;
    int rc;
    if ((rc = check_spectrum(s->d2, s->n_d2, two, "d2", info, err)) < 0 ||
        (rc = check_spectrum(s->d3, s->n_d3, one, "d3", info, err)) < 0 ||
        (rc = check_spectrum(s->d1, s->n_d1, two, "d1", info, err)) < 0 ||
        (rc = check_spectrum(s->w, s->n_w, one, "w", info, err)) < 0 ||
        (rc = check_nonneg_opt(s->has_q_delta_sq, s->q_delta_sq, "q_delta_sq", info, err)) < 0 ||
        (rc = check_nonneg_opt(s->has_q_sq, s->q_sq, "q_sq", info, err)) < 0 ||
        (rc = check_nonneg_opt(s->has_k_sq, s->k_sq, "k_sq", info, err)) < 0 ||
        (rc = check_nonneg_opt(s->has_k_delta_sq, s->k_delta_sq, "k_delta_sq", info, err)) < 0 ||
        (rc = check_nonneg_opt(s->has_cqk, s->cqk, "cqk", info, err)) < 0)
        return rc;
    if (s->has_cqk && isfinite(s->cqk) && s->cqk > 1.0 + 1e-6)
        return fail(err, E_MALFORMED, -EINVAL, "spectrum cqk = %g is above 1", s->cqk);
    return 0;
}

static int check_attention(const Foreshock__AttentionSketch *a, size_t i,
                           const struct decode_limits *lim, struct decode_info *info,
                           struct fs_err *err)
{
    if (a->layer >= lim->max_layers || a->head >= lim->max_heads ||
        (a->has_kv_head && a->kv_head >= lim->max_heads))
        return fail(err, E_MALFORMED, -EINVAL,
                    "attention[%zu]: layer %u / head %u beyond limits %u / %u", i, a->layer,
                    a->head, lim->max_layers, lim->max_heads);
    if (a->window < 1 || a->window > lim->max_window)
        return fail(err, E_MALFORMED, -EINVAL, "attention[%zu]: window %u outside 1..%u", i,
                    a->window, lim->max_window);
    switch (a->kind_case) {
    case FORESHOCK__ATTENTION_SKETCH__KIND_GRAM:
        return check_gram(a->gram, lim, info, err);
    case FORESHOCK__ATTENTION_SKETCH__KIND_SPECTRUM:
        return check_spectrum_sketch(a->spectrum, lim, info, err);
    default:
        return fail(err, E_MALFORMED, -EINVAL, "attention[%zu]: neither gram nor spectrum", i);
    }
}

static int check_router_gram(const Foreshock__RouterGram *g, size_t i,
                             const struct decode_limits *lim, struct decode_info *info,
                             struct fs_err *err)
{
    if (g->layer >= lim->max_layers)
        return fail(err, E_MALFORMED, -EINVAL, "router_gram[%zu]: layer %u >= %u", i, g->layer,
                    lim->max_layers);
    if (g->n_experts < 1 || g->n_experts > lim->max_experts)
        return fail(err, E_MALFORMED, -EINVAL, "router_gram[%zu]: n_experts %u outside 1..%u", i,
                    g->n_experts, lim->max_experts);
    uint32_t count = g->has_shard_count ? g->shard_count : 1;
    uint32_t index = g->has_shard_index ? g->shard_index : 0;
    if (count < 1 || count > lim->max_shards || index >= count)
        return fail(err, E_MALFORMED, -EINVAL, "router_gram[%zu]: shard %u of %u is invalid", i,
                    index, count);
    uint64_t want = tri_bytes(g->n_experts);
    if (g->gram.len != want)
        return fail(err, E_MALFORMED, -EINVAL,
                    "router_gram[%zu]: %u experts need %llu bytes, got %zu", i, g->n_experts,
                    (unsigned long long)want, g->gram.len);
    info->nonfinite_sketch_values += count_nonfinite_le(&g->gram);
    return 0;
}

static int check_router_tokens(const Foreshock__RouterTokens *t, size_t i,
                               const struct decode_limits *lim, struct fs_err *err)
{
    if (t->layer >= lim->max_layers)
        return fail(err, E_MALFORMED, -EINVAL, "router_tokens[%zu]: layer %u >= %u", i, t->layer,
                    lim->max_layers);
    if (t->n_experts < 1 || t->n_experts > lim->max_experts)
        return fail(err, E_MALFORMED, -EINVAL, "router_tokens[%zu]: n_experts %u outside 1..%u", i,
                    t->n_experts, lim->max_experts);
    if (t->n_load != t->n_experts || t->n_sum_p != t->n_experts)
        return fail(err, E_MALFORMED, -EINVAL,
                    "router_tokens[%zu]: load has %zu and sum_p %zu values, n_experts is %u", i,
                    t->n_load, t->n_sum_p, t->n_experts);
    /* Token statistics are sums the monitors divide and compare: a
     * non-finite one is a client bug, not a training symptom. */
    if (!is_finite(t->sum_h) || !is_finite(t->sum_h2) || !is_finite(t->sum_lse2) || t->sum_h2 < 0 ||
        t->sum_lse2 < 0)
        return fail(err, E_MALFORMED, -EINVAL,
                    "router_tokens[%zu]: sum_h/sum_h2/sum_lse2 must be finite (squares >= 0)", i);
    for (size_t e = 0; e < t->n_sum_p; e++)
        if (!is_finite(t->sum_p[e]) || t->sum_p[e] < 0)
            return fail(err, E_MALFORMED, -EINVAL,
                        "router_tokens[%zu]: sum_p[%zu] = %g must be finite and >= 0", i, e,
                        t->sum_p[e]);
    return 0;
}

void decode_scalars(const Foreshock__Scalars *s, struct decode_scalars *out)
{
    *out = (struct decode_scalars){0};
    if (!s)
        return;
    const struct {
        int has;
        double v;
    } sc[DECODE_NSCALARS] = {
        [DECODE_SCALAR_LOSS] = {s->has_loss, s->loss},
        [DECODE_SCALAR_GRAD_NORM] = {s->has_grad_norm, s->grad_norm},
        [DECODE_SCALAR_LR] = {s->has_lr, s->lr},
        [DECODE_SCALAR_LOSS_SCALE] = {s->has_loss_scale, s->loss_scale},
        [DECODE_SCALAR_TOKENS] = {s->has_tokens, (double)s->tokens},
        [DECODE_SCALAR_STEP_TIME] = {s->has_step_time_s, s->step_time_s},
        [DECODE_SCALAR_STEP_UPDATE_RATIO] = {s->has_step_update_ratio, s->step_update_ratio},
    };
    for (int i = 0; i < DECODE_NSCALARS; i++) {
        out->v[i] = sc[i].v;
        if (sc[i].has)
            out->present |= 1u << i;
    }
}

static int check_scalars(const Foreshock__Scalars *s, const struct decode_limits *lim,
                         struct decode_info *info, struct fs_err *err)
{
    if ((s->has_lr && !is_finite(s->lr)) || (s->has_loss_scale && !is_finite(s->loss_scale)) ||
        (s->has_step_time_s && !is_finite(s->step_time_s)))
        return fail(err, E_MALFORMED, -EINVAL,
                    "scalars: lr, loss_scale and step_time_s must be finite");
    /* loss and grad_norm may be NaN/Inf: that is what the non-finite
     * detector exists to see. */
    if ((s->has_loss && !is_finite(s->loss)) || (s->has_grad_norm && !is_finite(s->grad_norm)))
        info->nonfinite_scalars = 1;
    /* Derived from the weights like the per-layer ratios below: non-finite
     * accepted and flagged (weights gone NaN), negative refused. */
    if (s->has_step_update_ratio) {
        if (!is_finite(s->step_update_ratio))
            info->nonfinite_scalars = 1;
        else if (s->step_update_ratio < 0)
            return fail(err, E_MALFORMED, -EINVAL, "scalars: step_update_ratio = %g is negative",
                        s->step_update_ratio);
    }
    if (s->n_layer_weight_norm > lim->max_layers || s->n_layer_update_ratio > lim->max_layers)
        return fail(err, E_LIMIT, -EINVAL, "scalars: more than %u per-layer values",
                    lim->max_layers);
    /* Per-layer norms are derived from the weights, like the sketches:
     * non-finite ones are accepted and flagged, negative ones are not norms. */
    const float *arr[2] = {s->layer_weight_norm, s->layer_update_ratio};
    size_t len[2] = {s->n_layer_weight_norm, s->n_layer_update_ratio};
    for (int k = 0; k < 2; k++) {
        for (size_t i = 0; i < len[k]; i++) {
            if (!isfinite(arr[k][i]))
                info->nonfinite_scalars = 1;
            else if (arr[k][i] < 0)
                return fail(err, E_MALFORMED, -EINVAL, "scalars: %s[%zu] = %g is negative",
                            k ? "layer_update_ratio" : "layer_weight_norm", i, (double)arr[k][i]);
        }
    }
    return 0;
}

/* ModelShape.optimizer: 1..FS_MAX_OPTIMIZER_LEN bytes of printable ASCII, ' '..'~'
 * (a class name; it is stored and shown, so no control bytes). */
static int optimizer_name_valid(const char *s)
{
    size_t n = 0;
    for (; s[n]; n++) {
        unsigned char ch = (unsigned char)s[n];
        if (n >= FS_MAX_OPTIMIZER_LEN || ch < ' ' || ch > '~')
            return 0;
    }
    return n > 0;
}

static int check_model_shape(const Foreshock__ModelShape *m, const struct decode_limits *lim,
                             struct fs_err *err)
{
    if ((m->has_n_layers && m->n_layers > lim->max_layers) ||
        (m->has_n_heads && m->n_heads > lim->max_heads) ||
        (m->has_n_kv_heads && m->n_kv_heads > lim->max_heads) ||
        (m->has_d_head && m->d_head > lim->max_dh) ||
        (m->has_n_experts && m->n_experts > lim->max_experts) ||
        (m->has_top_k && m->top_k > lim->max_experts) || m->n_moe_layers > lim->max_layers)
        return fail(err, E_MALFORMED, -EINVAL, "model shape beyond limits");
    for (size_t i = 0; i < m->n_moe_layers; i++)
        if (m->moe_layers[i] >= lim->max_layers)
            return fail(err, E_MALFORMED, -EINVAL, "model.moe_layers[%zu] = %u >= %u", i,
                        m->moe_layers[i], lim->max_layers);
    if (m->optimizer && !optimizer_name_valid(m->optimizer))
        return fail(err, E_MALFORMED, -EINVAL,
                    "model.optimizer must be 1..%u bytes of printable ASCII", FS_MAX_OPTIMIZER_LEN);
    return 0;
}

int decode_check_hello(const Foreshock__Hello *h, const struct decode_limits *lim,
                       struct fs_err *err)
{
    /* Version first: a newer client's other fields may mean other things. */
    if (h->protocol_version != FORESHOCK__PROTOCOL_VERSION__PROTOCOL_VERSION_CURRENT)
        return fail(err, E_VERSION, -EINVAL,
                    "protocol version %u is not supported; this daemon speaks version %d",
                    h->protocol_version, FORESHOCK__PROTOCOL_VERSION__PROTOCOL_VERSION_CURRENT);
    if (!decode_run_id_valid(h->run_id, lim->max_run_id_len))
        return fail(err, E_MALFORMED, -EINVAL, "run_id must be 1..%u bytes of [A-Za-z0-9._:-]",
                    lim->max_run_id_len);
    if (h->world_size < 1 || h->world_size > lim->max_world_size)
        return fail(err, E_MALFORMED, -EINVAL, "world_size %u outside 1..%u", h->world_size,
                    lim->max_world_size);
    if (h->rank >= h->world_size)
        return fail(err, E_MALFORMED, -EINVAL, "rank %u is not below world_size %u", h->rank,
                    h->world_size);
    if (h->token && strlen(h->token) > lim->max_token_len)
        return fail(err, E_MALFORMED, -EINVAL, "token longer than %u bytes", lim->max_token_len);
    if (h->client_name && strlen(h->client_name) > FS_MAX_CLIENT_NAME_LEN)
        return fail(err, E_MALFORMED, -EINVAL, "client_name longer than %u bytes",
                    FS_MAX_CLIENT_NAME_LEN);
    /* A local group names ranks of this job, this one among them: a
     * group without it is a global/local rank mix-up, not a topology. */
    if (h->n_local_ranks > FS_MAX_LOCAL_RANKS)
        return fail(err, E_MALFORMED, -EINVAL, "local_ranks: more than %u values",
                    FS_MAX_LOCAL_RANKS);
    int self = h->n_local_ranks == 0;
    for (size_t i = 0; i < h->n_local_ranks; i++) {
        if (h->local_ranks[i] >= h->world_size)
            return fail(err, E_MALFORMED, -EINVAL,
                        "local_ranks[%zu] = %u is not below world_size %u", i, h->local_ranks[i],
                        h->world_size);
        self |= h->local_ranks[i] == h->rank;
    }
    if (!self)
        return fail(err, E_MALFORMED, -EINVAL, "local_ranks does not include rank %u itself",
                    h->rank);
    int rc;
    if (h->model && (rc = check_model_shape(h->model, lim, err)) < 0)
        return rc;
    if (h->has_resume_step && h->resume_step > INT64_MAX) /* SQLite integers */
        return fail(err, E_MALFORMED, -EINVAL, "resume_step must be below 2^63");
    return 0;
}

int decode_check_report(const Foreshock__Report *r, const struct decode_limits *lim,
                        struct decode_info *info, struct fs_err *err)
{
    if (r->seq < 1)
        return fail(err, E_MALFORMED, -EINVAL, "report seq must be >= 1");
    /* SQLite integers are signed 64-bit. */
    if (r->seq > INT64_MAX || r->step > INT64_MAX)
        return fail(err, E_MALFORMED, -EINVAL, "report seq and step must be below 2^63");
    if (r->has_time_unix && !is_finite(r->time_unix))
        return fail(err, E_MALFORMED, -EINVAL, "report time_unix must be finite");
    if (r->n_attention > lim->max_attention_per_report)
        return fail(err, E_LIMIT, -EINVAL, "report has %zu attention sketches, limit %u",
                    r->n_attention, lim->max_attention_per_report);
    if (r->n_router_gram > lim->max_router_per_report ||
        r->n_router_tokens > lim->max_router_per_report)
        return fail(err, E_LIMIT, -EINVAL, "report has more than %u router sketches",
                    lim->max_router_per_report);
    int rc;
    if (r->scalars && (rc = check_scalars(r->scalars, lim, info, err)) < 0)
        return rc;
    for (size_t i = 0; i < r->n_attention; i++)
        if ((rc = check_attention(r->attention[i], i, lim, info, err)) < 0)
            return rc;
    for (size_t i = 0; i < r->n_router_gram; i++)
        if ((rc = check_router_gram(r->router_gram[i], i, lim, info, err)) < 0)
            return rc;
    for (size_t i = 0; i < r->n_router_tokens; i++)
        if ((rc = check_router_tokens(r->router_tokens[i], i, lim, err)) < 0)
            return rc;
    info->sketches = (uint32_t)(r->n_attention + r->n_router_gram + r->n_router_tokens);
    return 0;
}

int decode_frame(const uint8_t *body, size_t len, const struct decode_limits *lim,
                 Foreshock__Frame **out, struct decode_info *info, struct fs_err *err)
{
    struct decode_info local;
    if (!info)
        info = &local;
    memset(info, 0, sizeof(*info));
    *out = NULL;
    if (len == 0 || len > lim->max_frame_bytes)
        return fail(err, E_TOO_LARGE, -EMSGSIZE, "frame length %zu outside 1..%u", len,
                    lim->max_frame_bytes);
    size_t sketches = (size_t)lim->max_attention_per_report + 2u * lim->max_router_per_report;
    if (sketches > len / FS_DECODE_MIN_SKETCH_WIRE)
        sketches = len / FS_DECODE_MIN_SKETCH_WIRE;
    struct cap_state st = {.cap = (size_t)FS_DECODE_ALLOC_FACTOR * len + FS_DECODE_ALLOC_SLACK +
                                  sketches * FS_DECODE_SKETCH_STRUCT_BYTES};
    ProtobufCAllocator alloc = {.alloc = cap_alloc, .free = cap_free, .allocator_data = &st};
    Foreshock__Frame *f = foreshock__frame__unpack(&alloc, len, body);
    info->alloc_bytes = st.used;
    if (!f) {
        if (st.exceeded)
            return fail(err, E_LIMIT, -E2BIG,
                        "frame of %zu bytes would take more than %zu bytes to decode", len, st.cap);
        return fail(err, E_MALFORMED, -EINVAL, "frame of %zu bytes does not decode", len);
    }
    int rc = 0;
    switch (f->body_case) {
    case FORESHOCK__FRAME__BODY_HELLO:
        /* protobuf-c hands strings over NUL-terminated: "run\0/../x" would
         * read as "run" and a token "secret\0junk" as "secret". Packed again,
         * such a Hello comes out shorter than it arrived, so a size
         * mismatch refuses it (and any non-canonical Hello with it). */
        if (foreshock__frame__get_packed_size(f) != len)
            rc = fail(err, E_MALFORMED, -EINVAL,
                      "Hello holds a string with a NUL byte (or is not canonically encoded)");
        else
            rc = decode_check_hello(f->hello, lim, err);
        break;
    case FORESHOCK__FRAME__BODY_REPORT:
        rc = decode_check_report(f->report, lim, info, err);
        break;
    case FORESHOCK__FRAME__BODY_ADVICE_ACK:
        if (f->advice_ack->n_advice_id > FS_MAX_ADVICE_ACK_IDS)
            rc = fail(err, E_LIMIT, -EINVAL, "AdviceAck holds %zu ids, limit %u",
                      f->advice_ack->n_advice_id, FS_MAX_ADVICE_ACK_IDS);
        break;
    case FORESHOCK__FRAME__BODY_WELCOME:
    case FORESHOCK__FRAME__BODY_ACK:
    case FORESHOCK__FRAME__BODY_ERROR:
    case FORESHOCK__FRAME__BODY_BYE:
    case FORESHOCK__FRAME__BODY_ADVICE:
        break;
    default:
        rc = fail(err, E_MALFORMED, -EINVAL, "frame has no body");
        break;
    }
    if (rc < 0) {
        decode_frame_free(f);
        return rc;
    }
    *out = f;
    return 0;
}

void decode_frame_free(Foreshock__Frame *f)
{
    if (f)
        foreshock__frame__free_unpacked(f, NULL);
}

int decode_encode(const Foreshock__Frame *f, uint8_t **out, size_t *outlen)
{
    size_t n = foreshock__frame__get_packed_size(f);
    if (n > UINT32_MAX)
        return -EMSGSIZE;
    uint8_t *buf = malloc(DECODE_PREFIX_BYTES + n);
    if (!buf)
        return -ENOMEM;
    buf[0] = (uint8_t)(n >> 24);
    buf[1] = (uint8_t)(n >> 16);
    buf[2] = (uint8_t)(n >> 8);
    buf[3] = (uint8_t)n;
    foreshock__frame__pack(f, buf + DECODE_PREFIX_BYTES);
    *out = buf;
    *outlen = DECODE_PREFIX_BYTES + n;
    return 0;
}

int decode_encode_error(int code, const char *message, uint64_t seq, uint8_t **out, size_t *outlen)
{
    Foreshock__Error e = FORESHOCK__ERROR__INIT;
    e.code = (Foreshock__ErrorCode)code;
    e.message = (char *)message;
    e.has_seq = seq > 0;
    e.seq = seq;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_ERROR;
    f.error = &e;
    return decode_encode(&f, out, outlen);
}

/* --- reading a seq from bytes that do not decode ------------------------------ */

/* Reads a varint at *p (< end); advances *p. 0 or -1 (truncated or longer
 * than 10 bytes). */
static int wire_varint(const uint8_t **p, const uint8_t *end, uint64_t *v)
{
    uint64_t x = 0;
    for (unsigned shift = 0; shift < 70 && *p < end; shift += 7) {
        uint8_t b = *(*p)++;
        x |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *v = x;
            return 0;
        }
    }
    return -1;
}

/* Skips the value of a field of this wire type. 0 or -1. */
static int wire_skip(const uint8_t **p, const uint8_t *end, unsigned type)
{
    uint64_t n;
    switch (type) {
    case 0: /* varint */
        return wire_varint(p, end, &n);
    case 1: /* 64-bit */
        n = 8;
        break;
    case 2: /* length-delimited */
        if (wire_varint(p, end, &n) < 0)
            return -1;
        break;
    case 5: /* 32-bit */
        n = 4;
        break;
    default:
        return -1; /* groups are not in our protocol */
    }
    if (n > (uint64_t)(end - *p))
        return -1;
    *p += n;
    return 0;
}

/* Finds the first field `want` of wire type `type` in [p, end): *at is its
 * value (for type 2, the bytes; *n their count; for type 0 *n the value). */
static int wire_find(const uint8_t *p, const uint8_t *end, unsigned want, unsigned type,
                     const uint8_t **at, uint64_t *n)
{
    while (p < end) {
        uint64_t key;
        if (wire_varint(&p, end, &key) < 0)
            return -1;
        unsigned ftype = (unsigned)(key & 7);
        if (key >> 3 == want && ftype == type) {
            if (type == 0)
                return wire_varint(&p, end, n);
            if (type != 2 || wire_varint(&p, end, n) < 0 || *n > (uint64_t)(end - p))
                return -1;
            *at = p;
            return 0;
        }
        if (wire_skip(&p, end, ftype) < 0)
            return -1;
    }
    return -1;
}

int decode_peek_report_seq(const uint8_t *body, size_t len, uint64_t *seq)
{
    const uint8_t *rep;
    uint64_t n, s;
    if (wire_find(body, body + len, FORESHOCK__FRAME__BODY_REPORT, 2, &rep, &n) < 0 ||
        wire_find(rep, rep + n, 1, 0, NULL, &s) < 0 || s < 1)
        return -ENOENT;
    *seq = s;
    return 0;
}
