/* The monitor stage: reduction -> worker math -> detection -> writer. See
 * stage.h for the data path and threads. */
#include "stage.h"
#include "fs_clock.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "alert.h"
#include "decode.h"
#include "evaluate.h"
#include "log.h"
#include "monitor_qk.h"
#include "monitor_router.h"
#include "ranks.h"
#include "rewind.h"
#include "schema.h"
#include "spool.h"

_Static_assert(STORE_ALERT_KEY_MAX >= ALERT_KEY_MAX, "alert key buffer");
_Static_assert(STORE_DEDUP_KEY_MAX >= ALERT_DEDUP_MAX, "dedup key buffer");
_Static_assert(STORE_STATE_BLOB_MAX >= DETECT_STATE_ENCODED_MAX, "detector blob buffer");
_Static_assert(STORE_ALERT_BLOB_MAX >= ALERT_STATE_ENCODED_BYTES, "alert blob buffer");
_Static_assert(STORE_RULE_MAX >= DETECT_NAME_MAX, "rule name buffer");

#define STAGE_DEFAULT_CHUNKS 8u      /* work requests per bucket */
#define STAGE_SWEEP_MIN_MS 50u       /* timeout sweep period bounds */
#define STAGE_SWEEP_MAX_MS 1000u
#define STAGE_WS_MIN_DH 16u          /* smallest workspace made (rounded up to powers of 2) */
#define STAGE_WS_MIN_EXPERTS 8u
#define STAGE_LOAD_MAX_BODY (1u << 30) /* spooled frames re-fed at most this large */
#define STAGE_MAX_SCALAR_QUEUE 65536u  /* per run; past it scalars are detected at once */
#define STAGE_WORKER_NICE 5            /* workers' nice value above the daemon's */

/* Per head: the series MONITORS.md 1.3 names (spectrum, scalar). */
static const unsigned head_series[] = {
    QK_SERIES(QK_D2, QK_ENTROPY2), QK_SERIES(QK_D2, QK_ERANK2), QK_SERIES(QK_D2, QK_SRANK),
    QK_SERIES(QK_D2, QK_FRO),      QK_SERIES(QK_D1, QK_ENTROPY2), QK_SERIES(QK_D1, QK_ERANK2),
    QK_SERIES(QK_D1, QK_SRANK),    QK_SERIES(QK_D1, QK_FRO),      QK_SERIES(QK_D3, QK_ENTROPY2),
    QK_SERIES(QK_D3, QK_ERANK2),   QK_SERIES(QK_D3, QK_SRANK),    QK_SERIES(QK_D3, QK_FRO),
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
    [RS_SIMILARITY] = "router.similarity",   [RS_CENTERED] = "router.centered_energy",
    [RS_KAPPA] = "router.kappa",             [RS_ERANK] = "router.erank",
    [RS_SRANK] = "router.srank",             [RS_ENTROPY] = "router.entropy",
    [RS_ENTROPY_NORM] = "router.entropy_norm", [RS_ENTROPY_SPREAD] = "router.entropy_spread",
    [RS_MAXVIO] = "router.maxvio",           [RS_LOAD_ENTROPY] = "router.load_entropy",
    [RS_DEAD] = "router.dead_experts",       [RS_BALANCE] = "router.balance",
    [RS_ZLOSS] = "router.zloss",
};

static const char *const agg_suffix[4] = {"min", "mean", "max", "argmin"};

/* --- worker pool: workspaces checked out under a mutex -------------------------------- */

struct ws_entry {
    void *ws;
    unsigned cap;
};

struct ws_pool {
    pthread_mutex_t mu;
    struct ws_entry *qk, *rt; /* free workspaces */
    size_t n_qk, cap_qk, n_rt, cap_rt;
};

static unsigned round_pow2(unsigned x, unsigned min)
{
    unsigned c = min;
    while (c < x)
        c *= 2;
    return c;
}

static void *pool_take(struct ws_pool *p, int router, unsigned need)
{
    pthread_mutex_lock(&p->mu);
    struct ws_entry *arr = router ? p->rt : p->qk;
    size_t n = router ? p->n_rt : p->n_qk, best = n;
    for (size_t i = 0; i < n; i++)
        if (arr[i].cap >= need && (best == n || arr[i].cap < arr[best].cap))
            best = i;
    void *ws = NULL;
    if (best < n) {
        ws = arr[best].ws;
        arr[best] = arr[n - 1];
        if (router)
            p->n_rt--;
        else
            p->n_qk--;
    }
    pthread_mutex_unlock(&p->mu);
    if (ws)
        return ws;
    if (router) {
        unsigned cap = round_pow2(need, STAGE_WS_MIN_EXPERTS);
        if (cap > ROUTER_MAX_EXPERTS)
            cap = ROUTER_MAX_EXPERTS;
        struct router_workspace *w;
        return router_workspace_create(cap, &w) == 0 ? (void *)w : NULL;
    }
    unsigned cap = round_pow2(need, STAGE_WS_MIN_DH);
    if (cap > QK_MAX_DH)
        cap = QK_MAX_DH;
    struct qk_workspace *w;
    return qk_workspace_create(cap, &w) == 0 ? (void *)w : NULL;
}

/* Returns ws (capacity cap) to the pool; destroys it if the pool cannot grow. */
static void pool_give(struct ws_pool *p, int router, void *ws, unsigned cap)
{
    if (!ws)
        return;
    pthread_mutex_lock(&p->mu);
    struct ws_entry **arr = router ? &p->rt : &p->qk;
    size_t *n = router ? &p->n_rt : &p->n_qk, *capn = router ? &p->cap_rt : &p->cap_qk;
    int kept = 0;
    if (*n == *capn) {
        size_t c = *capn ? *capn * 2 : 8;
        struct ws_entry *a = realloc(*arr, c * sizeof(*a));
        if (a) {
            *arr = a;
            *capn = c;
        }
    }
    if (*n < *capn) {
        (*arr)[(*n)++] = (struct ws_entry){.ws = ws, .cap = cap};
        kept = 1;
    }
    pthread_mutex_unlock(&p->mu);
    if (!kept) {
        if (router)
            router_workspace_destroy(ws);
        else
            qk_workspace_destroy(ws);
    }
}

static void pool_destroy(struct ws_pool *p)
{
    for (size_t i = 0; i < p->n_qk; i++)
        qk_workspace_destroy(p->qk[i].ws);
    for (size_t i = 0; i < p->n_rt; i++)
        router_workspace_destroy(p->rt[i].ws);
    free(p->qk);
    free(p->rt);
    pthread_mutex_destroy(&p->mu);
}

/* --- detected series: the evaluator (evaluate.h) per run ---------------------------------- */

/* Scalars of a rank-0 report waiting for the earlier steps' buckets, so that
 * every detector of a run sees its steps in order and attribution at a
 * step reflects only what was known up to that step. */
struct scalar_sample {
    uint64_t step;
    double time;
    uint32_t rank; /* the run's lead rank when queued */
    bool has_loss, has_grad, has_lr;
    double loss, grad, lr;
    uint32_t n_wn, n_ur;
    float *wn, *ur; /* owned */
    struct scalar_sample *next;
};

/* A stream's attempt (stage_attempt, or the streams table at a restart). */
struct stream_attempt {
    int64_t stream_id;
    uint32_t attempt;
};

enum rewind_phase {
    REWIND_IDLE = 0,
    REWIND_DRAINING = 1,   /* the old attempt's jobs of steps <= the rewind step finish */
    REWIND_REBUILDING = 2, /* rewind_rebuild on a worker */
};

/* Spooled frame bytes of one step not yet evaluated (spool_max_bytes). */
struct spool_step {
    uint64_t step;
    uint64_t bytes;
};

struct stage_run {
    struct scalar_sample *sc_head, *sc_tail;
    size_t n_sc;
    struct spool_step *spooled; /* ascending step */
    size_t n_spooled, cap_spooled;
    struct eval_run ev; /* detector and alert state of the run's detected series */
    bool dropping; /* a step was abandoned at shutdown: later ones are not evaluated either */
    struct job *jobs_head, *jobs_tail; /* buckets on workers or waiting to be evaluated */
    /* Attempts (stage.h): the run's latest and its rewind step, and each
     * stream's. Reports of an older attempt after resume_step are ignored. */
    uint32_t attempt;
    bool has_resume;
    uint64_t resume_step;
    struct stream_attempt *streams;
    size_t n_streams, cap_streams;
    /* A rewind in progress: nothing of the run is dispatched or detected. */
    enum rewind_phase rewind;
    uint64_t rewind_step;
    uint32_t rewind_from;  /* the attempt being abandoned */
    unsigned rewind_gen;   /* a newer rewind makes a rebuild in flight stale */
    bool rebuild_busy;     /* a rewind_work of this run is on a worker */
};

/* --- jobs: one bucket on the workers ----------------------------------------------------- */

struct chunk {
    uv_work_t req;
    struct job *job;
    size_t lo, hi; /* units[lo..hi) */
    double seconds; /* CPU time of the worker thread (fs_clock_thread_cpu) */
    uint64_t heads;
};

struct job {
    struct stage *st;
    int64_t run_id;
    struct run_bucket *b;
    struct run_group **units; /* groups that need the workers */
    size_t n_units;
    struct chunk *chunks;
    size_t n_chunks, pending;
    bool computed;
    bool cancelled; /* a chunk never ran (shutdown deadline): not to be evaluated */
    bool superseded; /* a step a rewind abandoned: not to be evaluated */
    struct job *next;
};

struct stage {
    struct stage_opts opts;
    struct fs_stats *stats;
    struct fs_stats own_stats;
    struct run_registry *reg;
    struct ws_pool pool;
    uv_timer_t sweep;
    int timer_open;
    size_t inflight; /* chunks on workers */
    size_t jobs;     /* jobs not yet evaluated */
    int stopping;
    size_t abandoned; /* steps left unevaluated (spooled) by the deadline */
    uint64_t spool_pending; /* spooled frame bytes of steps not yet evaluated, all runs */
    int full;
    void (*pressure)(void *ctx, int full);
    void *pressure_ctx;
    void (*done)(void *ctx);
    void *done_ctx;
    char *db_path; /* for rewinds (opts.db_path or stage_load's), owned */
    struct log_ratelimit rl_incomplete, rl_late, rl_dup, rl_err, rl_superseded;
};

static double now_mono(void) { return (double)uv_hrtime() * 1e-9; }

static int64_t detect_from(const struct stage *st, const struct run *run)
{
    return (int64_t)(run->has_detect_from_step ? run->detect_from_step : st->opts.detect_from_step);
}

static struct stage_run *stage_run_of(const struct stage *st, struct run *run)
{
    if (!run->user) {
        struct stage_run *sr = calloc(1, sizeof(*sr));
        if (!sr)
            return NULL;
        eval_run_init(&sr->ev, st->opts.rules);
        run->user = sr;
    }
    return run->user;
}

static void sample_free(struct scalar_sample *s)
{
    if (!s)
        return;
    free(s->wn);
    free(s->ur);
    free(s);
}

static void stage_run_free(struct stage_run *sr)
{
    if (!sr)
        return;
    while (sr->sc_head) {
        struct scalar_sample *x = sr->sc_head;
        sr->sc_head = x->next;
        sample_free(x);
    }
    eval_run_clear(&sr->ev);
    free(sr->streams);
    free(sr->spooled);
    free(sr);
}

/* --- the spool bound: frame bytes waiting for their step's evaluation ----------------- */

/* A fed report's spooled frame (bytes) waits for step's evaluation. */
static void spool_note(struct stage *st, struct stage_run *sr, uint64_t step, uint64_t bytes)
{
    size_t i = sr->n_spooled;
    while (i > 0 && sr->spooled[i - 1].step > step)
        i--;
    if (i > 0 && sr->spooled[i - 1].step == step) {
        sr->spooled[i - 1].bytes += bytes;
    } else {
        if (sr->n_spooled == sr->cap_spooled) {
            size_t cap = sr->cap_spooled ? sr->cap_spooled * 2 : 16;
            struct spool_step *p = realloc(sr->spooled, cap * sizeof(*p));
            if (!p)
                return; /* not counted: the bound is a little looser */
            sr->spooled = p;
            sr->cap_spooled = cap;
        }
        memmove(&sr->spooled[i + 1], &sr->spooled[i], (sr->n_spooled - i) * sizeof(*sr->spooled));
        sr->spooled[i] = (struct spool_step){.step = step, .bytes = bytes};
        sr->n_spooled++;
    }
    st->spool_pending += bytes;
}

/* Every step <= step of the run is evaluated: its frames no longer count. */
static void spool_evaluated(struct stage *st, struct stage_run *sr, uint64_t step)
{
    size_t k = 0;
    while (k < sr->n_spooled && sr->spooled[k].step <= step)
        st->spool_pending -= sr->spooled[k++].bytes;
    if (k) {
        memmove(sr->spooled, sr->spooled + k, (sr->n_spooled - k) * sizeof(*sr->spooled));
        sr->n_spooled -= k;
    }
}

/* --- building one STORE_ITEM_MONITOR -------------------------------------------------------- */

struct build {
    struct store_item *it;
    size_t cap_points, cap_states, cap_alerts, cap_incomplete;
    size_t *blob_off; /* per state: offset into blobs */
    size_t blob_len, blob_cap;
    struct eval_batch batch; /* alert rows changed by this item */
    int oom;
};

static int build_begin(struct build *bd, int64_t run_id, double time)
{
    memset(bd, 0, sizeof(*bd));
    bd->it = store_item_new(STORE_ITEM_MONITOR);
    if (!bd->it)
        return -ENOMEM;
    bd->it->monitor.run_id = run_id;
    bd->it->monitor.time = time;
    return 0;
}

static void *grow(void *p, size_t *cap, size_t n, size_t size, int *oom)
{
    if (n < *cap)
        return p;
    size_t c = *cap ? *cap * 2 : 64;
    void *q = realloc(p, c * size);
    if (!q) {
        *oom = 1;
        return NULL;
    }
    *cap = c;
    return q;
}

static void set_key(struct store_series_key *k, const char *name, int32_t layer, int32_t head,
                    int32_t window, int32_t rank)
{
    snprintf(k->name, sizeof(k->name), "%s", name);
    k->layer = layer;
    k->head = head;
    k->window = window;
    k->rank = rank;
}

static void add_point(struct build *bd, const struct store_series_key *k, uint64_t step,
                      double value)
{
    struct store_monitor *m = &bd->it->monitor;
    struct store_point *p = grow(m->points, &bd->cap_points, m->n_points, sizeof(*p), &bd->oom);
    if (!p)
        return;
    m->points = p;
    p[m->n_points++] = (struct store_point){.key = *k, .step = step, .value = value};
}

static void add_state(struct build *bd, const struct eval_track *t)
{
    struct store_monitor *m = &bd->it->monitor;
    uint8_t buf[DETECT_STATE_ENCODED_MAX];
    int len = detect_state_encode(&t->ds, buf, sizeof(buf));
    if (len < 0) {
        bd->oom = 1;
        return;
    }
    size_t cap = bd->cap_states;
    struct store_detector_row *d = grow(m->states, &cap, m->n_states, sizeof(*d), &bd->oom);
    if (!d)
        return;
    m->states = d;
    if (cap != bd->cap_states) {
        size_t *off = realloc(bd->blob_off, cap * sizeof(*off));
        if (!off) {
            bd->oom = 1;
            return;
        }
        bd->blob_off = off;
        bd->cap_states = cap;
    }
    if (bd->blob_len + (size_t)len > bd->blob_cap) {
        size_t c = bd->blob_cap ? bd->blob_cap * 2 : 8192;
        while (c < bd->blob_len + (size_t)len)
            c *= 2;
        uint8_t *b = realloc(m->blobs, c);
        if (!b) {
            bd->oom = 1;
            return;
        }
        m->blobs = b;
        bd->blob_cap = c;
    }
    memcpy(m->blobs + bd->blob_len, buf, (size_t)len);
    bd->blob_off[m->n_states] = bd->blob_len;
    d[m->n_states++] = (struct store_detector_row){
        .key = t->key, .step = (uint64_t)t->last_step, .len = (uint32_t)len};
    bd->blob_len += (size_t)len;
}

static void add_incomplete(struct build *bd, uint64_t step, const struct run_incomplete *r)
{
    struct store_monitor *m = &bd->it->monitor;
    struct store_incomplete_row *p =
        grow(m->incomplete, &bd->cap_incomplete, m->n_incomplete, sizeof(*p), &bd->oom);
    if (!p)
        return;
    m->incomplete = p;
    p[m->n_incomplete++] = (struct store_incomplete_row){
        .kind = run_group_kind_name(r->kind), .step = step, .layer = (int32_t)r->layer,
        .head = r->head, .window = (int32_t)r->window, .have = r->have, .want = r->want};
}

/* One sample into a detected series: detector, alert lifecycle (evaluate.h),
 * the detector-state row, and the alert row when it changed (labels and
 * rows are filled in by build_finish). */
static void feed_track(struct stage *st, struct stage_run *sr, struct run *run, struct build *bd,
                       const struct store_series_key *k, const char *rule_name, uint64_t step,
                       double value, bool present, int32_t argmin_head)
{
    struct eval_track *t = eval_track_get(&sr->ev, k, rule_name);
    if (!t)
        return;
    size_t before = bd->batch.n;
    int rc = eval_feed(&sr->ev, &bd->batch, t, step, value, present, argmin_head,
                       detect_from(st, run), fs_clock_unix());
    if (rc < 0) {
        bd->oom |= rc == -ENOMEM;
        return;
    }
    if (rc == 0)
        return;
    add_state(bd, t);
    if (bd->batch.n > before && bd->batch.ev[before].tr.change == ALERT_CHANGE_TO_FIRING)
        atomic_fetch_add(&st->stats->alerts_fired, 1);
}

static json_t *jnum(double v) { return isfinite(v) ? json_real(v) : json_null(); }

static json_t *jstep(int64_t v) { return v >= 0 ? json_integer(v) : json_null(); }

static json_t *jlabel(int32_t v, int32_t none) { return v == none ? json_null() : json_integer(v); }

static char *evidence_json(const struct eval_event *p)
{
    const struct alert_transition *tr = &p->tr;
    json_t *o = json_object();
    if (!o)
        return NULL;
    json_object_set_new(o, "value", jnum(tr->value));
    json_object_set_new(o, "median", jnum(tr->median));
    json_object_set_new(o, "mad", jnum(tr->mad));
    json_object_set_new(o, "z", jnum(tr->z));
    json_object_set_new(o, "first_breach_step", jstep(tr->first_breach_step));
    json_object_set_new(o, "fired_step", jstep(tr->fired_step));
    json_object_set_new(o, "step", json_integer(tr->step));
    json_object_set_new(o, "layer", jlabel(tr->scope.layer, -1));
    json_object_set_new(o, "head", jlabel(tr->scope.head, -1));
    json_object_set_new(o, "window", jlabel(tr->scope.window, 0));
    json_object_set_new(o, "rank", jlabel(tr->scope.rank, -1));
    json_object_set_new(o, "argmin_head", jlabel(p->argmin_head, -1));
    json_object_set_new(o, "breach_kind", json_string(detect_breach_kind_name(tr->breach_kind)));
    json_object_set_new(o, "attribution", json_string(alert_attribution_name(p->attr)));
    /* The series the label rests on (evaluate.h): what a person checks first. */
    json_object_set_new(o, "label_series", json_string(p->why));
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

/* Labels the changed alert rows (every sample of their steps is in) and
 * turns them into rows; fixes the blob pointers. */
static void build_finish(struct stage_run *sr, const struct run *run, struct build *bd)
{
    struct store_monitor *m = &bd->it->monitor;
    struct eval_batch *b = &bd->batch;
    for (size_t i = 0; i < m->n_states; i++)
        m->states[i].blob = m->blobs + bd->blob_off[i];
    if (b->oom)
        bd->oom = 1;
    if (b->n) {
        eval_label_all(&sr->ev, b);
        m->alerts = calloc(b->n, sizeof(*m->alerts));
        if (!m->alerts)
            bd->oom = 1;
        for (size_t i = 0; m->alerts && i < b->n; i++) {
            const struct eval_event *p = &b->ev[i];
            struct eval_track *t = p->t;
            struct store_alert_row *a = &m->alerts[m->n_alerts];
            struct alert_scope scope = {.layer = t->key.layer, .head = t->key.head,
                                        .window = t->key.window, .rank = t->key.rank};
            if (alert_key(run->name, t->rule_name, &scope, a->alert_key, sizeof(a->alert_key)) < 0 ||
                alert_dedup_key(a->alert_key, a->dedup_key, sizeof(a->dedup_key)) < 0)
                continue;
            if (p->has_event) {
                a->event_attribution = alert_attribution_name(p->attr);
                a->has_event = 1;
                a->change = alert_change_name(p->tr.change);
                a->from_state = (int)p->tr.from;
                a->to_state = (int)p->tr.to;
                a->event_step = p->tr.step;
                a->evidence_json = evidence_json(p);
                if (!a->evidence_json)
                    bd->oom = 1;
                /* pending <-> inactive flips are routine: debug; firing and
                 * resolved are news. */
                log_msg(p->tr.change == ALERT_CHANGE_TO_FIRING ||
                                  p->tr.change == ALERT_CHANGE_TO_RESOLVED
                              ? LOG_LEVEL_INFO
                              : LOG_LEVEL_DEBUG,
                          "stage", "alert %s %s run=%s layer=%d head=%d window=%d rank=%d step=%lld "
                         "value=%g attribution=%s (%s)",
                         t->rule_name, a->change, run->name, scope.layer, scope.head,
                         scope.window, scope.rank, (long long)p->tr.step, p->tr.value,
                         alert_attribution_name(p->attr), p->why);
            }
            a->series = t->key;
            snprintf(a->rule, sizeof(a->rule), "%s", t->rule_name);
            a->state = t->as.state;
            a->severity = detect_severity_name((enum detect_severity)t->as.severity);
            a->family = detect_family_name(t->rule->family);
            a->attribution = alert_attribution_name(t->ev_attr);
            a->value = t->ev_value;
            a->median = t->ev_median;
            a->mad = t->ev_mad;
            a->z = t->ev_z;
            a->first_breach_step = t->as.first_breach_step;
            a->fired_step = t->as.fired_step;
            a->resolved_step = t->as.resolved_step;
            a->last_step = t->last_step;
            a->incidents = t->as.incidents;
            a->attempt = sr->attempt;
            int len = alert_state_encode(&t->as, a->blob, sizeof(a->blob));
            a->blob_len = len > 0 ? (uint32_t)len : 0;
            if (len > 0)
                memcpy(t->row_blob, a->blob, sizeof(t->row_blob));
            m->n_alerts++;
        }
    }
    eval_batch_free(b);
    free(bd->blob_off);
    bd->blob_off = NULL;
}

/* Submits the item (or drops an empty one). */
static void build_submit(struct stage *st, struct build *bd)
{
    struct store_item *it = bd->it;
    const struct store_monitor *m = &it->monitor;
    bd->it = NULL;
    if (bd->oom)
        log_limited(&st->rl_err, LOG_LEVEL_ERROR, "stage",
                    "out of memory building monitor rows of run %lld: some are lost",
                    (long long)m->run_id);
    if (!m->n_points && !m->n_states && !m->n_alerts && !m->n_incomplete && !m->has_spool_done) {
        store_item_free(it);
        return;
    }
    int rc = store_submit(st->opts.store, it);
    if (rc < 0) {
        log_limited(&st->rl_err, LOG_LEVEL_ERROR, "stage",
                    "cannot queue monitor rows of run %lld: %s", (long long)m->run_id,
                    strerror(-rc));
        store_item_free(it);
    }
}

/* --- scalars (at feed time, no math) -------------------------------------------------------- */

static void detect_scalars(struct stage *st, struct stage_run *sr, struct run *run,
                           struct build *bd, const struct scalar_sample *x)
{
    struct store_series_key k;
    if (x->has_lr) { /* training progress (evaluate.h), and the lr rule */
        eval_progress_lr(&sr->ev, x->step, x->lr);
        set_key(&k, "lr", -1, -1, 0, (int32_t)x->rank);
        feed_track(st, sr, run, bd, &k, "lr", x->step, x->lr, true, -1);
    }
    if (x->has_loss) {
        set_key(&k, "loss", -1, -1, 0, (int32_t)x->rank);
        feed_track(st, sr, run, bd, &k, "loss", x->step, x->loss, true, -1);
    }
    if (x->has_grad) {
        set_key(&k, "grad_norm", -1, -1, 0, (int32_t)x->rank);
        feed_track(st, sr, run, bd, &k, "grad_norm", x->step, x->grad, true, -1);
    }
    for (uint32_t l = 0; l < x->n_wn; l++) {
        set_key(&k, "weight_norm", (int32_t)l, -1, 0, (int32_t)x->rank);
        feed_track(st, sr, run, bd, &k, "weight_norm", x->step, x->wn[l], true, -1);
    }
    for (uint32_t l = 0; l < x->n_ur; l++) {
        set_key(&k, "update_ratio", (int32_t)l, -1, 0, (int32_t)x->rank);
        feed_track(st, sr, run, bd, &k, "update_ratio", x->step, x->ur[l], true, -1);
    }
    /* The report was spooled (stage_wants_spool): its row goes with the
     * rows derived from it. Every bucket at or below this step is
     * evaluated, so nothing else at or below it is still needed. */
    struct store_monitor *m = &bd->it->monitor;
    if (!m->has_spool_done || m->spool_done_step < x->step) {
        m->has_spool_done = 1;
        m->spool_done_step = x->step;
    }
    spool_evaluated(st, sr, x->step);
}

/* Lowest step of the run still reducing or on the workers (UINT64_MAX: none). */
static uint64_t pending_step(const struct run *run)
{
    const struct stage_run *sr = run->user;
    if (sr && sr->jobs_head)
        return sr->jobs_head->b->step; /* jobs are taken before the buckets left */
    return run->buckets ? run->buckets->step : UINT64_MAX;
}

/* Detects queued scalars of steps below every pending bucket (all of them
 * when `all`, at shutdown), into bd (an item being built for the run) or,
 * when bd is NULL, into one item of their own. */
static void flush_scalars(struct stage *st, struct run *run, struct build *bd, bool all)
{
    struct stage_run *sr = run->user;
    if (!sr || !sr->sc_head || (sr->rewind && !all))
        return; /* a rewind detects them once the state at its step is rebuilt */
    uint64_t limit = all ? UINT64_MAX : pending_step(run);
    if (!all && sr->sc_head->step >= limit)
        return;
    struct build own;
    if (!bd) {
        if (build_begin(&own, run->run_id, sr->sc_head->time) < 0)
            return;
        bd = &own;
    }
    while (sr->sc_head && (all || sr->sc_head->step < limit)) {
        struct scalar_sample *x = sr->sc_head;
        sr->sc_head = x->next;
        if (!sr->sc_head)
            sr->sc_tail = NULL;
        sr->n_sc--;
        detect_scalars(st, sr, run, bd, x);
        sample_free(x);
    }
    if (bd == &own) {
        build_finish(sr, run, bd);
        build_submit(st, bd);
    }
}

/* Queues the detected scalars of a report (loss and grad norm of the
 * run's lead rank only, rank 0 unless a local group says otherwise: the
 * other ranks' are stored by the REPORT item, but one detector per run is
 * what attribution and lead time are measured against). */
static void queue_scalars(struct stage *st, struct run *run, const struct stage_report *in)
{
    const Foreshock__Scalars *s = in->report->scalars;
    if (!s || in->rank != run->lead_rank)
        return;
    struct stage_run *sr = stage_run_of(st, run);
    struct scalar_sample *x = calloc(1, sizeof(*x));
    if (!sr || !x) {
        free(x);
        log_limited(&st->rl_err, LOG_LEVEL_ERROR, "stage",
                    "out of memory: scalars of run %s step %llu not detected", run->name,
                    (unsigned long long)in->step);
        return;
    }
    x->step = in->step;
    x->time = in->time;
    x->rank = in->rank;
    x->has_loss = s->has_loss;
    x->loss = s->loss;
    x->has_grad = s->has_grad_norm;
    x->grad = s->grad_norm;
    x->has_lr = s->has_lr;
    x->lr = s->lr;
    if (s->n_layer_weight_norm && (x->wn = malloc(s->n_layer_weight_norm * sizeof(float)))) {
        memcpy(x->wn, s->layer_weight_norm, s->n_layer_weight_norm * sizeof(float));
        x->n_wn = (uint32_t)s->n_layer_weight_norm;
    }
    if (s->n_layer_update_ratio && (x->ur = malloc(s->n_layer_update_ratio * sizeof(float)))) {
        memcpy(x->ur, s->layer_update_ratio, s->n_layer_update_ratio * sizeof(float));
        x->n_ur = (uint32_t)s->n_layer_update_ratio;
    }
    if (sr->n_sc >= STAGE_MAX_SCALAR_QUEUE)
        flush_scalars(st, run, NULL, true);
    if (sr->sc_tail)
        sr->sc_tail->next = x;
    else
        sr->sc_head = x;
    sr->sc_tail = x;
    sr->n_sc++;
}

/* --- evaluation of a computed bucket (loop thread, step order) --------------------------------- */

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
                set_key(&k, qk_series_name(head_series[s]), (int32_t)layer, (int32_t)g[i]->head,
                        (int32_t)window, -1);
                add_point(bd, &k, b->step, v);
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
                    set_key(&k, name, (int32_t)layer, -1, (int32_t)window, -1);
                    add_point(bd, &k, b->step, a->present ? vals[q] : NAN);
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
                        if (qk_head_value(&heads[i], qk_detected[d].series, &x) == 0 && x == a->max) {
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
                set_key(&k, name, (int32_t)layer, -1, (int32_t)window, -1);
                if (eval_input_rule(st->opts.rules, &k, run->lead_rank, rule, sizeof(rule)))
                    feed_track(st, sr, run, bd, &k, rule, b->step, v, present, at);
            }
        }
        lo = hi;
    }
    free(g);
    free(heads);
}

static void router_point(struct stage *st, struct stage_run *sr, struct run *run,
                         struct build *bd, uint64_t step, uint32_t layer, int which, bool present,
                         double v, bool nonfinite)
{
    struct store_series_key k;
    set_key(&k, router_names[which], (int32_t)layer, -1, 0, -1);
    if (nonfinite) {
        v = NAN;
        present = true;
    }
    add_point(bd, &k, step, present ? v : NAN);
    /* Detection where a rule exists (similarity, centered energy, z-loss,
     * MaxVio, load entropy by default). */
    char rule[DETECT_NAME_MAX];
    if (eval_input_rule(st->opts.rules, &k, run->lead_rank, rule, sizeof(rule)))
        feed_track(st, sr, run, bd, &k, rule, step, v, present, -1);
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
            router_point(st, sr, run, bd, step, g->layer, RS_SIMILARITY, w->sim_present, w->sim, nf);
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
            router_point(st, sr, run, bd, step, g->layer, RS_MAXVIO, d->load_present, d->maxvio, nf);
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

static void evaluate(struct stage *st, struct run *run, struct run_bucket *b)
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
        add_incomplete(&bd, b->step, &b->incomplete[i]);
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
    spool_evaluated(st, sr, b->step);
    flush_scalars(st, run, &bd, false);
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
            pool_give(&st->pool, 0, *qk_ws, *qk_cap);
            *qk_ws = NULL;
        }
        if (!*qk_ws) {
            *qk_ws = pool_take(&st->pool, 0, g->size);
            *qk_cap = round_pow2(g->size, STAGE_WS_MIN_DH);
        }
        r->rc = *qk_ws ? qk_head_from_grams(*qk_ws, g->size, g->a, g->b, &r->qk) : -ENOMEM;
        r->done = r->rc != -ENOMEM;
    } else if (g->kind == RUN_GROUP_ROUTER_GRAM) {
        if (*rt_ws && *rt_cap < g->size) {
            pool_give(&st->pool, 1, *rt_ws, *rt_cap);
            *rt_ws = NULL;
        }
        if (!*rt_ws) {
            *rt_ws = pool_take(&st->pool, 1, g->size);
            *rt_cap = round_pow2(g->size, STAGE_WS_MIN_EXPERTS);
        }
        r->rc = *rt_ws ? router_weight_compute(*rt_ws, g->size, g->a, &r->rw) : -ENOMEM;
        r->done = r->rc != -ENOMEM;
    } else {
        struct router_tokens in = {.n_experts = g->size, .n_tok = g->n_tok, .sum_h = g->sum_h,
                                   .sum_h2 = g->sum_h2, .sum_lse2 = g->sum_lse2, .load = g->load,
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
static void work_cb(uv_work_t *req)
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
    pool_give(&st->pool, 0, qk, qk_cap);
    pool_give(&st->pool, 1, rt, rt_cap);
    c->seconds = fs_clock_thread_cpu() - t0;
}

static void job_free(struct job *j)
{
    run_bucket_free(j->b);
    free(j->units);
    free(j->chunks);
    free(j);
}

/* Ingest reads only the streams that can complete a run's oldest step
 * (stage_may_read) while reduction memory or the spooled frames of steps
 * not yet evaluated are at their bound: ranks that ran ahead wait, and the
 * lagging ranks' shards, which are what frees both, always get in. (The
 * writer used to refuse every report at the spool bound instead: with
 * 1,024 ranks the ranks ahead filled it and the oldest step waited for the
 * reduce timeout.) */
static void check_pressure(struct stage *st)
{
    uint64_t bytes = run_registry_bytes(st->reg);
    uint64_t spool_max = st->opts.spool_max_bytes;
    atomic_store(&st->stats->reduce_bytes, bytes);
    bool spool_full = spool_max && st->spool_pending >= spool_max;
    if (!st->full && (run_registry_full(st->reg) || spool_full)) {
        st->full = 1;
        atomic_fetch_add(&st->stats->reduce_pauses, 1);
        if (spool_full)
            log_warn("stage", "spooled frames of steps not yet evaluated reached spool_max_bytes "
                     "%llu (%llu bytes): only ranks that complete the oldest step are read until "
                     "steps are evaluated",
                     (unsigned long long)spool_max, (unsigned long long)st->spool_pending);
        else
            log_warn("stage", "reduction memory %llu bytes reached reduce_max_bytes %llu: only "
                     "ranks that complete the oldest step are read until steps complete or time "
                     "out",
                     (unsigned long long)bytes, (unsigned long long)st->opts.reduce_max_bytes);
        if (st->pressure)
            st->pressure(st->pressure_ctx, 1);
    } else if (st->full && bytes < st->opts.reduce_max_bytes / 4 * 3 &&
               (!spool_max || st->spool_pending < spool_max / 4 * 3)) {
        st->full = 0;
        if (st->pressure)
            st->pressure(st->pressure_ctx, 0);
    } else if (st->full && st->pressure) {
        st->pressure(st->pressure_ctx, 1); /* which streams are needed may have changed */
    }
}

static void maybe_done(struct stage *st);
static void rewind_rebuild_start(struct stage *st, struct run *run);
static void pump(struct stage *st, struct run *run, double now);

/* Evaluates the run's computed jobs from the front, in step order. */
static void drain(struct stage *st, struct run *run)
{
    struct stage_run *sr = run->user;
    while (sr && sr->jobs_head && sr->jobs_head->computed) {
        struct job *j = sr->jobs_head;
        sr->jobs_head = j->next;
        if (!sr->jobs_head)
            sr->jobs_tail = NULL;
        /* A step whose math was cancelled at the shutdown deadline is not
         * evaluated, nor any later step of the run (steps go in order): their
         * sketches stay spooled and the next start evaluates them. */
        if (j->cancelled)
            sr->dropping = true;
        if (sr->dropping)
            st->abandoned++;
        else if (!j->superseded)
            evaluate(st, run, j->b);
        st->jobs--;
        job_free(j);
    }
    if (sr && sr->rewind == REWIND_DRAINING && !sr->jobs_head)
        rewind_rebuild_start(st, run);
    check_pressure(st);
}

/* --- rewinds (stage.h, rewind.h) ------------------------------------------------------ */

struct rewind_work {
    uv_work_t req;
    struct stage *st;
    int64_t run_id;
    uint64_t step;
    unsigned gen;
    int64_t detect_from;
    uint32_t lead_rank;
    struct eval_run er; /* the rebuilt state; moved into the run when applied */
    int rc;
    char err[256];
};

/* Threadpool thread: the state at the rewind step from the stored points. */
static void rewind_work_cb(uv_work_t *req)
{
    struct rewind_work *w = req->data;
    /* Every monitor row of steps <= step was submitted before this started
     * (the old attempt's jobs up to it were evaluated): committed once the
     * flush returns, so the replay reads what live detection saw. */
    if (w->st->opts.store)
        store_flush(w->st->opts.store);
    w->rc = rewind_rebuild(w->st->db_path, w->run_id, w->step, w->lead_rank, w->detect_from,
                           &w->er, w->err, sizeof(w->err));
}

/* A row the rewind changes, to set what build_finish cannot know. */
struct rewind_fix {
    const struct eval_track *t;
    int row_state;
    bool superseded;
    int64_t first_breach_step, fired_step; /* of the superseded incident */
};

/* Applies a rebuilt state to the run: alert fates (rewind_fate), one item
 * with every detector state and changed alert row, then the swap. */
static void rewind_apply(struct stage *st, struct run *run, struct stage_run *sr,
                         struct rewind_work *w)
{
    int64_t step = (int64_t)w->step;
    struct build bd;
    if (build_begin(&bd, run->run_id, fs_clock_unix()) < 0) {
        log_error("stage", "run %s: out of memory storing the rewind to step %lld; the next "
                  "start rebuilds it", run->name, (long long)step);
        return;
    }
    size_t n_rebuilt = w->er.n_tracks, n_fix = 0, superseded = 0;
    bool *matched = calloc(n_rebuilt ? n_rebuilt : 1, sizeof(*matched));
    struct rewind_fix *fix = calloc(sr->ev.n_tracks ? sr->ev.n_tracks : 1, sizeof(*fix));
    if (!matched || !fix)
        bd.oom = 1;
    for (size_t i = 0; matched && fix && i < sr->ev.n_tracks; i++) {
        const struct eval_track *old = sr->ev.tracks[i];
        struct eval_track *t = eval_track_get(&w->er, &old->key, old->rule_name);
        if (!t) {
            bd.oom = 1;
            continue;
        }
        for (size_t k = 0; k < n_rebuilt; k++)
            if (w->er.tracks[k] == t)
                matched[k] = true;
        memcpy(t->row_blob, old->row_blob, sizeof(t->row_blob)); /* what the row holds */
        enum rewind_fate f = rewind_fate(&old->as, &t->as, step);
        if (f != REWIND_ROW) { /* the row goes on showing the old incident's evidence */
            t->ev_value = old->ev_value;
            t->ev_median = old->ev_median;
            t->ev_mad = old->ev_mad;
            t->ev_z = old->ev_z;
            t->ev_attr = old->ev_attr;
            memcpy(t->ev_why, old->ev_why, sizeof(t->ev_why));
        }
        if (f == REWIND_CONTINUE)
            t->as = old->as;
        if (t->last_step < 0)
            t->last_step = step; /* never fed at or before step: starts after it */
        add_state(&bd, t);
        if (f == REWIND_KEEP)
            continue;
        struct eval_batch *b = &bd.batch;
        struct eval_event *e = grow(b->ev, &b->cap, b->n, sizeof(*e), &bd.oom);
        if (!e)
            continue;
        b->ev = e;
        struct alert_transition tr = {
            .change = ALERT_CHANGE_TO_SUPERSEDED, .from = (enum alert_state_id)old->as.state,
            .to = ALERT_SUPERSEDED, .family = t->rule->family,
            .severity = (enum detect_severity)old->as.severity, .breach_kind = DETECT_BREACH_NONE,
            .scope = {.layer = t->key.layer, .head = t->key.head, .window = t->key.window,
                      .rank = t->key.rank},
            .step = step, .value = NAN, .median = NAN, .mad = NAN, .z = NAN,
            .first_breach_step = old->as.first_breach_step, .fired_step = old->as.fired_step,
            .incident = old->as.incidents};
        snprintf(tr.rule, sizeof(tr.rule), "%s", t->rule_name);
        e[b->n] = (struct eval_event){.t = t, .has_event = f == REWIND_SUPERSEDE, .tr = tr,
                                      .argmin_head = -1, .attr = old->ev_attr};
        memcpy(e[b->n].why, old->ev_why, sizeof(e[b->n].why));
        b->n++;
        fix[n_fix++] = (struct rewind_fix){
            .t = t, .row_state = rewind_row_state(f, &old->as, &t->as),
            .superseded = f == REWIND_SUPERSEDE, .first_breach_step = old->as.first_breach_step,
            .fired_step = old->as.fired_step};
        superseded += f == REWIND_SUPERSEDE;
    }
    /* Series seen only up to the step... and not since: their state too. */
    for (size_t k = 0; matched && k < n_rebuilt; k++)
        if (!matched[k])
            add_state(&bd, w->er.tracks[k]);
    /* The events carry their labels (the old incidents'): none to decide. */
    bd.batch.next_label = bd.batch.n;
    build_finish(sr, run, &bd);
    struct store_monitor *m = &bd.it->monitor;
    for (size_t i = 0; i < m->n_alerts; i++) {
        struct store_alert_row *a = &m->alerts[i];
        for (size_t k = 0; k < n_fix; k++) {
            const struct rewind_fix *x = &fix[k];
            if (strcmp(x->t->rule_name, a->rule) != 0 ||
                memcmp(&x->t->key, &a->series, sizeof(a->series)) != 0)
                continue;
            a->state = x->row_state;
            if (x->superseded) {
                /* The row keeps showing the incident it ended; its blob is the
                 * rebuilt state the next transition starts from. */
                a->first_breach_step = x->first_breach_step;
                a->fired_step = x->fired_step;
                a->attempt = sr->rewind_from;
            }
            break;
        }
    }
    m->has_rebuilt = 1;
    m->rebuilt_attempt = sr->attempt;
    build_submit(st, &bd);
    free(matched);
    free(fix);
    eval_run_clear(&sr->ev);
    sr->ev = w->er; /* moved */
    memset(&w->er, 0, sizeof(w->er));
    atomic_fetch_add(&st->stats->rewinds, 1);
    log_info("stage", "run %s: attempt %u goes on from step %lld: detection state rebuilt from the "
             "stored points (%zu series), %zu incidents of attempt %u superseded",
             run->name, sr->attempt, (long long)step, sr->ev.n_tracks, superseded, sr->rewind_from);
}

static void rewind_after_cb(uv_work_t *req, int status)
{
    struct rewind_work *w = req->data;
    struct stage *st = w->st;
    st->inflight--;
    struct run *run = run_find(st->reg, w->run_id);
    struct stage_run *sr = run ? run->user : NULL;
    if (sr)
        sr->rebuild_busy = false;
    if (sr && sr->rewind == REWIND_REBUILDING && sr->rewind_gen == w->gen) {
        if (status == 0 && w->rc == 0)
            rewind_apply(st, run, sr, w);
        else
            log_error("stage", "run %s: rebuilding detection at step %llu failed (%s); the new "
                      "attempt goes on from the live state, and the next start rebuilds it",
                      run->name, (unsigned long long)w->step,
                      status ? uv_strerror(status) : w->err);
        sr->rewind = REWIND_IDLE;
        pump(st, run, now_mono());
        flush_scalars(st, run, NULL, false);
    } else if (sr && sr->rewind == REWIND_DRAINING && !sr->jobs_head) {
        rewind_rebuild_start(st, run); /* a newer rewind came while this one rebuilt */
    }
    eval_run_clear(&w->er);
    free(w);
    check_pressure(st);
    maybe_done(st);
}

static void rewind_rebuild_start(struct stage *st, struct run *run)
{
    struct stage_run *sr = run->user;
    if (!sr || sr->rewind != REWIND_DRAINING || sr->rebuild_busy || st->stopping)
        return;
    /* The old attempt's history up to the step first (lagging ranks). */
    if (run->buckets && run->buckets->step <= sr->rewind_step)
        return;
    struct rewind_work *w = st->db_path ? calloc(1, sizeof(*w)) : NULL;
    if (w) {
        w->st = st;
        w->run_id = run->run_id;
        w->step = sr->rewind_step;
        w->gen = sr->rewind_gen;
        w->detect_from = detect_from(st, run);
        w->lead_rank = run->lead_rank;
        w->req.data = w;
        eval_run_init(&w->er, st->opts.rules);
        if (uv_queue_work(st->opts.loop, &w->req, rewind_work_cb, rewind_after_cb) == 0) {
            st->inflight++;
            sr->rebuild_busy = true;
            sr->rewind = REWIND_REBUILDING;
            return;
        }
        free(w);
    }
    log_error("stage", "run %s: cannot rebuild detection at step %llu (%s); the new attempt "
              "goes on from the live state", run->name, (unsigned long long)sr->rewind_step,
              st->db_path ? "out of memory" : "no database");
    sr->rewind = REWIND_IDLE;
    pump(st, run, now_mono());
}

/* A Hello started an attempt that rewinds the run to step (abandoning
 * attempt `from`): what the old attempt left after step goes, the rest is
 * evaluated, then the state at step is rebuilt (rewind_rebuild_start). */
static void rewind_start(struct stage *st, struct run *run, struct stage_run *sr, uint64_t step,
                         uint32_t from)
{
    size_t buckets = run_drop_after(run, step), jobs = 0, scalars = 0;
    for (struct job *j = sr->jobs_head; j; j = j->next) {
        if (j->b->step > step && !j->superseded) {
            j->superseded = true;
            jobs++;
        }
    }
    struct scalar_sample **pp = &sr->sc_head;
    sr->sc_tail = NULL;
    while (*pp) {
        struct scalar_sample *x = *pp;
        if (x->step > step) {
            *pp = x->next;
            sample_free(x);
            sr->n_sc--;
            scalars++;
        } else {
            sr->sc_tail = x;
            pp = &x->next;
        }
    }
    sr->rewind = REWIND_DRAINING;
    sr->rewind_step = step;
    sr->rewind_from = from;
    sr->rewind_gen++;
    log_info("stage", "run %s: attempt %u restarts from step %llu: attempt %u's steps after it "
             "are dropped (%zu reducing, %zu on the workers, %zu scalar samples)",
             run->name, sr->attempt, (unsigned long long)step, from, buckets, jobs, scalars);
    check_pressure(st);
    if (!sr->jobs_head)
        rewind_rebuild_start(st, run);
}

static int set_stream_attempt(struct stage_run *sr, int64_t stream_id, uint32_t attempt)
{
    for (size_t i = 0; i < sr->n_streams; i++) {
        if (sr->streams[i].stream_id == stream_id) {
            sr->streams[i].attempt = attempt;
            return 0;
        }
    }
    if (sr->n_streams >= RUN_MAX_STREAMS_PER_RUN)
        return -ENOSPC;
    if (sr->n_streams == sr->cap_streams) {
        size_t cap = sr->cap_streams ? sr->cap_streams * 2 : 8;
        struct stream_attempt *p = realloc(sr->streams, cap * sizeof(*p));
        if (!p)
            return -ENOMEM;
        sr->streams = p;
        sr->cap_streams = cap;
    }
    sr->streams[sr->n_streams++] = (struct stream_attempt){.stream_id = stream_id,
                                                           .attempt = attempt};
    return 0;
}

/* The run's latest attempt (and its rewind step) as the writer knows it. */
static void set_run_attempt(struct stage_run *sr, const struct attempt_info *a)
{
    if (a->attempt < sr->attempt)
        return;
    sr->attempt = a->attempt;
    sr->has_resume = a->has_resume;
    sr->resume_step = a->resume_step;
}

static void after_work_cb(uv_work_t *req, int status)
{
    struct chunk *c = req->data;
    struct job *j = c->job;
    struct stage *st = j->st;
    if (status == UV_ECANCELED) /* cancelled by the shutdown deadline */
        j->cancelled = true;
    st->inflight--;
    atomic_fetch_add(&st->stats->heads_computed, c->heads);
    atomic_fetch_add(&st->stats->monitor_seconds_sum_us, (uint64_t)(c->seconds * 1e6));
    if (--j->pending == 0) {
        j->computed = true;
        struct run *run = run_find(st->reg, j->run_id);
        if (run)
            drain(st, run);
    }
    maybe_done(st);
}

/* Hands a taken bucket to the workers (or straight to evaluation when it
 * holds nothing to compute). */
static void dispatch(struct stage *st, struct run *run, struct run_bucket *b)
{
    struct stage_run *sr = stage_run_of(st, run);
    struct job *j = calloc(1, sizeof(*j));
    if (!sr || !j) {
        log_limited(&st->rl_err, LOG_LEVEL_ERROR, "stage",
                    "out of memory: run %s step %llu not evaluated (its sketches stay spooled)",
                    run->name, (unsigned long long)b->step);
        free(j);
        run_bucket_free(b);
        return;
    }
    j->st = st;
    j->run_id = run->run_id;
    j->b = b;
    size_t n = 0;
    for (size_t i = 0; i < b->n; i++)
        n += !b->groups[i]->res.done;
    unsigned maxc = st->opts.max_chunks ? st->opts.max_chunks : STAGE_DEFAULT_CHUNKS;
    size_t nc = n < maxc ? n : maxc;
    if (n) {
        j->units = malloc(n * sizeof(*j->units));
        j->chunks = calloc(nc, sizeof(*j->chunks));
        if (!j->units || !j->chunks) {
            nc = 0; /* evaluate without the math: the groups read as not computed */
            n = 0;
        }
    }
    n = 0;
    for (size_t i = 0; j->units && i < b->n; i++)
        if (!b->groups[i]->res.done)
            j->units[n++] = b->groups[i];
    if (sr->jobs_tail)
        sr->jobs_tail->next = j;
    else
        sr->jobs_head = j;
    sr->jobs_tail = j;
    st->jobs++;
    j->n_units = n;
    j->n_chunks = nc;
    for (size_t c = 0; c < nc; c++) {
        struct chunk *ch = &j->chunks[c];
        ch->job = j;
        ch->lo = n * c / nc;
        ch->hi = n * (c + 1) / nc;
        ch->req.data = ch;
        if (uv_queue_work(st->opts.loop, &ch->req, work_cb, after_work_cb) == 0) {
            j->pending++;
            st->inflight++;
        }
    }
    if (j->pending == 0) {
        j->computed = true;
        drain(st, run);
    }
}

/* Starts every ready bucket of the run, earliest first. */
static void pump(struct stage *st, struct run *run, double now)
{
    const struct stage_run *sr = run->user;
    if (st->stopping || (sr && sr->rewind == REWIND_REBUILDING))
        return;
    struct run_bucket *b;
    /* While a rewind drains, only the old attempt's history up to its step
     * goes on: the new attempt's steps wait for the rebuilt state. */
    while ((!sr || !sr->rewind || (run->buckets && run->buckets->step <= sr->rewind_step)) &&
           (b = run_take_ready(st->reg, run, now)) != NULL)
        dispatch(st, run, b);
    if (sr && sr->rewind == REWIND_DRAINING && !sr->jobs_head)
        rewind_rebuild_start(st, run);
}

void stage_poll(struct stage *st)
{
    double now = now_mono();
    for (size_t i = 0; i < run_count(st->reg); i++)
        pump(st, run_at(st->reg, i), now);
    check_pressure(st);
}

static void on_sweep(uv_timer_t *t) { stage_poll(t->data); }

bool stage_wants_spool(struct stage *st, int64_t run_id, uint32_t rank,
                       const Foreshock__Report *r)
{
    const Foreshock__Scalars *s = r->scalars;
    if (r->n_attention || r->n_router_gram || r->n_router_tokens)
        return true;
    const struct run *run = run_find(st->reg, run_id);
    return rank == (run ? run->lead_rank : 0) && s &&
           (s->has_loss || s->has_grad_norm || s->has_lr || s->n_layer_weight_norm ||
            s->n_layer_update_ratio);
}

/* --- public API ------------------------------------------------------------------------------ */

static void *detect_open(void *ctx, const char *sub, char *why, size_t whylen)
{
    if (!sub || !sub[0]) {
        snprintf(why, whylen, "needs a rule name: [detect \"RULE\"]");
        return NULL;
    }
    struct detect_rule *rule = detect_rules_find(ctx, sub);
    if (!rule)
        snprintf(why, whylen, "unknown detector rule '%s'", sub);
    return rule;
}

static int detect_set(void *ctx, void *target, const char *key, const char *value, char *why,
                      size_t whylen)
{
    const struct detect_rule *rule = target;
    struct detect_error e = {0};
    if (detect_rules_set(ctx, rule->name, key, value, &e) < 0) {
        snprintf(why, whylen, "%s", e.msg);
        return -EINVAL;
    }
    return 0;
}

void stage_detect_section(struct detect_rules *rules, struct config_section *out)
{
    *out = (struct config_section){.name = "detect", .open = detect_open, .set = detect_set,
                                   .ctx = rules};
}

int stage_create(const struct stage_opts *opts, struct stage **out, char *err, size_t errlen)
{
    struct stage *st = calloc(1, sizeof(*st));
    if (!st) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    st->opts = *opts;
    st->stats = opts->stats ? opts->stats : &st->own_stats;
    if (opts->db_path && !(st->db_path = strdup(opts->db_path))) {
        free(st);
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    struct run_limits lim = {.timeout_s = opts->reduce_timeout_s, .max_bytes = opts->reduce_max_bytes};
    int rc = run_registry_create(&lim, &st->reg);
    if (rc < 0) {
        snprintf(err, errlen, "reduce_timeout_s %g is below %g s", opts->reduce_timeout_s,
                 RUN_TIMEOUT_MIN_S);
        free(st->db_path);
        free(st);
        return rc;
    }
    if (pthread_mutex_init(&st->pool.mu, NULL) != 0) {
        run_registry_destroy(st->reg);
        free(st->db_path);
        free(st);
        snprintf(err, errlen, "cannot create the workspace pool lock");
        return -ENOMEM;
    }
    uv_timer_init(opts->loop, &st->sweep);
    st->sweep.data = st;
    st->timer_open = 1;
    double ms = opts->reduce_timeout_s * 1000.0 / 4;
    uint64_t period = ms < STAGE_SWEEP_MIN_MS ? STAGE_SWEEP_MIN_MS
                      : ms > STAGE_SWEEP_MAX_MS ? STAGE_SWEEP_MAX_MS
                                                : (uint64_t)ms;
    uv_timer_start(&st->sweep, on_sweep, period, period);
    *out = st;
    return 0;
}

void stage_set_pressure(struct stage *st, void (*cb)(void *ctx, int full), void *ctx)
{
    st->pressure = cb;
    st->pressure_ctx = ctx;
}

bool stage_full(const struct stage *st) { return st->full; }

bool stage_may_read(struct stage *st, int64_t run_id, int64_t stream_id)
{
    if (!st->full)
        return true;
    const struct run *run = run_find(st->reg, run_id);
    return run && run_stream_needed(run, stream_id);
}

size_t stage_inflight(const struct stage *st) { return st->inflight; }

/* Says once per change what a declared local group means for the run's
 * monitors: which statistics are the group's and not the job's. */
static void log_local_group(const struct run *run)
{
    char *text = ranks_format(run->local, run->n_local);
    if (!run->n_local)
        log_info("stage", "run %s: no local group declared any more: router token statistics "
                 "reduce over all %u ranks, loss/grad_norm/lr are rank 0's", run->name,
                 run->world_size);
    else
        log_info("stage", "run %s: this daemon hears local group %s (%zu of %u ranks): router "
                 "token statistics (routing entropy, MaxVio, load entropy, balance, dead "
                 "experts, z-loss) reduce over these ranks only, not the whole job; "
                 "loss/grad_norm/lr are rank %u's; attention and router-weight monitors are "
                 "whole-model only if these ranks send every head",
                 run->name, text ? text : "?", run->n_local, run->world_size, run->lead_rank);
    free(text);
}

int stage_hello(struct stage *st, int64_t run_id, const char *run_name, int64_t stream_id,
                uint64_t last_seq, const struct run_hello *h)
{
    struct run *run;
    int rc = run_open(st->reg, run_id, run_name, &run);
    if (rc < 0)
        return rc;
    run_set_name(run, run_name);
    if (h && (rc = run_hello(run, h)) < 0) {
        if (rc == -ENOSPC)
            log_limited(&st->rl_err, LOG_LEVEL_ERROR, "stage",
                        "run %s rank %u: refused: more than %u distinct local groups", run->name,
                        h->rank, RUN_MAX_LOCAL_GROUPS);
        return rc;
    }
    if (rc == 1)
        log_local_group(run);
    rc = run_stream_seen(run, stream_id, last_seq);
    /* An announcement may complete waiting token groups. */
    pump(st, run, now_mono());
    return rc == -ENOSPC ? 0 : rc;
}

static uint32_t stream_attempt_of(const struct stage_run *sr, int64_t stream_id, bool *known)
{
    for (size_t i = 0; sr && i < sr->n_streams; i++) {
        if (sr->streams[i].stream_id == stream_id) {
            *known = true;
            return sr->streams[i].attempt;
        }
    }
    *known = false;
    return 0;
}

/* A report of an attempt older than the run's latest rewind, for a step
 * that rewind re-does: not the run's history any more. */
static bool abandoned(const struct run *run, int64_t stream_id, uint64_t step)
{
    const struct stage_run *sr = run->user;
    bool known;
    if (!sr || !sr->has_resume || step <= sr->resume_step)
        return false;
    uint32_t a = stream_attempt_of(sr, stream_id, &known);
    return known && a < sr->attempt;
}

int stage_attempt(struct stage *st, int64_t run_id, int64_t stream_id, uint32_t attempt,
                  const struct attempt_info *a)
{
    struct run *run;
    int rc = run_open(st->reg, run_id, NULL, &run);
    struct stage_run *sr = rc == 0 ? stage_run_of(st, run) : NULL;
    if (!sr)
        return -ENOMEM;
    rc = set_stream_attempt(sr, stream_id, attempt);
    uint32_t prev = sr->attempt;
    set_run_attempt(sr, a);
    if (a->rewind && a->started)
        rewind_start(st, run, sr, a->resume_step, prev);
    return rc == -ENOSPC ? 0 : rc;
}

int stage_feed(struct stage *st, const struct stage_report *in)
{
    struct run *run;
    int rc = run_open(st->reg, in->run_id, NULL, &run);
    if (rc < 0)
        return rc;
    if (!run_stream_fresh(run, in->stream_id, in->seq)) {
        atomic_fetch_add(&st->stats->reports_resent, 1);
        return 0;
    }
    run_stream_fed_step(run, in->stream_id, in->step);
    if (!in->report)
        return 0;
    if (abandoned(run, in->stream_id, in->step)) {
        atomic_fetch_add(&st->stats->reports_superseded, 1);
        log_limited(&st->rl_superseded, LOG_LEVEL_WARN, "stage",
                    "run %s step %llu: a report of an abandoned attempt (the run was rewound "
                    "to step %llu); ignored",
                    run->name, (unsigned long long)in->step,
                    (unsigned long long)((struct stage_run *)run->user)->resume_step);
        return 0;
    }
    /* Frames of a step already taken are late (ignored below) and their
     * records go with that step's evaluation. */
    struct stage_run *sr = in->spool_bytes ? stage_run_of(st, run) : NULL;
    if (sr && (int64_t)in->step > run->done_step)
        spool_note(st, sr, in->step, in->spool_bytes);
    struct run_add_stats as;
    double now = now_mono();
    rc = run_add(st->reg, run, in->step, in->time, in->rank, in->report, now, &as);
    queue_scalars(st, run, in);
    flush_scalars(st, run, NULL, false);
    if (as.late) {
        atomic_fetch_add(&st->stats->sketches_late, as.late);
        log_limited(&st->rl_late, LOG_LEVEL_WARN, "stage",
                    "run %s step %llu: %u sketches arrived after the step was evaluated; ignored",
                    run->name, (unsigned long long)in->step, as.late);
    }
    if (as.duplicates || as.mismatched || as.limit) {
        atomic_fetch_add(&st->stats->sketches_duplicate, as.duplicates);
        log_limited(&st->rl_dup, LOG_LEVEL_WARN, "stage",
                    "run %s step %llu rank %u: %u duplicate, %u inconsistent, %u over-limit "
                    "sketches ignored",
                    run->name, (unsigned long long)in->step, in->rank, as.duplicates,
                    as.mismatched, as.limit);
    }
    if (rc < 0)
        log_limited(&st->rl_err, LOG_LEVEL_ERROR, "stage",
                    "out of memory reducing run %s step %llu", run->name,
                    (unsigned long long)in->step);
    pump(st, run, now);
    check_pressure(st);
    return rc;
}

static void on_timer_closed(uv_handle_t *h)
{
    struct stage *st = h->data;
    st->timer_open = 0;
    if (st->done)
        st->done(st->done_ctx);
}

static void maybe_done(struct stage *st)
{
    if (!st->stopping || st->inflight || st->timer_open != 1)
        return;
    if (st->abandoned)
        log_warn("stage", "stopped at the shutdown deadline (%.3g s): %zu steps left unevaluated; "
                 "their sketches stay spooled and are evaluated at the next start",
                 st->opts.stop_timeout_s, st->abandoned);
    /* Scalars still queued behind steps that stay spooled are spooled too
     * (stage_wants_spool): the next start re-feeds them in order. */
    st->timer_open = 2; /* closing */
    uv_close((uv_handle_t *)&st->sweep, on_timer_closed);
}

/* The shutdown deadline: cancels every chunk not yet started. Running
 * chunks finish (each is bounded: part of one step's heads). */
static void on_stop_deadline(uv_timer_t *t)
{
    struct stage *st = t->data;
    for (size_t i = 0; i < run_count(st->reg); i++) {
        struct stage_run *sr = run_at(st->reg, i)->user;
        for (struct job *j = sr ? sr->jobs_head : NULL; j; j = j->next)
            for (size_t c = 0; c < j->n_chunks && !j->computed; c++)
                (void)uv_cancel((uv_req_t *)&j->chunks[c].req); /* UV_EBUSY when running */
    }
}

void stage_stop(struct stage *st, void (*done)(void *ctx), void *ctx)
{
    if (st->stopping)
        return;
    st->stopping = 1;
    st->done = done;
    st->done_ctx = ctx;
    /* The sweep timer becomes the shutdown deadline: past it, math not yet
     * started is cancelled (a flood of large router Grams once held SIGTERM
     * for 149 s). */
    uv_timer_stop(&st->sweep);
    if (st->opts.stop_timeout_s > 0)
        uv_timer_start(&st->sweep, on_stop_deadline,
                       (uint64_t)(st->opts.stop_timeout_s * 1000.0), 0);
    log_info("stage", "stopping: %zu steps on the workers finish; steps still reducing stay "
             "spooled (so far %llu steps evaluated, %llu heads in %.3f s of worker CPU time, "
             "%llu incomplete, %llu alerts fired)",
             st->jobs, (unsigned long long)atomic_load(&st->stats->buckets_evaluated),
             (unsigned long long)atomic_load(&st->stats->heads_computed),
             (double)atomic_load(&st->stats->monitor_seconds_sum_us) * 1e-6,
             (unsigned long long)atomic_load(&st->stats->incomplete_total),
             (unsigned long long)atomic_load(&st->stats->alerts_fired));
    maybe_done(st);
}

void stage_free(struct stage *st)
{
    if (!st)
        return;
    for (size_t i = 0; i < run_count(st->reg); i++) {
        struct run *run = run_at(st->reg, i);
        struct stage_run *sr = run->user;
        while (sr && sr->jobs_head) { /* computed but behind an unevaluated step */
            struct job *j = sr->jobs_head;
            sr->jobs_head = j->next;
            job_free(j);
        }
        stage_run_free(sr);
        run->user = NULL;
    }
    run_registry_destroy(st->reg);
    pool_destroy(&st->pool);
    free(st->db_path);
    free(st);
}

/* --- restart: persisted state and the spool ---------------------------------------------------- */

static int load_fail(sqlite3 *db, char *err, size_t errlen, const char *what)
{
    snprintf(err, errlen, "loading monitor state (%s): %s", what, sqlite3_errmsg(db));
    return -EIO;
}

static void model_from_json(struct run *run, const char *text)
{
    if (!text)
        return;
    json_t *o = json_loads(text, 0, NULL);
    if (!o)
        return;
    json_int_t l = json_integer_value(json_object_get(o, "n_layers"));
    json_int_t h = json_integer_value(json_object_get(o, "n_heads"));
    if (l > 0 && l <= FS_MAX_LAYERS)
        run->n_layers = (uint32_t)l;
    if (h > 0 && h <= FS_MAX_HEADS)
        run->n_heads = (uint32_t)h;
    json_decref(o);
}

/* The run's stored local group (SCHEMA_RUN_LOCAL_RANKS_SQL), held for the
 * spool re-fed before its ranks reconnect. */
static void local_from_text(struct run *run, const char *text)
{
    uint32_t *v;
    size_t n;
    if (!text)
        return;
    int rc = ranks_parse(text, run->world_size ? run->world_size : 1,
                         (size_t)RUN_MAX_LOCAL_GROUPS * FS_MAX_LOCAL_RANKS, &v, &n);
    if (rc == 0 && n)
        rc = run_restore_local(run, v, n);
    free(v);
    if (rc < 0)
        log_warn("stage", "run %s: stored local group '%.64s' not restored (%s): spooled router "
                 "tokens wait for the ranks' Hellos", run->name, text, strerror(-rc));
    else if (n)
        log_local_group(run);
}

static struct eval_track *load_track(struct stage *st, struct run *run, sqlite3_stmt *q, int col)
{
    struct store_series_key k;
    const char *name = (const char *)sqlite3_column_text(q, col);
    if (!name)
        return NULL;
    set_key(&k, name, sqlite3_column_int(q, col + 1), sqlite3_column_int(q, col + 2),
            sqlite3_column_int(q, col + 3), sqlite3_column_int(q, col + 4));
    char rule[DETECT_NAME_MAX];
    eval_rule_of_series(name, rule, sizeof(rule));
    struct stage_run *sr = stage_run_of(st, run);
    return sr ? eval_track_get(&sr->ev, &k, rule) : NULL;
}

static enum alert_attribution attribution_of(const char *s)
{
    for (int a = ALERT_ATTR_NONE; s && a <= ALERT_ATTR_LOSS_SPIKE; a++)
        if (strcmp(alert_attribution_name((enum alert_attribution)a), s) == 0)
            return (enum alert_attribution)a;
    return ALERT_ATTR_NONE;
}

static double col_real(sqlite3_stmt *q, int i)
{
    return sqlite3_column_type(q, i) == SQLITE_NULL ? NAN : sqlite3_column_double(q, i);
}

/* Attempts (stage.h): each stream's, each run's latest, and the rewinds
 * a stop left unrebuilt, which start again here (before the spool). */
static int load_attempts(struct stage *st, sqlite3 *db, char *err, size_t errlen)
{
    sqlite3_stmt *q = NULL;
    int rc;
    if (sqlite3_prepare_v2(db, "SELECT id, run_id, attempt FROM streams", -1, &q, NULL) !=
        SQLITE_OK)
        return load_fail(db, err, errlen, "streams");
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        struct run *run = run_find(st->reg, sqlite3_column_int64(q, 1));
        struct stage_run *sr = run ? stage_run_of(st, run) : NULL;
        if (sr)
            set_stream_attempt(sr, sqlite3_column_int64(q, 0),
                               (uint32_t)sqlite3_column_int64(q, 2));
    }
    sqlite3_finalize(q);
    if (rc != SQLITE_DONE)
        return load_fail(db, err, errlen, "streams");
    if (sqlite3_prepare_v2(db,
                           "SELECT a.run_id, a.attempt, a.resume_step, a.rebuilt_at, "
                           "(SELECT max(b.attempt) FROM attempts b WHERE b.run_id = a.run_id "
                           "AND b.attempt < a.attempt) FROM attempts a WHERE a.attempt = "
                           "(SELECT max(c.attempt) FROM attempts c WHERE c.run_id = a.run_id)",
                           -1, &q, NULL) != SQLITE_OK)
        return load_fail(db, err, errlen, "attempts");
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        struct run *run = run_find(st->reg, sqlite3_column_int64(q, 0));
        struct stage_run *sr = run ? stage_run_of(st, run) : NULL;
        if (!sr)
            continue;
        struct attempt_info a = {.attempt = (uint32_t)sqlite3_column_int64(q, 1),
                                 .has_resume = sqlite3_column_type(q, 2) != SQLITE_NULL};
        a.resume_step = a.has_resume ? (uint64_t)sqlite3_column_int64(q, 2) : 0;
        set_run_attempt(sr, &a);
        if (a.has_resume && sqlite3_column_type(q, 3) == SQLITE_NULL &&
            sqlite3_column_type(q, 4) != SQLITE_NULL)
            rewind_start(st, run, sr, a.resume_step, (uint32_t)sqlite3_column_int64(q, 4));
    }
    sqlite3_finalize(q);
    if (rc != SQLITE_DONE)
        return load_fail(db, err, errlen, "attempts");
    return 0;
}

static int load_state(struct stage *st, sqlite3 *db, char *err, size_t errlen)
{
    sqlite3_stmt *q = NULL;
    /* Runs: shape and detect_from_step; done_step as recorded with the
     * monitor rows, or from history. */
    if (sqlite3_prepare_v2(db,
                           "SELECT id, name, world_size, detect_from_step, model_json, "
                           "spool_done_step, "
                           SCHEMA_RUN_LOCAL_RANKS_SQL("runs.id") " FROM runs",
                           -1, &q, NULL) != SQLITE_OK)
        return load_fail(db, err, errlen, "runs");
    int rc;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        struct run *run;
        if (run_open(st->reg, sqlite3_column_int64(q, 0), (const char *)sqlite3_column_text(q, 1),
                     &run) < 0)
            break;
        run->world_size = (uint32_t)sqlite3_column_int64(q, 2);
        if (sqlite3_column_int64(q, 3) > 0) {
            run->has_detect_from_step = true;
            run->detect_from_step = (uint64_t)sqlite3_column_int64(q, 3);
        }
        model_from_json(run, (const char *)sqlite3_column_text(q, 4));
        local_from_text(run, (const char *)sqlite3_column_text(q, 6));
        /* Raised in the transaction that stored the monitor rows of those
         * steps; NULL (a database of an older version), see below. */
        run->done_step = sqlite3_column_type(q, 5) == SQLITE_NULL ? -2
                                                                 : sqlite3_column_int64(q, 5);
    }
    sqlite3_finalize(q);
    if (rc != SQLITE_DONE)
        return load_fail(db, err, errlen, "runs");
    /* Not recorded: the last step any (non-scalar) monitor was detected at. */
    if (sqlite3_prepare_v2(db,
                           "SELECT s.run_id, max(d.step) FROM detector_state d "
                           "JOIN series s ON s.id = d.series_id WHERE s.rank = -1 "
                           "GROUP BY s.run_id",
                           -1, &q, NULL) != SQLITE_OK)
        return load_fail(db, err, errlen, "evaluated steps");
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        struct run *run = run_find(st->reg, sqlite3_column_int64(q, 0));
        if (run && run->done_step == -2)
            run->done_step = sqlite3_column_int64(q, 1);
    }
    sqlite3_finalize(q);
    if (rc != SQLITE_DONE)
        return load_fail(db, err, errlen, "evaluated steps");
    for (size_t i = 0; i < run_count(st->reg); i++)
        if (run_at(st->reg, i)->done_step == -2)
            run_at(st->reg, i)->done_step = -1;

    /* Training progress (evaluate.h) from the lead rank's stored learning
     * rates (rank 0, or a local group's first: run.h).
     * Every acked report's scalars are points, so the restart knows the
     * warm-up end the stopped daemon knew, however much it left
     * unevaluated; learnt only from the re-fed sketch steps, it came out
     * later (their LR is constant from the first one on), and re-fed steps
     * started detection where the uninterrupted run had not. One run at a
     * time, its lead rank's series only: a 1,024-rank job stores 1,024
     * learning-rate series and only one of them counts. */
    if (sqlite3_prepare_v2(db,
                           "SELECT p.step, p.value FROM points p "
                           "JOIN series s ON s.id = p.series_id WHERE s.run_id = ?1 "
                           "AND s.name = 'lr' AND s.rank = ?2 AND s.layer = -1 AND s.head = -1 "
                           "ORDER BY p.step",
                           -1, &q, NULL) != SQLITE_OK)
        return load_fail(db, err, errlen, "learning rates");
    rc = SQLITE_DONE;
    for (size_t i = 0; i < run_count(st->reg) && rc == SQLITE_DONE; i++) {
        struct run *run = run_at(st->reg, i);
        struct stage_run *sr = stage_run_of(st, run);
        if (!sr)
            continue;
        sqlite3_bind_int64(q, 1, run->run_id);
        sqlite3_bind_int64(q, 2, (int64_t)run->lead_rank);
        while ((rc = sqlite3_step(q)) == SQLITE_ROW)
            if (sqlite3_column_type(q, 1) != SQLITE_NULL && sqlite3_column_int64(q, 0) >= 0)
                eval_progress_lr(&sr->ev, (uint64_t)sqlite3_column_int64(q, 0),
                                 sqlite3_column_double(q, 1));
        sqlite3_reset(q);
    }
    sqlite3_finalize(q);
    if (rc != SQLITE_DONE)
        return load_fail(db, err, errlen, "learning rates");

    if (sqlite3_prepare_v2(db,
                           "SELECT s.run_id, d.step, d.state, s.name, s.layer, s.head, "
                           "s.\"window\", s.rank FROM detector_state d "
                           "JOIN series s ON s.id = d.series_id",
                           -1, &q, NULL) != SQLITE_OK)
        return load_fail(db, err, errlen, "detector_state");
    size_t n_det = 0;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        struct run *run = run_find(st->reg, sqlite3_column_int64(q, 0));
        struct eval_track *t = run ? load_track(st, run, q, 3) : NULL;
        if (!t)
            continue;
        const void *blob = sqlite3_column_blob(q, 2);
        int len = sqlite3_column_bytes(q, 2);
        if (detect_state_decode(&t->ds, blob, (size_t)len) < 0) {
            log_warn("stage", "run %s series %s: unreadable detector state; starting afresh",
                     run->name, t->key.name);
            continue;
        }
        t->last_step = sqlite3_column_int64(q, 1);
        n_det++;
    }
    sqlite3_finalize(q);
    if (rc != SQLITE_DONE)
        return load_fail(db, err, errlen, "detector_state");

    if (sqlite3_prepare_v2(db,
                           "SELECT a.run_id, a.state_blob, a.attribution, a.value, a.median, "
                           "a.mad, a.z, s.name, s.layer, s.head, s.\"window\", s.rank "
                           "FROM alerts a JOIN series s ON s.id = a.series_id",
                           -1, &q, NULL) != SQLITE_OK)
        return load_fail(db, err, errlen, "alerts");
    size_t n_alerts = 0;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        struct run *run = run_find(st->reg, sqlite3_column_int64(q, 0));
        struct eval_track *t = run ? load_track(st, run, q, 7) : NULL;
        if (!t)
            continue;
        const void *blob = sqlite3_column_blob(q, 1);
        int len = sqlite3_column_bytes(q, 1);
        if (!blob || alert_state_decode(&t->as, blob, (size_t)len) < 0)
            continue;
        memcpy(t->row_blob, blob, sizeof(t->row_blob));
        t->ev_attr = attribution_of((const char *)sqlite3_column_text(q, 2));
        t->ev_value = col_real(q, 3);
        t->ev_median = col_real(q, 4);
        t->ev_mad = col_real(q, 5);
        t->ev_z = col_real(q, 6);
        n_alerts++;
    }
    sqlite3_finalize(q);
    if (rc != SQLITE_DONE)
        return load_fail(db, err, errlen, "alerts");
    if (n_det || n_alerts)
        log_info("stage", "restored %zu detector states and %zu alerts of %zu runs", n_det,
                 n_alerts, run_count(st->reg));
    return load_attempts(st, db, err, errlen);
}

/* The replay of the spool log: frames of steps a run has evaluated are
 * skipped unread; the others are decoded and fed as ingest feeds them. */
struct replay {
    struct stage *st;
    struct decode_limits lim;
    size_t bad, unknown;
};

static int replay_want(void *ctx, const struct spool_rec *rec)
{
    struct replay *rp = ctx;
    struct run *run = run_find(rp->st->reg, rec->run_id);
    if (!run) {
        rp->unknown++;
        return 0;
    }
    return (int64_t)rec->step > run->done_step;
}

static int replay_feed(void *ctx, const struct spool_rec *rec, const uint8_t *body)
{
    struct replay *rp = ctx;
    Foreshock__Frame *f = NULL;
    struct decode_error derr;
    if (decode_frame(body, rec->len, &rp->lim, &f, NULL, &derr) < 0 ||
        f->body_case != FORESHOCK__FRAME__BODY_REPORT || f->report->seq != rec->seq ||
        f->report->step != rec->step) {
        rp->bad++;
        decode_frame_free(f);
        return 0;
    }
    const Foreshock__Report *r = f->report;
    struct stage_report in = {
        .run_id = rec->run_id, .stream_id = rec->stream_id, .seq = rec->seq, .step = rec->step,
        .rank = rec->rank, .time = r->has_time_unix ? r->time_unix : fs_clock_unix(),
        .report = r, .spool_bytes = rec->len};
    stage_feed(rp->st, &in);
    decode_frame_free(f);
    return 0;
}

static int load_spool(struct stage *st, sqlite3 *db, const char *db_path, char *err,
                      size_t errlen)
{
    sqlite3_stmt *q = NULL;
    if (sqlite3_prepare_v2(db, "SELECT segment, byte_offset FROM spool_log WHERE id = 1", -1, &q,
                           NULL) != SQLITE_OK)
        return load_fail(db, err, errlen, "spool_log");
    struct spool_pos head = {0, 0};
    int rc = sqlite3_step(q);
    if (rc == SQLITE_ROW)
        head = (struct spool_pos){.seg = (uint64_t)sqlite3_column_int64(q, 0),
                                  .off = (uint64_t)sqlite3_column_int64(q, 1)};
    sqlite3_finalize(q);
    if (rc != SQLITE_ROW && rc != SQLITE_DONE)
        return load_fail(db, err, errlen, "spool_log");
    char dir[SPOOL_PATH_MAX];
    if (spool_dir_of(db_path, dir, sizeof(dir)) < 0) {
        snprintf(err, errlen, "%s: path too long for its spool directory", db_path);
        return -ENAMETOOLONG;
    }
    struct replay rp = {.st = st};
    decode_limits_default(&rp.lim, STAGE_LOAD_MAX_BODY);
    struct spool_replay_ops ops = {.want = replay_want, .feed = replay_feed, .ctx = &rp};
    struct spool_replay_stats rs;
    if ((rc = spool_replay(dir, &head, &ops, &rs, err, errlen)) < 0)
        return rc;
    if (rs.fed || rs.unreadable || rp.bad || rp.unknown)
        log_info("stage", "re-fed %llu spooled reports (%.1f MB) of steps not yet evaluated; "
                 "%llu of evaluated steps skipped, %llu unreadable, %zu of unknown runs",
                 (unsigned long long)(rs.fed - rp.bad), (double)rs.bytes_fed / 1e6,
                 (unsigned long long)(rs.records - rs.fed - rp.unknown),
                 (unsigned long long)(rs.unreadable + rp.bad), rp.unknown);
    return 0;
}

int stage_load(struct stage *st, const char *db_path, char *err, size_t errlen)
{
    if (!st->db_path && !(st->db_path = strdup(db_path))) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    sqlite3 *db;
    int rc = store_open_readonly(db_path, &db, err, errlen);
    if (rc < 0)
        return rc;
    rc = load_state(st, db, err, errlen);
    if (rc == 0)
        rc = load_spool(st, db, db_path, err, errlen);
    sqlite3_close(db);
    return rc;
}
