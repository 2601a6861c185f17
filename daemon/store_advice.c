/* The advice rows (advice.h's advice_store): advice and advice_deliveries
 * on the writer's connection, inside its open transaction. Moved here from
 * advice.c so that the writer's SQL lives in the store_* files; the policy,
 * the frame and the per-connection bookkeeping stay in advice.c. */
#include "advice.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alert.h"
#include "fs_grow.h"
#include "store_stmt.h"

enum {
    AS_CLOSE_ALERT,
    AS_OPEN_FIRE,
    AS_INSERT,
    AS_OWED,
    AS_SENT,
    AS_ACKED,
    AS_REWOUND,
    AS_FIRE_STREAMS,
    AS_COUNT
};

/* A delivery is recorded only for a stream of the advice's own run. */
#define DELIVERY_OF_RUN                                                                            \
    " WHERE EXISTS (SELECT 1 FROM advice a JOIN streams s ON s.run_id = a.run_id "                 \
    "WHERE a.id = ?1 AND s.id = ?2) "

/* An advice row with its alert's series, read by row_msg; AS_OWED and
 * AS_REWOUND select these first. */
#define ADVICE_COLUMNS                                                                             \
    "a.id, a.alert_id, a.action, a.rule, a.label, a.severity, a.step, a.first_breach_step, "       \
    "a.fired_step, a.rollback_step, al.layer, al.head, al.\"window\", al.rank, a.fire_id"
enum {
    AD_ID,
    AD_ALERT,
    AD_ACTION,
    AD_RULE,
    AD_LABEL,
    AD_SEVERITY,
    AD_STEP,
    AD_FIRST_BREACH,
    AD_FIRED,
    AD_ROLLBACK,
    AD_LAYER,
    AD_HEAD,
    AD_WINDOW,
    AD_RANK,
    AD_FIRE,
    AD_NEXT /* the first column after ADVICE_COLUMNS */
};

static const char *const as_sql[AS_COUNT] = {
    [AS_CLOSE_ALERT] = "UPDATE advice SET closed_at = ?2 WHERE alert_id = ?1 AND closed_at IS NULL",
    [AS_OPEN_FIRE] = "SELECT id FROM advice WHERE alert_id = ?1 AND closed_at IS NULL "
                     "AND action IN (1, 2) ORDER BY id DESC LIMIT 1",
    [AS_INSERT] = "INSERT INTO advice (run_id, alert_id, event_id, action, fire_id, rule, label, "
                  "severity, step, first_breach_step, fired_step, rollback_step, created_at) "
                  "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13) RETURNING id",
    /* Open advices of the run this stream has not acknowledged; an answer
     * (resolved, superseded) only to streams that were sent its question. */
    [AS_OWED] = "SELECT " ADVICE_COLUMNS " FROM advice a JOIN alerts al ON al.id = a.alert_id "
                "WHERE a.run_id = ?1 AND a.closed_at IS NULL AND (a.fire_id IS NULL OR EXISTS "
                "(SELECT 1 FROM advice_deliveries d WHERE d.advice_id = a.fire_id "
                "AND d.stream_id = ?2 AND d.sends > 0)) AND NOT EXISTS (SELECT 1 FROM "
                "advice_deliveries d WHERE d.advice_id = a.id AND d.stream_id = ?2 "
                "AND d.acked_at IS NOT NULL) ORDER BY a.id LIMIT ?3",
    [AS_SENT] = "INSERT INTO advice_deliveries (advice_id, stream_id, first_sent_at, "
                "last_sent_at, sends) SELECT ?1, ?2, ?3, ?3, 1" DELIVERY_OF_RUN
                "ON CONFLICT (advice_id, stream_id) DO UPDATE SET "
                "first_sent_at = COALESCE(first_sent_at, excluded.first_sent_at), "
                "last_sent_at = excluded.last_sent_at, sends = sends + 1",
    [AS_ACKED] =
        "INSERT INTO advice_deliveries (advice_id, stream_id, acked_at) "
        "SELECT ?1, ?2, ?3" DELIVERY_OF_RUN "ON CONFLICT (advice_id, stream_id) DO UPDATE SET "
        "acked_at = COALESCE(acked_at, excluded.acked_at)",
    [AS_FIRE_STREAMS] = "SELECT stream_id FROM advice_deliveries WHERE advice_id = ?1 "
                        "AND sends > 0 ORDER BY stream_id",
    /* Open firing advices of incidents that opened after a rewind's step. */
    [AS_REWOUND] = "SELECT " ADVICE_COLUMNS ", a.event_id FROM advice a "
                   "JOIN alerts al ON al.id = a.alert_id "
                   "WHERE a.run_id = ?1 AND a.closed_at IS NULL AND a.action IN (1, 2) "
                   "AND a.first_breach_step > ?2 ORDER BY a.id",
};

struct advice_store {
    sqlite3 *db;
    sqlite3_stmt *st[AS_COUNT];
};

int advice_store_open(sqlite3 *db, struct advice_store **out)
{
    struct advice_store *as = calloc(1, sizeof(*as));
    if (!as)
        return -ENOMEM;
    as->db = db;
    if (store_prepare_all(db, as_sql, AS_COUNT, as->st) < AS_COUNT) {
        advice_store_close(as);
        return -EIO;
    }
    *out = as;
    return 0;
}

void advice_store_close(struct advice_store *as)
{
    if (!as)
        return;
    store_finalize_all(as->st, AS_COUNT);
    free(as);
}

/* Steps st once; reads column 0 as int64 into *v when there is a row.
 * Resets st and clears its bindings. */
static int step1(sqlite3_stmt *st, int64_t *v)
{
    int rc = sqlite3_step(st);
    if (rc == SQLITE_ROW && v)
        *v = sqlite3_column_int64(st, 0);
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    return rc;
}

static void copy_text(char *dst, size_t len, const char *src)
{
    snprintf(dst, len, "%s", src ? src : "");
}

/* Stores m as its alert's one open advice, made by alert event event_id:
 * what the alert owed before is closed (the new one replaces it). m->id
 * becomes the new row's id. */
static int put_advice(struct advice_store *as, struct advice_msg *m, int64_t event_id, double now)
{
    sqlite3_stmt *st = as->st[AS_CLOSE_ALERT];
    sqlite3_bind_int64(st, 1, m->alert_id);
    sqlite3_bind_double(st, 2, now);
    int rc = step1(st, NULL);
    if (rc != SQLITE_DONE)
        return rc;
    st = as->st[AS_INSERT];
    sqlite3_bind_int64(st, 1, m->run_id);
    sqlite3_bind_int64(st, 2, m->alert_id);
    sqlite3_bind_int64(st, 3, event_id);
    sqlite3_bind_int(st, 4, m->action);
    store_bind_opt_step(st, 5, m->fire_id > 0 ? m->fire_id : -1);
    sqlite3_bind_text(st, 6, m->rule, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 7, m->label, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 8, m->severity, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 9, m->step);
    store_bind_opt_step(st, 10, m->first_breach_step);
    store_bind_opt_step(st, 11, m->fired_step);
    store_bind_opt_step(st, 12, m->rollback_step);
    sqlite3_bind_double(st, 13, now);
    if ((rc = step1(st, &m->id)) != SQLITE_ROW)
        return rc == SQLITE_DONE ? SQLITE_ERROR : rc;
    return SQLITE_OK;
}

int advice_store_event(struct advice_store *as, const struct advice_policy *p,
                       const struct advice_event *ev, double now, struct advice_msg *out,
                       bool *made)
{
    *made = false;
    int action = ADVICE_NONE;
    int64_t fire_id = -1;
    int rc;
    if (ev->to_state == ALERT_FIRING) {
        action = advice_decide(p, ev->label, ev->severity);
    } else if (ev->to_state == ALERT_RESOLVED || ev->to_state == ALERT_SUPERSEDED) {
        /* Only a firing that was advised gets its answer. */
        rc = sqlite3_bind_int64(as->st[AS_OPEN_FIRE], 1, ev->alert_id);
        if (rc != SQLITE_OK)
            return rc;
        rc = step1(as->st[AS_OPEN_FIRE], &fire_id);
        if (rc != SQLITE_ROW && rc != SQLITE_DONE)
            return rc;
        if (rc == SQLITE_ROW)
            action = ev->to_state == ALERT_RESOLVED ? ADVICE_RESOLVED : ADVICE_SUPERSEDED;
    }
    if (action == ADVICE_NONE)
        return SQLITE_OK;
    *out = (struct advice_msg){.run_id = ev->run_id,
                               .alert_id = ev->alert_id,
                               .action = action,
                               .step = ev->step,
                               .first_breach_step = ev->first_breach_step,
                               .fired_step = ev->fired_step,
                               .rollback_step =
                                   advice_rollback_step(ev->first_breach_step, ev->window),
                               .layer = ev->layer,
                               .head = ev->head,
                               .window = ev->window,
                               .rank = ev->rank,
                               .fire_id = fire_id > 0 ? fire_id : 0};
    copy_text(out->rule, sizeof(out->rule), ev->rule);
    copy_text(out->label, sizeof(out->label), ev->label);
    copy_text(out->severity, sizeof(out->severity), ev->severity);
    if ((rc = put_advice(as, out, ev->event_id, now)) != SQLITE_OK)
        return rc;
    *made = true;
    return SQLITE_OK;
}

static int64_t col_step(sqlite3_stmt *st, int i)
{
    return sqlite3_column_type(st, i) == SQLITE_NULL ? -1 : sqlite3_column_int64(st, i);
}

/* The advice of run_id on st's current row (ADVICE_COLUMNS). */
static void row_msg(sqlite3_stmt *st, int64_t run_id, struct advice_msg *m)
{
    *m = (struct advice_msg){.id = sqlite3_column_int64(st, AD_ID),
                             .run_id = run_id,
                             .alert_id = sqlite3_column_int64(st, AD_ALERT),
                             .action = sqlite3_column_int(st, AD_ACTION),
                             .step = col_step(st, AD_STEP),
                             .first_breach_step = col_step(st, AD_FIRST_BREACH),
                             .fired_step = col_step(st, AD_FIRED),
                             .rollback_step = col_step(st, AD_ROLLBACK),
                             .layer = sqlite3_column_int(st, AD_LAYER),
                             .head = sqlite3_column_int(st, AD_HEAD),
                             .window = sqlite3_column_int(st, AD_WINDOW),
                             .rank = sqlite3_column_int(st, AD_RANK),
                             .fire_id = sqlite3_column_int64(st, AD_FIRE)};
    copy_text(m->rule, sizeof(m->rule), (const char *)sqlite3_column_text(st, AD_RULE));
    copy_text(m->label, sizeof(m->label), (const char *)sqlite3_column_text(st, AD_LABEL));
    copy_text(m->severity, sizeof(m->severity), (const char *)sqlite3_column_text(st, AD_SEVERITY));
}

int advice_store_rewind(struct advice_store *as, int64_t run_id, uint64_t resume_step, double now,
                        int (*cb)(void *ctx, const struct advice_msg *m), void *ctx)
{
    /* Read first, then write: the answers go into the table being read. */
    struct rewound {
        struct advice_msg m;
        int64_t event_id;
    } *v = NULL;
    size_t n = 0, cap = 0;
    sqlite3_stmt *st = as->st[AS_REWOUND];
    sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_int64(st, 2, (int64_t)resume_step);
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        struct rewound *p = fs_grow(v, &cap, n + 1, sizeof(*p), 16);
        if (!p) {
            rc = SQLITE_NOMEM;
            break;
        }
        v = p;
        struct rewound *r = &v[n++];
        row_msg(st, run_id, &r->m); /* the firing advice; its answer is made below */
        r->m.action = ADVICE_SUPERSEDED;
        r->m.step = (int64_t)resume_step;
        r->event_id = sqlite3_column_int64(st, AD_NEXT);
    }
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    if (rc != SQLITE_DONE) {
        free(v);
        return rc == SQLITE_ROW ? SQLITE_ERROR : rc;
    }
    rc = SQLITE_OK;
    for (size_t i = 0; i < n && rc == SQLITE_OK; i++) {
        struct advice_msg *m = &v[i].m;
        m->fire_id = m->id; /* the answer to the firing advice just read */
        if ((rc = put_advice(as, m, v[i].event_id, now)) != SQLITE_OK)
            break;
        rc = cb ? cb(ctx, m) : SQLITE_OK;
    }
    free(v);
    return rc;
}

int advice_store_owed(struct advice_store *as, int64_t run_id, int64_t stream_id, size_t max,
                      int (*cb)(void *ctx, const struct advice_msg *m), void *ctx, bool *more)
{
    sqlite3_stmt *st = as->st[AS_OWED];
    *more = false;
    sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_int64(st, 2, stream_id);
    sqlite3_bind_int64(st, 3, (int64_t)max + 1);
    size_t n = 0;
    int rc, stop = 0;
    while (!stop && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (n == max) {
            *more = true;
            break;
        }
        struct advice_msg m;
        row_msg(st, run_id, &m);
        n++;
        stop = cb(ctx, &m);
    }
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    if (stop)
        return stop;
    return rc == SQLITE_ROW || rc == SQLITE_DONE ? SQLITE_OK : rc;
}

int advice_store_fire_streams(struct advice_store *as, int64_t fire_id,
                              int (*cb)(void *ctx, int64_t stream_id), void *ctx)
{
    sqlite3_stmt *st = as->st[AS_FIRE_STREAMS];
    sqlite3_bind_int64(st, 1, fire_id);
    int rc, stop = 0;
    while (!stop && (rc = sqlite3_step(st)) == SQLITE_ROW)
        stop = cb(ctx, sqlite3_column_int64(st, 0));
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    if (stop)
        return stop;
    return rc == SQLITE_DONE ? SQLITE_OK : rc;
}

int advice_store_delivery(struct advice_store *as, int64_t advice_id, int64_t stream_id, int acked,
                          double now)
{
    sqlite3_stmt *st = as->st[acked ? AS_ACKED : AS_SENT];
    sqlite3_bind_int64(st, 1, advice_id);
    sqlite3_bind_int64(st, 2, stream_id);
    sqlite3_bind_double(st, 3, now);
    int rc = step1(st, NULL);
    return rc == SQLITE_DONE ? SQLITE_OK : rc;
}
