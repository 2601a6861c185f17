/* The monitor stage: reduction -> worker math -> detection -> writer. See
 * stage.h for the data path and threads. */
#include "stage.h"
#include "stage_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decode.h"
#include "fs_clock.h"
#include "fs_grow.h"
#include "log.h"
#include "ranks.h"

#define STAGE_DEFAULT_CHUNKS 8u /* work requests per bucket */
#define STAGE_SWEEP_MIN_MS 50u  /* timeout sweep period bounds */
#define STAGE_SWEEP_MAX_MS 1000u
#define STAGE_MAX_SCALAR_QUEUE 65536u /* per run; past it scalars are detected at once */

struct stage_run *stage_run_of(const struct stage *st, struct run *run)
{
    if (!run->user) {
        struct stage_run *sr = calloc(1, sizeof(*sr));
        if (!sr)
            return NULL;
        eval_run_init(&sr->ev, st->opts.rules);
        if (st->opts.max_run_bytes) {
            size_t n = (size_t)(st->opts.max_run_bytes / 2 / EVAL_TRACK_BYTES);
            sr->ev.max_tracks = n ? n : 1;
        }
        run->user = sr;
    }
    struct stage_run *sr = run->user;
    sr->ev.update_follows_grad = run->update_follows_grad; /* a later Hello may tell it */
    return sr;
}

void stage_sample_free(struct scalar_sample *s)
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
        stage_sample_free(x);
    }
    eval_run_clear(&sr->ev);
    free(sr->streams);
    free(sr->spooled);
    free(sr);
}

/* --- the spool bound: frame bytes waiting for their step's evaluation ----------------- */

/* The run's spooled bytes change by +add / -sub: keeps the counts of runs
 * spooling and of runs at their budget. */
static void spool_run_bytes(struct stage *st, struct stage_run *sr, uint64_t add, uint64_t sub)
{
    uint64_t max = st->opts.spool_run_max_bytes;
    bool was = sr->spool_bytes > 0, was_over = max && sr->spool_bytes >= max;
    sr->spool_bytes += add;
    sr->spool_bytes -= sub < sr->spool_bytes ? sub : sr->spool_bytes;
    bool is = sr->spool_bytes > 0, is_over = max && sr->spool_bytes >= max;
    st->runs_spooling = st->runs_spooling + is - was;
    st->runs_over = st->runs_over + is_over - was_over;
}

/* A fed report's spooled frame (bytes) waits for step's evaluation. */
static void spool_note(struct stage *st, struct stage_run *sr, uint64_t step, uint64_t bytes)
{
    size_t i = sr->n_spooled;
    while (i > 0 && sr->spooled[i - 1].step > step)
        i--;
    if (i > 0 && sr->spooled[i - 1].step == step) {
        sr->spooled[i - 1].bytes += bytes;
    } else {
        struct spool_step *p =
            fs_grow(sr->spooled, &sr->cap_spooled, sr->n_spooled + 1, sizeof(*p), 16);
        if (!p)
            return; /* not counted: the bound is a little looser */
        sr->spooled = p;
        memmove(&sr->spooled[i + 1], &sr->spooled[i], (sr->n_spooled - i) * sizeof(*sr->spooled));
        sr->spooled[i] = (struct spool_step){.step = step, .bytes = bytes};
        sr->n_spooled++;
    }
    st->spool_pending += bytes;
    spool_run_bytes(st, sr, bytes, 0);
}

/* Every step <= step of the run is evaluated: its frames no longer count. */
void stage_spool_evaluated(struct stage *st, struct stage_run *sr, uint64_t step)
{
    size_t k = 0;
    uint64_t freed = 0;
    while (k < sr->n_spooled && sr->spooled[k].step <= step)
        freed += sr->spooled[k++].bytes;
    st->spool_pending -= freed;
    spool_run_bytes(st, sr, 0, freed);
    if (k) {
        memmove(sr->spooled, sr->spooled + k, (sr->n_spooled - k) * sizeof(*sr->spooled));
        sr->n_spooled -= k;
    }
}

/* --- the scalar queue: detected scalars wait for earlier steps' buckets -------------- */

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
void stage_flush_scalars(struct stage *st, struct run *run, struct build *bd, bool all)
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
        sr->sc_bytes -= stage_sample_bytes(x);
        stage_detect_scalars(st, sr, run, bd, x);
        stage_sample_free(x);
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
    struct decode_scalars ds;
    decode_scalars(s, &ds);
    x->has_loss = ds.present & (1u << DECODE_SCALAR_LOSS);
    x->loss = ds.v[DECODE_SCALAR_LOSS];
    x->has_grad = ds.present & (1u << DECODE_SCALAR_GRAD_NORM);
    x->grad = ds.v[DECODE_SCALAR_GRAD_NORM];
    x->has_lr = ds.present & (1u << DECODE_SCALAR_LR);
    x->lr = ds.v[DECODE_SCALAR_LR];
    x->has_sur = ds.present & (1u << DECODE_SCALAR_STEP_UPDATE_RATIO);
    x->sur = ds.v[DECODE_SCALAR_STEP_UPDATE_RATIO];
    if (s->n_layer_weight_norm && (x->wn = malloc(s->n_layer_weight_norm * sizeof(float)))) {
        memcpy(x->wn, s->layer_weight_norm, s->n_layer_weight_norm * sizeof(float));
        x->n_wn = (uint32_t)s->n_layer_weight_norm;
    }
    if (s->n_layer_update_ratio && (x->ur = malloc(s->n_layer_update_ratio * sizeof(float)))) {
        memcpy(x->ur, s->layer_update_ratio, s->n_layer_update_ratio * sizeof(float));
        x->n_ur = (uint32_t)s->n_layer_update_ratio;
    }
    /* A full queue (by count, or by a quarter of max_run_bytes) is detected
     * at once rather than grown. */
    if (sr->n_sc >= STAGE_MAX_SCALAR_QUEUE ||
        (st->opts.max_run_bytes &&
         sr->sc_bytes + stage_sample_bytes(x) > st->opts.max_run_bytes / 4))
        stage_flush_scalars(st, run, NULL, true);
    if (sr->sc_tail)
        sr->sc_tail->next = x;
    else
        sr->sc_head = x;
    sr->sc_tail = x;
    sr->n_sc++;
    sr->sc_bytes += stage_sample_bytes(x);
}

/* --- jobs: buckets to the workers, evaluated in step order ---------------------------- */

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
void stage_check_pressure(struct stage *st)
{
    uint64_t bytes = run_registry_bytes(st->reg);
    uint64_t spool_max = st->opts.spool_max_bytes;
    atomic_store(&st->stats->reduce_bytes, bytes);
    bool spool_full = spool_max && st->spool_pending >= spool_max;
    if (!st->full && st->runs_over && !run_registry_full(st->reg) && !spool_full) {
        /* Only the runs at spool_run_max_bytes wait (stage_may_read). */
        st->full = 1;
        if (st->pressure)
            st->pressure(st->pressure_ctx, 1);
        return;
    }
    if (!st->full && (run_registry_full(st->reg) || spool_full)) {
        st->full = 1;
        atomic_fetch_add(&st->stats->reduce_pauses, 1);
        if (spool_full)
            log_warn("stage",
                     "spooled frames of steps not yet evaluated reached spool_max_bytes "
                     "%llu (%llu bytes): only ranks that complete the oldest step are read until "
                     "steps are evaluated",
                     (unsigned long long)spool_max, (unsigned long long)st->spool_pending);
        else
            log_warn("stage",
                     "reduction memory %llu bytes reached reduce_max_bytes %llu: only "
                     "ranks that complete the oldest step are read until steps complete or time "
                     "out",
                     (unsigned long long)bytes, (unsigned long long)st->opts.reduce_max_bytes);
        if (st->pressure)
            st->pressure(st->pressure_ctx, 1);
    } else if (st->full && !st->runs_over && bytes < st->opts.reduce_max_bytes / 4 * 3 &&
               (!spool_max || st->spool_pending < spool_max / 4 * 3)) {
        st->full = 0;
        if (st->pressure)
            st->pressure(st->pressure_ctx, 0);
    } else if (st->full && st->pressure) {
        st->pressure(st->pressure_ctx, 1); /* which streams are needed may have changed */
    }
}

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
            stage_evaluate(st, run, j->b);
        st->jobs--;
        job_free(j);
    }
    if (sr && sr->rewind == REWIND_DRAINING && !sr->jobs_head)
        stage_rewind_rebuild(st, run);
    stage_check_pressure(st);
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
        if (run && run->user && ((struct stage_run *)run->user)->forget)
            stage_forget(st, run->run_id);
    }
    stage_maybe_done(st);
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
    size_t n = 0, spectra = 0;
    for (size_t i = 0; i < b->n; i++) {
        n += !b->groups[i]->res.done;
        /* Heads sent as spectrum sketches went through the QK math when
         * they arrived (run.c) and never reach a worker: counted here. */
        spectra += b->groups[i]->kind == RUN_GROUP_ATTENTION && b->groups[i]->spectrum;
    }
    atomic_fetch_add(&st->stats->heads_computed, spectra);
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
        if (uv_queue_work(st->opts.loop, &ch->req, stage_work_cb, after_work_cb) == 0) {
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
void stage_pump(struct stage *st, struct run *run, double now)
{
    const struct stage_run *sr = run->user;
    if (st->stopping || (sr && sr->rewind == REWIND_REBUILDING))
        return;
    struct run_bucket *b;
    /* While a rewind drains, only the old attempt's history up to its step
     * goes on: the new attempt's steps wait for the rebuilt state. */
    while ((!sr || !sr->rewind || (run->buckets && run->buckets->step <= sr->rewind_step)) &&
           (b = run_take_ready(st->reg, run, now)))
        dispatch(st, run, b);
    if (sr && sr->rewind == REWIND_DRAINING && !sr->jobs_head)
        stage_rewind_rebuild(st, run);
}

void stage_poll(struct stage *st)
{
    double now = now_mono();
    for (size_t i = 0; i < run_count(st->reg); i++)
        stage_pump(st, run_at(st->reg, i), now);
    stage_check_pressure(st);
}

static void on_sweep(uv_timer_t *t)
{
    stage_poll(t->data);
}

bool stage_wants_spool(struct stage *st, int64_t run_id, uint32_t rank, const Foreshock__Report *r)
{
    const Foreshock__Scalars *s = r->scalars;
    if (r->n_attention || r->n_router_gram || r->n_router_tokens)
        return true;
    const struct run *run = run_find(st->reg, run_id);
    struct decode_scalars ds;
    decode_scalars(s, &ds);
    const unsigned detected = 1u << DECODE_SCALAR_LOSS | 1u << DECODE_SCALAR_GRAD_NORM |
                              1u << DECODE_SCALAR_LR | 1u << DECODE_SCALAR_STEP_UPDATE_RATIO;
    return rank == (run ? run->lead_rank : 0) && s &&
           ((ds.present & detected) || s->n_layer_weight_norm || s->n_layer_update_ratio);
}

/* --- public API ------------------------------------------------------------------------------ */

int stage_create(const struct stage_opts *opts, struct stage **out, struct fs_err *err)
{
    struct stage *st = calloc(1, sizeof(*st));
    if (!st)
        return fs_err_set(err, -ENOMEM, "out of memory");
    st->opts = *opts;
    st->stats = opts->stats ? opts->stats : &st->own_stats;
    if (opts->db_path && !(st->db_path = strdup(opts->db_path))) {
        free(st);
        return fs_err_set(err, -ENOMEM, "out of memory");
    }
    struct run_limits lim = {.timeout_s = opts->reduce_timeout_s,
                             .max_bytes = opts->reduce_max_bytes};
    int rc = run_registry_create(&lim, &st->reg);
    if (rc < 0) {
        /* -EINVAL is the one limit run_registry_create checks; anything else
         * (-ENOMEM) is no fault of the configuration. */
        if (rc == -EINVAL)
            fs_err_set(err, rc, "reduce_timeout_s %g is below %g s", opts->reduce_timeout_s,
                       RUN_TIMEOUT_MIN_S);
        else
            fs_err_set(err, rc, "cannot create the run registry: %s", strerror(-rc));
        free(st->db_path);
        free(st);
        return rc;
    }
    if ((rc = monitor_ws_pool_create(&st->pool)) < 0) {
        run_registry_destroy(st->reg);
        free(st->db_path);
        free(st);
        return fs_err_set(err, rc, "cannot create the workspace pool: %s", strerror(-rc));
    }
    uv_timer_init(opts->loop, &st->sweep);
    st->sweep.data = st;
    st->timer_open = 1;
    double ms = opts->reduce_timeout_s * 1000.0 / 4;
    uint64_t period = ms < STAGE_SWEEP_MIN_MS   ? STAGE_SWEEP_MIN_MS
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

bool stage_full(const struct stage *st)
{
    return st->full;
}

/* Whether the run's spooled frames hold it back: at spool_run_max_bytes,
 * or, with every run's together at spool_max_bytes, at an equal share of
 * it or more. A run that spools less (its steps are evaluated) goes on: a
 * straggler or a half-sent run delays only itself. */
static bool spool_held(const struct stage *st, const struct run *run)
{
    const struct stage_run *sr = run->user;
    uint64_t bytes = sr ? sr->spool_bytes : 0, max = st->opts.spool_max_bytes;
    if (st->opts.spool_run_max_bytes && bytes >= st->opts.spool_run_max_bytes)
        return true;
    if (!max || st->spool_pending < max)
        return false;
    return bytes >= max / (st->runs_spooling ? st->runs_spooling : 1);
}

bool stage_may_read(struct stage *st, int64_t run_id, int64_t stream_id)
{
    if (!st->full)
        return true;
    const struct run *run = run_find(st->reg, run_id);
    if (!run)
        return false;
    if (run_stream_needed(run, stream_id))
        return true;
    /* Reduction memory is shared by every run's partial sums: all wait. */
    return !run_registry_full(st->reg) && !spool_held(st, run);
}

size_t stage_inflight(const struct stage *st)
{
    return st->inflight;
}

/* Says once per change what a declared local group means for the run's
 * monitors: which statistics are the group's and not the job's. */
void stage_log_local_group(const struct run *run)
{
    char *text = ranks_format(run->local, run->n_local);
    if (!run->n_local)
        log_info("stage",
                 "run %s: no local group declared any more: router token statistics "
                 "reduce over all %u ranks, loss/grad_norm/lr are rank 0's",
                 run->name, run->world_size);
    else
        log_info("stage",
                 "run %s: this daemon hears local group %s (%zu of %u ranks): router "
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
    bool follows = run->update_follows_grad;
    if (h && (rc = run_hello(run, h)) < 0) {
        if (rc == -ENOSPC)
            log_limited(&st->rl_err, LOG_LEVEL_ERROR, "stage",
                        "run %s rank %u: refused: its local group has more than %u ranks",
                        run->name, h->rank, RUN_MAX_LOCAL_RANKS);
        return rc;
    }
    if (rc == 1)
        stage_log_local_group(run);
    if (run->update_follows_grad != follows) /* evaluate.h: per_grad_credit */
        log_info("stage",
                 "run %s: optimizer %s %s the gradient: the update-ratio rules %s its rise",
                 run->name, h->optimizer, run->update_follows_grad ? "steps by" : "normalises",
                 run->update_follows_grad ? "credit" : "no longer credit");
    if (h && eval_optimizer_orthogonalizes(h->optimizer) && !run->orthogonal_said) {
        run->orthogonal_said = true;
        log_warn("stage",
                 "run %s: optimizer %s orthogonalizes each matrix's update: the Delta2 attention "
                 "rules see little of an attention fault under it (docs/detection.md, the "
                 "seventeenth held-out look); a grad_norm page with a flat loss may be one",
                 run->name, h->optimizer);
    }
    rc = run_stream_seen(run, stream_id, last_seq);
    /* An announcement may complete waiting token groups. */
    stage_pump(st, run, now_mono());
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
    rc = stage_stream_attempt_set(sr, stream_id, attempt);
    uint32_t prev = sr->attempt;
    stage_run_attempt_set(sr, a);
    if (a->rewind && a->started)
        stage_rewind_start(st, run, sr, a->resume_step, prev);
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
    if (sr && (int64_t)in->step > run->done_step) {
        size_t over = st->runs_over;
        spool_note(st, sr, in->step, in->spool_bytes);
        if (st->runs_over > over)
            log_limited(&st->rl_err, LOG_LEVEL_WARN, "stage",
                        "run %s: its spooled frames of steps not yet evaluated reached "
                        "spool_run_max_bytes %llu: only its ranks that complete its oldest step "
                        "(%llu) are read until it is evaluated; other runs go on",
                        run->name, (unsigned long long)st->opts.spool_run_max_bytes,
                        (unsigned long long)(run->buckets ? run->buckets->step : in->step));
    }
    struct run_add_stats as;
    double now = now_mono();
    rc = run_add(st->reg, run, in->step, in->time, in->rank, in->report, now, &as);
    queue_scalars(st, run, in);
    stage_flush_scalars(st, run, NULL, false);
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
                    run->name, (unsigned long long)in->step, in->rank, as.duplicates, as.mismatched,
                    as.limit);
    }
    if (rc < 0)
        log_limited(&st->rl_err, LOG_LEVEL_ERROR, "stage",
                    "out of memory reducing run %s step %llu", run->name,
                    (unsigned long long)in->step);
    stage_pump(st, run, now);
    stage_check_pressure(st);
    return rc;
}

static void on_timer_closed(uv_handle_t *h)
{
    struct stage *st = h->data;
    st->timer_open = 0;
    if (st->done)
        st->done(st->done_ctx);
}

void stage_maybe_done(struct stage *st)
{
    if (!st->stopping || st->inflight || st->timer_open != 1)
        return;
    if (st->abandoned)
        log_warn("stage",
                 "stopped at the shutdown deadline (%.3g s): %zu steps left unevaluated; "
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
        uv_timer_start(&st->sweep, on_stop_deadline, (uint64_t)(st->opts.stop_timeout_s * 1000.0),
                       0);
    log_info("stage",
             "stopping: %zu steps on the workers finish; steps still reducing stay "
             "spooled (so far %llu steps evaluated, %llu heads in %.3f s of worker CPU time, "
             "%llu incomplete, %llu alerts fired)",
             st->jobs, (unsigned long long)atomic_load(&st->stats->buckets_evaluated),
             (unsigned long long)atomic_load(&st->stats->heads_computed),
             (double)atomic_load(&st->stats->monitor_seconds_sum_us) * 1e-6,
             (unsigned long long)atomic_load(&st->stats->incomplete_total),
             (unsigned long long)atomic_load(&st->stats->alerts_fired));
    stage_maybe_done(st);
}

int stage_shape_check(const struct stage *st, const struct run_hello *h, char *why, size_t len)
{
    uint64_t budget = st->opts.max_run_bytes;
    if (!budget || !h->has_n_layers)
        return 0;
    uint64_t need = (uint64_t)h->n_layers * STAGE_SERIES_PER_LAYER * EVAL_TRACK_BYTES;
    if (need <= budget / 2)
        return 0;
    snprintf(why, len,
             "declared shape too large: n_layers = %u needs at least %llu bytes of detector "
             "state (%u series per layer), over half of max_run_bytes = %llu",
             h->n_layers, (unsigned long long)need, STAGE_SERIES_PER_LAYER,
             (unsigned long long)budget);
    return -E2BIG;
}

void stage_forget(struct stage *st, int64_t run_id)
{
    struct run *run = run_find(st->reg, run_id);
    if (!run)
        return;
    struct stage_run *sr = run->user;
    if (sr) {
        bool busy = sr->rebuild_busy; /* a rewind's rebuild reads the run's state */
        for (struct job *j = sr->jobs_head; j && !busy; j = j->next)
            busy = !j->computed;
        if (busy) {
            sr->forget = true; /* after_work_cb and the rewind's end call again */
            return;
        }
        while (sr->jobs_head) { /* computed, behind a step still on the workers: none now */
            struct job *j = sr->jobs_head;
            sr->jobs_head = j->next;
            job_free(j);
        }
        stage_spool_evaluated(st, sr, UINT64_MAX);
        stage_run_free(sr);
        run->user = NULL;
    }
    run_remove(st->reg, run);
    stage_check_pressure(st);
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
    monitor_ws_pool_destroy(st->pool);
    free(st->db_path);
    free(st);
}
