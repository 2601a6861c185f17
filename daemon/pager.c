/* The pager thread: outbox -> route -> silences -> libcurl -> outcome
 * through the writer. See pager.h for the contract. */
#include "pager.h"
#include "fs_clock.h"

#include <curl/curl.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "log.h"
#include "silence_set.h"

/* --- configuration: [target "NAME"] ------------------------------------------------------ */

#define TFIELD(f) .offset = offsetof(struct pager_target_cfg, f), \
                  .size = sizeof(((struct pager_target_cfg *)0)->f)

static const char *const type_names[] = {[PAGER_ALERTMANAGER] = "alertmanager",
                                         [PAGER_PAGERDUTY] = "pagerduty",
                                         [PAGER_WEBHOOK] = "webhook", NULL};
static const char *const severity_names[] = {"warning", "critical", NULL};

static const struct config_key target_keys[] = {
    {.name = "type", .type = CONFIG_ENUM, .def = NULL, .choices = type_names, TFIELD(type),
     .help = "alertmanager | pagerduty | webhook (required)"},
    {.name = "url", .type = CONFIG_STRING, .def = "", .min = 0, .max = PAGE_URL_MAX - 1,
     TFIELD(url), .help = "Alertmanager base URL, PagerDuty events URL, or the webhook URL"},
    {.name = "routing_key", .type = CONFIG_STRING, .def = "", .min = 0,
     .max = PAGER_ROUTING_KEY_MAX - 1, TFIELD(routing_key),
     .help = "PagerDuty integration (routing) key"},
    {.name = "secret", .type = CONFIG_STRING, .def = "", .min = 0, .max = PAGER_SECRET_MAX - 1,
     TFIELD(secret), .help = "webhook HMAC-SHA256 key (empty: unsigned)"},
    {.name = "min_severity", .type = CONFIG_ENUM, .def = "warning", .choices = severity_names,
     TFIELD(min_severity), .help = "warning | critical"},
    {.name = "match", .type = CONFIG_STRING, .def = "", .min = 0, .max = PAGER_MATCH_MAX - 1,
     TFIELD(match), .help = "label filter, e.g. run=~gpt-.*,family=attention_d2"},
    {.name = "timeout", .type = CONFIG_DOUBLE, .def = "10", .min = 0.1, .max = 300,
     TFIELD(timeout), .help = "seconds a whole request may take"},
    {.name = "connect_timeout", .type = CONFIG_DOUBLE, .def = "5", .min = 0.1, .max = 300,
     TFIELD(connect_timeout), .help = "seconds to connect"},
    {.name = "backoff_initial", .type = CONFIG_DOUBLE, .def = "1", .min = 0.01, .max = 86400,
     TFIELD(backoff_initial), .help = "seconds before the first retry (doubles, jittered)"},
    {.name = "backoff_max", .type = CONFIG_DOUBLE, .def = "300", .min = 0.01, .max = 86400,
     TFIELD(backoff_max), .help = "longest wait between retries, seconds"},
    {.name = "give_up_after", .type = CONFIG_DOUBLE, .def = "86400", .min = 1, .max = 31536000,
     TFIELD(give_up_after), .help = "seconds after the transition a delivery is given up"},
    {.name = "resend_interval", .type = CONFIG_DOUBLE, .def = "60", .min = 0.1, .max = 86400,
     TFIELD(resend_interval), .help = "alertmanager: re-send firing alerts this often, seconds"},
};

const char *pager_type_name(int type)
{
    return type >= 0 && type <= PAGER_WEBHOOK ? type_names[type] : "unknown";
}

static void *target_open(void *ctx, const char *sub, char *why, size_t whylen)
{
    struct pager_config *pc = ctx;
    if (!sub || !sub[0]) {
        snprintf(why, whylen, "needs a name: [target \"NAME\"]");
        return NULL;
    }
    if (strlen(sub) >= STATS_TARGET_NAME_MAX) {
        snprintf(why, whylen, "name longer than %d bytes", STATS_TARGET_NAME_MAX - 1);
        return NULL;
    }
    for (const char *c = sub; *c; c++) {
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
              *c == '_' || *c == '-' || *c == '.')) {
            snprintf(why, whylen, "name may hold letters, digits, '_', '-' and '.' only");
            return NULL;
        }
    }
    for (size_t i = 0; i < pc->n; i++) {
        if (strcmp(pc->t[i].name, sub) == 0) {
            snprintf(why, whylen, "target defined twice");
            return NULL;
        }
    }
    if (pc->n >= STATS_MAX_TARGETS) {
        snprintf(why, whylen, "more than %d targets", STATS_MAX_TARGETS);
        return NULL;
    }
    struct pager_target_cfg *t = &pc->t[pc->n];
    memset(t, 0, sizeof(*t));
    t->type = -1;
    struct config_error err;
    if (config_apply_defaults(target_keys, sizeof(target_keys) / sizeof(target_keys[0]), t,
                              &err) < 0) {
        snprintf(why, whylen, "%s", err.message);
        return NULL;
    }
    snprintf(t->name, sizeof(t->name), "%s", sub);
    pc->n++;
    return t;
}

void pager_target_section(struct pager_config *pc, struct config_section *out)
{
    *out = (struct config_section){.name = "target",
                                   .keys = target_keys,
                                   .nkeys = sizeof(target_keys) / sizeof(target_keys[0]),
                                   .open = target_open,
                                   .ctx = pc};
}

/* NULL when url parses with a host (and, for Alertmanager, a base URL
 * that "/api/v2/alerts" can follow: no query or fragment), else why not. */
static const char *url_problem(const char *url, int type)
{
    CURLU *u = curl_url();
    if (!u)
        return "out of memory checking 'url'";
    const char *why = NULL;
    char *host = NULL, *query = NULL, *frag = NULL;
    if (curl_url_set(u, CURLUPART_URL, url, 0) != CURLUE_OK)
        why = "key 'url' is not a valid URL";
    else if (curl_url_get(u, CURLUPART_HOST, &host, 0) != CURLUE_OK || !host || !host[0])
        why = "key 'url' has no host";
    else if (type == PAGER_ALERTMANAGER &&
             (curl_url_get(u, CURLUPART_QUERY, &query, 0) == CURLUE_OK ||
              curl_url_get(u, CURLUPART_FRAGMENT, &frag, 0) == CURLUE_OK))
        why = "key 'url': an Alertmanager base URL has no query or fragment";
    curl_free(host);
    curl_free(query);
    curl_free(frag);
    curl_url_cleanup(u);
    return why;
}

int pager_config_check(const struct pager_config *pc, char *err, size_t errlen)
{
    const char *origin = pc->origin[0] ? pc->origin : "config";
    for (size_t i = 0; i < pc->n; i++) {
        const struct pager_target_cfg *t = &pc->t[i];
        const char *why = NULL;
        char buf[300];
        struct silence m;
        if (t->type < 0)
            why = "key 'type' is required (alertmanager | pagerduty | webhook)";
        else if (t->type != PAGER_PAGERDUTY && !t->url[0])
            why = "key 'url' is required";
        else if (t->url[0] && strncmp(t->url, "http://", 7) != 0 &&
                 strncmp(t->url, "https://", 8) != 0)
            why = "key 'url' must start with http:// or https://";
        else if (t->url[0] && (why = url_problem(t->url, t->type)) != NULL)
            ;
        else if (t->type == PAGER_PAGERDUTY && !t->routing_key[0])
            why = "key 'routing_key' is required for pagerduty";
        else if (t->type != PAGER_PAGERDUTY && t->routing_key[0])
            why = "key 'routing_key' applies to pagerduty targets only";
        else if (t->type != PAGER_WEBHOOK && t->secret[0])
            why = "key 'secret' applies to webhook targets only";
        else if (t->backoff_initial > t->backoff_max)
            why = "backoff_initial is larger than backoff_max";
        else if (page_parse_match(t->match, &m, buf, sizeof(buf)) < 0)
            why = buf;
        else
            silence_free(&m);
        if (why) {
            snprintf(err, errlen, "config: %s: [target \"%s\"]: %s", origin, t->name, why);
            return -EINVAL;
        }
    }
    return 0;
}

void pager_name_stats(const struct pager_config *cfg, struct fs_stats *stats)
{
    for (size_t i = 0; i < cfg->n && i < STATS_MAX_TARGETS; i++) {
        snprintf(stats->targets[i].name, sizeof(stats->targets[i].name), "%s", cfg->t[i].name);
        snprintf(stats->targets[i].kind, sizeof(stats->targets[i].kind), "%s",
                 pager_type_name(cfg->t[i].type));
    }
    stats->ntargets = (unsigned)(cfg->n < STATS_MAX_TARGETS ? cfg->n : STATS_MAX_TARGETS);
}

void pager_register(const struct pager_config *cfg, struct store *store)
{
    const char *names[STATS_MAX_TARGETS];
    for (size_t i = 0; i < cfg->n; i++)
        names[i] = cfg->t[i].name;
    store_set_pager(store, names, cfg->n, NULL, NULL);
}

/* --- the thread's state ---------------------------------------------------------------------- */

/* An undone outbox row. */
struct prow {
    int64_t id;
    int64_t event_id;
    int target;          /* index into cfg.t, -1 = no longer configured */
    int state;           /* STORE_OUTBOX_PENDING or _SILENCED while held here */
    int done;            /* reached a final state; removed at the next compaction */
    int blocked;         /* waits for an earlier row of its alert and target */
    uint32_t attempts;
    double next_at;      /* unix seconds */
    double created_at;
    int logged;          /* a failure of this row was logged */
    struct page_alert a;
};

/* A paged incident not yet resolved at one target: its resolve is sent;
 * Alertmanager targets get it re-sent. */
struct popen {
    int target;
    int resolving;       /* its resolve row is queued: no more re-sends */
    int silenced;        /* the last re-send was held by a silence */
    int failing;         /* the last re-send failed (logged once) */
    double next_resend;  /* monotonic seconds: a wall clock step back must not stall re-sends
                          * (Alertmanager would end the alert after endsAt) */
    struct page_alert a;
};

struct pager {
    struct pager_config cfg;
    struct page_route routes[STATS_MAX_TARGETS];
    char public_url[PAGE_URL_MAX];
    struct store *store;
    struct fs_stats *stats;
    sqlite3 *db;
    CURL *curl;
    int curl_global;

    pthread_t thread;
    int started;
    pthread_mutex_t mu;
    pthread_cond_t cv;   /* CLOCK_MONOTONIC */
    int64_t announced;   /* guarded by mu */
    atomic_int stopping;

    /* pager thread only */
    struct prow *rows;
    size_t nrows;
    struct popen *open;
    size_t nopen, capopen;
    /* Per target: rows are loaded per target into a share of the memory
     * (quota rows each), so a target that is down, or a silence holding
     * many triggers, never keeps another target's pages in the table. */
    size_t quota;                          /* PAGER_MAX_ROWS / targets */
    size_t count[STATS_MAX_TARGETS];       /* undone rows in memory */
    int64_t watermark[STATS_MAX_TARGETS];  /* highest outbox id loaded */
    int backlog[STATS_MAX_TARGETS];        /* the last load filled the share */
    int load_error;      /* the last load failed (retried at the next wake, not at once) */
    struct silence_set *sils; /* compiled once per silence (silence_set.h); NULL: none read */
    double sil_next;     /* monotonic seconds of the next reload */
    int sil_fresh;       /* silences were read during this pass of the loop */
    int sil_ok;          /* the last silence read succeeded: triggers may be sent */
    /* Targets that failed a retryable attempt during this pass, and when
     * that row retries: their other due rows wait until then instead of
     * each waiting out a timeout (one thread sends for every target). */
    int down[STATS_MAX_TARGETS];
    double down_until[STATS_MAX_TARGETS];
    uint64_t rng;
    struct log_ratelimit rl_fail, rl_giveup, rl_resend, rl_db, rl_store, rl_sil;
};

/* xorshift64*: jitter only. */
static double rand01(struct pager *p)
{
    uint64_t x = p->rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    p->rng = x;
    return (double)((x * 0x2545F4914F6CDD1Dull) >> 11) * 0x1.0p-53;
}

static int target_index(const struct pager *p, const char *name)
{
    for (size_t i = 0; i < p->cfg.n; i++)
        if (strcmp(p->cfg.t[i].name, name) == 0)
            return (int)i;
    return -1;
}

static struct fs_target_stats *tstats(struct pager *p, int target)
{
    return target >= 0 && target < STATS_MAX_TARGETS ? &p->stats->targets[target] : NULL;
}

/* --- outcomes through the writer ------------------------------------------------------------ */

static void record(struct pager *p, const struct prow *r, int state, int status, const char *err)
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

#define PAGE_COLUMNS                                                                             \
    "o.id, o.target, o.kind, o.state, o.attempts, o.next_attempt_at, o.created_at, o.event_id, " \
    "o.severity, o.attribution, a.id, r.name, a.rule, a.alert_key, a.dedup_key, a.family, "      \
    "a.layer, a.head, a.\"window\", a.rank, a.incidents, a.series_id, a.created_at, "            \
    "a.updated_at, e.step, e.at, e.evidence_json, "                                              \
    "(SELECT f.at FROM alert_events f WHERE f.alert_id = o.alert_id AND f.change = 'to_firing' " \
    "AND f.id <= o.event_id ORDER BY f.id DESC LIMIT 1) "                                        \
    "FROM outbox o JOIN alerts a ON a.id = o.alert_id JOIN runs r ON r.id = a.run_id "           \
    "JOIN alert_events e ON e.id = o.event_id "

enum { PC_ID, PC_TARGET, PC_KIND, PC_STATE, PC_ATTEMPTS, PC_NEXT, PC_CREATED, PC_EVENT,
       PC_SEVERITY, PC_ATTR, PC_ALERT, PC_RUN, PC_RULE, PC_KEY, PC_DEDUP, PC_FAMILY, PC_LAYER,
       PC_HEAD, PC_WINDOW, PC_RANK, PC_INCIDENTS, PC_SERIES, PC_A_CREATED, PC_A_UPDATED,
       PC_STEP, PC_AT, PC_EVIDENCE, PC_FIRED_AT };

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

static struct popen *open_find(struct pager *p, int64_t alert_id, int target)
{
    for (size_t i = 0; i < p->nopen; i++)
        if (p->open[i].a.alert_id == alert_id && p->open[i].target == target)
            return &p->open[i];
    return NULL;
}

/* Tracks a paged incident (replacing an older one of the same alert and
 * target). Returns 0 or -ENOSPC / -ENOMEM (logged). */
static int open_add(struct pager *p, const struct page_alert *a, int target, double next_resend)
{
    struct popen *o = open_find(p, a->alert_id, target);
    if (!o) {
        if (p->nopen >= PAGER_MAX_OPEN) {
            log_limited(&p->rl_db, LOG_LEVEL_WARN, "pager",
                        "more than %u paged incidents open: alert %lld is neither re-sent nor "
                        "resolved at target %s",
                        PAGER_MAX_OPEN, (long long)a->alert_id, p->cfg.t[target].name);
            return -ENOSPC;
        }
        if (p->nopen == p->capopen) {
            size_t cap = p->capopen ? p->capopen * 2 : 16;
            struct popen *n = realloc(p->open, cap * sizeof(*n));
            if (!n)
                return -ENOMEM;
            p->open = n;
            p->capopen = cap;
        }
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

static void open_remove(struct pager *p, struct popen *o)
{
    size_t i = (size_t)(o - p->open);
    p->open[i] = p->open[--p->nopen];
}

/* Paged incidents of the previous run: delivered (or given up) triggers
 * with no later row of the same alert and target done since. */
static void load_open(struct pager *p)
{
    sqlite3_stmt *q = NULL;
    const char *sql = "SELECT " PAGE_COLUMNS
                      "WHERE o.kind = 1 AND o.state IN (1, 2) AND NOT EXISTS (SELECT 1 FROM "
                      "outbox x WHERE x.alert_id = o.alert_id AND x.target = o.target AND "
                      "x.id > o.id AND x.state IN (1, 2, 4)) ORDER BY o.id LIMIT ?1";
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
        open_add(p, &a, t, now); /* Alertmanager: re-send at once */
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
    const char *sql = "SELECT " PAGE_COLUMNS
                      "WHERE o.id > ?1 AND o.state IN (0, 3) AND o.target = ?3 "
                      "ORDER BY o.id LIMIT ?2";
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
            struct popen *o = open_find(p, r->a.alert_id, r->target);
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
static void load_rows(struct pager *p)
{
    p->load_error = 0;
    for (size_t t = 0; t < p->cfg.n; t++)
        if (load_target_rows(p, (int)t) < 0)
            p->load_error = 1;
}

/* Whether a target has rows waiting in the table and room for them now. */
static int more_to_load(const struct pager *p)
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
static void close_unconfigured(struct pager *p)
{
    json_t *names = json_array();
    for (size_t t = 0; names && t < p->cfg.n; t++)
        json_array_append_new(names, json_string(p->cfg.t[t].name));
    char *js = names ? json_dumps(names, JSON_COMPACT) : NULL;
    json_decref(names);
    sqlite3_stmt *q = NULL;
    if (!js || sqlite3_prepare_v2(p->db,
                                  "SELECT id, attempts FROM outbox WHERE id > ?1 AND "
                                  "state IN (0, 3) AND target NOT IN (SELECT value FROM "
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
            record(p, &r, STORE_OUTBOX_GIVEN_UP, 0, "target no longer configured");
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
static int silenced(const struct pager *p, const struct page_alert *a, double now)
{
    return p->sils != NULL && page_silenced(p->sils->v, p->sils->n, a, now);
}

/* Re-reads the silences that are active now or start later. p->sil_ok
 * says whether the read was whole: a partial list must not let a silenced
 * trigger through, so until a read succeeds nothing a silence could hold is
 * sent. A silence read before is not compiled again (silence_set.h). */
static void load_silences(struct pager *p, double now)
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
        char why[256];
        brc = silence_build_row(&b, &row, why, sizeof(why));
        if (brc == 1)
            log_limited(&p->rl_sil, LOG_LEVEL_WARN, "pager", "silence %lld ignored: %s",
                        (long long)row.id, why);
    }
    atomic_fetch_add(&p->stats->silence_compiles_pager, b.parsed);
    struct silence_set *next = silence_build_finish(&b);
    if (brc < 0 || rc != SQLITE_DONE || next == NULL) {
        if (brc < 0 || next == NULL)
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
static int still_firing(struct pager *p, int64_t alert_id, int64_t event_id)
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

/* --- HTTP ------------------------------------------------------------------------------------- */

struct resp {
    char body[PAGER_RESPONSE_KEEP + 1];
    size_t len;
};

static size_t on_body(char *data, size_t size, size_t n, void *ctx)
{
    struct resp *r = ctx;
    size_t b = size * n, keep = PAGER_RESPONSE_KEEP - r->len;
    if (keep > b)
        keep = b;
    memcpy(r->body + r->len, data, keep);
    r->len += keep;
    r->body[r->len] = '\0';
    return b;
}

/* libcurl's progress hook (at least once a second, also while waiting for
 * an answer): pager_stop ends a request in flight instead of waiting out
 * its timeout. */
static int on_progress(void *ctx, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ultotal,
                       curl_off_t ulnow)
{
    (void)dltotal, (void)dlnow, (void)ultotal, (void)ulnow;
    struct pager *p = ctx;
    return atomic_load(&p->stopping) ? 1 : 0;
}

/* Printable one-line copy of a response body for messages. */
static void oneline(char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || (unsigned char)*s >= 0x7f)
            *s = ' ';
}

/* POSTs body; *status is the HTTP status, or 0 after a transport error
 * (err says which; *permanent when retrying cannot help). */
static void post(struct pager *p, const struct pager_target_cfg *t, const char *url,
                 const char *body, long *status, int *permanent, char *err, size_t errlen)
{
    *status = 0;
    *permanent = 0;
    err[0] = '\0';
    CURL *c = p->curl;
    curl_easy_reset(c);
    struct curl_slist *h = NULL, *h2;
    struct resp resp = {.len = 0};
    char sig[128], ts[64], ua[64];
    snprintf(ua, sizeof(ua), "User-Agent: foreshockd/%s", FORESHOCK_VERSION);
    h2 = curl_slist_append(h, "Content-Type: application/json");
    if (h2)
        h = h2;
    if ((h2 = curl_slist_append(h, ua)))
        h = h2;
    if ((h2 = curl_slist_append(h, "Expect:")))
        h = h2;
    if (t->type == PAGER_WEBHOOK && t->secret[0]) {
        char hex[65];
        if (page_hmac_sha256_hex(t->secret, strlen(t->secret), body, strlen(body), hex) < 0) {
            snprintf(err, errlen, "HMAC failed");
            curl_slist_free_all(h);
            return;
        }
        snprintf(sig, sizeof(sig), "X-Foreshock-Signature: sha256=%s", hex);
        snprintf(ts, sizeof(ts), "X-Foreshock-Timestamp: %lld", (long long)fs_clock_unix());
        if ((h2 = curl_slist_append(h, sig)))
            h = h2;
        if ((h2 = curl_slist_append(h, ts)))
            h = h2;
    }
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_POST, 1L);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, (long)(t->connect_timeout * 1000));
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)(t->timeout * 1000));
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &resp);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(c, CURLOPT_XFERINFODATA, p);
    CURLcode rc = curl_easy_perform(c);
    curl_slist_free_all(h);
    if (rc != CURLE_OK) {
        snprintf(err, errlen, "%s", curl_easy_strerror(rc));
        *permanent = rc == CURLE_URL_MALFORMAT || rc == CURLE_UNSUPPORTED_PROTOCOL;
        return;
    }
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, status);
    if (*status < 200 || *status >= 300) {
        oneline(resp.body);
        snprintf(err, errlen, "HTTP %ld: %s", *status, resp.body);
    }
}

/* Builds the payload of page a for target t and sends it. Returns the
 * verdict; status/err as for post. */
static enum page_verdict send_page(struct pager *p, const struct pager_target_cfg *t,
                                   const struct page_alert *a, long *status, char *err,
                                   size_t errlen)
{
    char url[PAGE_URL_MAX + 32];
    char *body = NULL;
    double now = fs_clock_unix();
    switch (t->type) {
    case PAGER_ALERTMANAGER: {
        size_t n = strlen(t->url);
        while (n > 0 && t->url[n - 1] == '/')
            n--;
        snprintf(url, sizeof(url), "%.*s/api/v2/alerts", (int)n, t->url);
        body = page_alertmanager_body(a, p->public_url, now, t->resend_interval);
        break;
    }
    case PAGER_PAGERDUTY:
        snprintf(url, sizeof(url), "%s", t->url[0] ? t->url : PAGER_DEFAULT_PAGERDUTY_URL);
        body = page_pagerduty_body(a, t->routing_key, p->public_url);
        break;
    default:
        snprintf(url, sizeof(url), "%s", t->url);
        body = page_webhook_body(a, p->public_url);
        break;
    }
    if (!body) {
        *status = 0;
        snprintf(err, errlen, "out of memory building the payload");
        return PAGE_RETRY;
    }
    int permanent;
    post(p, t, url, body, status, &permanent, err, errlen);
    free(body);
    if (*status == 0)
        return permanent ? PAGE_GIVE_UP : PAGE_RETRY;
    return page_classify(*status);
}

/* --- delivery --------------------------------------------------------------------------------- */

static const char *kind_name(const struct page_alert *a)
{
    return a->kind == PAGE_RESOLVE ? "resolve" : "trigger";
}

static void finish(struct pager *p, struct prow *r, int state, int status, const char *err)
{
    record(p, r, state, status, err);
    r->done = 1;
}

/* One attempt at row r (due, pending). */
static void attempt(struct pager *p, struct prow *r)
{
    const struct pager_target_cfg *t = &p->cfg.t[r->target];
    struct fs_target_stats *ts = tstats(p, r->target);
    long status = 0;
    char err[PAGE_ERROR_MAX];
    enum page_verdict v = send_page(p, t, &r->a, &status, err, sizeof(err));
    double now = fs_clock_unix();
    /* Cut short by pager_stop: not a failure of the target; the row stays
     * as it is in the outbox for the next start. */
    if (v != PAGE_DELIVERED && atomic_load(&p->stopping))
        return;
    if (v == PAGE_DELIVERED) {
        atomic_fetch_add(&ts->sent, 1);
        if (r->attempts)
            log_info("pager", "target %s: %s of %s (run %s, alert %lld) delivered after %u failed "
                     "attempts", t->name, kind_name(&r->a), r->a.rule, r->a.run,
                     (long long)r->a.alert_id, r->attempts);
        finish(p, r, STORE_OUTBOX_DELIVERED, (int)status, NULL);
        if (r->a.kind == PAGE_TRIGGER)
            open_add(p, &r->a, r->target, fs_clock_mono() + t->resend_interval);
        else {
            struct popen *o = open_find(p, r->a.alert_id, r->target);
            if (o)
                open_remove(p, o);
        }
        return;
    }
    r->attempts++;
    if (v == PAGE_RETRY && now - r->created_at < t->give_up_after) {
        atomic_fetch_add(&ts->failed, 1);
        double wait = page_backoff(t->backoff_initial, t->backoff_max, r->attempts, rand01(p));
        r->next_at = now + wait;
        p->down[r->target] = 1;
        p->down_until[r->target] = r->next_at;
        if (!r->logged) {
            r->logged = 1;
            log_limited(&p->rl_fail, LOG_LEVEL_WARN, "pager",
                        "target %s: %s of %s (run %s, alert %lld) failed: %s; retrying with "
                        "backoff (next in %.1f s)",
                        t->name, kind_name(&r->a), r->a.rule, r->a.run, (long long)r->a.alert_id,
                        err, wait);
        }
        record(p, r, STORE_OUTBOX_PENDING, (int)status, err);
        return;
    }
    atomic_fetch_add(&ts->dropped, 1);
    log_limited(&p->rl_giveup, LOG_LEVEL_ERROR, "pager",
                "target %s: giving up the %s of %s (run %s, alert %lld) after %u attempts: %s",
                t->name, kind_name(&r->a), r->a.rule, r->a.run, (long long)r->a.alert_id,
                r->attempts, v == PAGE_GIVE_UP ? err : "too old (give_up_after)");
    char why[PAGE_ERROR_MAX + 32];
    snprintf(why, sizeof(why), "%s%s", v == PAGE_GIVE_UP ? "" : "give_up_after passed: ", err);
    finish(p, r, STORE_OUTBOX_GIVEN_UP, (int)status, why);
    /* A given-up trigger still gets its resolve (harmless, and the receiver
     * may have seen it after all); a given-up resolve closes the incident. */
    if (r->a.kind == PAGE_TRIGGER)
        open_add(p, &r->a, r->target, INFINITY);
    else {
        struct popen *o = open_find(p, r->a.alert_id, r->target);
        if (o)
            open_remove(p, o);
    }
}

/* The earliest undone row before r of the same alert and target, or NULL. */
static struct prow *blocker(struct pager *p, const struct prow *r)
{
    for (struct prow *x = p->rows; x < r; x++)
        if (!x->done && x->target == r->target && x->a.alert_id == r->a.alert_id)
            return x;
    return NULL;
}

static void handle(struct pager *p, struct prow *r, double now)
{
    if (r->target < 0) {
        finish(p, r, STORE_OUTBOX_GIVEN_UP, 0, "target no longer configured");
        return;
    }
    struct prow *b = blocker(p, r);
    r->blocked = b != NULL;
    if (b) {
        /* A resolve behind a trigger held by a silence: the incident ended
         * silenced, so nothing of it is sent. */
        if (b->state == STORE_OUTBOX_SILENCED && b->a.kind == PAGE_TRIGGER &&
            r->a.kind == PAGE_RESOLVE) {
            finish(p, b, STORE_OUTBOX_SKIPPED, 0, "resolved while silenced");
            finish(p, r, STORE_OUTBOX_SKIPPED, 0, "resolved while silenced");
        }
        return; /* wait for it */
    }
    const struct pager_target_cfg *t = &p->cfg.t[r->target];
    /* Retry times are unix time (they outlive the process): one further
     * ahead than any backoff means the clock stepped back (or the row came
     * from elsewhere); wait no longer than backoff_max for it. */
    if (r->next_at > now + t->backoff_max)
        r->next_at = now + t->backoff_max;
    if (r->state == STORE_OUTBOX_SILENCED || r->next_at > now)
        return;
    if (p->down[r->target]) { /* failed a moment ago: not an attempt, no record */
        r->next_at = p->down_until[r->target];
        return;
    }
    if (!page_route_matches(&p->routes[r->target], &r->a)) {
        finish(p, r, STORE_OUTBOX_SKIPPED, 0, "not routed to this target (min_severity, match)");
        return;
    }
    if (r->a.kind == PAGE_TRIGGER) {
        /* A silence committed before the transition always holds its
         * trigger: read them afresh (triggers are rare; one query a pass). */
        if (!p->sil_fresh) {
            load_silences(p, now);
            p->sil_fresh = 1;
        }
        if (!p->sil_ok) { /* cannot tell whether a silence holds it: later */
            r->next_at = now + PAGER_SILENCE_RELOAD_S;
            return;
        }
        if (silenced(p, &r->a, now)) {
            r->state = STORE_OUTBOX_SILENCED;
            atomic_fetch_add(&tstats(p, r->target)->silenced, 1);
            log_info("pager", "target %s: trigger of %s (run %s, alert %lld) silenced; held "
                     "until the silence ends", t->name, r->a.rule, r->a.run,
                     (long long)r->a.alert_id);
            record(p, r, STORE_OUTBOX_SILENCED, 0, "silenced");
            return;
        }
    } else if (!open_find(p, r->a.alert_id, r->target)) {
        finish(p, r, STORE_OUTBOX_SKIPPED, 0, "its trigger was not sent to this target");
        return;
    }
    attempt(p, r);
}

/* Held triggers whose silence ended: sent if the alert still fires in
 * that incident, else closed. */
static void release_held(struct pager *p, double now)
{
    for (size_t i = 0; i < p->nrows; i++) {
        struct prow *r = &p->rows[i];
        if (r->done || r->state != STORE_OUTBOX_SILENCED || silenced(p, &r->a, now))
            continue;
        int f = still_firing(p, r->a.alert_id, r->event_id);
        if (f < 0)
            continue;
        if (f) {
            log_info("pager", "target %s: silence over, sending the trigger of %s (run %s, "
                     "alert %lld)", p->cfg.t[r->target].name, r->a.rule, r->a.run,
                     (long long)r->a.alert_id);
            r->state = STORE_OUTBOX_PENDING;
            r->next_at = now;
        } else if (!blocker(p, r)) {
            finish(p, r, STORE_OUTBOX_SKIPPED, 0, "resolved while silenced");
        }
    }
}

/* Alertmanager re-sends of open incidents; now is monotonic, wall the
 * unix time (silences). */
static void resend_due(struct pager *p, double now, double wall)
{
    for (size_t i = 0; i < p->nopen && !atomic_load(&p->stopping); i++) {
        struct popen *o = &p->open[i];
        const struct pager_target_cfg *t = &p->cfg.t[o->target];
        if (t->type != PAGER_ALERTMANAGER || o->resolving || o->next_resend > now)
            continue;
        o->next_resend = now + t->resend_interval;
        if (p->down[o->target])
            continue; /* failed during this pass: one timeout per pass is enough */
        if (!p->sil_ok)
            continue; /* silences unreadable: send nothing they might hold */
        if (silenced(p, &o->a, wall)) {
            if (!o->silenced)
                atomic_fetch_add(&tstats(p, o->target)->silenced, 1);
            o->silenced = 1;
            continue;
        }
        o->silenced = 0;
        long status;
        char err[PAGE_ERROR_MAX];
        if (send_page(p, t, &o->a, &status, err, sizeof(err)) == PAGE_DELIVERED) {
            atomic_fetch_add(&tstats(p, o->target)->sent, 1);
            o->failing = 0;
            continue;
        }
        if (atomic_load(&p->stopping))
            break;
        p->down[o->target] = 1;
        atomic_fetch_add(&tstats(p, o->target)->failed, 1);
        if (!o->failing)
            log_limited(&p->rl_resend, LOG_LEVEL_WARN, "pager",
                        "target %s: re-send of %s (run %s, alert %lld) failed: %s; next in %g s",
                        t->name, o->a.rule, o->a.run, (long long)o->a.alert_id, err,
                        t->resend_interval);
        o->failing = 1;
    }
}

static void compact(struct pager *p)
{
    size_t j = 0;
    for (size_t i = 0; i < p->nrows; i++) {
        if (!p->rows[i].done)
            p->rows[j++] = p->rows[i];
        else if (p->rows[i].target >= 0)
            p->count[p->rows[i].target]--;
    }
    p->nrows = j;
    atomic_store(&p->stats->outbox_pending, (uint64_t)p->nrows);
}

/* Seconds until the next timer: a retry (unix time), a re-send
 * (monotonic) or a silence reload. */
static double next_wait(struct pager *p)
{
    double now = fs_clock_unix(), mono = fs_clock_mono(), w = PAGER_SILENCE_RELOAD_S;
    for (size_t i = 0; i < p->nrows; i++)
        if (p->rows[i].state == STORE_OUTBOX_PENDING && !p->rows[i].blocked &&
            p->rows[i].next_at - now < w)
            w = p->rows[i].next_at - now;
    for (size_t i = 0; i < p->nopen; i++)
        if (!p->open[i].resolving && p->cfg.t[p->open[i].target].type == PAGER_ALERTMANAGER &&
            p->open[i].next_resend - mono < w)
            w = p->open[i].next_resend - mono;
    return w;
}

static void *pager_main(void *arg)
{
    struct pager *p = arg;
    close_unconfigured(p);
    load_open(p);
    int64_t seen = -1;
    while (!atomic_load(&p->stopping)) {
        pthread_mutex_lock(&p->mu);
        int64_t ann = p->announced;
        pthread_mutex_unlock(&p->mu);
        if (ann != seen || p->load_error || more_to_load(p)) {
            seen = ann;
            load_rows(p);
        }
        double now = fs_clock_unix();
        p->sil_fresh = 0;
        memset(p->down, 0, sizeof(p->down));
        if (fs_clock_mono() >= p->sil_next) {
            load_silences(p, now);
            p->sil_next = fs_clock_mono() + PAGER_SILENCE_RELOAD_S;
            if (p->sil_ok)
                release_held(p, now);
        }
        for (size_t i = 0; i < p->nrows && !atomic_load(&p->stopping); i++)
            if (!p->rows[i].done)
                handle(p, &p->rows[i], fs_clock_unix());
        resend_due(p, fs_clock_mono(), fs_clock_unix());
        compact(p);
        if (more_to_load(p))
            continue;
        double wait = next_wait(p);
        if (wait <= 0)
            continue;
        struct timespec ts = fs_clock_mono_after(wait);
        pthread_mutex_lock(&p->mu);
        while (!atomic_load(&p->stopping) && p->announced == seen &&
               pthread_cond_timedwait(&p->cv, &p->mu, &ts) == 0) {
        }
        pthread_mutex_unlock(&p->mu);
    }
    return NULL;
}

/* --- lifecycle -------------------------------------------------------------------------------- */

void pager_announce(void *ctx, int64_t max_id)
{
    struct pager *p = ctx;
    pthread_mutex_lock(&p->mu);
    if (max_id > p->announced)
        p->announced = max_id;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void pager_free(struct pager *p)
{
    for (size_t i = 0; i < p->cfg.n; i++)
        silence_free(&p->routes[i].match);
    silence_set_unref(p->sils);
    free(p->rows);
    free(p->open);
    if (p->curl)
        curl_easy_cleanup(p->curl);
    if (p->curl_global)
        curl_global_cleanup();
    sqlite3_close(p->db);
    free(p);
}

int pager_start(const struct pager_opts *opts, struct pager **out, char *err, size_t errlen)
{
    *out = NULL;
    if (opts->cfg->n == 0)
        return 0;
    struct pager *p = calloc(1, sizeof(*p));
    if (!p) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    int rc = -ENOMEM, mu = 0, cv = 0;
    p->cfg = *opts->cfg;
    snprintf(p->public_url, sizeof(p->public_url), "%s", opts->public_url);
    p->store = opts->store;
    p->stats = opts->stats;
    p->rng = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull ^ (uint64_t)getpid() ^ 1;
    p->quota = PAGER_MAX_ROWS / p->cfg.n;
    p->rows = calloc(PAGER_MAX_ROWS, sizeof(*p->rows));
    if (!p->rows) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    for (size_t i = 0; i < p->cfg.n; i++) {
        p->routes[i].min_critical = p->cfg.t[i].min_severity == 1;
        char why[300];
        if (page_parse_match(p->cfg.t[i].match, &p->routes[i].match, why, sizeof(why)) < 0) {
            snprintf(err, errlen, "target %s: %s", p->cfg.t[i].name, why);
            rc = -EINVAL;
            goto fail;
        }
    }
    if ((rc = store_open_readonly(opts->db_path, &p->db, err, errlen)) < 0)
        goto fail;
    rc = -EIO;
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        snprintf(err, errlen, "cannot initialise libcurl");
        goto fail;
    }
    p->curl_global = 1;
    if (!(p->curl = curl_easy_init())) {
        snprintf(err, errlen, "cannot create a libcurl handle");
        goto fail;
    }
    pthread_condattr_t ca;
    rc = -ENOMEM;
    if (pthread_condattr_init(&ca) != 0) {
        snprintf(err, errlen, "cannot create the pager's locks");
        goto fail;
    }
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    mu = pthread_mutex_init(&p->mu, NULL) == 0;
    cv = mu && pthread_cond_init(&p->cv, &ca) == 0;
    pthread_condattr_destroy(&ca);
    if (!cv) {
        snprintf(err, errlen, "cannot create the pager's locks");
        goto fail;
    }
    const char *names[STATS_MAX_TARGETS];
    for (size_t i = 0; i < p->cfg.n; i++)
        names[i] = p->cfg.t[i].name;
    /* Announcements start now; rows committed before are found by the
     * thread's first load (its watermark starts at 0). */
    store_set_pager(p->store, names, p->cfg.n, pager_announce, p);
    if (pthread_create(&p->thread, NULL, pager_main, p) != 0) {
        store_set_pager(p->store, names, p->cfg.n, NULL, NULL);
        snprintf(err, errlen, "cannot start the pager thread");
        rc = -EAGAIN;
        goto fail;
    }
    p->started = 1;
    log_info("pager", "%zu targets; public_url %s", p->cfg.n, p->public_url);
    *out = p;
    return 0;
fail:
    if (cv)
        pthread_cond_destroy(&p->cv);
    if (mu)
        pthread_mutex_destroy(&p->mu);
    pager_free(p);
    return rc;
}

void pager_stop(struct pager *p)
{
    if (!p)
        return;
    /* No more announcements into a pager that is going away. */
    const char *names[STATS_MAX_TARGETS];
    for (size_t i = 0; i < p->cfg.n; i++)
        names[i] = p->cfg.t[i].name;
    store_set_pager(p->store, names, p->cfg.n, NULL, NULL);
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stopping, 1);
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    if (p->started)
        pthread_join(p->thread, NULL);
    log_info("pager", "stopped; %zu deliveries wait in the outbox for the next start", p->nrows);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    pager_free(p);
}
