/* The monitor stage's rows: one STORE_ITEM_MONITOR built from the
 * evaluator's tracks and batches (points, detector states, alert rows and
 * events with their evidence, incomplete rows), then submitted to the
 * writer. See stage_internal.h. Loop thread. */
#include "stage_internal.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alert.h"
#include "fs_clock.h"
#include "fs_grow.h"

_Static_assert(STORE_ALERT_KEY_MAX >= ALERT_KEY_MAX, "alert key buffer");
_Static_assert(STORE_DEDUP_KEY_MAX >= ALERT_DEDUP_MAX, "dedup key buffer");
_Static_assert(STORE_STATE_BLOB_MAX >= DETECT_STATE_ENCODED_MAX, "detector blob buffer");
_Static_assert(STORE_ALERT_BLOB_MAX >= ALERT_STATE_ENCODED_BYTES, "alert blob buffer");
_Static_assert(STORE_RULE_MAX >= DETECT_NAME_MAX, "rule name buffer");

int build_begin(struct build *bd, int64_t run_id, double time)
{
    memset(bd, 0, sizeof(*bd));
    bd->it = store_item_new(STORE_ITEM_MONITOR);
    if (!bd->it)
        return -ENOMEM;
    bd->it->monitor.run_id = run_id;
    bd->it->monitor.time = time;
    return 0;
}

void *build_grow(void *p, size_t *cap, size_t n, size_t size, int *oom)
{
    void *q = fs_grow(p, cap, n + 1, size, 64);
    if (!q)
        *oom = 1;
    return q;
}

void build_key(struct store_series_key *k, const char *name, int32_t layer, int32_t head,
               int32_t window, int32_t rank)
{
    snprintf(k->name, sizeof(k->name), "%s", name);
    k->layer = layer;
    k->head = head;
    k->window = window;
    k->rank = rank;
}

void build_point(struct build *bd, const struct store_series_key *k, uint64_t step, double value)
{
    struct store_monitor *m = &bd->it->monitor;
    struct store_point *p =
        build_grow(m->points, &bd->cap_points, m->n_points, sizeof(*p), &bd->oom);
    if (!p)
        return;
    m->points = p;
    p[m->n_points++] = (struct store_point){.key = *k, .step = step, .value = value};
}

void build_state(struct build *bd, const struct eval_track *t)
{
    struct store_monitor *m = &bd->it->monitor;
    uint8_t buf[DETECT_STATE_ENCODED_MAX];
    int len = detect_state_encode(&t->ds, buf, sizeof(buf));
    if (len < 0) {
        bd->oom = 1;
        return;
    }
    size_t cap = bd->cap_states;
    struct store_detector_row *d = build_grow(m->states, &cap, m->n_states, sizeof(*d), &bd->oom);
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
    uint8_t *b = fs_grow(m->blobs, &bd->blob_cap, bd->blob_len + (size_t)len, 1, 8192);
    if (!b) {
        bd->oom = 1;
        return;
    }
    m->blobs = b;
    memcpy(m->blobs + bd->blob_len, buf, (size_t)len);
    bd->blob_off[m->n_states] = bd->blob_len;
    d[m->n_states++] = (struct store_detector_row){
        .key = t->key, .step = (uint64_t)t->last_step, .len = (uint32_t)len};
    bd->blob_len += (size_t)len;
}

void build_incomplete(struct build *bd, uint64_t step, const struct run_incomplete *r)
{
    struct store_monitor *m = &bd->it->monitor;
    struct store_incomplete_row *p =
        build_grow(m->incomplete, &bd->cap_incomplete, m->n_incomplete, sizeof(*p), &bd->oom);
    if (!p)
        return;
    m->incomplete = p;
    p[m->n_incomplete++] = (struct store_incomplete_row){.kind = run_group_kind_name(r->kind),
                                                         .step = step,
                                                         .layer = (int32_t)r->layer,
                                                         .head = r->head,
                                                         .window = (int32_t)r->window,
                                                         .have = r->have,
                                                         .want = r->want};
}

/* One sample into a detected series: detector, alert lifecycle (evaluate.h),
 * the detector-state row, and the alert row when it changed (labels and
 * rows are filled in by build_finish). */
void build_feed(struct stage *st, struct stage_run *sr, struct run *run, struct build *bd,
                const struct store_series_key *k, const char *rule_name, uint64_t step,
                double value, bool present, int32_t argmin_head)
{
    uint64_t capped = sr->ev.capped;
    struct eval_track *t = eval_track_get(&sr->ev, k, rule_name);
    if (!t) {
        if (sr->ev.capped != capped && !sr->budget_logged) {
            sr->budget_logged = true;
            log_error("stage",
                      "run %s: its detected series need more than half of max_run_bytes = %llu "
                      "(%zu series of %zu bytes): %s layer %d and later new series are not "
                      "detected; raise max_run_bytes or report fewer layers",
                      run->name, (unsigned long long)st->opts.max_run_bytes, sr->ev.n_tracks,
                      (size_t)EVAL_TRACK_BYTES, k->name, k->layer);
        }
        return;
    }
    size_t before = bd->batch.n;
    int rc = eval_feed(&sr->ev, &bd->batch, t, step, value, present, argmin_head,
                       detect_from(st, run), fs_clock_unix());
    if (rc < 0) {
        bd->oom |= rc == -ENOMEM;
        return;
    }
    if (rc == 0)
        return;
    build_state(bd, t);
    if (bd->batch.n > before && bd->batch.ev[before].tr.change == ALERT_CHANGE_TO_FIRING)
        atomic_fetch_add(&st->stats->alerts_fired, 1);
}

static json_t *jnum(double v)
{
    return isfinite(v) ? json_real(v) : json_null();
}

static json_t *jstep(int64_t v)
{
    return v >= 0 ? json_integer(v) : json_null();
}

static json_t *jlabel(int32_t v, int32_t none)
{
    return v == none ? json_null() : json_integer(v);
}

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
void build_finish(struct stage_run *sr, const struct run *run, struct build *bd)
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
            struct alert_scope scope = {.layer = t->key.layer,
                                        .head = t->key.head,
                                        .window = t->key.window,
                                        .rank = t->key.rank};
            if (alert_key(run->name, t->rule_name, &scope, a->alert_key, sizeof(a->alert_key)) <
                    0 ||
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
                        "stage",
                        "alert %s %s run=%s layer=%d head=%d window=%d rank=%d step=%lld "
                        "value=%g attribution=%s (%s)",
                        t->rule_name, a->change, run->name, scope.layer, scope.head, scope.window,
                        scope.rank, (long long)p->tr.step, p->tr.value,
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
void build_submit(struct stage *st, struct build *bd)
{
    struct store_item *it = bd->it;
    const struct store_monitor *m = &it->monitor;
    bd->it = NULL;
    if (bd->oom)
        log_limited(&st->rl_err, LOG_LEVEL_ERROR, "stage",
                    "out of memory building monitor rows of run %lld: some are lost",
                    (long long)m->run_id);
    if (!m->n_points && !m->n_states && !m->n_alerts && !m->n_incomplete && !m->has_spool_done &&
        !m->has_spool_rewind) {
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
