/* The monitor workspace pool. See monitor_ws.h. */
#include "monitor_ws.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

#include "fs_grow.h"
#include "monitor_qk.h"
#include "monitor_router.h"

/* --- the pool: workspaces checked out under a mutex ------------------------------------- */

struct ws_entry {
    void *ws;
    unsigned cap;
};

struct ws_free {
    struct ws_entry *v; /* free workspaces */
    size_t n, cap;
};

struct monitor_ws_pool {
    pthread_mutex_t mu;
    struct ws_free kind[2]; /* by enum monitor_ws_kind */
};

/* What the pool needs of each kind. */
static void *qk_new(unsigned cap)
{
    struct qk_workspace *w;
    return qk_workspace_create(cap, &w) == 0 ? w : NULL;
}

static void qk_free(void *ws)
{
    qk_workspace_destroy(ws);
}

static void *router_new(unsigned cap)
{
    struct router_workspace *w;
    return router_workspace_create(cap, &w) == 0 ? w : NULL;
}

static void router_free(void *ws)
{
    router_workspace_destroy(ws);
}

static const struct {
    unsigned min, max;
    void *(*create)(unsigned cap);
    void (*destroy)(void *ws);
} kinds[2] = {
    [MONITOR_WS_QK] = {MONITOR_WS_MIN_DH, QK_MAX_DH, qk_new, qk_free},
    [MONITOR_WS_ROUTER] = {MONITOR_WS_MIN_EXPERTS, ROUTER_MAX_EXPERTS, router_new, router_free},
};

static unsigned round_pow2(unsigned x, unsigned min)
{
    unsigned c = min;
    while (c < x)
        c *= 2;
    return c;
}

int monitor_ws_pool_create(struct monitor_ws_pool **out)
{
    struct monitor_ws_pool *p = calloc(1, sizeof(*p));
    *out = NULL;
    if (!p)
        return -ENOMEM;
    if (pthread_mutex_init(&p->mu, NULL) != 0) {
        free(p);
        return -ENOMEM;
    }
    *out = p;
    return 0;
}

void monitor_ws_pool_destroy(struct monitor_ws_pool *p)
{
    if (!p)
        return;
    for (int k = 0; k < 2; k++) {
        for (size_t i = 0; i < p->kind[k].n; i++)
            kinds[k].destroy(p->kind[k].v[i].ws);
        free(p->kind[k].v);
    }
    pthread_mutex_destroy(&p->mu);
    free(p);
}

void *monitor_ws_take(struct monitor_ws_pool *p, enum monitor_ws_kind kind, unsigned need,
                      unsigned *cap)
{
    pthread_mutex_lock(&p->mu);
    struct ws_free *f = &p->kind[kind];
    size_t best = f->n;
    for (size_t i = 0; i < f->n; i++)
        if (f->v[i].cap >= need && (best == f->n || f->v[i].cap < f->v[best].cap))
            best = i;
    void *ws = NULL;
    if (best < f->n) {
        ws = f->v[best].ws;
        *cap = f->v[best].cap;
        f->v[best] = f->v[--f->n];
    }
    pthread_mutex_unlock(&p->mu);
    if (ws)
        return ws;
    unsigned c = round_pow2(need, kinds[kind].min);
    if (c > kinds[kind].max)
        c = kinds[kind].max;
    *cap = c;
    return kinds[kind].create(c);
}

void monitor_ws_give(struct monitor_ws_pool *p, enum monitor_ws_kind kind, void *ws, unsigned cap)
{
    if (!ws)
        return;
    pthread_mutex_lock(&p->mu);
    struct ws_free *f = &p->kind[kind];
    int kept = 0;
    struct ws_entry *a = fs_grow(f->v, &f->cap, f->n + 1, sizeof(*a), 8);
    if (a) {
        f->v = a;
        f->v[f->n++] = (struct ws_entry){.ws = ws, .cap = cap};
        kept = 1;
    }
    pthread_mutex_unlock(&p->mu);
    if (!kept)
        kinds[kind].destroy(ws);
}
