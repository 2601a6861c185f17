/* The monitor stage's evaluation: the workers' math over one bucket's
 * groups (stage_work_cb, with workspaces from the pool of monitor_ws.h),
 * then, on the loop thread in step order, the points and detection of the
 * attention aggregates, the router series and the queued scalars. See
 * stage_internal.h. */
#include "stage_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "fs_clock.h"
#include "monitor_qk.h"
#include "monitor_router.h"

#define STAGE_WORKER_NICE 5 /* workers' nice value above the daemon's */

/* Per head: the series docs/monitors.md 1.3 names (spectrum, scalar). */
static const unsigned head_series[] = {
    QK_SERIES(QK_D2, QK_ENTROPY2), QK_SERIES(QK_D2, QK_ERANK2),
    QK_SERIES(QK_D2, QK_SRANK),    QK_SERIES(QK_D2, QK_FRO),
    QK_SERIES(QK_D1, QK_ENTROPY2), QK_SERIES(QK_D1, QK_ERANK2),
    QK_SERIES(QK_D1, QK_SRANK),    QK_SERIES(QK_D1, QK_FRO),
    QK_SERIES(QK_D3, QK_ENTROPY2), QK_SERIES(QK_D3, QK_ERANK2),
    QK_SERIES(QK_D3, QK_SRANK),    QK_SERIES(QK_D3, QK_FRO),
    QK_SERIES(QK_W, QK_ENTROPY2),  QK_SERIES_CQK,
};
#define N_HEAD_SERIES (sizeof(head_series) / sizeof(head_series[0]))

/* Detected per (layer, window): the aggregate series and whether the max
 * (rise is bad) rather than the min over heads is the signal. Which of them
 * a rule watches is eval_input_rule's answer (evaluate.c), shared with the
 * backtest. */
static const struct {
    unsigned series;
    bool use_max;
} qk_detected[] = {
    {QK_SERIES(QK_D2, QK_ERANK2), false},
    {QK_SERIES(QK_D2, QK_ENTROPY2), false},
    {QK_SERIES(QK_D2, QK_SRANK), false},
    {QK_SERIES_CQK, true},
};

/* Router series per layer. */
enum {
    RS_SIMILARITY,
    RS_CENTERED,
    RS_KAPPA,
    RS_ERANK,
    RS_SRANK,
    RS_ENTROPY,
    RS_ENTROPY_NORM,
    RS_ENTROPY_SPREAD,
    RS_MAXVIO,
    RS_LOAD_ENTROPY,
    RS_DEAD,
    RS_BALANCE,
    RS_ZLOSS,
    RS_COUNT
};
static const char *const router_names[RS_COUNT] = {
    [RS_SIMILARITY] = "router.similarity",
    [RS_CENTERED] = "router.centered_energy",
    [RS_KAPPA] = "router.kappa",
    [RS_ERANK] = "router.erank",
    [RS_SRANK] = "router.srank",
    [RS_ENTROPY] = "router.entropy",
    [RS_ENTROPY_NORM] = "router.entropy_norm",
    [RS_ENTROPY_SPREAD] = "router.entropy_spread",
    [RS_MAXVIO] = "router.maxvio",
    [RS_LOAD_ENTROPY] = "router.load_entropy",
    [RS_DEAD] = "router.dead_experts",
    [RS_BALANCE] = "router.balance",
    [RS_ZLOSS] = "router.zloss",
};

static const char *const agg_suffix[4] = {"min", "mean", "max", "argmin"};

/* --- scalars (at feed time, no math) -------------------------------------------------------- */

void stage_detect_scalars(struct stage *st, struct stage_run *sr, struct run *run, struct build *bd,
                          const struct scalar_sample *x)
{
    struct store_series_key k;
    if (x->has_lr) { /* training progress (evaluate.h), and the lr rule */
        eval_progress_lr(&sr->ev, x->step, x->lr);
        build_key(&k, "lr", -1, -1, 0, (int32_t)x->rank);
        build_feed(st, sr, run, bd, &k, "lr", x->step, x->lr, true, -1);
    }
    if (x->has_loss) {
        build_key(&k, "loss", -1, -1, 0, (int32_t)x->rank);
        build_feed(st, sr, run, bd, &k, "loss", x->step, x->loss, true, -1);
    }
    if (x->has_grad) { /* before step_update_ratio: its credit (evaluate.h) */
        eval_progress_grad(&sr->ev, x->step, x->grad);
        build_key(&k, "grad_norm", -1, -1, 0, (int32_t)x->rank);
        build_feed(st, sr, run, bd, &k, "grad_norm", x->step, x->grad, true, -1);
    }
    if (x->has_sur) {
        build_key(&k, "step_update_ratio", -1, -1, 0, (int32_t)x->rank);
        build_feed(st, sr, run, bd, &k, "step_update_ratio", x->step, x->sur, true, -1);
    }
    for (uint32_t l = 0; l < x->n_wn; l++) {
        build_key(&k, "weight_norm", (int32_t)l, -1, 0, (int32_t)x->rank);
        build_feed(st, sr, run, bd, &k, "weight_norm", x->step, x->wn[l], true, -1);
    }
    for (uint32_t l = 0; l < x->n_ur; l++) {
        build_key(&k, "update_ratio", (int32_t)l, -1, 0, (int32_t)x->rank);
        build_feed(st, sr, run, bd, &k, "update_ratio", x->step, x->ur[l], true, -1);
    }
    /* The report was spooled (stage_wants_spool): its row goes with the
     * rows derived from it. Every bucket at or below this step is
     * evaluated, so nothing else at or below it is still needed. */
    struct store_monitor *m = &bd->it->monitor;
    if (!m->has_spool_done || m->spool_done_step < x->step) {
        m->has_spool_done = 1;
        m->spool_done_step = x->step;
    }
    stage_spool_evaluated(st, sr, x->step);
}

/* --- evaluation of a computed bucket (loop thread, step order) ---------------------------------
 */

static int cmp_attention(const void *a, const void *b)
{
    const struct run_group *x = *(const struct run_group *const *)a;
    const struct run_group *y = *(const struct run_group *const *)b;
    if (x->window != y->window)
        return x->window < y->window ? -1 : 1;
    if (x->layer != y->layer)
        return x->layer < y->layer ? -1 : 1;
    return (x->head > y->head) - (x->head < y->head);
}

static bool layer_incomplete(const struct run_bucket *b, uint32_t layer, uint32_t window)
{
    for (size_t i = 0; i < b->n_incomplete; i++) {
        const struct run_incomplete *r = &b->incomplete[i];
        if (r->kind == RUN_GROUP_ATTENTION && r->layer == layer && r->window == window)
            return true;
    }
    return false;
}

/* Per-head points, then per (layer, window) aggregates and detection. */
static void evaluate_attention(struct stage *st, struct stage_run *sr, struct run *run,
                               struct run_bucket *b, struct build *bd)
{
    size_t n = 0;
    for (size_t i = 0; i < b->n; i++)
        n += b->groups[i]->kind == RUN_GROUP_ATTENTION;
    if (!n)
        return;
    struct run_group **g = malloc(n * sizeof(*g));
    struct qk_head *heads = malloc(n * sizeof(*heads));
    if (!g || !heads) {
        bd->oom = 1;
        free(g);
        free(heads);
        return;
    }
    n = 0;
    for (size_t i = 0; i < b->n; i++)
        if (b->groups[i]->kind == RUN_GROUP_ATTENTION)
            g[n++] = b->groups[i];
    qsort(g, n, sizeof(*g), cmp_attention);
    struct store_series_key k;
    for (size_t lo = 0; lo < n;) {
        size_t hi = lo;
        while (hi < n && g[hi]->layer == g[lo]->layer && g[hi]->window == g[lo]->window)
            hi++;
        uint32_t layer = g[lo]->layer, window = g[lo]->window;
        bool nonfinite = false;
        /* Per-head points are for drill-down and most of a large run's
         * database; the aggregates below (and detection) see every step. */
        uint64_t every = st->opts.head_points_every;
        bool head_points = every <= 1 || b->step % every == 0;
        for (size_t i = lo; i < hi; i++) {
            const struct qk_head *h = &g[i]->res.qk;
            heads[i - lo] = *h;
            if (!g[i]->res.done || g[i]->res.rc == -EINVAL)
                heads[i - lo].nonfinite = true; /* never computed: absent everywhere */
            else if (h->nonfinite)
                nonfinite = true;
            for (size_t s = 0; head_points && s < N_HEAD_SERIES; s++) {
                double v;
                if (qk_head_value(&heads[i - lo], head_series[s], &v) < 0)
                    v = NAN;
                build_key(&k, qk_series_name(head_series[s]), (int32_t)layer, (int32_t)g[i]->head,
                          (int32_t)window, -1);
                build_point(bd, &k, b->step, v);
            }
        }
        /* Aggregates only over a whole layer: never from part of the heads. */
        size_t nh = hi - lo;
        bool whole = run->n_heads ? nh == run->n_heads : !layer_incomplete(b, layer, window);
        struct qk_agg agg[QK_NSERIES];
        if (whole && qk_layer_aggregate(heads, nh, agg) == 0) {
            for (size_t s = 0; s < N_HEAD_SERIES; s++) {
                const struct qk_agg *a = &agg[head_series[s]];
                double vals[4] = {a->min, a->mean, a->max,
                                  a->present ? (double)g[lo + a->argmin]->head : NAN};
                for (int q = 0; q < 4; q++) {
                    char name[STORE_SERIES_NAME_MAX];
                    snprintf(name, sizeof(name), "%s.%s", qk_series_name(head_series[s]),
                             agg_suffix[q]);
                    build_key(&k, name, (int32_t)layer, -1, (int32_t)window, -1);
                    build_point(bd, &k, b->step, a->present ? vals[q] : NAN);
                }
            }
            for (size_t d = 0; d < sizeof(qk_detected) / sizeof(qk_detected[0]); d++) {
                const struct qk_agg *a = &agg[qk_detected[d].series];
                double v = qk_detected[d].use_max ? a->max : a->min;
                int32_t at = -1;
                if (a->present && !qk_detected[d].use_max) {
                    at = (int32_t)g[lo + a->argmin]->head;
                } else if (a->present) {
                    for (size_t i = 0; i < nh; i++) {
                        double x;
                        if (qk_head_value(&heads[i], qk_detected[d].series, &x) == 0 &&
                            x == a->max) {
                            at = (int32_t)g[lo + i]->head;
                            break;
                        }
                    }
                }
                bool present = a->present;
                if (nonfinite) { /* NaN fires at once, whatever the other heads say */
                    v = NAN;
                    present = true;
                }
                char name[STORE_SERIES_NAME_MAX], rule[DETECT_NAME_MAX];
                snprintf(name, sizeof(name), "%s.%s", qk_series_name(qk_detected[d].series),
                         qk_detected[d].use_max ? "max" : "min");
                build_key(&k, name, (int32_t)layer, -1, (int32_t)window, -1);
                if (eval_input_rule(st->opts.rules, &k, run->lead_rank, rule, sizeof(rule)))
                    build_feed(st, sr, run, bd, &k, rule, b->step, v, present, at);
            }
        }
        lo = hi;
    }
    free(g);
    free(heads);
}

static void router_point(struct stage *st, struct stage_run *sr, struct run *run, struct build *bd,
                         uint64_t step, uint32_t layer, int which, bool present, double v,
                         bool nonfinite)
{
    struct store_series_key k;
    build_key(&k, router_names[which], (int32_t)layer, -1, 0, -1);
    if (nonfinite) {
        v = NAN;
        present = true;
    }
    build_point(bd, &k, step, present ? v : NAN);
    /* Detection where a rule exists (similarity, centered energy, z-loss,
     * MaxVio, load entropy by default). */
    char rule[DETECT_NAME_MAX];
    if (eval_input_rule(st->opts.rules, &k, run->lead_rank, rule, sizeof(rule)))
        build_feed(st, sr, run, bd, &k, rule, step, v, present, -1);
}

static void evaluate_router(struct stage *st, struct stage_run *sr, struct run *run,
                            struct run_bucket *b, struct build *bd)
{
    for (size_t i = 0; i < b->n; i++) {
        const struct run_group *g = b->groups[i];
        if (!g->res.done)
            continue;
        uint64_t step = b->step;
        if (g->kind == RUN_GROUP_ROUTER_GRAM) {
            const struct router_weight *w = &g->res.rw;
            bool nf = w->nonfinite;
            router_point(st, sr, run, bd, step, g->layer, RS_SIMILARITY, w->sim_present, w->sim,
                         nf);
            router_point(st, sr, run, bd, step, g->layer, RS_CENTERED, w->present,
                         w->centered_energy, nf);
            router_point(st, sr, run, bd, step, g->layer, RS_KAPPA, w->kappa_present, w->kappa, nf);
            router_point(st, sr, run, bd, step, g->layer, RS_ERANK, w->spec.present, w->spec.erank2,
                         nf);
            router_point(st, sr, run, bd, step, g->layer, RS_SRANK, w->spec.present, w->spec.srank,
                         nf);
        } else if (g->kind == RUN_GROUP_ROUTER_TOKENS) {
            const struct router_decision *d = &g->res.rd;
            bool nf = d->nonfinite;
            router_point(st, sr, run, bd, step, g->layer, RS_ENTROPY, d->present, d->entropy_mean,
                         nf);
            router_point(st, sr, run, bd, step, g->layer, RS_ENTROPY_NORM,
                         d->present && d->norm_present, d->entropy_norm, nf);
            router_point(st, sr, run, bd, step, g->layer, RS_ENTROPY_SPREAD, d->present,
                         d->entropy_spread, nf);
            router_point(st, sr, run, bd, step, g->layer, RS_MAXVIO, d->load_present, d->maxvio,
                         nf);
            router_point(st, sr, run, bd, step, g->layer, RS_LOAD_ENTROPY, d->load_present,
                         d->load_entropy, nf);
            router_point(st, sr, run, bd, step, g->layer, RS_DEAD, d->present,
                         (double)d->dead_experts, nf);
            router_point(st, sr, run, bd, step, g->layer, RS_BALANCE, d->load_present, d->balance,
                         nf);
            router_point(st, sr, run, bd, step, g->layer, RS_ZLOSS, d->present, d->zloss, nf);
        }
    }
}

void stage_evaluate(struct stage *st, struct run *run, struct run_bucket *b)
{
    struct stage_run *sr = stage_run_of(st, run);
    struct build bd;
    if (!sr || build_begin(&bd, run->run_id, b->time) < 0) {
        log_limited(&st->rl_err, LOG_LEVEL_ERROR, "stage",
                    "out of memory evaluating run %s step %llu", run->name,
                    (unsigned long long)b->step);
        return;
    }
    evaluate_attention(st, sr, run, b, &bd);
    evaluate_router(st, sr, run, b, &bd);
    for (size_t i = 0; i < b->n_incomplete; i++)
        build_incomplete(&bd, b->step, &b->incomplete[i]);
    if (b->n_incomplete) {
        atomic_fetch_add(&st->stats->incomplete_total, b->n_incomplete);
        const struct run_incomplete *r = &b->incomplete[0];
        log_limited(&st->rl_incomplete, LOG_LEVEL_WARN, "stage",
                    "run %s step %llu: %zu reductions incomplete after %.3g s (first: %s layer %u "
                    "head %d window %u, %u of %u); recorded, not computed",
                    run->name, (unsigned long long)b->step, b->n_incomplete,
                    st->opts.reduce_timeout_s, run_group_kind_name(r->kind), r->layer, r->head,
                    r->window, r->have, r->want);
    }
    /* Every step <= this one is evaluated (buckets go in step order): their
     * spooled sketches go in the same transaction as the derived rows, and
     * so do the scalars of the steps up to the next pending bucket (the
     * caller popped this one). */
    bd.it->monitor.has_spool_done = 1;
    bd.it->monitor.spool_done_step = b->step;
    stage_spool_evaluated(st, sr, b->step);
    stage_flush_scalars(st, run, &bd, false);
    build_finish(sr, run, &bd);
    build_submit(st, &bd);
    atomic_fetch_add(&st->stats->buckets_evaluated, 1);
}

/* --- workers ------------------------------------------------------------------------------ */

static void compute_group(struct stage *st, struct run_group *g, void **qk_ws, unsigned *qk_cap,
                          void **rt_ws, unsigned *rt_cap)
{
    struct run_result *r = &g->res;
    if (g->kind == RUN_GROUP_ATTENTION) {
        if (*qk_ws && *qk_cap < g->size) {
            monitor_ws_give(st->pool, MONITOR_WS_QK, *qk_ws, *qk_cap);
            *qk_ws = NULL;
        }
        if (!*qk_ws)
            *qk_ws = monitor_ws_take(st->pool, MONITOR_WS_QK, g->size, qk_cap);
        r->rc = *qk_ws ? qk_head_from_grams(*qk_ws, g->size, g->a, g->b, &r->qk) : -ENOMEM;
        r->done = r->rc != -ENOMEM;
    } else if (g->kind == RUN_GROUP_ROUTER_GRAM) {
        if (*rt_ws && *rt_cap < g->size) {
            monitor_ws_give(st->pool, MONITOR_WS_ROUTER, *rt_ws, *rt_cap);
            *rt_ws = NULL;
        }
        if (!*rt_ws)
            *rt_ws = monitor_ws_take(st->pool, MONITOR_WS_ROUTER, g->size, rt_cap);
        r->rc = *rt_ws ? router_weight_compute(*rt_ws, g->size, g->a, &r->rw) : -ENOMEM;
        r->done = r->rc != -ENOMEM;
    } else {
        struct router_tokens in = {.n_experts = g->size,
                                   .n_tok = g->n_tok,
                                   .sum_h = g->sum_h,
                                   .sum_h2 = g->sum_h2,
                                   .sum_lse2 = g->sum_lse2,
                                   .load = g->load,
                                   .sum_p = g->sum_p};
        r->rc = router_decision_compute(&in, &r->rd);
        r->done = true;
    }
}

/* Monitor math is throughput work; reading sockets, answering Hellos and
 * committing are latency work. A worker lowers its own priority once (on
 * Linux the nice value is per thread): with every core busy with math, the
 * loop and writer threads otherwise got a third of a core, and a new
 * trainer's Welcome took seconds. The math still gets every cycle the
 * latency work leaves. Threadpool thread. */
static void worker_nice_once(void)
{
    static _Thread_local int done;
    if (done)
        return;
    done = 1;
    errno = 0;
    int cur = getpriority(PRIO_PROCESS, 0);
    if (cur == -1 && errno)
        return;
    (void)setpriority(PRIO_PROCESS, 0, cur + STAGE_WORKER_NICE); /* best effort */
}

/* Threadpool thread: the math of units[lo..hi) of one bucket. */
void stage_work_cb(uv_work_t *req)
{
    worker_nice_once();
    struct chunk *c = req->data;
    struct job *j = c->job;
    struct stage *st = j->st;
    /* CPU time of this thread, not wall time: on a loaded host the chunk
     * also waits for a core, and foreshock_monitor_seconds_total would
     * count the wait (measured up to 16x the CPU actually used). */
    double t0 = fs_clock_thread_cpu();
    void *qk = NULL, *rt = NULL;
    unsigned qk_cap = 0, rt_cap = 0;
    for (size_t i = c->lo; i < c->hi; i++) {
        compute_group(st, j->units[i], &qk, &qk_cap, &rt, &rt_cap);
        c->heads += j->units[i]->kind == RUN_GROUP_ATTENTION;
    }
    monitor_ws_give(st->pool, MONITOR_WS_QK, qk, qk_cap);
    monitor_ws_give(st->pool, MONITOR_WS_ROUTER, rt, rt_cap);
    c->seconds = fs_clock_thread_cpu() - t0;
}
