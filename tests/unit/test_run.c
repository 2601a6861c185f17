/* The run registry (daemon/run.c): shard and rank reduction, completeness,
 * duplicates, timeouts into incomplete records, step order, memory
 * accounting, resend dedup. Pure: reports are built in memory. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fstest.h"
#include "ranks.h"
#include "run.h"

#define T_TIMEOUT 10.0
#define T_MAX_N 64 /* 2*dh in these tests */

/* --- building reports -------------------------------------------------------------- */

struct t_report {
    Foreshock__Report r;
    Foreshock__AttentionSketch *att[8];
    Foreshock__AttentionSketch att_s[8];
    Foreshock__GramSketch gram[8];
    Foreshock__SpectrumSketch spec[8];
    Foreshock__RouterGram *rg[4];
    Foreshock__RouterGram rg_s[4];
    Foreshock__RouterTokens *rt[4];
    Foreshock__RouterTokens rt_s[4];
    float bufs[8][2][T_MAX_N * (T_MAX_N + 1) / 2];
    float rgbuf[4][64 * 65 / 2];
    uint64_t load[4][64];
    double sum_p[4][64];
    float spec_d2[8][4];
};

static void report_init(struct t_report *t, uint64_t seq, uint64_t step)
{
    memset(t, 0, sizeof(*t));
    foreshock__report__init(&t->r);
    t->r.seq = seq;
    t->r.step = step;
    t->r.attention = t->att;
    t->r.router_gram = t->rg;
    t->r.router_tokens = t->rt;
}

/* Adds a Gram shard whose triangles are copied from ga / gb (n(n+1)/2 floats). */
static void add_gram(struct t_report *t, uint32_t layer, uint32_t head, uint32_t window,
                     uint32_t dh, uint32_t shard, uint32_t shards, const float *ga, const float *gb)
{
    size_t i = t->r.n_attention++, len = monitor_tri_len(2 * dh);
    Foreshock__AttentionSketch *a = &t->att_s[i];
    Foreshock__GramSketch *g = &t->gram[i];
    foreshock__attention_sketch__init(a);
    foreshock__gram_sketch__init(g);
    a->layer = layer;
    a->head = head;
    a->window = window;
    a->kind_case = FORESHOCK__ATTENTION_SKETCH__KIND_GRAM;
    a->gram = g;
    g->dh = dh;
    g->has_shard_index = g->has_shard_count = 1;
    g->shard_index = shard;
    g->shard_count = shards;
    memcpy(t->bufs[i][0], ga, len * sizeof(float));
    memcpy(t->bufs[i][1], gb, len * sizeof(float));
    g->ga.data = (uint8_t *)t->bufs[i][0];
    g->ga.len = len * sizeof(float);
    g->gb.data = (uint8_t *)t->bufs[i][1];
    g->gb.len = len * sizeof(float);
    t->att[i] = a;
}

static void add_ones(struct t_report *t, uint32_t layer, uint32_t head, uint32_t dh, uint32_t shard,
                     uint32_t shards)
{
    static float ones[T_MAX_N * (T_MAX_N + 1) / 2];
    for (size_t i = 0; i < sizeof(ones) / sizeof(ones[0]); i++)
        ones[i] = 1.0f;
    add_gram(t, layer, head, 1, dh, shard, shards, ones, ones);
}

static void add_spectrum(struct t_report *t, uint32_t layer, uint32_t head)
{
    size_t i = t->r.n_attention++;
    Foreshock__AttentionSketch *a = &t->att_s[i];
    Foreshock__SpectrumSketch *s = &t->spec[i];
    foreshock__attention_sketch__init(a);
    foreshock__spectrum_sketch__init(s);
    a->layer = layer;
    a->head = head;
    a->window = 1;
    a->kind_case = FORESHOCK__ATTENTION_SKETCH__KIND_SPECTRUM;
    a->spectrum = s;
    for (int k = 0; k < 4; k++)
        t->spec_d2[i][k] = (float)(4 - k);
    s->d2 = t->spec_d2[i];
    s->n_d2 = 4;
    t->att[i] = a;
}

static void add_tokens(struct t_report *t, uint32_t layer, uint32_t e, uint64_t n_tok)
{
    size_t i = t->r.n_router_tokens++;
    Foreshock__RouterTokens *x = &t->rt_s[i];
    foreshock__router_tokens__init(x);
    x->layer = layer;
    x->n_experts = e;
    x->n_tok = n_tok;
    x->sum_h = 1.5 * (double)n_tok;
    x->sum_h2 = 2.5 * (double)n_tok;
    x->sum_lse2 = 0.5 * (double)n_tok;
    for (uint32_t k = 0; k < e; k++) {
        t->load[i][k] = n_tok / e;
        t->sum_p[i][k] = (double)n_tok / e;
    }
    x->load = t->load[i];
    x->n_load = e;
    x->sum_p = t->sum_p[i];
    x->n_sum_p = e;
    t->rt[i] = x;
}

static void add_router_gram(struct t_report *t, uint32_t layer, uint32_t e, uint32_t shard,
                            uint32_t shards)
{
    size_t i = t->r.n_router_gram++;
    Foreshock__RouterGram *g = &t->rg_s[i];
    foreshock__router_gram__init(g);
    g->layer = layer;
    g->n_experts = e;
    g->has_shard_index = g->has_shard_count = 1;
    g->shard_index = shard;
    g->shard_count = shards;
    for (size_t k = 0; k < monitor_tri_len(e); k++)
        t->rgbuf[i][k] = (float)(k + 1);
    g->gram.data = (uint8_t *)t->rgbuf[i];
    g->gram.len = monitor_tri_len(e) * sizeof(float);
    t->rg[i] = g;
}

struct fixture {
    struct run_registry *reg;
    struct run *run;
};

static void fx_init(struct fixture *fx, uint32_t world, uint64_t max_bytes)
{
    struct run_limits lim = {.timeout_s = T_TIMEOUT, .max_bytes = max_bytes};
    cr_assert_eq(run_registry_create(&lim, &fx->reg), 0);
    cr_assert_eq(run_open(fx->reg, 7, "r", &fx->run), 0);
    struct run_hello h = {.rank = 0, .world_size = world};
    cr_assert_eq(run_hello(fx->run, &h), 0);
}

static void fx_add(struct fixture *fx, struct t_report *t, uint32_t rank, double now,
                   struct run_add_stats *st)
{
    cr_assert_eq(run_add(fx->reg, fx->run, t->r.step, 100.0, rank, &t->r, now, st), 0);
}

/* --- shard sums equal the unsharded Gram --------------------------------------------- */

struct shard_case {
    unsigned dh, d, shards;
};

static const struct shard_case shard_cases[] = {
    {.dh = 4, .d = 16, .shards = 1},  {.dh = 4, .d = 16, .shards = 4},
    {.dh = 8, .d = 24, .shards = 3},  {.dh = 16, .d = 40, .shards = 5},
    {.dh = 32, .d = 64, .shards = 2},
};

Test(run, shard_sums_equal_unsharded_gram)
{
    for (size_t c = 0; c < sizeof(shard_cases) / sizeof(shard_cases[0]); c++) {
        const struct shard_case *sc = &shard_cases[c];
        size_t n = 2 * sc->dh, len = monitor_tri_len(n);
        double *a = malloc(n * sc->d * sizeof(double)), *b = malloc(n * sc->d * sizeof(double));
        double *full_a = malloc(len * sizeof(double)), *full_b = malloc(len * sizeof(double));
        double *part = malloc(len * sizeof(double));
        float *pa = malloc(len * sizeof(float)), *pb = malloc(len * sizeof(float));
        uint64_t seed = 17u + c;
        for (size_t i = 0; i < n * sc->d; i++) {
            a[i] = uniform01(&seed) - 0.5;
            b[i] = uniform01(&seed) - 0.5;
        }
        memset(full_a, 0, len * sizeof(double));
        memset(full_b, 0, len * sizeof(double));
        gram_tri_add(a, n, sc->d, 0, sc->d, full_a);
        gram_tri_add(b, n, sc->d, 0, sc->d, full_b);
        struct fixture fx;
        fx_init(&fx, sc->shards, 1ull << 30);
        for (unsigned s = 0; s < sc->shards; s++) {
            size_t c0 = sc->d * s / sc->shards, c1 = sc->d * (s + 1) / sc->shards;
            memset(part, 0, len * sizeof(double));
            gram_tri_add(a, n, sc->d, c0, c1, part);
            for (size_t k = 0; k < len; k++)
                pa[k] = (float)part[k];
            memset(part, 0, len * sizeof(double));
            gram_tri_add(b, n, sc->d, c0, c1, part);
            for (size_t k = 0; k < len; k++)
                pb[k] = (float)part[k];
            struct t_report *t = malloc(sizeof(*t));
            report_init(t, s + 1, 3);
            add_gram(t, 0, 0, 1, sc->dh, s, sc->shards, pa, pb);
            fx_add(&fx, t, s, 0.0, NULL);
            free(t);
            /* complete exactly when the last shard arrived */
            struct run_bucket *bk = run_take_ready(fx.reg, fx.run, 0.0);
            if (s + 1 < sc->shards) {
                cr_assert_null(bk, "case %zu: ready after %u of %u shards", c, s + 1, sc->shards);
                continue;
            }
            cr_assert_not_null(bk, "case %zu: not ready after all shards", c);
            cr_assert_eq(bk->n, 1);
            cr_assert_eq(bk->n_incomplete, 0);
            const struct run_group *g = bk->groups[0];
            cr_assert_eq(g->have, sc->shards);
            /* float32 partial Grams summed in double: relative error ~1e-7 of
             * the entry scale (|entries| <= d/4). */
            for (size_t k = 0; k < len; k++) {
                cr_assert(fabs(g->a[k] - full_a[k]) <= 1e-6 * sc->d, "case %zu ga[%zu] %g vs %g", c,
                          k, g->a[k], full_a[k]);
                cr_assert(fabs(g->b[k] - full_b[k]) <= 1e-6 * sc->d, "case %zu gb[%zu]", c, k);
            }
            run_bucket_free(bk);
        }
        cr_expect_eq(run_registry_bytes(fx.reg), 0);
        run_registry_destroy(fx.reg);
        free(a), free(b), free(full_a), free(full_b), free(part), free(pa), free(pb);
    }
}

/* --- duplicates and mismatches ------------------------------------------------------------ */

Test(run, duplicate_shard_is_ignored)
{
    struct fixture fx;
    fx_init(&fx, 2, 1ull << 30);
    struct t_report *t = malloc(sizeof(*t));
    struct run_add_stats st;
    report_init(t, 1, 0);
    add_ones(t, 0, 0, 2, 0, 2);
    fx_add(&fx, t, 0, 0.0, &st);
    cr_assert_eq(st.pieces, 1);
    fx_add(&fx, t, 0, 0.0, &st); /* the same shard again */
    cr_assert_eq(st.duplicates, 1);
    cr_assert_eq(st.pieces, 0);
    cr_assert_null(run_take_ready(fx.reg, fx.run, 1.0));
    report_init(t, 2, 0);
    add_ones(t, 0, 0, 3, 1, 2); /* other dh: inconsistent */
    fx_add(&fx, t, 1, 0.0, &st);
    cr_assert_eq(st.mismatched, 1);
    report_init(t, 3, 0);
    add_ones(t, 0, 0, 2, 1, 2);
    fx_add(&fx, t, 1, 0.0, &st);
    struct run_bucket *b = run_take_ready(fx.reg, fx.run, 1.0);
    cr_assert_not_null(b);
    cr_assert_eq(b->groups[0]->have, 2);
    cr_assert_float_eq(b->groups[0]->a[0], 2.0, 0.0, "duplicate shard was summed");
    run_bucket_free(b);
    free(t);
    run_registry_destroy(fx.reg);
}

/* --- router tokens: complete by announced ranks or world size ------------------------------- */

struct tokens_case {
    const char *what;
    uint32_t world;
    uint32_t announce_ranks; /* ranks 0..k-1 announce `layer` */
    uint32_t silent_ranks;   /* ranks k..k+s-1 say hello announcing another layer */
    uint32_t layer;
    uint32_t want;
};

static const struct tokens_case tokens_cases[] = {
    {"nothing announced: world size", 4, 0, 0, 1, 4},
    {"two of four announced, the others without the layer", 4, 2, 2, 1, 2},
    {"all announced", 3, 3, 0, 0, 3},
    {"single rank", 1, 0, 0, 0, 1},
    /* the first hello of a restart: the unheard rank may hold the layer */
    {"one of two heard so far", 2, 1, 0, 1, 2},
    {"two heard, one unheard", 4, 1, 1, 2, 3},
};

Test(run, router_tokens_complete_by_announced_ranks_or_world_size)
{
    for (size_t c = 0; c < sizeof(tokens_cases) / sizeof(tokens_cases[0]); c++) {
        const struct tokens_case *tc = &tokens_cases[c];
        struct fixture fx;
        fx_init(&fx, tc->world, 1ull << 30);
        for (uint32_t r = 0; r < tc->announce_ranks; r++) {
            uint32_t layers[1] = {tc->layer};
            struct run_hello h = {
                .rank = r, .world_size = tc->world, .moe_layers = layers, .n_moe_layers = 1};
            cr_assert_eq(run_hello(fx.run, &h), 0);
            /* saying hello again does not count twice */
            cr_assert_eq(run_hello(fx.run, &h), 0);
        }
        for (uint32_t r = tc->announce_ranks; r < tc->announce_ranks + tc->silent_ranks; r++) {
            uint32_t layers[1] = {tc->layer + 100};
            struct run_hello h = {
                .rank = r, .world_size = tc->world, .moe_layers = layers, .n_moe_layers = 1};
            cr_assert_eq(run_hello(fx.run, &h), 0);
        }
        cr_assert_eq(run_tokens_want(fx.run, tc->layer), tc->want, "%s: want %u", tc->what,
                     run_tokens_want(fx.run, tc->layer));
        struct t_report *t = malloc(sizeof(*t));
        for (uint32_t r = 0; r < tc->want; r++) {
            report_init(t, 1, 5);
            add_tokens(t, tc->layer, 4, 100);
            fx_add(&fx, t, r, 0.0, NULL);
            struct run_bucket *b = run_take_ready(fx.reg, fx.run, 0.0);
            if (r + 1 < tc->want) {
                cr_assert_null(b, "%s: ready after %u ranks", tc->what, r + 1);
                continue;
            }
            cr_assert_not_null(b, "%s: not ready", tc->what);
            cr_assert_eq(b->n, 1);
            const struct run_group *g = b->groups[0];
            cr_assert_eq(g->n_tok, 100u * tc->want);
            cr_assert_eq(g->load[0], 25u * tc->want);
            cr_assert_float_eq(g->sum_h, 150.0 * tc->want, 1e-9);
            run_bucket_free(b);
        }
        free(t);
        run_registry_destroy(fx.reg);
    }
}

Test(run, router_tokens_rank_counted_once)
{
    struct fixture fx;
    fx_init(&fx, 2, 1ull << 30);
    struct t_report *t = malloc(sizeof(*t));
    struct run_add_stats st;
    report_init(t, 1, 0);
    add_tokens(t, 0, 4, 10);
    fx_add(&fx, t, 0, 0.0, &st);
    fx_add(&fx, t, 0, 0.0, &st);
    cr_assert_eq(st.duplicates, 1);
    cr_assert_null(run_take_ready(fx.reg, fx.run, 0.0));
    free(t);
    run_registry_destroy(fx.reg);
}

/* --- router tokens: a daemon per node hears its local group ------------------------------ */

struct t_hello {
    uint32_t rank;
    const char *local; /* Hello.local_ranks as ranges, NULL: none */
    int layer;         /* announced MoE layer, -1: none */
};

struct local_case {
    const char *what;
    uint32_t world;
    const char *restored;    /* group reloaded from the database at start, NULL: none */
    struct t_hello hello[6]; /* until rank UINT32_MAX */
    uint32_t want;           /* of layer 1 */
    uint32_t lead;
    const char *local; /* the union, as ranges */
};

#define END                                                                                        \
    {                                                                                              \
        UINT32_MAX, NULL, -1                                                                       \
    }

static const struct local_case local_cases[] = {
    {"ranks 2-3 of 4 declare their node",
     4,
     NULL,
     {{2, "2-3", 1}, {3, "2-3", 1}, END},
     2,
     2,
     "2-3"},
    {"one of the node's ranks still connecting", 4, NULL, {{2, "2-3", 1}, END}, 2, 2, "2-3"},
    {"declared, nothing announced", 4, NULL, {{2, "2-3", -1}, {3, "2-3", -1}, END}, 2, 2, "2-3"},
    {"two nodes' groups on one daemon",
     8,
     NULL,
     {{4, "4-5", 1}, {5, "4-5", 1}, {6, "6-7", 1}, {7, "6-7", 1}, END},
     4,
     4,
     "4-7"},
    {"a rank heard outside the declared group counts",
     4,
     NULL,
     {{2, "2-3", 1}, {3, "2-3", 1}, {0, NULL, 1}, END},
     3,
     2,
     "2-3"},
    {"latest declaration of a rank wins", 4, NULL, {{2, "2-3", 1}, {2, "2", 1}, END}, 1, 2, "2"},
    {"restored at start, no rank back yet", 4, "2-3", {END}, 2, 2, "2-3"},
    {"restored, then the ranks say hello",
     4,
     "2-3",
     {{2, "2-3", 1}, {3, "2-3", 1}, END},
     2,
     2,
     "2-3"},
    /* without a declaration nothing changes: the world is waited for */
    {"undeclared: ranks 2-3 of 4", 4, NULL, {{2, NULL, 1}, {3, NULL, 1}, END}, 4, 0, ""},
};

static void hello_of(struct run *run, uint32_t world, const struct t_hello *th, int expect)
{
    uint32_t *local = NULL;
    size_t n = 0;
    uint32_t layer = (uint32_t)th->layer;
    if (th->local)
        cr_assert_eq(ranks_parse(th->local, world, 4096, &local, &n), 0);
    struct run_hello h = {.rank = th->rank,
                          .world_size = world,
                          .moe_layers = th->layer >= 0 ? &layer : NULL,
                          .n_moe_layers = th->layer >= 0,
                          .local_ranks = local,
                          .n_local_ranks = n};
    int rc = run_hello(run, &h);
    if (expect < 0)
        cr_assert_eq(rc, expect);
    else
        cr_assert_geq(rc, 0);
    free(local);
}

Test(run, router_tokens_reduce_over_the_declared_local_group)
{
    for (size_t c = 0; c < sizeof(local_cases) / sizeof(local_cases[0]); c++) {
        const struct local_case *tc = &local_cases[c];
        struct run_limits lim = {.timeout_s = T_TIMEOUT, .max_bytes = 1ull << 30};
        struct fixture fx;
        cr_assert_eq(run_registry_create(&lim, &fx.reg), 0);
        cr_assert_eq(run_open(fx.reg, 7, "r", &fx.run), 0);
        fx.run->world_size = tc->world;
        if (tc->restored) {
            uint32_t *v;
            size_t n;
            cr_assert_eq(ranks_parse(tc->restored, tc->world, 4096, &v, &n), 0);
            cr_assert_eq(run_restore_local(fx.run, v, n), 0);
            free(v);
        }
        const struct t_hello *heard = tc->hello;
        for (; heard->rank != UINT32_MAX; heard++)
            hello_of(fx.run, tc->world, heard, 0);
        cr_assert_eq(run_tokens_want(fx.run, 1), tc->want, "%s: want %u", tc->what,
                     run_tokens_want(fx.run, 1));
        cr_assert_eq(fx.run->lead_rank, tc->lead, "%s: lead %u", tc->what, fx.run->lead_rank);
        char *text = ranks_format(fx.run->local, fx.run->n_local);
        cr_assert_str_eq(text, tc->local, "%s", tc->what);
        free(text);
        /* The group completes with exactly `want` ranks' tokens: the
         * union's, then those heard outside it, then the rest of the world. */
        uint32_t feed[16], n_feed = 0;
        for (size_t i = 0; i < fx.run->n_local; i++)
            feed[n_feed++] = fx.run->local[i];
        for (heard = tc->hello; heard->rank != UINT32_MAX; heard++)
            if (!ranks_contains(fx.run->local, fx.run->n_local, heard->rank))
                feed[n_feed++] = heard->rank;
        for (uint32_t r = 0; r < tc->world; r++) {
            bool in = false;
            for (uint32_t i = 0; i < n_feed; i++)
                in |= feed[i] == r;
            if (!in)
                feed[n_feed++] = r;
        }
        struct t_report *t = malloc(sizeof(*t));
        for (uint32_t i = 0; i < tc->want; i++) {
            uint32_t rank = feed[i];
            report_init(t, 1, 5);
            add_tokens(t, 1, 4, 100);
            fx_add(&fx, t, rank, 0.0, NULL);
            struct run_bucket *b = run_take_ready(fx.reg, fx.run, 0.0);
            if (i + 1 < tc->want) {
                cr_assert_null(b, "%s: ready after %u ranks", tc->what, i + 1);
                continue;
            }
            cr_assert_not_null(b, "%s: not ready", tc->what);
            cr_assert_eq(b->n, 1);
            cr_assert_eq(b->n_incomplete, 0);
            cr_assert_eq(b->groups[0]->n_tok, 100u * tc->want);
            run_bucket_free(b);
        }
        free(t);
        run_registry_destroy(fx.reg);
    }
}

/* Local groups are bounded and stale ones replaced (issue 22, Critical 4):
 * RUN_MAX_LOCAL_GROUPS one-rank groups (fake ranks) never lock the run's
 * real node group out; the group fewest ranks declare goes first, so a
 * flood of one-rank groups gives up its own, not the real group; a group
 * larger than RUN_MAX_LOCAL_RANKS alone is refused. */
static const struct {
    const char *what;
    uint32_t fakes_before; /* one-rank groups declared before the real group */
    uint32_t fakes_after;  /* ... and after it */
} local_flood_cases[] = {
    {"a full table of one-rank groups", RUN_MAX_LOCAL_GROUPS, 0},
    {"one-rank groups before and after", RUN_MAX_LOCAL_GROUPS, 3 * RUN_MAX_LOCAL_GROUPS},
    {"one-rank groups after only", 0, 4 * RUN_MAX_LOCAL_GROUPS},
};

Test(run, local_groups_are_bounded_and_replaced)
{
    for (size_t k = 0; k < sizeof(local_flood_cases) / sizeof(local_flood_cases[0]); k++) {
        struct run_limits lim = {.timeout_s = T_TIMEOUT, .max_bytes = 1ull << 30};
        struct fixture fx;
        cr_assert_eq(run_registry_create(&lim, &fx.reg), 0);
        cr_assert_eq(run_open(fx.reg, 7, "r", &fx.run), 0);
        char text[32];
        uint32_t world = 4096, fake = 100;
        for (uint32_t g = 0; g < local_flood_cases[k].fakes_before; g++, fake++) {
            snprintf(text, sizeof(text), "%u", fake);
            struct t_hello th = {fake, text, -1};
            hello_of(fx.run, world, &th, 0);
        }
        /* The real node: ranks 0-7, two of them heard. */
        struct t_hello r0 = {0, "0-7", -1}, r1 = {1, "0-7", -1};
        hello_of(fx.run, world, &r0, 0);
        hello_of(fx.run, world, &r1, 0);
        for (uint32_t g = 0; g < local_flood_cases[k].fakes_after; g++, fake++) {
            snprintf(text, sizeof(text), "%u", fake);
            struct t_hello th = {fake, text, -1};
            hello_of(fx.run, world, &th, 0);
        }
        cr_expect_leq(fx.run->n_decls, RUN_MAX_LOCAL_GROUPS, "%s", local_flood_cases[k].what);
        for (uint32_t r = 0; r < 8; r++)
            cr_expect(ranks_contains(fx.run->local, fx.run->n_local, r), "%s: rank %u",
                      local_flood_cases[k].what, r);
        cr_expect_leq(fx.run->n_local, 8 + RUN_MAX_LOCAL_GROUPS, "%s", local_flood_cases[k].what);
        run_registry_destroy(fx.reg);
    }
    /* One group larger than RUN_MAX_LOCAL_RANKS: refused, nothing applied. */
    struct run_limits lim = {.timeout_s = T_TIMEOUT, .max_bytes = 1ull << 30};
    struct fixture fx;
    cr_assert_eq(run_registry_create(&lim, &fx.reg), 0);
    cr_assert_eq(run_open(fx.reg, 7, "r", &fx.run), 0);
    uint32_t n = RUN_MAX_LOCAL_RANKS + 1;
    uint32_t *big = malloc(n * sizeof(*big));
    for (uint32_t i = 0; i < n; i++)
        big[i] = i;
    struct run_hello h = {.rank = 0, .world_size = n, .local_ranks = big, .n_local_ranks = n};
    cr_expect_eq(run_hello(fx.run, &h), -ENOSPC);
    cr_expect_eq(fx.run->n_local, 0);
    free(big);
    run_registry_destroy(fx.reg);
}

/* --- timeouts -> incomplete records ------------------------------------------------------------
 */

struct timeout_case {
    const char *what;
    enum run_group_kind kind;
    uint32_t shards, sent;
};

static const struct timeout_case timeout_cases[] = {
    {"attention 2 of 3", RUN_GROUP_ATTENTION, 3, 2},
    {"attention 1 of 4", RUN_GROUP_ATTENTION, 4, 1},
    {"router gram 1 of 2", RUN_GROUP_ROUTER_GRAM, 2, 1},
    {"router tokens 3 of 4 ranks", RUN_GROUP_ROUTER_TOKENS, 4, 3},
};

Test(run, timeout_records_incomplete_with_have_and_want)
{
    for (size_t c = 0; c < sizeof(timeout_cases) / sizeof(timeout_cases[0]); c++) {
        const struct timeout_case *tc = &timeout_cases[c];
        struct fixture fx;
        fx_init(&fx, tc->shards, 1ull << 30);
        struct t_report *t = malloc(sizeof(*t));
        for (uint32_t s = 0; s < tc->sent; s++) {
            report_init(t, s + 1, 9);
            if (tc->kind == RUN_GROUP_ATTENTION)
                add_ones(t, 2, 1, 2, s, tc->shards);
            else if (tc->kind == RUN_GROUP_ROUTER_GRAM)
                add_router_gram(t, 2, 4, s, tc->shards);
            else
                add_tokens(t, 2, 4, 10);
            /* a complete group of the same step beside it */
            add_spectrum(t, 0, 0);
            fx_add(&fx, t, s, 1.0, NULL);
        }
        cr_assert_null(run_take_ready(fx.reg, fx.run, 1.0 + T_TIMEOUT - 0.5), "%s", tc->what);
        uint64_t held = run_registry_bytes(fx.reg);
        struct run_bucket *b = run_take_ready(fx.reg, fx.run, 1.0 + T_TIMEOUT);
        cr_assert_not_null(b, "%s: not taken at the timeout", tc->what);
        cr_assert_eq(b->n_incomplete, 1, "%s", tc->what);
        const struct run_incomplete *r = &b->incomplete[0];
        cr_expect_eq(r->kind, tc->kind, "%s", tc->what);
        cr_expect_eq(r->layer, 2);
        cr_expect_eq(r->head, tc->kind == RUN_GROUP_ATTENTION ? 1 : -1);
        cr_expect_eq(r->have, tc->sent, "%s", tc->what);
        cr_expect_eq(r->want, tc->shards, "%s", tc->what);
        /* the partial group is dropped (memory back), never computed */
        cr_assert_eq(b->n, 1, "%s", tc->what);
        cr_assert(b->groups[0]->spectrum);
        cr_expect_lt(run_registry_bytes(fx.reg), held);
        cr_expect_eq(fx.run->done_step, 9);
        run_bucket_free(b);
        cr_expect_eq(run_registry_bytes(fx.reg), 0);
        free(t);
        run_registry_destroy(fx.reg);
    }
}

/* A Hello's optimizer decides whether the run's update follows the
 * gradient; a Hello without one leaves what an earlier one said. */
Test(run, hello_optimizer_table)
{
    static const struct {
        const char *first, *second;
        bool follows;
    } cases[] = {
        {"SGD", NULL, true},     {"AdamW", NULL, false}, {NULL, NULL, false},
        {"SGD", "AdamW", false}, {"AdamW", "SGD", true}, {"SGD", NULL, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct fixture fx;
        fx_init(&fx, 1, 1ull << 30);
        struct run_hello h = {.rank = 0, .world_size = 1, .optimizer = cases[i].first};
        cr_assert_eq(run_hello(fx.run, &h), 0);
        h.optimizer = cases[i].second;
        cr_assert_eq(run_hello(fx.run, &h), 0);
        cr_expect_eq(fx.run->update_follows_grad, cases[i].follows, "case %zu", i);
        run_registry_destroy(fx.reg);
    }
}

Test(run, declared_shape_waits_for_every_head)
{
    struct fixture fx;
    fx_init(&fx, 1, 1ull << 30);
    struct run_hello h = {.rank = 0,
                          .world_size = 1,
                          .has_n_layers = true,
                          .n_layers = 2,
                          .has_n_heads = true,
                          .n_heads = 2};
    cr_assert_eq(run_hello(fx.run, &h), 0);
    struct t_report *t = malloc(sizeof(*t));
    report_init(t, 1, 4);
    add_ones(t, 0, 0, 2, 0, 1);
    add_ones(t, 0, 1, 2, 0, 1);
    add_ones(t, 1, 0, 2, 0, 1);
    fx_add(&fx, t, 0, 0.0, NULL);
    cr_assert_null(run_take_ready(fx.reg, fx.run, 1.0), "ready with a head missing");
    struct run_bucket *b = run_take_ready(fx.reg, fx.run, T_TIMEOUT);
    cr_assert_not_null(b);
    cr_assert_eq(b->n, 3);
    cr_assert_eq(b->n_incomplete, 1);
    cr_expect_eq(b->incomplete[0].layer, 1);
    cr_expect_eq(b->incomplete[0].head, 1);
    cr_expect_eq(b->incomplete[0].have, 0);
    run_bucket_free(b);
    /* all four heads: ready at once */
    report_init(t, 2, 5);
    for (uint32_t l = 0; l < 2; l++)
        for (uint32_t hd = 0; hd < 2; hd++)
            add_ones(t, l, hd, 2, 0, 1);
    fx_add(&fx, t, 0, 20.0, NULL);
    b = run_take_ready(fx.reg, fx.run, 20.0);
    cr_assert_not_null(b);
    cr_assert_eq(b->n_incomplete, 0);
    run_bucket_free(b);
    free(t);
    run_registry_destroy(fx.reg);
}

/* --- step order and late data
 * --------------------------------------------------------------------- */

Test(run, later_bucket_waits_for_earlier)
{
    struct fixture fx;
    fx_init(&fx, 2, 1ull << 30);
    struct t_report *t = malloc(sizeof(*t));
    report_init(t, 1, 5);
    add_ones(t, 0, 0, 2, 0, 2); /* step 5: 1 of 2 shards */
    fx_add(&fx, t, 0, 0.0, NULL);
    report_init(t, 2, 6);
    add_spectrum(t, 0, 0); /* step 6: complete */
    fx_add(&fx, t, 0, 0.0, NULL);
    cr_assert_null(run_take_ready(fx.reg, fx.run, 1.0), "step 6 overtook step 5");
    report_init(t, 1, 5);
    add_ones(t, 0, 0, 2, 1, 2);
    fx_add(&fx, t, 1, 1.0, NULL);
    struct run_bucket *b5 = run_take_ready(fx.reg, fx.run, 1.0);
    struct run_bucket *b6 = run_take_ready(fx.reg, fx.run, 1.0);
    cr_assert(b5 && b6);
    cr_expect_eq(b5->step, 5);
    cr_expect_eq(b6->step, 6);
    cr_assert_null(run_take_ready(fx.reg, fx.run, 1.0));
    /* step 6 is evaluated: data for it (or earlier) is late */
    struct run_add_stats st;
    report_init(t, 3, 6);
    add_spectrum(t, 0, 1);
    fx_add(&fx, t, 1, 2.0, &st);
    cr_expect_eq(st.late, 1);
    cr_assert_null(fx.run->buckets);
    run_bucket_free(b5);
    run_bucket_free(b6);
    free(t);
    run_registry_destroy(fx.reg);
}

Test(run, buckets_created_out_of_order_are_taken_in_step_order)
{
    struct fixture fx;
    fx_init(&fx, 1, 1ull << 30);
    struct t_report *t = malloc(sizeof(*t));
    const uint64_t steps[] = {9, 3, 7, 4};
    for (size_t i = 0; i < 4; i++) {
        report_init(t, i + 1, steps[i]);
        add_spectrum(t, 0, 0);
        fx_add(&fx, t, 0, 0.0, NULL);
    }
    const uint64_t want[] = {3, 4, 7, 9};
    for (size_t i = 0; i < 4; i++) {
        struct run_bucket *b = run_take_ready(fx.reg, fx.run, 0.0);
        cr_assert_not_null(b);
        cr_expect_eq(b->step, want[i]);
        run_bucket_free(b);
    }
    free(t);
    run_registry_destroy(fx.reg);
}

/* --- memory accounting
 * ---------------------------------------------------------------------------- */

Test(run, memory_is_accounted_and_bounded)
{
    struct fixture fx;
    uint32_t dh = 16;
    size_t one = 2 * monitor_tri_len(2 * dh) * sizeof(double);
    fx_init(&fx, 2, 3 * one);
    struct t_report *t = malloc(sizeof(*t));
    cr_assert_eq(run_registry_bytes(fx.reg), 0);
    report_init(t, 1, 1);
    add_ones(t, 0, 0, dh, 0, 2);
    fx_add(&fx, t, 0, 0.0, NULL);
    uint64_t b1 = run_registry_bytes(fx.reg);
    cr_assert_geq(b1, one, "Gram triangles not accounted");
    cr_assert(!run_registry_full(fx.reg));
    report_init(t, 2, 1);
    add_ones(t, 0, 1, dh, 0, 2);
    add_ones(t, 0, 2, dh, 0, 2);
    fx_add(&fx, t, 0, 0.0, NULL);
    cr_assert(run_registry_full(fx.reg), "%llu bytes held, bound %zu",
              (unsigned long long)run_registry_bytes(fx.reg), 3 * one);
    struct run_bucket *b = run_take_ready(fx.reg, fx.run, T_TIMEOUT);
    cr_assert_not_null(b);
    cr_assert_eq(b->n_incomplete, 3);
    cr_assert(!run_registry_full(fx.reg), "dropped groups still accounted");
    run_bucket_free(b);
    cr_assert_eq(run_registry_bytes(fx.reg), 0);
    free(t);
    run_registry_destroy(fx.reg);
}

/* --- resend dedup --------------------------------------------------------------------------------
 */

Test(run, stream_resend_dedup)
{
    struct fixture fx;
    fx_init(&fx, 1, 1ull << 30);
    cr_assert(run_stream_fresh(fx.run, 11, 1));
    cr_assert(run_stream_fresh(fx.run, 11, 2));
    cr_assert(!run_stream_fresh(fx.run, 11, 2));
    cr_assert(!run_stream_fresh(fx.run, 11, 1));
    cr_assert(run_stream_fresh(fx.run, 12, 1), "streams are independent");
    cr_assert_eq(run_stream_seen(fx.run, 13, 40), 0); /* Welcome: 40 committed */
    cr_assert(!run_stream_fresh(fx.run, 13, 40));
    cr_assert(run_stream_fresh(fx.run, 13, 41));
    cr_assert_eq(run_stream_seen(fx.run, 13, 5), 0); /* never lowers */
    cr_assert(!run_stream_fresh(fx.run, 13, 41));
    run_registry_destroy(fx.reg);
}

/* Under memory pressure only streams that can complete the oldest reducing
 * step are read (pausing all would leave it to time out). */
Test(run, streams_needed_by_the_oldest_bucket)
{
    struct fixture fx;
    fx_init(&fx, 2, 1ull << 30);
    cr_assert(!run_stream_needed(fx.run, 1), "needed with nothing reducing");
    struct t_report *t = malloc(sizeof(*t));
    report_init(t, 1, 5);
    add_ones(t, 0, 0, 2, 0, 2);
    fx_add(&fx, t, 0, 0.0, NULL);
    run_stream_fed_step(fx.run, 1, 5); /* rank 0 sent its shard of step 5 */
    run_stream_fed_step(fx.run, 2, 4); /* rank 1 is at step 4 */
    cr_assert(!run_stream_needed(fx.run, 1), "the stream that is ahead is read");
    cr_assert(run_stream_needed(fx.run, 2), "the lagging stream is paused");
    cr_assert(run_stream_needed(fx.run, 3), "a stream that fed nothing yet is paused");
    report_init(t, 2, 5);
    add_ones(t, 0, 0, 2, 1, 2);
    fx_add(&fx, t, 1, 0.0, NULL);
    run_stream_fed_step(fx.run, 2, 5);
    struct run_bucket *b = run_take_ready(fx.reg, fx.run, 0.0);
    cr_assert_not_null(b);
    cr_assert(!run_stream_needed(fx.run, 2));
    run_bucket_free(b);
    free(t);
    run_registry_destroy(fx.reg);
}

/* A stream known only from its Welcome (or a resend check) has fed no
 * step: under pressure it is read. Its entry once kept realloc's garbage
 * in has_step/fed_step, and 204 of 1,024 ranks looked ahead, unread, until
 * the reduce timeout. (Criterion's ASan build fills new memory, so this
 * fails there without the fix; scribbled memory makes it likely anywhere.) */
Test(run, streams_that_fed_nothing_are_needed)
{
    void *scribble = malloc(1 << 16);
    memset(scribble, 0xbe, 1 << 16);
    free(scribble);
    struct fixture fx;
    fx_init(&fx, 2, 1ull << 30);
    struct t_report *t = malloc(sizeof(*t));
    report_init(t, 1, 5);
    add_ones(t, 0, 0, 2, 0, 2);
    fx_add(&fx, t, 0, 0.0, NULL);
    for (int64_t id = 100; id < 1100; id++) {
        if (id % 2)
            cr_assert_eq(run_stream_seen(fx.run, id, 7), 0);
        else
            cr_assert(run_stream_fresh(fx.run, id, 1));
    }
    for (int64_t id = 100; id < 1100; id++)
        cr_assert(run_stream_needed(fx.run, id), "stream %lld fed nothing and is not read",
                  (long long)id);
    free(t);
    run_registry_destroy(fx.reg);
}

Test(run, spectrum_sketch_is_complete_at_once)
{
    struct fixture fx;
    fx_init(&fx, 8, 1ull << 30);
    struct t_report *t = malloc(sizeof(*t));
    report_init(t, 1, 2);
    add_spectrum(t, 3, 1);
    fx_add(&fx, t, 5, 0.0, NULL);
    struct run_bucket *b = run_take_ready(fx.reg, fx.run, 0.0);
    cr_assert_not_null(b);
    cr_assert(b->groups[0]->res.done);
    cr_assert(b->groups[0]->res.qk.spec[QK_D2].present);
    /* 4,3,2,1: srank = 10/4 */
    cr_expect_float_eq(b->groups[0]->res.qk.spec[QK_D2].srank, 2.5, 1e-12);
    run_bucket_free(b);
    free(t);
    run_registry_destroy(fx.reg);
}
