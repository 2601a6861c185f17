#ifndef FORESHOCK_MONITOR_WS_H
#define FORESHOCK_MONITOR_WS_H

#include <stddef.h>

/* Monitor workspaces: the part the QK and router workspaces share, and the
 * pool the monitor stage's workers check them out of.
 *
 *  - struct monitor_eig: dsyev's eigenvalue output and work buffer for
 *    symmetric matrices up to n x n, sized once so the hot path never
 *    allocates. Embedded in struct qk_workspace (monitor_qk.c) and struct
 *    router_workspace (monitor_router.c). Owned by the workspace's thread.
 *  - struct monitor_ws_pool: free workspaces of each kind, best fit by
 *    capacity, under a mutex. Any thread; a workspace taken belongs to the
 *    taking thread until it is given back. */

/* The eigen-solver buffers of one workspace. */
struct monitor_eig {
    double *w;    /* n eigenvalues, ascending (dsyev's order) */
    double *work; /* at least 3n doubles, or what dsyev asked for at n */
    size_t lwork;
};

/* Sizes e for matrices up to n x n (n > 0); a: an n x n buffer the caller
 * owns, used only for dsyev's size query. Returns 0 or -ENOMEM (e then
 * holds nothing; monitor_eig_free is still safe). */
int monitor_eig_init(struct monitor_eig *e, size_t n, double *a);

/* Frees e's buffers (a zeroed e is fine). */
void monitor_eig_free(struct monitor_eig *e);

/* Eigenvalues of the symmetric m x m matrix a (lower triangle read,
 * overwritten; column-major, leading dimension m; m <= e's n) into e->w,
 * ascending. Returns 0 or -EDOM (dsyev did not converge). */
int monitor_eig_solve(struct monitor_eig *e, size_t m, double *a);

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
