/* The "advice" of /api/v1/alerts/{id}: what trainers were advised about the
 * alert (advice.h), and when each stream (attempt, rank) was sent each
 * advice and acknowledged it. Runs inside the request's read transaction. */

#include "http_internal.h"

#include "advice.h"

/* Columns of STMT_ALERT_ADVICE. */
enum {
    AV_ID,
    AV_ACTION,
    AV_STEP,
    AV_RULE,
    AV_LABEL,
    AV_SEVERITY,
    AV_FIRST_BREACH,
    AV_FIRED,
    AV_ROLLBACK,
    AV_CREATED,
    AV_CLOSED,
    AV_ATTEMPT,
    AV_RANK,
    AV_FIRST_SENT,
    AV_LAST_SENT,
    AV_SENDS,
    AV_ACKED,
};

static json_t *advice_json(sqlite3_stmt *st)
{
    json_t *o = json_object();
    if (!o)
        return NULL;
    int rc = 0;
    rc |= oset(o, "id", col_int(st, AV_ID));
    rc |= oset(o, "action", json_string(advice_action_name(sqlite3_column_int(st, AV_ACTION))));
    rc |= oset(o, "step", col_int(st, AV_STEP));
    rc |= oset(o, "rule", col_text(st, AV_RULE));
    rc |= oset(o, "label", col_text(st, AV_LABEL));
    rc |= oset(o, "severity", col_text(st, AV_SEVERITY));
    rc |= oset(o, "first_breach_step", col_int(st, AV_FIRST_BREACH));
    rc |= oset(o, "fired_step", col_int(st, AV_FIRED));
    rc |= oset(o, "rollback_step", col_int(st, AV_ROLLBACK));
    rc |= oset(o, "created_at", col_real(st, AV_CREATED));
    /* closed: no longer owed to streams that lack it (a later advice of
     * the alert replaced it) */
    rc |= oset(o, "closed_at", col_real(st, AV_CLOSED));
    rc |= oset(o, "deliveries", json_array());
    if (rc != 0) {
        json_decref(o);
        return NULL;
    }
    return o;
}

static json_t *delivery_json(sqlite3_stmt *st)
{
    json_t *o = json_object();
    if (!o)
        return NULL;
    int rc = 0;
    rc |= oset(o, "attempt", col_int(st, AV_ATTEMPT));
    rc |= oset(o, "rank", col_int(st, AV_RANK));
    rc |= oset(o, "first_sent_at", col_real(st, AV_FIRST_SENT));
    rc |= oset(o, "last_sent_at", col_real(st, AV_LAST_SENT));
    rc |= oset(o, "sends", col_int(st, AV_SENDS));
    rc |= oset(o, "acked_at", col_real(st, AV_ACKED));
    if (rc != 0) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* Prepends v to array a (rows arrive newest first). */
static int prepend(json_t *a, json_t *v)
{
    if (!v)
        return -1;
    int rc = json_array_insert_new(a, 0, v);
    return rc;
}

int http_alert_advice(struct ctx *c, int64_t id, json_t **out, bool *truncated)
{
    sqlite3_stmt *st = c->dbc->st[STMT_ALERT_ADVICE];
    json_t *list = json_array();
    if (!list) {
        http_reply_oom(c);
        return -ENOMEM;
    }
    sqlite3_bind_int64(st, 1, id);
    sqlite3_bind_int64(st, 2, HTTP_MAX_ALERT_ADVICE + 1);
    *truncated = false;
    json_t *cur = NULL; /* the advice rows are being added to (borrowed from list) */
    int64_t cur_id = 0;
    size_t rows = 0;
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (rows++ == HTTP_MAX_ALERT_ADVICE) {
            *truncated = true;
            break;
        }
        int64_t aid = sqlite3_column_int64(st, AV_ID);
        if (!cur || aid != cur_id) {
            if (prepend(list, advice_json(st)) != 0)
                goto oom;
            cur = json_array_get(list, 0);
            cur_id = aid;
        }
        /* LEFT JOIN: an advice nobody was sent yet has one row of NULLs */
        if (sqlite3_column_type(st, AV_ATTEMPT) != SQLITE_NULL &&
            prepend(json_object_get(cur, "deliveries"), delivery_json(st)) != 0)
            goto oom;
    }
    if (!*truncated && rc != SQLITE_DONE) {
        http_reply_db_error(c, "alert advice", rc);
        stmt_done(st);
        json_decref(list);
        return -EIO;
    }
    stmt_done(st);
    *out = list;
    return 0;
oom:
    stmt_done(st);
    json_decref(list);
    http_reply_oom(c);
    return -ENOMEM;
}
