/* The monitor stage's restart (stage_load, stage.h): the persisted
 * detector and alert state, attempts and evaluated steps, read through
 * store_restart.h, then the spool log re-fed oldest first. Main (= loop)
 * thread, before ingest starts. */
#include "stage_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decode.h"
#include "fs_clock.h"
#include "ranks.h"
#include "spool.h"
#include "store_restart.h"

#define STAGE_LOAD_MAX_BODY (1u << 30) /* spooled frames re-fed at most this large */

struct load {
    struct stage *st;
    size_t n_det, n_alerts;
    int oom; /* a run could not be registered */
};

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
        log_warn("stage",
                 "run %s: stored local group '%.64s' not restored (%s): spooled router "
                 "tokens wait for the ranks' Hellos",
                 run->name, text, strerror(-rc));
    else if (n)
        stage_log_local_group(run);
}

static int load_run(void *ctx, const struct store_restart_run *r)
{
    struct load *ld = ctx;
    struct run *run;
    if (run_open(ld->st->reg, r->id, r->name, &run) < 0) {
        ld->oom = 1;
        return -ENOMEM;
    }
    run->world_size = r->world_size;
    if (r->optimizer[0])
        run->update_follows_grad = eval_optimizer_follows_grad(r->optimizer);
    if (r->detect_from_step > 0) {
        run->has_detect_from_step = true;
        run->detect_from_step = r->detect_from_step;
    }
    if (r->n_layers)
        run->n_layers = r->n_layers;
    if (r->n_heads)
        run->n_heads = r->n_heads;
    local_from_text(run, r->local_ranks);
    /* Raised in the transaction that stored the monitor rows of those
     * steps; not recorded (a database of an older version): see
     * load_detected_step. */
    run->done_step = r->has_done_step ? r->done_step : -2;
    return 0;
}

/* Not recorded: the last step any (non-scalar) monitor was detected at. */
static int load_detected_step(void *ctx, int64_t run_id, int64_t step)
{
    struct load *ld = ctx;
    struct run *run = run_find(ld->st->reg, run_id);
    if (run && run->done_step == -2)
        run->done_step = step;
    return 0;
}

static int load_lr(void *ctx, uint64_t step, double lr)
{
    eval_progress_lr(ctx, step, lr);
    return 0;
}

static int load_grad(void *ctx, uint64_t step, double grad_norm)
{
    eval_progress_grad(ctx, step, grad_norm);
    return 0;
}

static struct eval_track *load_track(struct stage *st, int64_t run_id,
                                     const struct store_series_key *k, struct run **out)
{
    struct run *run = run_find(st->reg, run_id);
    *out = run;
    if (!run)
        return NULL;
    char rule[DETECT_NAME_MAX];
    eval_rule_of_series(k->name, rule, sizeof(rule));
    struct stage_run *sr = stage_run_of(st, run);
    return sr ? eval_track_get(&sr->ev, k, rule) : NULL;
}

static int load_detector(void *ctx, const struct store_restart_detector *d)
{
    struct load *ld = ctx;
    struct run *run;
    struct eval_track *t = load_track(ld->st, d->run_id, &d->key, &run);
    if (!t)
        return 0;
    if (detect_state_decode(&t->ds, d->state, d->len) < 0) {
        log_warn("stage", "run %s series %s: unreadable detector state; starting afresh", run->name,
                 t->key.name);
        return 0;
    }
    t->last_step = d->step;
    ld->n_det++;
    return 0;
}

static int load_alert(void *ctx, const struct store_restart_alert *a)
{
    struct load *ld = ctx;
    struct run *run;
    struct eval_track *t = load_track(ld->st, a->run_id, &a->key, &run);
    if (!t)
        return 0;
    if (!a->state || alert_state_decode(&t->as, a->state, a->len) < 0)
        return 0;
    memcpy(t->row_blob, a->state, sizeof(t->row_blob));
    t->ev_attr = a->attribution;
    t->ev_value = a->value;
    t->ev_median = a->median;
    t->ev_mad = a->mad;
    t->ev_z = a->z;
    ld->n_alerts++;
    return 0;
}

static int load_stream(void *ctx, int64_t stream_id, int64_t run_id, uint32_t attempt)
{
    struct load *ld = ctx;
    struct run *run = run_find(ld->st->reg, run_id);
    struct stage_run *sr = run ? stage_run_of(ld->st, run) : NULL;
    if (sr)
        stage_stream_attempt_set(sr, stream_id, attempt);
    return 0;
}

/* Each run's latest attempt; the rewinds a stop left unrebuilt start again
 * here (before the spool). */
static int load_attempt(void *ctx, const struct store_restart_attempt *r)
{
    struct load *ld = ctx;
    struct run *run = run_find(ld->st->reg, r->run_id);
    struct stage_run *sr = run ? stage_run_of(ld->st, run) : NULL;
    if (!sr)
        return 0;
    struct attempt_info a = {
        .attempt = r->attempt, .has_resume = r->has_resume, .resume_step = r->resume_step};
    stage_run_attempt_set(sr, &a);
    if (a.has_resume && !r->rebuilt && r->has_previous)
        stage_rewind_start(ld->st, run, sr, a.resume_step, r->previous);
    return 0;
}

static int load_state(struct stage *st, struct store_restart *db, struct fs_err *err)
{
    struct load ld = {.st = st};
    /* Runs: shape and detect_from_step; done_step as recorded with the
     * monitor rows, or from history. */
    int rc = store_restart_runs(db, load_run, &ld, err);
    if (rc == 0)
        rc = store_restart_detected_steps(db, load_detected_step, &ld, err);
    if (ld.oom)
        return fs_err_set(err, -ENOMEM, "loading monitor state (runs): out of memory");
    if (rc < 0)
        return rc;
    for (size_t i = 0; i < run_count(st->reg); i++)
        if (run_at(st->reg, i)->done_step == -2)
            run_at(st->reg, i)->done_step = -1;

    /* Training progress (evaluate.h) from the lead rank's stored learning
     * rates (rank 0, or a local group's first: run.h), and its gradient
     * norms for a run whose update follows them.
     * Every acked report's scalars are points, so the restart knows the
     * warm-up end the stopped daemon knew, however much it left
     * unevaluated; learnt only from the re-fed sketch steps, it came out
     * later (their LR is constant from the first one on), and re-fed steps
     * started detection where the uninterrupted run had not. */
    for (size_t i = 0; i < run_count(st->reg); i++) {
        struct run *run = run_at(st->reg, i);
        struct stage_run *sr = stage_run_of(st, run);
        if (!sr)
            continue;
        if ((rc = store_restart_scalar(db, run->run_id, run->lead_rank, "lr", load_lr, &sr->ev,
                                       err)) < 0)
            return rc;
        if (run->update_follows_grad &&
            (rc = store_restart_scalar(db, run->run_id, run->lead_rank, "grad_norm", load_grad,
                                       &sr->ev, err)) < 0)
            return rc;
    }

    if ((rc = store_restart_detectors(db, load_detector, &ld, err)) < 0 ||
        (rc = store_restart_alerts(db, load_alert, &ld, err)) < 0)
        return rc;
    if (ld.n_det || ld.n_alerts)
        log_info("stage", "restored %zu detector states and %zu alerts of %zu runs", ld.n_det,
                 ld.n_alerts, run_count(st->reg));
    /* Attempts (stage.h): each stream's, each run's latest. */
    if ((rc = store_restart_streams(db, load_stream, &ld, err)) < 0)
        return rc;
    return store_restart_attempts(db, load_attempt, &ld, err);
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
    struct fs_err derr;
    if (decode_frame(body, rec->len, &rp->lim, &f, NULL, &derr) < 0 ||
        f->body_case != FORESHOCK__FRAME__BODY_REPORT || f->report->seq != rec->seq ||
        f->report->step != rec->step) {
        rp->bad++;
        decode_frame_free(f);
        return 0;
    }
    const Foreshock__Report *r = f->report;
    struct stage_report in = {.run_id = rec->run_id,
                              .stream_id = rec->stream_id,
                              .seq = rec->seq,
                              .step = rec->step,
                              .rank = rec->rank,
                              .time = r->has_time_unix ? r->time_unix : fs_clock_unix(),
                              .report = r,
                              .spool_bytes = rec->len};
    stage_feed(rp->st, &in);
    decode_frame_free(f);
    return 0;
}

/* What the replay found wrong with the spool: one ERROR line with the
 * counts, the metrics, and /readyz "degraded" (http_ops.c) from then on. */
static void report_spool(struct stage *st, const char *dir, const struct spool_replay_stats *rs)
{
    struct fs_stats *s = st->stats;
    if (s) {
        atomic_fetch_add(&s->spool_lost_missing, rs->lost_missing);
        atomic_fetch_add(&s->spool_lost_damaged, rs->lost_damaged);
        atomic_fetch_add(&s->spool_damaged_records, rs->unreadable);
        atomic_fetch_add(&s->spool_skipped_bytes, rs->skipped_bytes);
    }
    if (rs->lost_missing || rs->lost_damaged)
        log_error("stage",
                  "spool %s: %llu of %llu acknowledged frames of steps not yet evaluated are "
                  "lost (%llu missing, %llu damaged); their steps are evaluated without them. "
                  "%llu damaged records, %llu bytes passed over",
                  dir, (unsigned long long)(rs->lost_missing + rs->lost_damaged),
                  (unsigned long long)rs->acked, (unsigned long long)rs->lost_missing,
                  (unsigned long long)rs->lost_damaged, (unsigned long long)rs->unreadable,
                  (unsigned long long)rs->skipped_bytes);
    else if (rs->unreadable)
        log_error("stage",
                  "spool %s: %llu damaged records (%llu bytes passed over), none of them an "
                  "acknowledged frame still needed",
                  dir, (unsigned long long)rs->unreadable, (unsigned long long)rs->skipped_bytes);
    if (rs->v1_records)
        log_info("stage",
                 "spool %s: %llu records of the format before per-record CRCs (their bodies "
                 "cannot be checked); new records carry CRCs",
                 dir, (unsigned long long)rs->v1_records);
}

static int load_spool(struct stage *st, struct store_restart *db, const char *db_path,
                      struct fs_err *err)
{
    struct spool_pos head;
    int rc = store_restart_spool_head(db, &head, err);
    if (rc < 0)
        return rc;
    char dir[SPOOL_PATH_MAX];
    if (spool_dir_of(db_path, dir, sizeof(dir)) < 0)
        return fs_err_set(err, -ENAMETOOLONG, "%s: path too long for its spool directory", db_path);
    struct spool_frame *acked;
    size_t nacked;
    if ((rc = store_restart_spool_frames(db, &acked, &nacked, err)) < 0)
        return rc;
    struct replay rp = {.st = st};
    decode_limits_default(&rp.lim, STAGE_LOAD_MAX_BODY);
    struct spool_replay_ops ops = {
        .want = replay_want, .feed = replay_feed, .ctx = &rp, .acked = acked, .nacked = nacked};
    struct spool_replay_stats rs;
    rc = spool_replay(dir, &head, &ops, &rs, err);
    free(acked);
    if (rc < 0)
        return rc;
    if (rs.fed || rs.unreadable || rp.bad || rp.unknown)
        log_info("stage",
                 "re-fed %llu spooled reports (%.1f MB) of steps not yet evaluated; "
                 "%llu of evaluated steps skipped, %llu unreadable, %zu of unknown runs",
                 (unsigned long long)(rs.fed - rp.bad), (double)rs.bytes_fed / 1e6,
                 (unsigned long long)(rs.records - rs.fed - rp.unknown),
                 (unsigned long long)(rs.unreadable + rp.bad), rp.unknown);
    report_spool(st, dir, &rs);
    return 0;
}

int stage_load(struct stage *st, const char *db_path, struct fs_err *err)
{
    if (!st->db_path && !(st->db_path = strdup(db_path)))
        return fs_err_set(err, -ENOMEM, "out of memory");
    struct store_restart *db;
    int rc = store_restart_open(db_path, &db, err);
    if (rc < 0)
        return rc;
    rc = load_state(st, db, err);
    if (rc == 0)
        rc = load_spool(st, db, db_path, err);
    store_restart_close(db);
    return rc;
}
