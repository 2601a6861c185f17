/* Applying the queued items inside the writer's open transaction: Hello
 * (run and stream rows), report (points, spool log), monitor output
 * (points, detector states, alerts with their outbox and advice rows,
 * incomplete reductions), the pager's outcomes and advice deliveries; and
 * the results the batch announces after COMMIT. See store_internal.h. */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alert.h" /* pinned state numbers only */
#include "foreshock.pb-c.h"
#include "fs_grow.h"
#include "fs_limits.h"
#include "log.h"
#include "spool.h"
#include "store_internal.h"
#include "store_stmt.h"

static const char *const scalar_series[STORE_NSCALARS] = {
    [STORE_LOSS] = "loss",
    [STORE_GRAD_NORM] = "grad_norm",
    [STORE_LR] = "lr",
    [STORE_LOSS_SCALE] = "loss_scale",
    [STORE_TOKENS] = "tokens",
    [STORE_STEP_TIME] = "step_time",
    [STORE_STEP_UPDATE_RATIO] = "step_update_ratio",
};

/* --- results of the batch being written ----------------------------------------- */

struct store_result *store_wres_add(struct store *s)
{
    struct store_result *w = fs_grow(s->wres, &s->capwres, s->nwres + 1, sizeof(*w), 64);
    if (!w)
        return NULL;
    s->wres = w;
    struct store_result *r = &s->wres[s->nwres++];
    memset(r, 0, sizeof(*r));
    return r;
}

/* One Ack per connection per batch: merges into that connection's latest
 * result when it is an Ack, else appends. */
static int wres_ack(struct store *s, const struct store_item *it)
{
    if (!it->conn_id)
        return 0;
    for (size_t i = s->nwres; i-- > 0;) {
        struct store_result *r = &s->wres[i];
        if (r->conn_id != it->conn_id)
            continue;
        if (r->kind == STORE_RESULT_ACK && !r->error_code) {
            r->items++;
            if (it->report.seq > r->seq)
                r->seq = it->report.seq;
            return 0;
        }
        break;
    }
    struct store_result *r = store_wres_add(s);
    if (!r)
        return -ENOMEM;
    r->kind = STORE_RESULT_ACK;
    r->conn_id = it->conn_id;
    r->items = 1;
    r->run_id = it->report.run_id;
    r->stream_id = it->report.stream_id;
    r->seq = it->report.seq;
    return 0;
}

/* --- applying items (inside the open transaction) ------------------------------ */

struct owed_ctx {
    struct store *s;
    uint64_t conn_id;
};

static int owed_one(void *ctx, const struct advice_msg *m)
{
    struct owed_ctx *o = ctx;
    struct store_result *r = store_wres_add(o->s);
    if (!r)
        return SQLITE_NOMEM;
    r->kind = STORE_RESULT_ADVICE;
    r->conn_id = o->conn_id;
    r->run_id = m->run_id;
    r->advice = *m;
    return 0;
}

/* The advices a stream is owed (advice.h), as results that follow its
 * HELLO result: the Welcome goes out first. */
static int owed_advice(struct store *s, uint64_t conn_id, int64_t run_id, int64_t stream_id)
{
    struct owed_ctx o = {.s = s, .conn_id = conn_id};
    bool more = false;
    int rc = advice_store_owed(s->advice, run_id, stream_id, ADVICE_MAX_OWED_PER_HELLO, owed_one,
                               &o, &more);
    if (rc == SQLITE_OK && more)
        log_limited(&s->rl_fail, LOG_LEVEL_WARN, "store",
                    "stream %lld is owed more than %u advices: the rest follow at its next "
                    "connection",
                    (long long)stream_id, ADVICE_MAX_OWED_PER_HELLO);
    return rc;
}

/* A committed advice for the connections of its run: a firing one for
 * every stream of the run, an answer only for the streams that were sent
 * the firing it answers (advice.h). */
struct announce_ctx {
    struct store *s;
    const struct advice_msg *m;
};

static int announce_to(void *ctx, int64_t stream_id)
{
    struct announce_ctx *a = ctx;
    struct store_result *r = store_wres_add(a->s);
    if (!r)
        return SQLITE_NOMEM;
    r->kind = STORE_RESULT_ADVICE;
    r->run_id = a->m->run_id;
    r->stream_id = stream_id;
    r->advice = *a->m;
    return 0;
}

static int announce_advice(void *ctx, const struct advice_msg *m)
{
    struct announce_ctx a = {.s = ctx, .m = m};
    if (m->fire_id <= 0)
        return announce_to(&a, 0);
    return advice_store_fire_streams(a.s->advice, m->fire_id, announce_to, &a);
}

static int rewind_advice(struct store *s, int64_t run_id, uint64_t resume_step, double now)
{
    return advice_store_rewind(s->advice, run_id, resume_step, now, announce_advice, s);
}

/* A spool failure inside the transaction: SQLite's code for it (I/O and
 * disk full are transient: the batch is retried with backoff) and the
 * reason for the log. */
int store_spool_failed(struct store *s, const char *what, int err)
{
    int fault = spool_fault(s->spool);
    if (fault) {
        atomic_store(&s->stats->spool_fault, fault);
        snprintf(
            s->w_spool_err, sizeof(s->w_spool_err),
            "spool: %s: the log was %s under the running daemon (%s); restart foreshockd", what,
            fault == SPOOL_FAULT_DIR_REMOVED || fault == SPOOL_FAULT_SEGMENT_REMOVED ? "deleted"
                                                                                     : "replaced",
            spool_fault_name(fault));
        return SQLITE_IOERR;
    }
    snprintf(s->w_spool_err, sizeof(s->w_spool_err), "spool: %s: %s", what, strerror(-err));
    return err == -ENOSPC ? SQLITE_FULL : err == -ENOMEM ? SQLITE_NOMEM : SQLITE_IOERR;
}

/* Notes a change of the run's evaluated step for the spool, which takes it
 * after COMMIT (spool_after_commit, store.c), in transaction order. */
static int note_spool_done(struct store *s, int64_t run_id, uint64_t step, bool lower)
{
    struct spool_done_step *d = fs_grow(s->w_done, &s->capw_done, s->nw_done + 1, sizeof(*d), 16);
    if (!d)
        return SQLITE_NOMEM;
    s->w_done = d;
    s->w_done[s->nw_done++] =
        (struct spool_done_step){.run_id = run_id, .step = (int64_t)step, .lower = lower};
    return SQLITE_OK;
}

/* The monitors of the run's steps <= step are stored (in this same
 * transaction): the spool may let those steps' records go once it commits
 * (store_writer_main calls spool_release after COMMIT, never before). */
static int apply_spool_done(struct store *s, int64_t run_id, uint64_t step)
{
    sqlite3_stmt *st = s->st[ST_RUN_DONE];
    sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_int64(st, 2, (int64_t)step);
    int rc = exec1(st, NULL, 0);
    if (!ok(rc))
        return rc;
    st = s->st[ST_FRAME_DONE];
    sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_int64(st, 2, (int64_t)step);
    if (!ok(rc = exec1(st, NULL, 0)))
        return rc;
    return note_spool_done(s, run_id, step, false);
}

/* A rewind to step: the run's evaluated step goes down to it. Twice per
 * rewind: with the Hello that starts it (so that a crash from then on
 * replays the new attempt's frames), and from the monitor stage once it
 * knows (store_monitor.has_spool_rewind), after the old attempt's rows it
 * had queued before, which raised the step again. */
static int apply_spool_rewind(struct store *s, int64_t run_id, uint64_t step)
{
    sqlite3_stmt *st = s->st[ST_RUN_UNDONE];
    sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_int64(st, 2, (int64_t)step);
    int rc = exec1(st, NULL, 0);
    return ok(rc) ? note_spool_done(s, run_id, step, true) : rc;
}

static int apply_hello(struct store *s, const struct store_item *it, double now,
                       struct store_result *r)
{
    const struct store_hello *h = &it->hello;
    r->kind = STORE_RESULT_HELLO;
    r->conn_id = it->conn_id;
    r->items = 1;
    /* id, live, deleting */
    int64_t found[3] = {0, 0, 0};
    sqlite3_bind_text(s->st[ST_RUN_FIND], 1, h->run, -1, SQLITE_STATIC);
    int rc = exec1(s->st[ST_RUN_FIND], found, 3);
    if (!ok(rc))
        return rc;
    if (rc == SQLITE_ROW && found[2]) {
        r->error_code = FORESHOCK__ERROR_CODE__ERROR_LIMIT;
        snprintf(r->message, sizeof(r->message), "%s",
                 "this run is being deleted; a Hello after its deletion starts it anew");
        return SQLITE_OK;
    }
    bool admit;
    uint32_t latest;
    int arc = attempts_store_admit(s->attempts, rc == SQLITE_ROW ? found[0] : 0, h->attempt, &admit,
                                   &latest);
    if (arc != SQLITE_OK)
        return arc;
    if (!admit) {
        r->error_code = FORESHOCK__ERROR_CODE__ERROR_MALFORMED;
        snprintf(r->message, sizeof(r->message),
                 "attempt %u is more than %u above the run's latest attempt %u (attempt "
                 "counts restarts: give the latest + 1)",
                 h->attempt, FS_MAX_ATTEMPT_JUMP, latest);
        return SQLITE_OK;
    }
    /* A run that is not live (new, ended, or without a report yet) may
     * become live: max_runs and the owner's quota count live runs. */
    if (rc == SQLITE_DONE || !found[1]) {
        rc = store_run_quota(s, h->owner, r->message, sizeof(r->message));
        if (rc != SQLITE_OK)
            return rc;
        if (r->message[0]) {
            r->error_code = FORESHOCK__ERROR_CODE__ERROR_LIMIT;
            return SQLITE_OK;
        }
    }
    sqlite3_stmt *st = s->st[ST_RUN_UPSERT];
    sqlite3_bind_text(st, 1, h->run, -1, SQLITE_STATIC);
    sqlite3_bind_double(st, 2, now);
    sqlite3_bind_int64(st, 3, h->world_size);
    if (h->has_detect_from_step)
        sqlite3_bind_int64(st, 4, (int64_t)h->detect_from_step);
    if (h->model_json)
        sqlite3_bind_text(st, 5, h->model_json, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 6, h->owner, -1, SQLITE_STATIC);
    rc = exec1(st, &r->run_id, 1);
    if (rc != SQLITE_ROW)
        return ok(rc) ? SQLITE_ERROR : rc;
    st = s->st[ST_STREAM_UPSERT];
    sqlite3_bind_int64(st, 1, r->run_id);
    sqlite3_bind_int64(st, 2, h->attempt);
    sqlite3_bind_int64(st, 3, h->rank);
    sqlite3_bind_double(st, 4, now);
    if (h->local_ranks)
        sqlite3_bind_text(st, 5, h->local_ranks, -1, SQLITE_STATIC);
    int64_t cols[2] = {0, 0};
    rc = exec1(st, cols, 2);
    if (rc != SQLITE_ROW)
        return ok(rc) ? SQLITE_ERROR : rc;
    r->stream_id = cols[0];
    r->seq = (uint64_t)cols[1];
    r->attempt = h->attempt;
    rc = attempts_store_hello(s->attempts, r->run_id, h->attempt, h->has_resume_step,
                              h->resume_step, now, &r->run_attempt);
    if (rc != SQLITE_OK)
        return rc;
    int64_t run_id = r->run_id, stream_id = r->stream_id;
    if (r->run_attempt.started && r->run_attempt.rewind &&
        (rc = apply_spool_rewind(s, run_id, r->run_attempt.resume_step)) != SQLITE_OK)
        return rc;
    /* A rewind supersedes the advice about incidents that opened after its
     * step before this stream's owed advice is looked up: the new attempt
     * is never told to act on what it is re-doing. */
    if (r->run_attempt.rewind && s->advice &&
        (rc = rewind_advice(s, run_id, r->run_attempt.resume_step, now)) != SQLITE_OK)
        return rc;
    if (!h->advice || !s->advice)
        return SQLITE_OK;
    /* r is not touched below: owed advices append results (wres may move). */
    return owed_advice(s, it->conn_id, run_id, stream_id);
}

/* ST_STREAM_BUMP / ST_RUN_BUMP: row id, its new seq or step, seen at. */
static int bump(sqlite3_stmt *st, int64_t id, int64_t mark, double at)
{
    sqlite3_bind_int64(st, 1, id);
    sqlite3_bind_int64(st, 2, mark);
    sqlite3_bind_double(st, 3, at);
    return exec1(st, NULL, 0);
}

/* Whether the row of `id` exists (ST_STREAM_EXISTS / ST_RUN_EXISTS): an
 * item queued before its run was deleted (store_runs.c) finds none. */
static int row_exists(sqlite3_stmt *st, int64_t id, bool *yes)
{
    sqlite3_bind_int64(st, 1, id);
    int rc = exec1(st, NULL, 0);
    *yes = rc == SQLITE_ROW;
    return ok(rc) ? SQLITE_OK : rc;
}

/* A report of a stream whose run was deleted: refused (the connection is
 * closed with the reason), nothing stored. */
static int refuse_gone(struct store *s, const struct store_item *it)
{
    struct store_result *r = store_wres_add(s);
    if (!r)
        return SQLITE_NOMEM;
    r->kind = STORE_RESULT_ACK;
    r->conn_id = it->conn_id;
    r->items = 1;
    r->run_id = it->report.run_id;
    r->stream_id = it->report.stream_id;
    r->error_code = FORESHOCK__ERROR_CODE__ERROR_LIMIT;
    snprintf(r->message, sizeof(r->message),
             "run deleted (ended and past run_retention_s, no report within run_hello_grace_s, "
             "or the API): reconnect to start it anew");
    return SQLITE_OK;
}

static int apply_report(struct store *s, const struct store_item *it, struct batch_counts *bc,
                        bool *gone)
{
    const struct store_report *rp = &it->report;
    bool exists;
    int rc0 = row_exists(s->st[ST_STREAM_EXISTS], rp->stream_id, &exists);
    if (rc0 != SQLITE_OK)
        return rc0;
    if ((*gone = !exists))
        return refuse_gone(s, it);
    sqlite3_stmt *st = s->st[ST_REPORT_INSERT];
    sqlite3_bind_int64(st, 1, rp->stream_id);
    sqlite3_bind_int64(st, 2, (int64_t)rp->seq);
    sqlite3_bind_int64(st, 3, (int64_t)rp->step);
    sqlite3_bind_double(st, 4, rp->received_at);
    sqlite3_bind_int64(st, 5, rp->frame_bytes);
    int rc = exec1(st, NULL, 0);
    if (!ok(rc))
        return rc;
    if (sqlite3_changes(s->db) == 0) {
        /* (stream, seq) is already committed: a resend. Store nothing. */
        bc->duplicates++;
        return SQLITE_OK;
    }
    long idx;
    int32_t rank = (int32_t)rp->rank;
    for (int i = 0; i < STORE_NSCALARS; i++) {
        if (!(rp->present & (1u << i)))
            continue;
        if ((rc = store_series_get(s, rp->run_id, scalar_series[i], -1, -1, 0, rank, &idx)) !=
                SQLITE_OK ||
            (rc = store_point_put(s, idx, rp->step, rp->scalars[i], rp->time, &bc->points)) !=
                SQLITE_OK)
            return rc;
    }
    const float *arr[2] = {rp->weight_norm, rp->update_ratio};
    const uint32_t len[2] = {rp->n_weight_norm, rp->n_update_ratio};
    const char *names[2] = {"weight_norm", "update_ratio"};
    for (int k = 0; k < 2; k++) {
        for (uint32_t l = 0; l < len[k]; l++) {
            if ((rc = store_series_get(s, rp->run_id, names[k], (int32_t)l, -1, 0, rank, &idx)) !=
                    SQLITE_OK ||
                (rc = store_point_put(s, idx, rp->step, arr[k][l], rp->time, &bc->points)) !=
                    SQLITE_OK)
                return rc;
        }
    }
    /* Its frame, if it has one, is in the spool log already (spool_batch,
     * store.c): where, so that a start can check it is still there. */
    if (rp->spooled) {
        sqlite3_stmt *fs = s->st[ST_FRAME_INSERT];
        sqlite3_bind_int64(fs, 1, (int64_t)rp->spool_seg);
        sqlite3_bind_int64(fs, 2, (int64_t)rp->spool_off);
        sqlite3_bind_int64(fs, 3, rp->run_id);
        sqlite3_bind_int64(fs, 4, rp->stream_id);
        sqlite3_bind_int64(fs, 5, (int64_t)rp->seq);
        sqlite3_bind_int64(fs, 6, (int64_t)rp->step);
        if (!ok(rc = exec1(fs, NULL, 0)))
            return rc;
    }
    if (!ok(rc = bump(s->st[ST_STREAM_BUMP], rp->stream_id, (int64_t)rp->seq, rp->received_at)) ||
        !ok(rc = bump(s->st[ST_RUN_BUMP], rp->run_id, (int64_t)rp->step, rp->received_at)))
        return rc;
    bc->reports++;
    return SQLITE_OK;
}

static int series_of(struct store *s, int64_t run_id, const struct store_series_key *k, long *idx)
{
    return store_series_get(s, run_id, k->name, k->layer, k->head, k->window, k->rank, idx);
}

/* The pages of a firing or resolving transition: one outbox row per
 * target, in the transaction that commits the transition. */
static int outbox_rows(struct store *s, int64_t alert_id, int64_t event_id,
                       const struct store_alert_row *a, double now)
{
    int kind = a->to_state == ALERT_FIRING ? STORE_OUTBOX_TRIGGER
               : a->to_state == ALERT_RESOLVED || a->to_state == ALERT_SUPERSEDED
                   ? STORE_OUTBOX_RESOLVE /* a superseded incident ends at the target too */
                   : 0;
    for (size_t i = 0; kind && i < s->w_ntargets; i++) {
        sqlite3_stmt *st = s->st[ST_OUTBOX_INSERT];
        sqlite3_bind_int64(st, 1, alert_id);
        sqlite3_bind_int64(st, 2, event_id);
        sqlite3_bind_text(st, 3, s->w_targets[i], -1, SQLITE_STATIC);
        sqlite3_bind_int(st, 4, kind);
        sqlite3_bind_text(st, 5, a->severity ? a->severity : "warning", -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 6, a->attribution ? a->attribution : "none", -1, SQLITE_STATIC);
        sqlite3_bind_double(st, 7, now);
        int rc = exec1(st, NULL, 0);
        if (!ok(rc))
            return rc;
        s->w_outbox_max = sqlite3_last_insert_rowid(s->db);
    }
    return SQLITE_OK;
}

/* The advice of a transition (advice.h), in its transaction; announced as a
 * result for every connection of the run once committed. */
static int advice_row(struct store *s, int64_t run_id, int64_t alert_id, int64_t event_id,
                      const struct store_alert_row *a, double now)
{
    if (!s->advice || !s->w_advice_policy)
        return SQLITE_OK;
    struct advice_event ev = {.run_id = run_id,
                              .alert_id = alert_id,
                              .event_id = event_id,
                              .to_state = a->to_state,
                              .rule = a->rule,
                              .label = a->attribution,
                              .severity = a->severity,
                              .step = a->event_step,
                              .first_breach_step = a->first_breach_step,
                              .fired_step = a->fired_step,
                              .layer = a->series.layer,
                              .head = a->series.head,
                              .window = a->series.window,
                              .rank = a->series.rank};
    struct advice_msg m;
    bool made = false;
    int rc = advice_store_event(s->advice, s->w_advice_policy, &ev, now, &m, &made);
    if (rc != SQLITE_OK || !made)
        return rc;
    return announce_advice(s, &m);
}

static int apply_alert(struct store *s, int64_t run_id, const struct store_alert_row *a, double now)
{
    long idx;
    int rc = series_of(s, run_id, &a->series, &idx);
    if (rc != SQLITE_OK)
        return rc;
    sqlite3_stmt *st = s->st[ST_ALERT_UPSERT];
    sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_text(st, 2, a->rule, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 3, a->alert_key, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 4, a->dedup_key, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 5, a->series.layer);
    sqlite3_bind_int(st, 6, a->series.head);
    sqlite3_bind_int(st, 7, a->series.window);
    sqlite3_bind_int(st, 8, a->series.rank);
    sqlite3_bind_int64(st, 9, s->cache.ents[idx].id);
    sqlite3_bind_int(st, 10, a->state);
    sqlite3_bind_text(st, 11, a->severity, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 12, a->family, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 13, a->attribution, -1, SQLITE_STATIC);
    bind_value(st, 14, a->value);
    bind_value(st, 15, a->median);
    bind_value(st, 16, a->mad);
    bind_value(st, 17, a->z);
    store_bind_opt_step(st, 18, a->first_breach_step);
    store_bind_opt_step(st, 19, a->fired_step);
    store_bind_opt_step(st, 20, a->resolved_step);
    sqlite3_bind_int64(st, 21, a->last_step);
    sqlite3_bind_int64(st, 22, (int64_t)a->incidents);
    sqlite3_bind_double(st, 23, now);
    sqlite3_bind_blob(st, 24, a->blob, (int)a->blob_len, SQLITE_STATIC);
    int64_t alert_id = 0;
    rc = exec1(st, &alert_id, 1);
    if (rc != SQLITE_ROW)
        return ok(rc) ? SQLITE_ERROR : rc;
    if (!a->has_event)
        return SQLITE_OK;
    st = s->st[ST_EVENT_INSERT];
    sqlite3_bind_int64(st, 1, alert_id);
    sqlite3_bind_text(st, 2, a->change, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 3, a->from_state);
    sqlite3_bind_int(st, 4, a->to_state);
    sqlite3_bind_int64(st, 5, a->event_step);
    sqlite3_bind_double(st, 6, now);
    sqlite3_bind_text(st, 7, a->event_attribution ? a->event_attribution : a->attribution, -1,
                      SQLITE_STATIC);
    sqlite3_bind_text(st, 8, a->evidence_json ? a->evidence_json : "{}", -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 9, a->attempt);
    sqlite3_bind_text(st, 10, a->severity, -1, SQLITE_STATIC);
    rc = exec1(st, NULL, 0);
    if (!ok(rc))
        return rc;
    int64_t event_id = sqlite3_last_insert_rowid(s->db);
    if ((rc = outbox_rows(s, alert_id, event_id, a, now)) != SQLITE_OK)
        return rc;
    return advice_row(s, run_id, alert_id, event_id, a, now);
}

/* The monitor stage's output for one run, inside the batch's transaction. */
static int apply_monitor(struct store *s, const struct store_item *it, double now,
                         struct batch_counts *bc)
{
    const struct store_monitor *m = &it->monitor;
    long idx;
    int rc;
    for (size_t i = 0; i < m->n_points; i++) {
        const struct store_point *p = &m->points[i];
        if ((rc = series_of(s, m->run_id, &p->key, &idx)) != SQLITE_OK ||
            (rc = store_point_put(s, idx, p->step, p->value, m->time, &bc->points)) != SQLITE_OK)
            return rc;
    }
    for (size_t i = 0; i < m->n_states; i++) {
        const struct store_detector_row *d = &m->states[i];
        if ((rc = series_of(s, m->run_id, &d->key, &idx)) != SQLITE_OK)
            return rc;
        sqlite3_stmt *st = s->st[ST_STATE_PUT];
        sqlite3_bind_int64(st, 1, s->cache.ents[idx].id);
        sqlite3_bind_int64(st, 2, (int64_t)d->step);
        sqlite3_bind_blob(st, 3, d->blob, (int)d->len, SQLITE_STATIC);
        if (!ok(rc = exec1(st, NULL, 0)))
            return rc;
    }
    for (size_t i = 0; i < m->n_alerts; i++)
        if ((rc = apply_alert(s, m->run_id, &m->alerts[i], now)) != SQLITE_OK)
            return rc;
    for (size_t i = 0; i < m->n_incomplete; i++) {
        const struct store_incomplete_row *r = &m->incomplete[i];
        sqlite3_stmt *st = s->st[ST_INCOMPLETE_PUT];
        sqlite3_bind_int64(st, 1, m->run_id);
        sqlite3_bind_int64(st, 2, (int64_t)r->step);
        sqlite3_bind_text(st, 3, r->kind, -1, SQLITE_STATIC);
        sqlite3_bind_int(st, 4, r->layer);
        sqlite3_bind_int(st, 5, r->head);
        sqlite3_bind_int(st, 6, r->window);
        sqlite3_bind_int64(st, 7, r->have);
        sqlite3_bind_int64(st, 8, r->want);
        sqlite3_bind_double(st, 9, now);
        if (!ok(rc = exec1(st, NULL, 0)))
            return rc;
    }
    if (m->has_rebuilt &&
        (rc = attempts_store_rebuilt(s->attempts, m->run_id, m->rebuilt_attempt, now)) != SQLITE_OK)
        return rc;
    if (m->has_spool_rewind &&
        (rc = apply_spool_rewind(s, m->run_id, m->spool_rewind_step)) != SQLITE_OK)
        return rc;
    if (m->has_spool_done && (rc = apply_spool_done(s, m->run_id, m->spool_done_step)) != SQLITE_OK)
        return rc;
    return SQLITE_OK;
}

/* The pager's outcome of one delivery. */
static int apply_outbox(struct store *s, const struct store_outbox_outcome *o, double now)
{
    sqlite3_stmt *st = s->st[ST_OUTBOX_OUTCOME];
    sqlite3_bind_int64(st, 1, o->outbox_id);
    sqlite3_bind_int(st, 2, o->state);
    sqlite3_bind_int64(st, 3, o->attempts);
    bind_value(st, 4, o->next_attempt_at);
    if (o->http_status)
        sqlite3_bind_int(st, 5, o->http_status);
    if (o->last_error[0])
        sqlite3_bind_text(st, 6, o->last_error, -1, SQLITE_STATIC);
    sqlite3_bind_double(st, 7, now);
    int rc = exec1(st, NULL, 0);
    return ok(rc) ? SQLITE_OK : rc;
}

/* The remote-write sender's cursor (remote_write.h): forward only. */
static int apply_rw_cursor(struct store *s, const struct store_rw_cursor *c, double now)
{
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(
        s->db,
        "INSERT INTO remote_write_cursor (kind, run_id, pos, updated_at, target) VALUES (?1, ?2, "
        "?3, ?4, ?5) ON CONFLICT (target, kind, run_id) DO UPDATE SET pos = max(pos, "
        "excluded.pos), "
        "updated_at = excluded.updated_at",
        -1, &st, NULL);
    if (rc == SQLITE_OK) {
        sqlite3_bind_int(st, 1, c->kind);
        sqlite3_bind_int64(st, 2, c->run_id);
        sqlite3_bind_int64(st, 3, c->pos);
        sqlite3_bind_double(st, 4, now);
        sqlite3_bind_text(st, 5, c->target, -1, SQLITE_STATIC);
        rc = sqlite3_step(st) == SQLITE_DONE ? SQLITE_OK : sqlite3_errcode(s->db);
    }
    sqlite3_finalize(st);
    return rc;
}

/* Applies one item; SQLite rc. A HELLO refused by a limit is not an error:
 * its result carries the refusal. */
int store_apply_item(struct store *s, const struct store_item *it, double now,
                     struct batch_counts *bc)
{
    switch (it->kind) {
    case STORE_ITEM_HELLO: {
        struct store_result *r = store_wres_add(s);
        return r ? apply_hello(s, it, now, r) : SQLITE_NOMEM;
    }
    case STORE_ITEM_REPORT: {
        bool gone = false;
        int rc = apply_report(s, it, bc, &gone);
        if (rc == SQLITE_OK && !gone && wres_ack(s, it) < 0)
            rc = SQLITE_NOMEM;
        return rc;
    }
    case STORE_ITEM_SPOOL_DONE:
        return apply_spool_done(s, it->spool_done.run_id, it->spool_done.step);
    case STORE_ITEM_MONITOR: {
        bool exists; /* the run may have been deleted since the stage evaluated it */
        int rc = row_exists(s->st[ST_RUN_EXISTS], it->monitor.run_id, &exists);
        return rc != SQLITE_OK || !exists ? rc : apply_monitor(s, it, now, bc);
    }
    case STORE_ITEM_RUN:
        return store_apply_run(s, (struct store_item *)it, now);
    case STORE_ITEM_SILENCE:
        return store_apply_silence(s, (struct store_item *)it, now);
    case STORE_ITEM_OUTBOX:
        return apply_outbox(s, &it->outbox, now);
    case STORE_ITEM_ADVICE: {
        bool exists;
        int rc = row_exists(s->st[ST_STREAM_EXISTS], it->advice.stream_id, &exists);
        if (rc != SQLITE_OK || !exists)
            return rc;
        return s->advice ? advice_store_delivery(s->advice, it->advice.advice_id,
                                                 it->advice.stream_id, it->advice.acked, now)
                         : SQLITE_OK;
    case STORE_ITEM_RW_CURSOR:
        return apply_rw_cursor(s, &it->rw_cursor, now);
    }
    }
    return SQLITE_MISUSE;
}
