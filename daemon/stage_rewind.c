/* The monitor stage's attempts and rewinds (stage.h, rewind.h): a Hello
 * that rewinds a run drops what the old attempt left after the rewind step,
 * lets the rest be evaluated, rebuilds the detection state at the step on
 * a worker and stores it with the fates of the old attempt's incidents.
 * See stage_internal.h. Loop thread (the rebuild on a threadpool thread). */
#include "stage_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alert.h"
#include "fs_clock.h"
#include "fs_grow.h"
#include "rewind.h"

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
    struct fs_err err;
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
    w->rc = rewind_rebuild(w->st->db_path, w->run_id, w->step, w->lead_rank, w->detect_from, &w->er,
                           &w->err);
}

/* A row the rewind changes, to set what build_finish cannot know. */
struct rewind_fix {
    const struct eval_track *t;
    int row_state;
    bool superseded;
    int64_t first_breach_step, fired_step; /* of the superseded incident */
};

/* Sets on the item's alert rows what build_finish cannot know (fix[]). */
static void rewind_fix_rows(struct store_monitor *m, const struct rewind_fix *fix, size_t n_fix,
                            uint32_t rewind_from)
{
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
                a->attempt = rewind_from;
            }
            break;
        }
    }
}

/* Applies a rebuilt state to the run: alert fates (rewind_fate), one item
 * with every detector state and changed alert row, then the swap. */
static void rewind_apply(struct stage *st, struct run *run, struct stage_run *sr,
                         struct rewind_work *w)
{
    int64_t step = (int64_t)w->step;
    struct build bd;
    if (build_begin(&bd, run->run_id, fs_clock_unix()) < 0) {
        log_error("stage",
                  "run %s: out of memory storing the rewind to step %lld; the next "
                  "start rebuilds it",
                  run->name, (long long)step);
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
        build_state(&bd, t);
        if (f == REWIND_KEEP)
            continue;
        struct eval_batch *b = &bd.batch;
        struct eval_event *e = build_grow(b->ev, &b->cap, b->n, sizeof(*e), &bd.oom);
        if (!e)
            continue;
        b->ev = e;
        struct alert_transition tr = {.change = ALERT_CHANGE_TO_SUPERSEDED,
                                      .from = (enum alert_state_id)old->as.state,
                                      .to = ALERT_SUPERSEDED,
                                      .family = t->rule->family,
                                      .severity = (enum detect_severity)old->as.severity,
                                      .breach_kind = DETECT_BREACH_NONE,
                                      .scope = {.layer = t->key.layer,
                                                .head = t->key.head,
                                                .window = t->key.window,
                                                .rank = t->key.rank},
                                      .step = step,
                                      .value = NAN,
                                      .median = NAN,
                                      .mad = NAN,
                                      .z = NAN,
                                      .first_breach_step = old->as.first_breach_step,
                                      .fired_step = old->as.fired_step,
                                      .incident = old->as.incidents};
        snprintf(tr.rule, sizeof(tr.rule), "%s", t->rule_name);
        e[b->n] = (struct eval_event){.t = t,
                                      .has_event = f == REWIND_SUPERSEDE,
                                      .tr = tr,
                                      .argmin_head = -1,
                                      .attr = old->ev_attr};
        memcpy(e[b->n].why, old->ev_why, sizeof(e[b->n].why));
        b->n++;
        fix[n_fix++] = (struct rewind_fix){.t = t,
                                           .row_state = rewind_row_state(f, &old->as, &t->as),
                                           .superseded = f == REWIND_SUPERSEDE,
                                           .first_breach_step = old->as.first_breach_step,
                                           .fired_step = old->as.fired_step};
        superseded += f == REWIND_SUPERSEDE;
    }
    /* Series seen only up to the step... and not since: their state too. */
    for (size_t k = 0; matched && k < n_rebuilt; k++)
        if (!matched[k])
            build_state(&bd, w->er.tracks[k]);
    /* The events carry their labels (the old incidents'): none to decide. */
    bd.batch.next_label = bd.batch.n;
    build_finish(sr, run, &bd);
    struct store_monitor *m = &bd.it->monitor;
    rewind_fix_rows(m, fix, n_fix, sr->rewind_from);
    m->has_rebuilt = 1;
    m->rebuilt_attempt = sr->rewind_attempt;
    build_submit(st, &bd);
    free(matched);
    free(fix);
    eval_run_clear(&sr->ev);
    sr->ev = w->er; /* moved */
    memset(&w->er, 0, sizeof(w->er));
    atomic_fetch_add(&st->stats->rewinds, 1);
    log_info("stage",
             "run %s: attempt %u goes on from step %lld: detection state rebuilt from the "
             "stored points (%zu series), %zu incidents of attempt %u superseded",
             run->name, sr->rewind_attempt, (long long)step, sr->ev.n_tracks, superseded,
             sr->rewind_from);
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
            log_error("stage",
                      "run %s: rebuilding detection at step %llu failed (%s); the new "
                      "attempt goes on from the live state, and the next start rebuilds it",
                      run->name, (unsigned long long)w->step,
                      status ? uv_strerror(status) : w->err.msg);
        sr->rewind = REWIND_IDLE;
        stage_pump(st, run, now_mono());
        stage_flush_scalars(st, run, NULL, false);
    } else if (sr && sr->rewind == REWIND_DRAINING && !sr->jobs_head) {
        stage_rewind_rebuild(st, run); /* a newer rewind came while this one rebuilt */
    }
    if (sr && sr->forget)
        stage_forget(st, w->run_id); /* deleted while it rebuilt */
    eval_run_clear(&w->er);
    free(w);
    stage_check_pressure(st);
    stage_maybe_done(st);
}

void stage_rewind_rebuild(struct stage *st, struct run *run)
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
        w->er.update_follows_grad = run->update_follows_grad;
        if (uv_queue_work(st->opts.loop, &w->req, rewind_work_cb, rewind_after_cb) == 0) {
            st->inflight++;
            sr->rebuild_busy = true;
            sr->rewind = REWIND_REBUILDING;
            return;
        }
        free(w);
    }
    log_error("stage",
              "run %s: cannot rebuild detection at step %llu (%s); the new attempt "
              "goes on from the live state",
              run->name, (unsigned long long)sr->rewind_step,
              st->db_path ? "out of memory" : "no database");
    sr->rewind = REWIND_IDLE;
    stage_pump(st, run, now_mono());
}

/* Has the writer lower the run's evaluated step to step (store.h,
 * has_spool_rewind). The Hello's transaction lowered it already, but rows
 * of the old attempt's later steps that this stage queued before it knew
 * of the rewind are applied after that and raise it again: this item
 * comes after them, and before any frame of the new attempt (its Welcome
 * is sent after stage_attempt returns). */
static void rewind_spool_done(struct stage *st, const struct run *run, uint64_t step)
{
    if (!st->opts.store)
        return;
    struct build bd;
    if (build_begin(&bd, run->run_id, fs_clock_unix()) < 0) {
        log_error("stage",
                  "run %s: out of memory queuing the rewind of its evaluated step to %llu: "
                  "frames of the new attempt up to the old attempt's last evaluated step are "
                  "not replayed if foreshockd stops before evaluating them",
                  run->name, (unsigned long long)step);
        return;
    }
    bd.it->monitor.has_spool_rewind = 1;
    bd.it->monitor.spool_rewind_step = step;
    build_submit(st, &bd);
}

/* A Hello started an attempt that rewinds the run to step (abandoning
 * attempt `from`): what the old attempt left after step goes, the rest is
 * evaluated, then the state at step is rebuilt (rewind_rebuild_start). */
void stage_rewind_start(struct stage *st, struct run *run, struct stage_run *sr, uint64_t step,
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
            sr->n_sc--;
            sr->sc_bytes -= stage_sample_bytes(x);
            stage_sample_free(x);
            scalars++;
        } else {
            sr->sc_tail = x;
            pp = &x->next;
        }
    }
    sr->rewind = REWIND_DRAINING;
    sr->rewind_step = step;
    sr->rewind_from = from;
    sr->rewind_attempt = sr->attempt;
    sr->rewind_gen++;
    rewind_spool_done(st, run, step);
    log_info("stage",
             "run %s: attempt %u restarts from step %llu: attempt %u's steps after it "
             "are dropped (%zu reducing, %zu on the workers, %zu scalar samples)",
             run->name, sr->attempt, (unsigned long long)step, from, buckets, jobs, scalars);
    stage_check_pressure(st);
    if (!sr->jobs_head)
        stage_rewind_rebuild(st, run);
}

int stage_stream_attempt_set(struct stage_run *sr, int64_t stream_id, uint32_t attempt)
{
    for (size_t i = 0; i < sr->n_streams; i++) {
        if (sr->streams[i].stream_id == stream_id) {
            sr->streams[i].attempt = attempt;
            return 0;
        }
    }
    if (sr->n_streams >= RUN_MAX_STREAMS_PER_RUN)
        return -ENOSPC;
    struct stream_attempt *p =
        fs_grow(sr->streams, &sr->cap_streams, sr->n_streams + 1, sizeof(*p), 8);
    if (!p)
        return -ENOMEM;
    sr->streams = p;
    sr->streams[sr->n_streams++] =
        (struct stream_attempt){.stream_id = stream_id, .attempt = attempt};
    return 0;
}

/* The run's latest attempt (and its rewind step) as the writer knows it. */
void stage_run_attempt_set(struct stage_run *sr, const struct attempt_info *a)
{
    if (a->attempt < sr->attempt)
        return;
    sr->attempt = a->attempt;
    sr->has_resume = a->has_resume;
    sr->resume_step = a->resume_step;
}
