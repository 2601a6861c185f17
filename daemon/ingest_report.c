/* Ingest, reports: a Report becomes a writer item (parked and ingest paused
 * when the writer pushes back) and is fed to the monitor stage; the
 * writer's results come back here (on_async): Welcomes, Acks after COMMIT,
 * advice, RESUME. */
#include "ingest_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fs_clock.h"

/* store_report.scalars is indexed as decode_scalars' v. */
_Static_assert((int)STORE_NSCALARS == (int)DECODE_NSCALARS &&
                   (int)STORE_LOSS == (int)DECODE_SCALAR_LOSS &&
                   (int)STORE_GRAD_NORM == (int)DECODE_SCALAR_GRAD_NORM &&
                   (int)STORE_LR == (int)DECODE_SCALAR_LR &&
                   (int)STORE_LOSS_SCALE == (int)DECODE_SCALAR_LOSS_SCALE &&
                   (int)STORE_TOKENS == (int)DECODE_SCALAR_TOKENS &&
                   (int)STORE_STEP_TIME == (int)DECODE_SCALAR_STEP_TIME &&
                   (int)STORE_STEP_UPDATE_RATIO == (int)DECODE_SCALAR_STEP_UPDATE_RATIO,
               "store_scalar and decode_scalar disagree");

static void pause_all(struct ingest *ing)
{
    if (!ing->paused) {
        ing->paused = 1;
        atomic_fetch_add(&ing->opts.stats->backpressure_pauses, 1);
        log_limited(&ing->rl_backpressure, LOG_LEVEL_WARN, "ingest",
                    "writer queue full: ingest paused until it drains");
    }
    for (struct conn *c = ing->head; c; c = c->next)
        conn_update_reading(c);
}

/* Hands a report the store accepted to the monitor stage: only after
 * store_submit, so that its spool append is queued before anything the
 * stage queues about the step. Takes f. */
static void feed_stage(struct conn *c, Foreshock__Frame *f, double time, size_t spooled)
{
    struct ingest *ing = c->ing;
    if (ing->opts.stage && f && f->body_case == FORESHOCK__FRAME__BODY_REPORT) {
        struct stage_report in = {.run_id = c->run_id,
                                  .stream_id = c->stream_id,
                                  .rank = c->rank,
                                  .seq = f->report->seq,
                                  .step = f->report->step,
                                  .time = time,
                                  .report = f->report,
                                  .spool_bytes = spooled};
        stage_feed(ing->opts.stage, &in);
    }
    decode_frame_free(f);
}

/* Submits or parks the item (with its decoded frame f for the stage, which
 * conn_submit takes; NULL for a Hello). Returns 0 when the connection may go on. */
int conn_submit(struct conn *c, struct store_item *it, Foreshock__Frame *f)
{
    double time = it->kind == STORE_ITEM_REPORT ? it->report.time : 0;
    size_t spooled = it->kind == STORE_ITEM_REPORT ? it->report.sketch_len : 0;
    int rc = store_submit(c->ing->opts.store, it);
    if (rc == 0) {
        c->inflight++;
        feed_stage(c, f, time, spooled);
        return 0;
    }
    int failing = atomic_load(&c->ing->opts.stats->storage_failing);
    if (rc == -EAGAIN && it->kind == STORE_ITEM_HELLO && failing) {
        /* The queue is full because commits fail: parked, this Hello would
         * get no answer for as long as the disk is full. */
        char msg[160];
        snprintf(msg, sizeof(msg), "storage is failing (%s); retry later",
                 store_failure_text(failing));
        store_item_free(it);
        conn_protocol_error(c, E(INTERNAL), msg);
        return -EIO;
    }
    if (rc == -EAGAIN) {
        c->pending = it;
        c->pending_frame = f;
        pause_all(c->ing);
        return -EAGAIN;
    }
    decode_frame_free(f);
    store_item_free(it);
    conn_protocol_error(c, E(SHUTTING_DOWN), "daemon is stopping; reconnect later");
    return rc;
}

static float *copy_floats(const float *v, size_t n)
{
    if (!n)
        return NULL;
    float *p = malloc(n * sizeof(*p));
    if (p)
        memcpy(p, v, n * sizeof(*p));
    return p;
}

/* Takes *fp (the decoded frame) for the stage; sets it NULL. */
void conn_on_report(struct conn *c, Foreshock__Frame **fp, const uint8_t *body, size_t len,
                    const struct decode_info *info)
{
    const Foreshock__Report *r = (*fp)->report;
    if (c->state != STREAMING) {
        conn_protocol_error(c, E(SEQUENCE), "Report before Hello");
        return;
    }
    /* A stream's seqs increase by one (proto/foreshock.proto). At or below
     * the Welcome's last_seq a report is a resend of a committed one
     * (acknowledged, not stored again); above it each must be the next:
     * after a gap (1, 2, 5) an Ack of 5 would cover reports never stored,
     * and a step back would be acknowledged by an earlier Ack. */
    if (r->seq > c->seq_base) {
        if (r->seq != c->seq_last + 1) {
            char msg[128];
            snprintf(msg, sizeof(msg), "report seq %llu after %llu: seqs must increase by one",
                     (unsigned long long)r->seq, (unsigned long long)c->seq_last);
            conn_protocol_error(c, E(SEQUENCE), msg);
            return;
        }
        c->seq_last = r->seq;
    }
    atomic_fetch_add(&c->ing->opts.stats->reports_in, 1);
    struct store_item *it = store_item_new(STORE_ITEM_REPORT);
    if (!it) {
        conn_protocol_error(c, E(INTERNAL), "out of memory");
        return;
    }
    struct store_report *rp = &it->report;
    it->conn_id = c->id;
    rp->run_id = c->run_id;
    rp->stream_id = c->stream_id;
    rp->stream_key = c->stream_key;
    rp->rank = c->rank;
    rp->seq = r->seq;
    rp->step = r->step;
    rp->received_at = fs_clock_unix();
    rp->time = r->has_time_unix ? r->time_unix : rp->received_at;
    rp->frame_bytes = (uint32_t)(len + DECODE_PREFIX_BYTES);
    const Foreshock__Scalars *s = r->scalars;
    int oom = 0;
    if (s) {
        struct decode_scalars ds;
        decode_scalars(s, &ds);
        for (int i = 0; i < STORE_NSCALARS; i++) {
            if (ds.present & (1u << i)) {
                rp->present |= 1u << i;
                rp->scalars[i] = ds.v[i];
            }
        }
        rp->n_weight_norm = (uint32_t)s->n_layer_weight_norm;
        rp->n_update_ratio = (uint32_t)s->n_layer_update_ratio;
        rp->weight_norm = copy_floats(s->layer_weight_norm, s->n_layer_weight_norm);
        rp->update_ratio = copy_floats(s->layer_update_ratio, s->n_layer_update_ratio);
        oom |= (rp->n_weight_norm && !rp->weight_norm) || (rp->n_update_ratio && !rp->update_ratio);
    }
    /* A resend of a committed report (at or below the Welcome's last_seq)
     * is stored as nothing: the writer spools frames before it learns that
     * (store.c spool_batch), so its frame is not handed over at all. */
    if (r->seq > c->seq_base &&
        (info->sketches ||
         (c->ing->opts.stage && stage_wants_spool(c->ing->opts.stage, c->run_id, c->rank, r)))) {
        /* The spool keeps the frame as it arrived for the monitor stage. A
         * large frame that is all the read buffer holds (on_alloc sized the
         * buffer to it) is handed over whole: copying 59 MB cost the loop
         * thread as much as decoding it. conn_process() sees rbuf gone. */
        if (len >= FS_INGEST_RBUF_INITIAL && body == c->rbuf + DECODE_PREFIX_BYTES &&
            c->rlen == len + DECODE_PREFIX_BYTES) {
            rp->sketch_alloc = c->rbuf;
            rp->sketch_body = c->rbuf + DECODE_PREFIX_BYTES;
            rp->sketch_len = len;
            c->rbuf = NULL;
            c->rcap = c->rlen = 0;
        } else if ((rp->sketch_body = malloc(len))) {
            memcpy(rp->sketch_body, body, len);
            rp->sketch_len = len;
        }
        oom |= !rp->sketch_body;
    }
    if (oom) {
        store_item_free(it);
        conn_protocol_error(c, E(INTERNAL), "out of memory");
        return;
    }
    Foreshock__Frame *f = *fp;
    *fp = NULL;
    conn_submit(c, it, f);
}

/* Records one advice on the stream (sent or acknowledged) with the writer. */
static void advice_record(struct conn *c, int64_t advice_id, int acked)
{
    struct store_item *it = store_item_new(STORE_ITEM_ADVICE);
    if (it) {
        it->advice = (struct store_advice_delivery){
            .advice_id = advice_id, .stream_id = c->stream_id, .acked = acked};
        if (store_submit(c->ing->opts.store, it) == 0)
            return;
        store_item_free(it);
    }
    log_limited(&c->ing->rl_advice, LOG_LEVEL_WARN, "ingest",
                "conn %llu: advice %lld %s on stream %lld not recorded (%s); it stays owed",
                (unsigned long long)c->id, (long long)advice_id, acked ? "acknowledged" : "sent",
                (long long)c->stream_id, it ? "daemon stopping" : "out of memory");
}

/* The trainer took these advices. Ids this connection was not sent (or
 * acknowledged already) are ignored: each sent advice is acknowledged once. */
void conn_on_advice_ack(struct conn *c, const Foreshock__AdviceAck *a)
{
    if (c->state != STREAMING) {
        conn_protocol_error(c, E(SEQUENCE), "AdviceAck before Welcome");
        return;
    }
    size_t ignored = 0;
    for (size_t i = 0; i < a->n_advice_id; i++) {
        int64_t id = a->advice_id[i] > INT64_MAX ? -1 : (int64_t)a->advice_id[i];
        if (!advice_conn_take(&c->advice, id)) {
            ignored++;
            continue;
        }
        atomic_fetch_add(&c->ing->opts.stats->advice_acked, 1);
        advice_record(c, id, 1);
    }
    if (ignored)
        log_debug("ingest", "conn %llu: %zu advice acks for nothing outstanding ignored",
                  (unsigned long long)c->id, ignored);
}

void conn_on_bye(struct conn *c, const Foreshock__Bye *b)
{
    /* Bye.end_run: the run ends after this stream's reports (the writer
     * applies items in order). No answer is waited for. */
    if (b && b->has_end_run && b->end_run && c->state == STREAMING) {
        struct store_item *it = store_item_new(STORE_ITEM_RUN);
        if (it) {
            it->run.op = STORE_RUN_END;
            snprintf(it->run.run, sizeof(it->run.run), "%s", c->run_name);
            if (store_submit(c->ing->opts.store, it) != 0)
                store_item_free(it);
            else
                log_info("ingest", "run %s: rank %u ended it (Bye.end_run)", c->run_name, c->rank);
        }
    }
    c->eof = 1;
    conn_update_reading(c);
    if (c->inflight == 0 && !c->pending)
        conn_close_when_flushed(c);
}

static void on_ack(struct conn *c, const struct store_result *r)
{
    if (r->error_code) {
        conn_protocol_error(c, r->error_code, r->message);
        return;
    }
    if (c->state != STREAMING)
        return;
    if (r->seq > c->acked)
        c->acked = r->seq;
    Foreshock__Ack a = FORESHOCK__ACK__INIT;
    a.seq = c->acked;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_ACK;
    f.ack = &a;
    if (conn_send_frame(c, &f) == 0)
        atomic_fetch_add(&c->ing->opts.stats->acks_out, 1);
}

/* Sends one committed advice on c and records the send. */
static void send_advice(struct conn *c, const struct advice_msg *m)
{
    struct ingest *ing = c->ing;
    int rc = advice_conn_sent(&c->advice, m->id);
    if (rc < 0) {
        log_limited(&ing->rl_advice, LOG_LEVEL_WARN, "ingest",
                    "conn %llu: advice %lld not sent: %s (%u unacknowledged at most); it stays "
                    "owed to the stream",
                    (unsigned long long)c->id, (long long)m->id,
                    rc == -ENOSPC ? "too many unacknowledged" : "out of memory",
                    ADVICE_MAX_UNACKED_PER_CONN);
        return;
    }
    uint8_t *buf;
    size_t len;
    if (advice_encode(m, &buf, &len) < 0) {
        log_limited(&ing->rl_advice, LOG_LEVEL_ERROR, "ingest",
                    "conn %llu: out of memory encoding advice %lld", (unsigned long long)c->id,
                    (long long)m->id);
        return;
    }
    if (conn_send_buf(c, buf, len) < 0)
        return; /* closed: the advice stays owed to the stream */
    atomic_fetch_add(&ing->opts.stats->advice_out, 1);
    log_debug("ingest", "conn %llu: advice %lld %s alert %lld step %lld", (unsigned long long)c->id,
              (long long)m->id, advice_action_name(m->action), (long long)m->alert_id,
              (long long)m->step);
    advice_record(c, m->id, 0);
}

/* A committed advice: owed to one connection's stream (conn_id, right
 * after its Welcome), or new, for the connections of its run that take
 * advice (all, or those of one stream: an answer to a firing advice). */
static void deliver_advice(struct ingest *ing, const struct store_result *r)
{
    if (r->conn_id) {
        struct conn *c = conn_find(ing, r->conn_id);
        if (c && !c->closing && c->state == STREAMING && c->advice.enabled)
            send_advice(c, &r->advice);
        return;
    }
    for (struct conn *c = ing->head; c; c = c->next)
        if (!c->closing && c->state == STREAMING && c->advice.enabled && c->run_id == r->run_id &&
            (!r->stream_id || r->stream_id == c->stream_id))
            send_advice(c, &r->advice);
}

/* A run was deleted with every row of it (store_runs.c): its connections
 * are closed with the reason (a trainer that reconnects starts it anew)
 * and the monitor stage forgets it. */
static void run_gone(struct ingest *ing, int64_t run_id)
{
    for (struct conn *c = ing->head; c; c = c->next)
        if (!c->closing && c->state == STREAMING && c->run_id == run_id)
            conn_protocol_error(c, E(LIMIT),
                                "run deleted (ended and past run_retention_s, no report within "
                                "run_hello_grace_s, or the API): reconnect to start it anew");
    if (ing->opts.stage)
        stage_forget(ing->opts.stage, run_id);
}

/* Resubmits parked items and reads again, oldest connection first. */
static void resume(struct ingest *ing)
{
    ing->paused = 0;
    for (struct conn *c = ing->head; c && !ing->paused; c = c->next) {
        if (c->closing)
            continue;
        if (c->pending) {
            struct store_item *it = c->pending;
            Foreshock__Frame *f = c->pending_frame;
            c->pending = NULL;
            c->pending_frame = NULL;
            if (conn_submit(c, it, f) == -EAGAIN)
                break; /* pushed back again: the rest stays parked */
        }
        conn_process(c);
    }
    for (struct conn *c = ing->head; c; c = c->next)
        conn_update_reading(c);
}

void ingest_on_async(uv_async_t *a)
{
    struct ingest *ing = a->data;
    struct store_result *res;
    size_t n = store_take_results(ing->opts.store, &res);
    int resumed = 0;
    for (size_t i = 0; i < n; i++) {
        const struct store_result *r = &res[i];
        if (r->kind == STORE_RESULT_RESUME) {
            resumed = 1;
            continue;
        }
        if (r->kind == STORE_RESULT_ADVICE) {
            deliver_advice(ing, r);
            continue;
        }
        if (r->kind == STORE_RESULT_RUN_GONE) {
            run_gone(ing, r->run_id);
            continue;
        }
        struct conn *c = conn_find(ing, r->conn_id);
        if (!c)
            continue; /* closed meanwhile: the data is committed anyway */
        c->inflight -= r->items <= c->inflight ? r->items : c->inflight;
        if (r->kind == STORE_RESULT_HELLO)
            conn_on_hello_done(c, r);
        else
            on_ack(c, r);
        if (c->closing)
            continue;
        if (c->state == STREAMING && !c->eof) {
            conn_process(c);
            conn_update_reading(c);
        }
        if (c->eof && c->inflight == 0 && !c->pending)
            conn_close_when_flushed(c);
        else if (ing->stopping && c->inflight == 0 && !c->pending)
            conn_linger(c);
    }
    free(res);
    /* Connections granted frame buffer room (grant_waiting) while their
     * frame is inside OpenSSL. */
    for (struct conn *c = ing->head; c; c = c->next) {
        if (!c->tls_kick)
            continue;
        c->tls_kick = 0;
        if (!c->closing && c->state == STREAMING) {
            conn_process(c);
            conn_update_reading(c);
        }
    }
    if (resumed && !ing->stopping)
        resume(ing);
    else if (resumed) {
        /* Stopping: parked items were received in full; they still commit. */
        ing->paused = 0;
        for (struct conn *c = ing->head; c && !ing->paused; c = c->next) {
            if (c->pending && !c->closing) {
                struct store_item *it = c->pending;
                Foreshock__Frame *f = c->pending_frame;
                c->pending = NULL;
                c->pending_frame = NULL;
                conn_submit(c, it, f);
            }
        }
    }
    ingest_check_stop(ing);
}

/* The stage's reduction memory filled (stop reading) or drained (go on). */
void ingest_on_stage_pressure(void *ctx, int full)
{
    struct ingest *ing = ctx;
    ing->stage_full = full;
    for (struct conn *c = ing->head; c; c = c->next) {
        if (!full && !c->closing && c->state == STREAMING)
            conn_process(c);
        conn_update_reading(c);
    }
}

void ingest_notify_loop(void *ctx)
{
    struct ingest *ing = ctx;
    uv_async_send(&ing->async);
}
