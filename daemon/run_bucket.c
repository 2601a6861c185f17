/* The run registry's per-step buckets: groups keyed by (kind, layer, head,
 * window) in an open-addressing index, shards and rank contributions
 * summed into them, readiness and taking in step order. See run.h. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "fs_grow.h"
#include "run_internal.h"

static void group_free(struct run_registry *reg, struct run_group *g)
{
    if (!g)
        return;
    if (reg)
        reg->bytes -= g->bytes;
    free(g->seen);
    free(g->a);
    free(g->b);
    free(g->load);
    free(g->sum_p);
    free(g);
}

static void bucket_free(struct run_bucket *b)
{
    if (!b)
        return;
    for (size_t i = 0; i < b->n; i++)
        group_free(b->reg, b->groups[i]);
    if (b->reg)
        b->reg->bytes -= b->bytes;
    free(b->groups);
    fs_index_free(&b->index);
    free(b->windows);
    free(b->incomplete);
    free(b);
}

void run_bucket_free(struct run_bucket *b)
{
    bucket_free(b);
}

/* --- buckets and groups -------------------------------------------------------------- */

/* layer < 2^12, head < 2^10, window <= 2^20 (fs_limits.h): disjoint bit ranges. */
static uint64_t group_key(enum run_group_kind kind, uint32_t layer, uint32_t head, uint32_t window)
{
    return ((uint64_t)kind << 60) | ((uint64_t)layer << 40) | ((uint64_t)head << 22) | window;
}

#define RUN_INDEX_MIN_SLOTS 64u /* slots of a bucket's first index */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static uint64_t key_of(const struct run_group *g)
{
    return group_key(g->kind, g->layer, g->head, g->window);
}

static uint64_t group_hash(const void *owner, size_t pos)
{
    return mix64(key_of(((const struct run_bucket *)owner)->groups[pos]));
}

static struct run_group *bucket_find(const struct run_bucket *b, uint64_t key)
{
    uint32_t at;
    for (size_t j = fs_index_start(&b->index, mix64(key)); (at = fs_index_at(&b->index, j));
         j = fs_index_next(&b->index, j)) {
        struct run_group *g = b->groups[at - 1];
        if (key_of(g) == key)
            return g;
    }
    return NULL;
}

static int bucket_insert(struct run_bucket *b, struct run_group *g)
{
    if (fs_index_reserve(&b->index, b->n, RUN_INDEX_MIN_SLOTS, group_hash, b) < 0)
        return -ENOMEM;
    struct run_group **p = fs_grow(b->groups, &b->cap, b->n + 1, sizeof(*p), 64);
    if (!p)
        return -ENOMEM;
    b->groups = p;
    b->groups[b->n] = g;
    fs_index_add(&b->index, group_hash(b, b->n), b->n);
    b->n++;
    return 0;
}

static int bucket_count_window(struct run_bucket *b, uint32_t window)
{
    for (size_t i = 0; i < b->n_windows; i++) {
        if (b->windows[i].window == window) {
            b->windows[i].count++;
            return 0;
        }
    }
    struct run_window_count *p = realloc(b->windows, (b->n_windows + 1) * sizeof(*p));
    if (!p)
        return -ENOMEM;
    b->windows = p;
    b->windows[b->n_windows++] = (struct run_window_count){.window = window, .count = 1};
    return 0;
}

/* The run's bucket for step, created in step order; NULL on -ENOMEM or at
 * the per-run bound (*limit set). */
static struct run_bucket *bucket_get(struct run_registry *reg, struct run *run, uint64_t step,
                                     double now, int *limit)
{
    struct run_bucket **pp = &run->buckets;
    while (*pp && (*pp)->step < step)
        pp = &(*pp)->next;
    if (*pp && (*pp)->step == step)
        return *pp;
    if (run->n_buckets >= RUN_MAX_BUCKETS_PER_RUN) {
        *limit = 1;
        return NULL;
    }
    struct run_bucket *b = calloc(1, sizeof(*b));
    if (!b)
        return NULL;
    b->reg = reg;
    b->run_id = run->run_id;
    b->step = step;
    b->first_seen = now;
    b->bytes = sizeof(*b);
    reg->bytes += b->bytes;
    b->next = *pp;
    *pp = b;
    run->n_buckets++;
    return b;
}

/* A new group with `bits` bits of seen-bitmap; the registry is charged
 * before the allocation is attempted, so the bound is checked first. */
static struct run_group *group_new(struct run_registry *reg, struct run_bucket *b,
                                   enum run_group_kind kind, uint32_t layer, uint32_t head,
                                   uint32_t window, uint32_t size, uint32_t bits, size_t tri,
                                   double now)
{
    struct run_group *g = malloc(sizeof(*g));
    if (!g)
        return NULL;
    size_t seen_bytes = ((size_t)bits + 7) / 8;
    *g = (struct run_group){.kind = kind,
                            .layer = layer,
                            .head = head,
                            .window = window,
                            .kv_head = head,
                            .size = size,
                            .first_seen = now,
                            .seen_bits = bits,
                            .bytes = sizeof(*g) + seen_bytes};
    if (bits && !(g->seen = calloc(seen_bytes ? seen_bytes : 1, 1)))
        goto fail;
    if (kind == RUN_GROUP_ATTENTION && tri) {
        g->bytes += 2 * tri * sizeof(double);
        if (!(g->a = calloc(tri, sizeof(double))) || !(g->b = calloc(tri, sizeof(double))))
            goto fail;
    } else if (kind == RUN_GROUP_ROUTER_GRAM) {
        g->bytes += tri * sizeof(double);
        if (!(g->a = calloc(tri, sizeof(double))))
            goto fail;
    } else if (kind == RUN_GROUP_ROUTER_TOKENS) {
        g->bytes += (size_t)size * (sizeof(uint64_t) + sizeof(double));
        if (!(g->load = calloc(size, sizeof(uint64_t))) ||
            !(g->sum_p = calloc(size, sizeof(double))))
            goto fail;
    }
    if (bucket_insert(b, g) < 0)
        goto fail;
    reg->bytes += g->bytes;
    return g;
fail:
    group_free(NULL, g);
    return NULL;
}

static bool bit_test_set(struct run_group *g, uint32_t i)
{
    uint8_t m = (uint8_t)(1u << (i & 7));
    bool was = (g->seen[i >> 3] & m) != 0;
    g->seen[i >> 3] |= m;
    return was;
}

static int add_attention(struct run_registry *reg, struct run_bucket *b,
                         const Foreshock__AttentionSketch *a, double now, struct run_add_stats *st)
{
    uint64_t key = group_key(RUN_GROUP_ATTENTION, a->layer, a->head, a->window);
    struct run_group *g = bucket_find(b, key);
    if (a->kind_case == FORESHOCK__ATTENTION_SKETCH__KIND_SPECTRUM) {
        if (g) {
            st->duplicates++;
            return 0;
        }
        const Foreshock__SpectrumSketch *s = a->spectrum;
        /* dh from the longest spectrum sent: d2/d1 carry 2dh, d3/w dh. */
        size_t dh = (s->n_d2 + 1) / 2;
        if ((s->n_d1 + 1) / 2 > dh)
            dh = (s->n_d1 + 1) / 2;
        if (s->n_d3 > dh)
            dh = s->n_d3;
        if (s->n_w > dh)
            dh = s->n_w;
        if (dh == 0)
            dh = 1;
        g = group_new(reg, b, RUN_GROUP_ATTENTION, a->layer, a->head, a->window, (uint32_t)dh, 0, 0,
                      now);
        if (!g)
            return -ENOMEM;
        g->spectrum = true;
        g->kv_head = a->has_kv_head ? a->kv_head : a->head;
        g->have = g->want = 1;
        struct qk_spectra_in in = {.dh = (unsigned)dh,
                                   .d2 = s->d2,
                                   .n_d2 = s->n_d2,
                                   .d1 = s->d1,
                                   .n_d1 = s->n_d1,
                                   .d3 = s->d3,
                                   .n_d3 = s->n_d3,
                                   .w = s->w,
                                   .n_w = s->n_w,
                                   .has_norms = s->has_q_delta_sq && s->has_q_sq && s->has_k_sq &&
                                                s->has_k_delta_sq,
                                   .q_delta_sq = s->q_delta_sq,
                                   .q_sq = s->q_sq,
                                   .k_sq = s->k_sq,
                                   .k_delta_sq = s->k_delta_sq,
                                   .has_cqk = s->has_cqk,
                                   .cqk = s->cqk};
        /* O(dh) scalars, no LAPACK: cheap enough for the loop thread. */
        g->res.rc = qk_head_from_spectra(&in, &g->res.qk);
        g->res.done = true;
        if (g->res.qk.nonfinite)
            st->nonfinite_spectra++;
        st->groups_new++;
        st->pieces++;
        return bucket_count_window(b, a->window);
    }
    const Foreshock__GramSketch *gs = a->gram;
    uint32_t count = gs->has_shard_count ? gs->shard_count : 1;
    uint32_t index = gs->has_shard_index ? gs->shard_index : 0;
    size_t n = 2u * (size_t)gs->dh;
    if (!g) {
        g = group_new(reg, b, RUN_GROUP_ATTENTION, a->layer, a->head, a->window, gs->dh, count,
                      monitor_tri_len(n), now);
        if (!g)
            return -ENOMEM;
        g->want = count;
        g->kv_head = a->has_kv_head ? a->kv_head : a->head;
        st->groups_new++;
        if (bucket_count_window(b, a->window) < 0)
            return -ENOMEM;
    } else if (g->spectrum || g->size != gs->dh || g->want != count) {
        st->mismatched++;
        return 0;
    }
    if (index >= g->seen_bits || bit_test_set(g, index)) {
        st->duplicates++;
        return 0;
    }
    /* Sizes were checked by decode_check_report; a failure here is a bug. */
    if (monitor_tri_accumulate(g->a, n, gs->ga.data, gs->ga.len) < 0 ||
        monitor_tri_accumulate(g->b, n, gs->gb.data, gs->gb.len) < 0) {
        st->mismatched++;
        return 0;
    }
    g->have++;
    st->pieces++;
    return 0;
}

static int add_router_gram(struct run_registry *reg, struct run_bucket *b,
                           const Foreshock__RouterGram *rg, double now, struct run_add_stats *st)
{
    uint64_t key = group_key(RUN_GROUP_ROUTER_GRAM, rg->layer, 0, 0);
    struct run_group *g = bucket_find(b, key);
    uint32_t count = rg->has_shard_count ? rg->shard_count : 1;
    uint32_t index = rg->has_shard_index ? rg->shard_index : 0;
    if (!g) {
        g = group_new(reg, b, RUN_GROUP_ROUTER_GRAM, rg->layer, 0, 0, rg->n_experts, count,
                      monitor_tri_len(rg->n_experts), now);
        if (!g)
            return -ENOMEM;
        g->want = count;
        st->groups_new++;
    } else if (g->size != rg->n_experts || g->want != count) {
        st->mismatched++;
        return 0;
    }
    if (index >= g->seen_bits || bit_test_set(g, index)) {
        st->duplicates++;
        return 0;
    }
    if (monitor_tri_accumulate(g->a, rg->n_experts, rg->gram.data, rg->gram.len) < 0) {
        st->mismatched++;
        return 0;
    }
    g->have++;
    st->pieces++;
    return 0;
}

static int add_router_tokens(struct run_registry *reg, struct run *run, struct run_bucket *b,
                             const Foreshock__RouterTokens *t, uint32_t rank, double now,
                             struct run_add_stats *st)
{
    uint64_t key = group_key(RUN_GROUP_ROUTER_TOKENS, t->layer, 0, 0);
    struct run_group *g = bucket_find(b, key);
    if (!g) {
        uint32_t bits = run->world_size > rank ? run->world_size : rank + 1;
        g = group_new(reg, b, RUN_GROUP_ROUTER_TOKENS, t->layer, 0, 0, t->n_experts, bits, 0, now);
        if (!g)
            return -ENOMEM;
        st->groups_new++;
    } else if (g->size != t->n_experts) {
        st->mismatched++;
        return 0;
    }
    if (rank >= g->seen_bits) {
        st->mismatched++; /* a rank beyond the world size the group was sized for */
        return 0;
    }
    if (bit_test_set(g, rank)) {
        st->duplicates++;
        return 0;
    }
    g->n_tok += t->n_tok;
    g->sum_h += t->sum_h;
    g->sum_h2 += t->sum_h2;
    g->sum_lse2 += t->sum_lse2;
    for (uint32_t e = 0; e < t->n_experts; e++) {
        g->load[e] += t->load[e];
        g->sum_p[e] += t->sum_p[e];
    }
    g->have++;
    st->pieces++;
    return 0;
}

int run_add(struct run_registry *reg, struct run *run, uint64_t step, double time, uint32_t rank,
            const Foreshock__Report *r, double now, struct run_add_stats *st)
{
    struct run_add_stats local;
    if (!st)
        st = &local;
    memset(st, 0, sizeof(*st));
    size_t pieces = r->n_attention + r->n_router_gram + r->n_router_tokens;
    if (!pieces)
        return 0;
    if (run->done_step >= 0 && step <= (uint64_t)run->done_step) {
        st->late = (uint32_t)pieces;
        return 0;
    }
    int limit = 0;
    struct run_bucket *b = bucket_get(reg, run, step, now, &limit);
    if (!b) {
        if (limit) {
            st->limit = (uint32_t)pieces;
            return 0;
        }
        return -ENOMEM;
    }
    if (time > b->time)
        b->time = time;
    int rc = 0;
    for (size_t i = 0; i < r->n_attention && rc == 0; i++)
        rc = add_attention(reg, b, r->attention[i], now, st);
    for (size_t i = 0; i < r->n_router_gram && rc == 0; i++)
        rc = add_router_gram(reg, b, r->router_gram[i], now, st);
    for (size_t i = 0; i < r->n_router_tokens && rc == 0; i++)
        rc = add_router_tokens(reg, run, b, r->router_tokens[i], rank, now, st);
    return rc;
}

/* --- readiness ---------------------------------------------------------------------- */

static uint32_t group_want(const struct run *run, const struct run_group *g)
{
    return g->kind == RUN_GROUP_ROUTER_TOKENS ? run_tokens_want(run, g->layer) : g->want;
}

static bool group_complete(const struct run *run, const struct run_group *g)
{
    return g->have >= group_want(run, g);
}

static bool expected_present(const struct run *run, const struct run_bucket *b)
{
    if (!run->n_layers || !run->n_heads)
        return true;
    uint64_t want = (uint64_t)run->n_layers * run->n_heads;
    for (size_t i = 0; i < b->n_windows; i++)
        if (b->windows[i].count < want)
            return false;
    return true;
}

static bool bucket_ready(const struct run_registry *reg, const struct run *run,
                         const struct run_bucket *b, double now)
{
    double t = reg->lim.timeout_s;
    for (size_t i = 0; i < b->n; i++) {
        const struct run_group *g = b->groups[i];
        if (!group_complete(run, g) && now < g->first_seen + t)
            return false;
    }
    return expected_present(run, b) || now >= b->first_seen + t;
}

static int add_incomplete(struct run_bucket *b, const struct run_incomplete *rec)
{
    struct run_incomplete *p = realloc(b->incomplete, (b->n_incomplete + 1) * sizeof(*p));
    if (!p)
        return -ENOMEM;
    b->incomplete = p;
    b->incomplete[b->n_incomplete++] = *rec;
    return 0;
}

/* Records missing expected attention groups, then drops incomplete groups
 * (recording them); fixes want of token groups. */
static void bucket_settle(struct run_registry *reg, const struct run *run, struct run_bucket *b)
{
    unsigned missing = 0;
    for (size_t w = 0; w < b->n_windows && run->n_layers && run->n_heads; w++) {
        uint32_t window = b->windows[w].window;
        if (b->windows[w].count >= (uint64_t)run->n_layers * run->n_heads)
            continue;
        for (uint32_t l = 0; l < run->n_layers && l < FS_MAX_LAYERS; l++) {
            for (uint32_t h = 0; h < run->n_heads && h < FS_MAX_HEADS; h++) {
                if (missing >= RUN_MAX_MISSING_RECORDS ||
                    bucket_find(b, group_key(RUN_GROUP_ATTENTION, l, h, window)))
                    continue;
                struct run_incomplete rec = {.kind = RUN_GROUP_ATTENTION,
                                             .layer = l,
                                             .head = (int32_t)h,
                                             .window = window,
                                             .have = 0,
                                             .want = 1};
                (void)add_incomplete(b, &rec);
                missing++;
            }
        }
    }
    size_t k = 0;
    for (size_t i = 0; i < b->n; i++) {
        struct run_group *g = b->groups[i];
        g->want = group_want(run, g);
        if (g->have >= g->want) {
            b->groups[k++] = g;
            continue;
        }
        struct run_incomplete rec = {.kind = g->kind,
                                     .layer = g->layer,
                                     .head = g->kind == RUN_GROUP_ATTENTION ? (int32_t)g->head : -1,
                                     .window = g->kind == RUN_GROUP_ATTENTION ? g->window : 0,
                                     .have = g->have,
                                     .want = g->want};
        (void)add_incomplete(b, &rec); /* out of memory: the record is lost, the drop is not */
        group_free(reg, g);
    }
    if (k != b->n) {
        b->n = k;
        if (fs_index_rebuild(&b->index, b->index.nslots, b->n, group_hash, b) < 0)
            fs_index_free(&b->index); /* no index beats one naming freed groups */
    }
}

static struct run_bucket *take_front(struct run_registry *reg, struct run *run)
{
    struct run_bucket *b = run->buckets;
    run->buckets = b->next;
    b->next = NULL;
    run->n_buckets--;
    run->done_step = (int64_t)b->step;
    bucket_settle(reg, run, b);
    return b;
}

struct run_bucket *run_take_ready(struct run_registry *reg, struct run *run, double now)
{
    struct run_bucket *b = run->buckets;
    if (!b || !bucket_ready(reg, run, b, now))
        return NULL;
    return take_front(reg, run);
}

struct run_bucket *run_take_front(struct run_registry *reg, struct run *run)
{
    return run->buckets ? take_front(reg, run) : NULL;
}

size_t run_drop_after(struct run *run, uint64_t step)
{
    size_t n = 0;
    struct run_bucket **p = &run->buckets;
    while (*p && (*p)->step <= step)
        p = &(*p)->next;
    while (*p) { /* ascending: everything from here on is after step */
        struct run_bucket *b = *p;
        *p = b->next;
        run->n_buckets--;
        bucket_free(b);
        n++;
    }
    if (run->done_step > (int64_t)step)
        run->done_step = (int64_t)step;
    return n;
}

const char *run_group_kind_name(enum run_group_kind k)
{
    switch (k) {
    case RUN_GROUP_ATTENTION:
        return "attention";
    case RUN_GROUP_ROUTER_GRAM:
        return "router_gram";
    case RUN_GROUP_ROUTER_TOKENS:
        return "router_tokens";
    }
    return "unknown";
}
