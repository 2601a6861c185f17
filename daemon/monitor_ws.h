#ifndef FORESHOCK_MONITOR_WS_H
#define FORESHOCK_MONITOR_WS_H

#include <stddef.h>

/* The pool the monitor stage's workers check their workspaces out of:
 * free workspaces of each kind (struct qk_workspace, monitor_qk.c; struct
 * router_workspace, monitor_router.c), best fit by capacity, under a mutex.
 * Any thread; a workspace taken belongs to the taking thread until it is
 * given back. The eigen-solver buffers every workspace embeds are in
 * eigen.h. */

enum monitor_ws_kind {
    MONITOR_WS_QK = 0,     /* struct qk_workspace, capacity max_dh */
    MONITOR_WS_ROUTER = 1, /* struct router_workspace, capacity max_experts */
};

#define MONITOR_WS_MIN_DH 16u /* smallest workspace made (rounded up to powers of 2) */
#define MONITOR_WS_MIN_EXPERTS 8u

struct monitor_ws_pool;

/* An empty pool. Returns 0 or -ENOMEM (*out NULL). */
int monitor_ws_pool_create(struct monitor_ws_pool **out);

/* Destroys the pool and every workspace in it (NULL is a no-op); none may
 * be checked out. */
void monitor_ws_pool_destroy(struct monitor_ws_pool *p);

/* A workspace of `kind` for size `need` (dh or experts): the smallest free
 * one that fits, else a new one of need rounded up to a power of two (at
 * least the kind's minimum, at most its maximum). *cap: its capacity.
 * NULL when out of memory. Any thread. */
void *monitor_ws_take(struct monitor_ws_pool *p, enum monitor_ws_kind kind, unsigned need,
                      unsigned *cap);

/* Returns ws (capacity cap, from monitor_ws_take) to the pool, or destroys
 * it if the pool cannot grow. NULL ws is a no-op. Any thread. */
void monitor_ws_give(struct monitor_ws_pool *p, enum monitor_ws_kind kind, void *ws, unsigned cap);

#endif
