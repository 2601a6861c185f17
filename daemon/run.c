/* The run registry: shard and rank reduction per (run, step). See run.h.
 * This file keeps the runs (shape, MoE announcements, local groups, resend
 * dedup); run_bucket.c the per-step buckets. */
#include "run.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "evaluate.h"
#include "fs_grow.h"
#include "ranks.h"
#include "run_internal.h"

/* --- registry ------------------------------------------------------------------ */

int run_registry_create(const struct run_limits *lim, struct run_registry **out)
{
    *out = NULL;
    if (!lim || !(lim->timeout_s >= RUN_TIMEOUT_MIN_S))
        return -EINVAL;
    struct run_registry *reg = calloc(1, sizeof(*reg));
    if (!reg)
        return -ENOMEM;
    reg->lim = *lim;
    *out = reg;
    return 0;
}

static void run_free(struct run *run)
{
    while (run->buckets) {
        struct run_bucket *b = run->buckets;
        run->buckets = b->next;
        run_bucket_free(b);
    }
    for (size_t i = 0; i < run->n_ann; i++)
        free(run->ann[i].layers);
    free(run->ann);
    free(run->moe_want);
    for (size_t i = 0; i < run->n_decls; i++)
        free(run->decls[i].ranks);
    free(run->decls);
    free(run->local);
    free(run->streams);
    free(run);
}

void run_registry_destroy(struct run_registry *reg)
{
    if (!reg)
        return;
    for (size_t i = 0; i < reg->n; i++)
        run_free(reg->runs[i]);
    free(reg->runs);
    free(reg);
}

void run_remove(struct run_registry *reg, struct run *run)
{
    for (size_t i = 0; i < reg->n; i++) {
        if (reg->runs[i] != run)
            continue;
        reg->runs[i] = reg->runs[--reg->n];
        run_free(run);
        return;
    }
}

uint64_t run_registry_bytes(const struct run_registry *reg)
{
    return reg->bytes;
}

bool run_registry_full(const struct run_registry *reg)
{
    return reg->bytes >= reg->lim.max_bytes;
}

struct run *run_find(struct run_registry *reg, int64_t run_id)
{
    for (size_t i = 0; i < reg->n; i++)
        if (reg->runs[i]->run_id == run_id)
            return reg->runs[i];
    return NULL;
}

void run_set_name(struct run *run, const char *name)
{
    if (!name)
        return;
    size_t n = strlen(name);
    if (n > FS_MAX_RUN_ID_LEN)
        n = FS_MAX_RUN_ID_LEN;
    memcpy(run->name, name, n);
    run->name[n] = '\0';
}

int run_open(struct run_registry *reg, int64_t run_id, const char *name, struct run **out)
{
    struct run *run = run_find(reg, run_id);
    if (run) {
        if (name && !run->name[0])
            run_set_name(run, name);
        *out = run;
        return 0;
    }
    struct run **runs = fs_grow(reg->runs, &reg->cap, reg->n + 1, sizeof(*runs), 16);
    if (!runs)
        return -ENOMEM;
    reg->runs = runs;
    run = calloc(1, sizeof(*run));
    if (!run)
        return -ENOMEM;
    run->run_id = run_id;
    run->done_step = -1;
    run->world_size = 1;
    run_set_name(run, name);
    reg->runs[reg->n++] = run;
    *out = run;
    return 0;
}

size_t run_count(const struct run_registry *reg)
{
    return reg->n;
}

struct run *run_at(struct run_registry *reg, size_t i)
{
    return i < reg->n ? reg->runs[i] : NULL;
}

void run_set_done_step(struct run *run, int64_t step)
{
    run->done_step = step;
}

/* --- local groups ---------------------------------------------------------------------- */

/* The group to give up for a new one when the run holds
 * RUN_MAX_LOCAL_GROUPS, or RUN_MAX_LOCAL_RANKS ranks over its groups: the
 * one fewest ranks declare now, of those the longest undeclared (a group
 * no rank declares any more, then one-rank groups), never the one restored
 * at start. -1 when none may go. */
static int32_t decl_victim(const struct run *run)
{
    int32_t best = -1;
    for (size_t i = 0; i < run->n_decls; i++) {
        const struct run_local_decl *d = &run->decls[i];
        if (d->restored || !d->ranks)
            continue;
        const struct run_local_decl *b = best >= 0 ? &run->decls[best] : NULL;
        if (!b || d->refs < b->refs || (d->refs == b->refs && d->used < b->used))
            best = (int32_t)i;
    }
    return best;
}

/* Gives up group i: the ranks that declared it declare nothing now (their
 * next Hello declares again); its slot is free. */
static void decl_evict(struct run *run, int32_t i)
{
    for (size_t k = 0; k < run->n_ann; k++)
        if (run->ann[k].decl == i)
            run->ann[k].decl = -1;
    run->n_decl_ranks -= run->decls[i].n;
    free(run->decls[i].ranks);
    run->decls[i] = (struct run_local_decl){0};
}

/* The index of the declared group equal to v[0..n) (sorted, distinct),
 * added when new, in place of the groups decl_victim picks while the run
 * is at RUN_MAX_LOCAL_GROUPS groups or RUN_MAX_LOCAL_RANKS ranks over
 * them (stale groups are replaced, never accumulated): -1 on out of
 * memory, -2 when no group may go. Takes v on success (when added). */
static int32_t decl_find_or_add(struct run *run, uint32_t *v, uint32_t n, bool *taken)
{
    *taken = false;
    int32_t free_slot = -1;
    for (size_t i = 0; i < run->n_decls; i++) {
        struct run_local_decl *d = &run->decls[i];
        if (d->ranks && d->n == n && memcmp(d->ranks, v, n * sizeof(*v)) == 0) {
            d->used = ++run->decl_clock;
            return (int32_t)i;
        }
    }
    if (n > RUN_MAX_LOCAL_RANKS)
        return -2;
    for (;;) {
        free_slot = -1;
        for (size_t i = 0; i < run->n_decls && free_slot < 0; i++)
            if (!run->decls[i].ranks || (run->decls[i].refs == 0 && !run->decls[i].restored))
                free_slot = (int32_t)i;
        if (free_slot >= 0 && run->decls[free_slot].ranks)
            decl_evict(run, free_slot); /* no rank declares it */
        if (run->n_decl_ranks + n <= RUN_MAX_LOCAL_RANKS &&
            (free_slot >= 0 || run->n_decls < RUN_MAX_LOCAL_GROUPS))
            break;
        int32_t victim = decl_victim(run);
        if (victim < 0)
            return -2;
        decl_evict(run, victim);
    }
    if (free_slot < 0) {
        struct run_local_decl *p = realloc(run->decls, (run->n_decls + 1) * sizeof(*p));
        if (!p)
            return -1;
        run->decls = p;
        free_slot = (int32_t)run->n_decls++;
    }
    run->decls[free_slot] = (struct run_local_decl){.ranks = v, .n = n, .used = ++run->decl_clock};
    run->n_decl_ranks += n;
    *taken = true;
    return free_slot;
}

/* Rebuilds run->local from the groups in use. 1 when it changed, 0 when
 * not, -ENOMEM (run->local is left as it was). */
static int local_rebuild(struct run *run)
{
    size_t total = 0;
    for (size_t i = 0; i < run->n_decls; i++)
        if (run->decls[i].refs || run->decls[i].restored)
            total += run->decls[i].n;
    uint32_t *u = NULL;
    size_t n = 0;
    if (total) {
        if (!(u = malloc(total * sizeof(*u))))
            return -ENOMEM;
        for (size_t i = 0; i < run->n_decls; i++)
            if (run->decls[i].refs || run->decls[i].restored) {
                memcpy(u + n, run->decls[i].ranks, run->decls[i].n * sizeof(*u));
                n += run->decls[i].n;
            }
        n = ranks_normalize(u, n);
    }
    int changed = n != run->n_local || (n && memcmp(u, run->local, n * sizeof(*u)) != 0);
    free(run->local);
    run->local = u;
    run->n_local = n;
    run->lead_rank = n ? u[0] : 0;
    return changed;
}

/* Counts kept for run_tokens_want: ranks heard, of them in the union of
 * local groups, and announcing; all below the world size. */
static void recount(struct run *run)
{
    uint32_t world = run->world_size ? run->world_size : 1;
    run->local_world = run->heard = run->heard_local = run->announcing = 0;
    for (size_t i = 0; i < run->n_local && run->local[i] < world; i++)
        run->local_world++;
    for (size_t i = 0; i < run->n_ann; i++) {
        const struct run_announce *a = &run->ann[i];
        if (a->rank >= world)
            continue;
        run->heard++;
        run->announcing += a->n > 0;
        run->heard_local += (uint32_t)ranks_contains(run->local, run->n_local, a->rank);
    }
}

/* The rank's declaration v[0..n) (normalised; n 0: none) in place of its
 * previous one, whose slot is free for it when no other rank shares it.
 * Takes v. 1 / 0 (union changed or not), -ENOMEM, -ENOSPC. */
static int declare(struct run *run, struct run_announce *a, uint32_t *v, uint32_t n)
{
    int32_t old = a->decl, idx = -1;
    if (old >= 0)
        run->decls[old].refs--;
    if (n) {
        bool taken;
        idx = decl_find_or_add(run, v, n, &taken);
        if (idx < 0) {
            if (old >= 0 && a->decl == old) /* not given up meanwhile */
                run->decls[old].refs++;
            free(v);
            return idx == -2 ? -ENOSPC : -ENOMEM;
        }
        if (!taken)
            free(v);
        run->decls[idx].refs++;
    } else {
        free(v);
    }
    a->decl = idx;
    return local_rebuild(run);
}

int run_restore_local(struct run *run, const uint32_t *ranks, size_t n)
{
    if (!n)
        return 0;
    uint32_t *v = malloc(n * sizeof(*v));
    if (!v)
        return -ENOMEM;
    memcpy(v, ranks, n * sizeof(*v));
    n = ranks_normalize(v, n);
    bool taken;
    int32_t idx = decl_find_or_add(run, v, (uint32_t)n, &taken);
    if (idx < 0) {
        free(v);
        return idx == -2 ? -ENOSPC : -ENOMEM;
    }
    if (!taken)
        free(v);
    run->decls[idx].restored = true;
    int rc = local_rebuild(run);
    recount(run);
    return rc < 0 ? rc : 0;
}

/* --- hello: shape and MoE announcements ------------------------------------------- */

int run_hello(struct run *run, const struct run_hello *h)
{
    /* The local group first: it is the one part that can be refused, and
     * a refused Hello changes nothing. */
    uint32_t *group = NULL;
    size_t n_group = 0;
    if (h->n_local_ranks) {
        if (!(group = malloc(h->n_local_ranks * sizeof(*group))))
            return -ENOMEM;
        memcpy(group, h->local_ranks, h->n_local_ranks * sizeof(*group));
        n_group = ranks_normalize(group, h->n_local_ranks);
    }
    /* Normalise the announcement: sorted, distinct, below FS_MAX_LAYERS. */
    uint32_t *layers = NULL;
    size_t n = 0;
    if (h->n_moe_layers) {
        layers = malloc(h->n_moe_layers * sizeof(*layers));
        if (!layers) {
            free(group);
            return -ENOMEM;
        }
        for (size_t i = 0; i < h->n_moe_layers; i++)
            if (h->moe_layers[i] < FS_MAX_LAYERS)
                layers[n++] = h->moe_layers[i];
        n = ranks_normalize(layers, n);
    }
    if (n && layers[n - 1] + 1 > run->n_moe_want) {
        size_t want = layers[n - 1] + 1;
        uint32_t *p = realloc(run->moe_want, want * sizeof(*p));
        if (!p) {
            free(layers);
            free(group);
            return -ENOMEM;
        }
        memset(p + run->n_moe_want, 0, (want - run->n_moe_want) * sizeof(*p));
        run->moe_want = p;
        run->n_moe_want = want;
    }
    struct run_announce *a = NULL;
    for (size_t i = 0; i < run->n_ann; i++)
        if (run->ann[i].rank == h->rank)
            a = &run->ann[i];
    if (!a) {
        /* Every rank heard from is kept, announcing or not: see run_tokens_want. */
        struct run_announce *p = realloc(run->ann, (run->n_ann + 1) * sizeof(*p));
        if (!p) {
            free(layers);
            free(group);
            return -ENOMEM;
        }
        run->ann = p;
        a = &run->ann[run->n_ann++];
        memset(a, 0, sizeof(*a));
        a->rank = h->rank;
        a->decl = -1;
    }
    int changed = declare(run, a, group, (uint32_t)n_group);
    if (changed < 0) {
        free(layers);
        recount(run);
        return changed;
    }
    if (h->world_size)
        run->world_size = h->world_size;
    if (h->has_n_layers)
        run->n_layers = h->n_layers;
    if (h->has_n_heads)
        run->n_heads = h->n_heads;
    if (h->optimizer)
        run->update_follows_grad = eval_optimizer_follows_grad(h->optimizer);
    if (h->has_detect_from_step) {
        run->has_detect_from_step = true;
        run->detect_from_step = h->detect_from_step;
    }
    /* A rank that says hello again replaces its announcement. */
    for (uint32_t i = 0; i < a->n; i++)
        run->moe_want[a->layers[i]]--;
    free(a->layers);
    a->layers = layers;
    a->n = (uint32_t)n;
    for (uint32_t i = 0; i < a->n; i++)
        run->moe_want[a->layers[i]]++;
    recount(run);
    return changed;
}

uint32_t run_tokens_want(const struct run *run, uint32_t layer)
{
    uint32_t world = run->world_size ? run->world_size : 1;
    /* The ranks this daemon will hear: the declared local groups plus any
     * rank heard outside them, else the whole world. */
    uint32_t expected = world, unheard = world - run->heard;
    if (run->n_local) {
        expected = run->local_world + (run->heard - run->heard_local);
        unheard = run->local_world - run->heard_local;
    }
    if (!run->announcing)
        return expected;
    /* A rank not heard from yet (after a restart, or still connecting) may
     * announce the layer too: until it says hello it counts as expected,
     * otherwise the first rank's hello would complete groups alone. */
    uint32_t want = layer < run->n_moe_want ? run->moe_want[layer] : 0;
    want += unheard;
    return want ? want : expected;
}

/* --- resend dedup ------------------------------------------------------------------ */

static struct run_stream *stream_get(struct run *run, int64_t stream_id, int create)
{
    for (size_t i = 0; i < run->n_streams; i++)
        if (run->streams[i].stream_id == stream_id)
            return &run->streams[i];
    if (!create || run->n_streams >= RUN_MAX_STREAMS_PER_RUN)
        return NULL;
    struct run_stream *p =
        fs_grow(run->streams, &run->cap_streams, run->n_streams + 1, sizeof(*p), 8);
    if (!p)
        return NULL;
    run->streams = p;
    struct run_stream *s = &run->streams[run->n_streams++];
    /* Every field: has_step left to realloc's garbage once made a stream
     * that had fed nothing look "ahead", so under memory or spool pressure
     * it was not read and the oldest step waited for the reduce timeout. */
    *s = (struct run_stream){.stream_id = stream_id};
    return s;
}

bool run_stream_fresh(struct run *run, int64_t stream_id, uint64_t seq)
{
    struct run_stream *s = stream_get(run, stream_id, 1);
    if (!s)
        return true; /* cannot track: feeding twice is safer than dropping */
    if (seq <= s->fed_seq)
        return false;
    s->fed_seq = seq;
    return true;
}

void run_stream_fed_step(struct run *run, int64_t stream_id, uint64_t step)
{
    struct run_stream *s = stream_get(run, stream_id, 1);
    if (s) {
        s->has_step = true;
        s->fed_step = step;
    }
}

bool run_stream_needed(const struct run *run, int64_t stream_id)
{
    if (!run->buckets)
        return false;
    for (size_t i = 0; i < run->n_streams; i++)
        if (run->streams[i].stream_id == stream_id)
            return !run->streams[i].has_step || run->streams[i].fed_step < run->buckets->step;
    return true;
}

int run_stream_seen(struct run *run, int64_t stream_id, uint64_t seq)
{
    struct run_stream *s = stream_get(run, stream_id, 1);
    if (!s)
        return run->n_streams >= RUN_MAX_STREAMS_PER_RUN ? -ENOSPC : -ENOMEM;
    if (seq > s->fed_seq)
        s->fed_seq = seq;
    return 0;
}
