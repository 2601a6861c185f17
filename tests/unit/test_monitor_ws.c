/* The monitor workspace pool (daemon/monitor_ws.c): capacities rounded up
 * to powers of two within each kind's bounds, best fit on reuse, kinds kept
 * apart, and workspaces that work (the math runs in them). Leaks are
 * failures under the sanitizer build. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>

#include "monitor_qk.h"
#include "monitor_router.h"
#include "monitor_ws.h"

static const struct {
    enum monitor_ws_kind kind;
    unsigned need, cap;
} caps[] = {
    {MONITOR_WS_QK, 1, MONITOR_WS_MIN_DH},
    {MONITOR_WS_QK, 17, 32},
    {MONITOR_WS_QK, 128, 128},
    {MONITOR_WS_QK, QK_MAX_DH, QK_MAX_DH},
    {MONITOR_WS_ROUTER, 1, MONITOR_WS_MIN_EXPERTS},
    {MONITOR_WS_ROUTER, 9, 16},
    {MONITOR_WS_ROUTER, ROUTER_MAX_EXPERTS - 1, ROUTER_MAX_EXPERTS},
};

Test(monitor_ws, new_workspaces_round_up_within_bounds)
{
    struct monitor_ws_pool *p;
    cr_assert_eq(monitor_ws_pool_create(&p), 0);
    for (size_t i = 0; i < sizeof(caps) / sizeof(caps[0]); i++) {
        unsigned cap = 0;
        void *ws = monitor_ws_take(p, caps[i].kind, caps[i].need, &cap);
        cr_assert_not_null(ws, "case %zu", i);
        cr_expect_eq(cap, caps[i].cap, "case %zu: need %u", i, caps[i].need);
        monitor_ws_give(p, caps[i].kind, ws, cap);
    }
    monitor_ws_pool_destroy(p);
}

Test(monitor_ws, reuse_is_best_fit_and_per_kind)
{
    struct monitor_ws_pool *p;
    cr_assert_eq(monitor_ws_pool_create(&p), 0);
    unsigned c64, c16, cr;
    void *big = monitor_ws_take(p, MONITOR_WS_QK, 64, &c64);
    void *small = monitor_ws_take(p, MONITOR_WS_QK, 16, &c16);
    void *rt = monitor_ws_take(p, MONITOR_WS_ROUTER, 64, &cr);
    cr_assert(big && small && rt);
    monitor_ws_give(p, MONITOR_WS_QK, big, c64);
    monitor_ws_give(p, MONITOR_WS_QK, small, c16);
    monitor_ws_give(p, MONITOR_WS_ROUTER, rt, cr);
    unsigned cap;
    cr_expect_eq(monitor_ws_take(p, MONITOR_WS_QK, 10, &cap), small, "smallest that fits");
    cr_expect_eq(cap, 16);
    cr_expect_eq(monitor_ws_take(p, MONITOR_WS_QK, 10, &cap), big, "then the larger one");
    cr_expect_eq(cap, 64);
    cr_expect_eq(monitor_ws_take(p, MONITOR_WS_ROUTER, 8, &cap), rt, "router kept apart");
    monitor_ws_give(p, MONITOR_WS_QK, small, 16);
    monitor_ws_give(p, MONITOR_WS_QK, big, 64);
    monitor_ws_give(p, MONITOR_WS_ROUTER, rt, cr);
    monitor_ws_give(p, MONITOR_WS_QK, NULL, 0); /* a no-op */
    monitor_ws_pool_destroy(p);
}

/* A pooled router workspace computes: GR of 3 orthonormal experts has
 * lambda = 1, 1, 1. */
Test(monitor_ws, pooled_workspace_computes)
{
    struct monitor_ws_pool *p;
    cr_assert_eq(monitor_ws_pool_create(&p), 0);
    unsigned cap;
    struct router_workspace *ws = monitor_ws_take(p, MONITOR_WS_ROUTER, 3, &cap);
    cr_assert_not_null(ws);
    double gr[6] = {1, 0, 0, 1, 0, 1}; /* upper triangle, row-major */
    struct router_weight out;
    cr_assert_eq(router_weight_compute(ws, 3, gr, &out), 0);
    size_t len;
    const double *spec = router_workspace_spectrum(ws, &len);
    cr_assert_eq(len, 3);
    for (size_t i = 0; i < len; i++)
        cr_expect(fabs(spec[i] - 1.0) < 1e-12, "lambda %zu = %g", i, spec[i]);
    monitor_ws_give(p, MONITOR_WS_ROUTER, ws, cap);
    monitor_ws_pool_destroy(p);
}
