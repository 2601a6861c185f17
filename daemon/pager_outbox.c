/* What the pager thread reads over its read-only connection (undone outbox
 * rows per target, paged incidents still open, silences, an alert's
 * state) and the outcomes it hands the writer (STORE_ITEM_OUTBOX). The
 * pager never writes SQLite itself. See pager_internal.h. */
#include "fs_clock.h"

#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "fs_grow.h"
#include "log.h"
#include "pager_internal.h"
#include "silence_set.h"

static int target_index(const struct pager *p, const char *name)
{
    for (size_t i = 0; i < p->cfg.n; i++)
        if (strcmp(p->cfg.t[i].name, name) == 0)
            return (int)i;
    return -1;
}
/* --- outcomes through the writer ------------------------------------------------------------ */

void pager_record(struct pager *p, const struct prow *r, int state, int status, const char *err)
{
    struct store_item *it = store_item_new(STORE_ITEM_OUTBOX);
    if (!it) {
        log_limited(&p->rl_store, LOG_LEVEL_ERROR, "pager",
                    "out of memory recording outbox row %lld; it is retried after a restart",
                    (long long)r->id);
        return;
    }
    struct store_outbox_outcome *o = &it->outbox;
    o->outbox_id = r->id;
    o->state = state;
    o->attempts = r->attempts;
    o->next_attempt_at = state == STORE_OUTBOX_PENDING ? r->next_at : NAN;
    o->http_status = status;
    snprintf(o->last_error, sizeof(o->last_error), "%s", err ? err : "");
    int rc = store_submit(p->store, it);
    if (rc < 0) {
        log_limited(&p->rl_store, LOG_LEVEL_ERROR, "pager",
                    "cannot record outbox row %lld: %s; it is retried after a restart",
                    (long long)r->id, strerror(-rc));
        store_item_free(it);
    }
}

/* --- reading: rows, open incidents, silences ------------------------------------------------ */

#define PAGE_COLUMNS                                                                               \
    "o.id, o.target, o.kind, o.state, o.attempts, o.next_attempt_at, o.created_at, o.event_id, "   \
    "o.severity, o.attribution, a.id, r.name, a.rule, a.alert_key, a.dedup_key, a.family, "        \
    "a.layer, a.head, a.\"window\", a.rank, a.incidents, a.series_id, a.created_at, "              \
    "a.updated_at, e.step, e.at, e.evidence_json, "                                                \
    "(SELECT f.at FROM alert_events f WHERE f.alert_id = o.alert_id AND f.change = 'to_firing' "   \
    "AND f.id <= o.event_id ORDER BY f.id DESC LIMIT 1) "                                          \
    "FROM outbox o JOIN alerts a ON a.id = o.alert_id JOIN runs r ON r.id = a.run_id "             \
    "JOIN alert_events e ON e.id = o.event_id "

enum {
    PC_ID,
    PC_TARGET,
    PC_KIND,
    PC_STATE,
    PC_ATTEMPTS,
    PC_NEXT,
    PC_CREATED,
    PC_EVENT,
    PC_SEVERITY,
    PC_ATTR,
    PC_ALERT,
    PC_RUN,
    PC_RULE,
    PC_KEY,
    PC_DEDUP,
    PC_FAMILY,
    PC_LAYER,
    PC_HEAD,
    PC_WINDOW,
    PC_RANK,
    PC_INCIDENTS,
    PC_SERIES,
    PC_A_CREATED,
    PC_A_UPDATED,
    PC_STEP,
    PC_AT,
    PC_EVIDENCE,
    PC_FIRED_AT
};

static void col_text(sqlite3_stmt *q, int i, char *out, size_t len)
{
    const unsigned char *t = sqlite3_column_text(q, i);
    snprintf(out, len, "%s", t ? (const char *)t : "");
}

static double col_real(sqlite3_stmt *q, int i, double none)
{
    return sqlite3_column_type(q, i) == SQLITE_NULL ? none : sqlite3_column_double(q, i);
}

static void page_from_row(sqlite3_stmt *q, struct page_alert *a)
{
    memset(a, 0, sizeof(*a));
    a->alert_id = sqlite3_column_int64(q, PC_ALERT);
    a->kind = sqlite3_column_int(q, PC_KIND) == STORE_OUTBOX_RESOLVE ? PAGE_RESOLVE : PAGE_TRIGGER;
    col_text(q, PC_RUN, a->run, sizeof(a->run));
    col_text(q, PC_RULE, a->rule, sizeof(a->rule));
    col_text(q, PC_KEY, a->alert_key, sizeof(a->alert_key));
    col_text(q, PC_DEDUP, a->dedup_key, sizeof(a->dedup_key));
    col_text(q, PC_SEVERITY, a->severity, sizeof(a->severity));
    col_text(q, PC_FAMILY, a->family, sizeof(a->family));
    col_text(q, PC_ATTR, a->attribution, sizeof(a->attribution));
    a->layer = sqlite3_column_int(q, PC_LAYER);
    a->head = sqlite3_column_int(q, PC_HEAD);
    a->window = sqlite3_column_int(q, PC_WINDOW);
    a->rank = sqlite3_column_int(q, PC_RANK);
    a->step = sqlite3_column_int64(q, PC_STEP);
    a->first_breach_step = a->fired_step = a->resolved_step = -1;
    a->value = a->median = a->mad = a->z = NAN;
    page_alert_evidence(a, (const char *)sqlite3_column_text(q, PC_EVIDENCE));
    double at = col_real(q, PC_AT, 0);
    a->fired_at = col_real(q, PC_FIRED_AT, at);
    if (a->kind == PAGE_RESOLVE) {
        a->resolved_at = at;
        a->resolved_step = a->step;
    }
    a->incidents = (uint64_t)sqlite3_column_int64(q, PC_INCIDENTS);
    a->series_id = sqlite3_column_int64(q, PC_SERIES);
    a->created_at = col_real(q, PC_A_CREATED, NAN);
    a->updated_at = col_real(q, PC_A_UPDATED, NAN);
}

static void db_complaint(struct pager *p, const char *what)
{
    log_limited(&p->rl_db, LOG_LEVEL_ERROR, "pager", "reading %s: %s", what, sqlite3_errmsg(p->db));
}

struct popen *pager_open_find(struct pager *p, int64_t alert_id, int target)
{
    for (size_t i = 0; i < p->nopen; i++)
        if (p->open[i].a.alert_id == alert_id && p->open[i].target == target)
            return &p->open[i];
    return NULL;
}

/* Tracks a paged incident (replacing an older one of the same alert and
 * target). Returns 0 or -ENOSPC / -ENOMEM (logged). */
int pager_open_add(struct pager *p, const struct page_alert *a, int target, double next_resend)
{
    struct popen *o = pager_open_find(p, a->alert_id, target);
    if (!o) {
        if (p->nopen >= PAGER_MAX_OPEN) {
            log_limited(&p->rl_db, LOG_LEVEL_WARN, "pager",
                        "more than %u paged incidents open: alert %lld is neither re-sent nor "
                        "resolved at target %s",
                        PAGER_MAX_OPEN, (long long)a->alert_id, p->cfg.t[target].name);
            return -ENOSPC;
        }
        struct popen *n = fs_grow(p->open, &p->capopen, p->nopen + 1, sizeof(*n), 16);
        if (!n)
            return -ENOMEM;
        p->open = n;
        o = &p->open[p->nopen++];
    }
    memset(o, 0, sizeof(*o));
    o->target = target;
    o->next_resend = next_resend;
    o->a = *a;
    /* A resolve loaded while its trigger was still retrying: the alert no
     * longer fires, so no re-send may follow the trigger. */
    for (size_t i = 0; i < p->nrows; i++) {
        const struct prow *r = &p->rows[i];
        if (!r->done && r->target == target && r->a.alert_id == a->alert_id &&
            r->a.kind == PAGE_RESOLVE)
            o->resolving = 1;
    }
    return 0;
}

void pager_open_remove(struct pager *p, struct popen *o)
{
    size_t i = (size_t)(o - p->open);
    p->open[i] = p->open[--p->nopen];
}

/* Paged incidents of the previous run: delivered (or given up) triggers
 * with no later row of the same alert and target done since. */
void pager_load_open(struct pager *p)
{
    sqlite3_stmt *q = NULL;
    const char *sql =
        "SELECT " PAGE_COLUMNS "WHERE o.kind = " STORE_OUTBOX_SQL_TRIGGER
        " AND o.state IN " STORE_OUTBOX_SQL_SENT " AND NOT EXISTS (SELECT 1 FROM "
        "outbox x WHERE x.alert_id = o.alert_id AND x.target = o.target AND "
        "x.id > o.id AND x.state IN " STORE_OUTBOX_SQL_FINISHED ") ORDER BY o.id LIMIT ?1";
    if (sqlite3_prepare_v2(p->db, sql, -1, &q, NULL) != SQLITE_OK) {
        db_complaint(p, "open incidents");
        return;
    }
    sqlite3_bind_int64(q, 1, PAGER_MAX_OPEN);
    double now = fs_clock_mono();
    int rc;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        char name[STATS_TARGET_NAME_MAX];
        col_text(q, PC_TARGET, name, sizeof(name));
        int t = target_index(p, name);
        if (t < 0)
            continue;
        struct page_alert a;
        page_from_row(q, &a);
        pager_open_add(p, &a, t, now); /* Alertmanager: re-send at once */
    }
    if (rc != SQLITE_DONE)
        db_complaint(p, "open incidents");
    sqlite3_finalize(q);
    if (p->nopen)
        log_info("pager", "%zu paged incidents still open", p->nopen);
}

/* Loads undone rows of target t above its watermark into its share of
 * memory. 0, or -EIO (logged). */
static int load_target_rows(struct pager *p, int t)
{
    size_t room = p->quota - p->count[t];
    p->backlog[t] = 0;
    if (room == 0 || p->nrows >= PAGER_MAX_ROWS) {
        p->backlog[t] = 1;
        return 0;
    }
    sqlite3_stmt *q = NULL;
    const char *sql =
        "SELECT " PAGE_COLUMNS "WHERE o.id > ?1 AND o.state IN " STORE_OUTBOX_SQL_UNDONE
        " AND o.target = ?3 ORDER BY o.id LIMIT ?2";
    if (sqlite3_prepare_v2(p->db, sql, -1, &q, NULL) != SQLITE_OK) {
        db_complaint(p, "outbox");
        p->backlog[t] = 1;
        return -EIO;
    }
    sqlite3_bind_int64(q, 1, p->watermark[t]);
    sqlite3_bind_int64(q, 2, (int64_t)room);
    sqlite3_bind_text(q, 3, p->cfg.t[t].name, -1, SQLITE_STATIC);
    size_t got = 0;
    int rc = SQLITE_DONE;
    double now = fs_clock_unix();
    while (p->nrows < PAGER_MAX_ROWS && (rc = sqlite3_step(q)) == SQLITE_ROW) {
        struct prow *r = &p->rows[p->nrows];
        memset(r, 0, sizeof(*r));
        r->id = sqlite3_column_int64(q, PC_ID);
        r->event_id = sqlite3_column_int64(q, PC_EVENT);
        r->target = t;
        r->state = sqlite3_column_int(q, PC_STATE);
        r->attempts = (uint32_t)sqlite3_column_int64(q, PC_ATTEMPTS);
        r->next_at = col_real(q, PC_NEXT, now);
        r->created_at = col_real(q, PC_CREATED, now);
        page_from_row(q, &r->a);
        if (r->a.kind == PAGE_RESOLVE) {
            struct popen *o = pager_open_find(p, r->a.alert_id, r->target);
            if (o)
                o->resolving = 1;
        }
        p->watermark[t] = r->id;
        p->nrows++;
        p->count[t]++;
        got++;
    }
    int err = 0;
    if (rc != SQLITE_DONE && rc != SQLITE_ROW) {
        db_complaint(p, "outbox");
        p->backlog[t] = 1;
        err = -EIO;
    } else if (got == room || rc == SQLITE_ROW) {
        p->backlog[t] = 1;
    }
    sqlite3_finalize(q);
    return err;
}

/* Loads every target's rows (see load_target_rows). */
void pager_load_rows(struct pager *p)
{
    p->load_error = 0;
    for (size_t t = 0; t < p->cfg.n; t++)
        if (load_target_rows(p, (int)t) < 0)
            p->load_error = 1;
}

/* Whether a target has rows waiting in the table and room for them now. */
int pager_more_to_load(const struct pager *p)
{
    if (p->load_error)
        return 0;
    for (size_t t = 0; t < p->cfg.n; t++)
        if (p->backlog[t] && p->count[t] < p->quota)
            return 1;
    return 0;
}

/* Undone rows of targets no longer configured are closed once, at start
 * (rows are only ever inserted for configured targets). Bounded: chunks of
 * PAGER_MAX_ROWS, each committed before the next is read. */
void pager_close_unconfigured(struct pager *p)
{
    json_t *names = json_array();
    for (size_t t = 0; names && t < p->cfg.n; t++)
        json_array_append_new(names, json_string(p->cfg.t[t].name));
    char *js = names ? json_dumps(names, JSON_COMPACT) : NULL;
    json_decref(names);
    sqlite3_stmt *q = NULL;
    if (!js || sqlite3_prepare_v2(p->db,
                                  "SELECT id, attempts FROM outbox WHERE id > ?1 AND "
                                  "state IN " STORE_OUTBOX_SQL_UNDONE " AND target NOT IN "
                                  "(SELECT value FROM "
                                  "json_each(?2)) ORDER BY id LIMIT ?3",
                                  -1, &q, NULL) != SQLITE_OK) {
        if (js)
            db_complaint(p, "outbox rows of removed targets");
        free(js);
        return;
    }
    int64_t after = 0;
    size_t total = 0, got;
    do {
        got = 0;
        sqlite3_bind_int64(q, 1, after);
        sqlite3_bind_text(q, 2, js, -1, SQLITE_STATIC);
        sqlite3_bind_int64(q, 3, PAGER_MAX_ROWS);
        int rc;
        while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
            struct prow r = {.id = sqlite3_column_int64(q, 0),
                             .attempts = (uint32_t)sqlite3_column_int64(q, 1)};
            pager_record(p, &r, STORE_OUTBOX_GIVEN_UP, 0, "target no longer configured");
            after = r.id;
            got++;
        }
        if (rc != SQLITE_DONE) {
            db_complaint(p, "outbox rows of removed targets");
            got = 0;
        }
        sqlite3_reset(q);
        total += got;
        if (got)
            store_flush(p->store); /* bounded queue use: one chunk at a time */
    } while (got == PAGER_MAX_ROWS && !atomic_load(&p->stopping));
    sqlite3_finalize(q);
    free(js);
    if (total)
        log_warn("pager", "%zu undone outbox rows name targets no longer configured: given up",
                 total);
}

/* Whether an active silence of the last read holds a. */
int pager_silenced(const struct pager *p, const struct page_alert *a, double now)
{
    return p->sils != NULL && page_silenced(p->sils->v, p->sils->n, a, now);
}

/* Re-reads the silences that are active now or start later. p->sil_ok
 * says whether the read was whole: a partial list must not let a silenced
 * trigger through, so until a read succeeds nothing a silence could hold is
 * sent. A silence read before is not compiled again (silence_set.h). */
void pager_load_silences(struct pager *p, double now)
{
    sqlite3_stmt *q = NULL;
    p->sil_ok = 0;
    if (sqlite3_prepare_v2(p->db,
                           "SELECT id, matchers_json, starts_at, ends_at FROM silences "
                           "WHERE ends_at > ?1 ORDER BY id LIMIT ?2",
                           -1, &q, NULL) != SQLITE_OK) {
        db_complaint(p, "silences");
        return;
    }
    sqlite3_bind_double(q, 1, now);
    sqlite3_bind_int64(q, 2, PAGER_MAX_SILENCES);
    struct silence_build b;
    silence_build_start(&b, p->sils, PAGER_MAX_SILENCES);
    int rc = SQLITE_DONE, brc = 0;
    while (brc >= 0 && (rc = sqlite3_step(q)) == SQLITE_ROW) {
        const char *json = (const char *)sqlite3_column_text(q, 1);
        struct silence_row row = {
            .id = sqlite3_column_int64(q, 0),
            .starts_at = sqlite3_column_double(q, 2),
            .ends_at = sqlite3_column_double(q, 3),
            .json = json ? json : "",
            .len = json ? (size_t)sqlite3_column_bytes(q, 1) : 0,
        };
        struct fs_err why = {0};
        brc = silence_build_row(&b, &row, &why);
        if (brc == 1)
            log_limited(&p->rl_sil, LOG_LEVEL_WARN, "pager", "silence %lld ignored: %s",
                        (long long)row.id, why.msg);
    }
    atomic_fetch_add(&p->stats->silence_compiles_pager, b.parsed);
    struct silence_set *next = silence_build_finish(&b);
    if (brc < 0 || rc != SQLITE_DONE || !next) {
        if (brc < 0 || !next)
            log_limited(&p->rl_sil, LOG_LEVEL_WARN, "pager", "silences: %s",
                        brc == -ENOSPC ? "too many" : "out of memory");
        else
            db_complaint(p, "silences");
        silence_set_unref(next); /* keep the last whole read; sil_ok stays 0 */
    } else {
        silence_set_unref(p->sils);
        p->sils = next;
        p->sil_ok = 1;
    }
    sqlite3_finalize(q);
}

/* Whether the alert still fires in the incident that event_id opened. */
int pager_still_firing(struct pager *p, int64_t alert_id, int64_t event_id)
{
    sqlite3_stmt *q = NULL;
    if (sqlite3_prepare_v2(p->db,
                           "SELECT a.state = 2 AND (SELECT max(id) FROM alert_events WHERE "
                           "alert_id = a.id AND change = 'to_firing') = ?2 FROM alerts a "
                           "WHERE a.id = ?1",
                           -1, &q, NULL) != SQLITE_OK) {
        db_complaint(p, "alert state");
        return -1;
    }
    sqlite3_bind_int64(q, 1, alert_id);
    sqlite3_bind_int64(q, 2, event_id);
    int rc = sqlite3_step(q), v = rc == SQLITE_ROW ? sqlite3_column_int(q, 0) : 0;
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) {
        db_complaint(p, "alert state");
        v = -1;
    }
    sqlite3_finalize(q);
    return v;
}
