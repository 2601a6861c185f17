/* The HTTP API: libmicrohttpd in front of read-only SQLite connections.
 * This file: server lifecycle, the read-connection pool, the request state
 * machine, dispatch (route table, methods, auth, parameters) and the small
 * routes (/healthz, /readyz, /metrics, the dashboard); the other routes'
 * handlers are in http_runs.c, http_alerts.c and http_silences.c
 * (http_internal.h lists the files).
 *
 * Shape of a request (all on one libmicrohttpd pool thread):
 *   on_request (1st call: allocate per-request state only)
 *   on_request (body chunks: read and discard, bounded)
 *   on_request (last call) -> dispatch: route table -> params -> db checkout
 *     -> BEGIN -> handler builds a jansson document -> COMMIT -> db return
 *     -> JSON response queued.
 *
 * Routes live in routes[] below; adding one is a table row plus a handler.
 * Handlers never write: the daemon core owns the only read-write
 * connection. */

#include "http.h"

#include <netdb.h>
#include <stdarg.h>
#include <sys/socket.h>

#include "http_internal.h"
#include "http_parse.h"
#include "store.h"
#include "alert.h" /* pinned state numbers only: fs_http does not link fs_monitor */
#include "page_format.h" /* PAGE_MAX_LABELS: the pager's label set */
#include "silence.h"

/* --- per-request state -------------------------------------------------------- */

struct request {
    size_t body_bytes;
    char *body;   /* POST: the body so far (malloc'd, NUL-terminated), else NULL */
    bool replied; /* a response was queued (early: announced body too large) */
};

/* Methods a route row answers (0 in a row: GET and HEAD). */
enum { M_GET = 1, M_HEAD = 2, M_POST = 4, M_DELETE = 8 };

struct route {
    const char *pattern;                  /* '*' matches one non-empty path segment */
    route_fn fn;
    unsigned methods;                     /* M_*; 0 = M_GET | M_HEAD */
    bool db;                              /* needs a read connection (and a read txn) */
    bool write;                           /* needs the write token; fn runs without a
                                             connection and takes one with http_db_read() */
    bool body;                            /* takes a JSON body (req_body) */
    bool open;                            /* no token needed, even with http_read_token */
    const char *params[HTTP_MAX_PARAMS];  /* accepted query parameters; others are 400 */
    const char *repeat[HTTP_MAX_REPEATABLE]; /* of those, the ones that may repeat */
};

struct collect {
    struct ctx *c;
    const struct route *r;
    int err;
};

static enum MHD_Result collect_param(void *cls, enum MHD_ValueKind kind, const char *key,
                                     const char *value)
{
    struct collect *col = cls;
    struct ctx *c = col->c;
    (void)kind;

    const char *name = NULL;
    for (unsigned i = 0; i < HTTP_MAX_PARAMS && col->r->params[i] != NULL; i++)
        if (strcmp(col->r->params[i], key) == 0)
            name = col->r->params[i];
    if (name == NULL) {
        char echo[HTTP_MAX_PARAM_LEN + 1];
        snprintf(echo, sizeof echo, "%s", key);
        http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request", "unknown parameter '%s'", echo);
        col->err = -EINVAL;
        return MHD_NO;
    }
    bool repeatable = false;
    for (unsigned i = 0; i < HTTP_MAX_REPEATABLE && col->r->repeat[i] != NULL; i++)
        repeatable |= strcmp(col->r->repeat[i], name) == 0;
    if (!repeatable && http_param_get(c, name) != NULL) {
        http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                         "parameter '%s' given more than once", name);
        col->err = -EINVAL;
        return MHD_NO;
    }
    if (c->nparams == HTTP_MAX_QUERY_VALUES) {
        http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                         "more than %u query parameters (parameter '%s')", HTTP_MAX_QUERY_VALUES,
                         name);
        col->err = -EINVAL;
        return MHD_NO;
    }
    if (value != NULL && strlen(value) > HTTP_MAX_PARAM_LEN) {
        http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                         "parameter '%s' is longer than %u bytes", name, HTTP_MAX_PARAM_LEN);
        col->err = -EINVAL;
        return MHD_NO;
    }
    /* nparams < HTTP_MAX_QUERY_VALUES was checked above */
    c->params[c->nparams].name = name;
    c->params[c->nparams].value = value != NULL ? value : ""; /* "?limit": empty, garbage */
    c->nparams++;
    return MHD_YES;
}

static int params_collect(struct ctx *c, const struct route *r)
{
    struct collect col = {.c = c, .r = r, .err = 0};
    MHD_get_connection_values(c->conn, MHD_GET_ARGUMENT_KIND, collect_param, &col);
    return col.err;
}

/* state=: names of alert states or "open" (pending or firing), repeated
 * and/or comma-separated; their union as a bit mask (bit = state number).
 * Absent: *mask = 0. Any empty or unknown item is a 400. */
static int param_states(struct ctx *c, unsigned *mask)
{
    static const char *const names[] = {"inactive", "pending", "firing", "resolved", "open"};
    static const unsigned bits[] = {
        1u << ALERT_INACTIVE, 1u << ALERT_PENDING, 1u << ALERT_FIRING, 1u << ALERT_RESOLVED,
        (1u << ALERT_PENDING) | (1u << ALERT_FIRING)};
    _Static_assert(sizeof names / sizeof names[0] == sizeof bits / sizeof bits[0], "states");
    *mask = 0;
    for (unsigned i = 0; i < c->nparams; i++) {
        if (strcmp(c->params[i].name, "state") != 0)
            continue;
        const char *p = c->params[i].value;
        for (;;) {
            size_t len = strcspn(p, ",");
            size_t k = 0;
            while (k < sizeof names / sizeof names[0] &&
                   (strlen(names[k]) != len || strncmp(p, names[k], len) != 0))
                k++;
            if (k == sizeof names / sizeof names[0]) {
                char list[128];
                http_join_names(names, sizeof names / sizeof names[0], list, sizeof list);
                http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                 "parameter 'state' must be one of: %s "
                                 "(repeated or comma-separated)",
                                 list);
                return -EINVAL;
            }
            *mask |= bits[k];
            if (p[len] == '\0')
                break;
            p += len + 1;
        }
    }
    return 0;
}

/* A UNIX time in seconds: digits with an optional fraction (no sign, no
 * exponent, no blanks). */
static int param_time(struct ctx *c, const char *name, double *out, bool *present)
{
    const char *s = http_param_get(c, name);
    *present = s != NULL;
    if (s == NULL)
        return 0;
    size_t int_digits = strspn(s, "0123456789");
    const char *p = s + int_digits;
    size_t frac_digits = 0;
    if (*p == '.') {
        frac_digits = strspn(p + 1, "0123456789");
        p += 1 + frac_digits;
    }
    char *end = NULL;
    double v = 0;
    if (int_digits > 0 && *p == '\0' && (p == s + int_digits || frac_digits > 0)) {
        v = strtod(s, &end);
    }
    if (end == NULL || *end != '\0' || !isfinite(v)) {
        http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                         "parameter '%s' must be a UNIX time in seconds "
                         "(digits, optional fraction)",
                         name);
        return -EINVAL;
    }
    *out = v;
    return 0;
}

/* Pinned state numbers (alert.h) and their names in the API. */
static const char *const alert_state_names[] = {
    [ALERT_INACTIVE] = "inactive",
    [ALERT_PENDING] = "pending",
    [ALERT_FIRING] = "firing",
    [ALERT_RESOLVED] = "resolved",
};
#define ALERT_STATE_COUNT (sizeof alert_state_names / sizeof alert_state_names[0])

static json_t *col_state(sqlite3_stmt *st, int i)
{
    if (sqlite3_column_type(st, i) == SQLITE_NULL)
        return json_null();
    int64_t v = sqlite3_column_int64(st, i);
    return json_string(v >= 0 && (uint64_t)v < ALERT_STATE_COUNT ? alert_state_names[v]
                                                                   : "unknown");
}

/* ALERT object from a row of ALERT_COLUMNS. */
static json_t *alert_json(sqlite3_stmt *st)
{
    static const struct label_cols lc = {
        .layer = AC_LAYER, .head = AC_HEAD, .window = AC_WINDOW, .rank = AC_RANK};
    json_t *o = json_object();
    json_t *ev = json_object();
    if (o == NULL || ev == NULL) {
        json_decref(o);
        json_decref(ev);
        return NULL;
    }
    int rc = 0;
    rc |= oset(ev, "value", col_real(st, AC_VALUE));
    rc |= oset(ev, "median", col_real(st, AC_MEDIAN));
    rc |= oset(ev, "mad", col_real(st, AC_MAD));
    rc |= oset(ev, "z", col_real(st, AC_Z));
    rc |= oset(ev, "first_breach_step", col_int(st, AC_FIRST_BREACH));
    rc |= oset(ev, "fired_step", col_int(st, AC_FIRED));
    rc |= oset(ev, "resolved_step", col_int(st, AC_RESOLVED));
    rc |= oset(ev, "last_step", col_int(st, AC_LAST_STEP));
    rc |= oset(o, "evidence", ev); /* consumes ev, also on failure */
    rc |= oset(o, "id", col_int(st, AC_ID));
    rc |= oset(o, "run", col_text(st, AC_RUN));
    rc |= oset(o, "rule", col_text(st, AC_RULE));
    rc |= oset(o, "state", col_state(st, AC_STATE));
    rc |= oset(o, "severity", col_text(st, AC_SEVERITY));
    rc |= oset(o, "family", col_text(st, AC_FAMILY));
    rc |= oset(o, "attribution", col_text(st, AC_ATTRIBUTION));
    rc |= oset(o, "labels", http_labels_json(st, &lc));
    rc |= oset(o, "dedup_key", col_text(st, AC_DEDUP));
    rc |= oset(o, "alert_key", col_text(st, AC_KEY));
    rc |= oset(o, "incidents", col_int(st, AC_INCIDENTS));
    rc |= oset(o, "created_at", col_real(st, AC_CREATED));
    rc |= oset(o, "updated_at", col_real(st, AC_UPDATED));
    rc |= oset(o, "series_id", col_int(st, AC_SERIES));
    if (rc != 0) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* One alert_events row (STMT_ALERT_HISTORY). */
static json_t *event_json(sqlite3_stmt *st)
{
    json_t *o = json_object();
    if (o == NULL)
        return NULL;
    int rc = 0;
    rc |= oset(o, "id", col_int(st, 0));
    rc |= oset(o, "change", col_text(st, 1));
    rc |= oset(o, "from", col_state(st, 2));
    rc |= oset(o, "to", col_state(st, 3));
    rc |= oset(o, "step", col_int(st, 4));
    rc |= oset(o, "at", col_real(st, 5));
    rc |= oset(o, "attribution", col_text(st, 6));
    rc |= oset(o, "evidence", http_col_json_object(st, 7, HTTP_MAX_EVIDENCE_JSON_BYTES));
    if (rc != 0) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* --- handlers ----------------------------------------------------------------------- */

static int h_healthz(struct ctx *c)
{
    json_t *doc = json_pack("{s:s}", "status", "ok");
    return doc != NULL ? http_reply_set(c, MHD_HTTP_OK, doc) : http_reply_oom(c);
}

static int h_readyz(struct ctx *c)
{
    struct fs_stats *s = c->h->stats;
    if (atomic_load_explicit(&s->ready, memory_order_relaxed) != 1)
        return http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable",
                                "daemon is not ready (starting or shutting down)");
    if (atomic_load_explicit(&s->storage_failing, memory_order_relaxed) != 0)
        return http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable",
                                "storage is failing: commits do not succeed");
    sqlite3_stmt *st = c->dbc->st[STMT_READY];
    int rc = sqlite3_step(st);
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) {
        log_limited(&c->dbc->rl, LOG_LEVEL_ERROR, LOG_MOD, "readyz: sqlite error %d: %s", rc,
                    sqlite3_errmsg(c->dbc->db));
        stmt_done(st);
        return http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable",
                                "database is not readable");
    }
    stmt_done(st);
    json_t *doc = json_pack("{s:s}", "status", "ready");
    return doc != NULL ? http_reply_set(c, MHD_HTTP_OK, doc) : http_reply_oom(c);
}

/* --- silences of alerts ------------------------------------------------------------
 * "silenced_by" in ALERT documents: the ids of the active silences whose
 * matchers match the alert's label set (the one the pager sends):
 * alertname (the rule), run, severity, family, signature and attribution
 * (both the attribution), and layer, head, window, rank where the alert
 * has that scope (page_format.h, page_labels). */
struct silence_set {
    size_t n;
    struct silence *v; /* n parsed silences (regexes compiled) */
    double now;
};


static void silences_release(struct silence_set *ss)
{
    for (size_t i = 0; i < ss->n; i++)
        silence_free(&ss->v[i]);
    free(ss->v);
    ss->v = NULL;
    ss->n = 0;
}

/* Loads the active silences (at most HTTP_MAX_ACTIVE_SILENCES, oldest
 * first). Returns 0, or -1 after setting the reply. A row that does not
 * parse (written by another version?) is skipped with a complaint. */
static int silences_load(struct ctx *c, struct silence_set *ss)
{
    ss->n = 0;
    ss->v = NULL;
    ss->now = wall_now();
    sqlite3_stmt *st = c->dbc->st[STMT_SILENCES_ACTIVE];
    sqlite3_bind_double(st, 1, ss->now);
    sqlite3_bind_int(st, 2, HTTP_MAX_ACTIVE_SILENCES);
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (ss->v == NULL) {
            ss->v = calloc(HTTP_MAX_ACTIVE_SILENCES, sizeof *ss->v);
            if (ss->v == NULL) {
                stmt_done(st);
                http_reply_oom(c);
                return -1;
            }
        }
        struct silence *x = &ss->v[ss->n];
        const char *m = (const char *)sqlite3_column_text(st, 1);
        char why[160];
        if (m == NULL ||
            silence_parse(m, (size_t)sqlite3_column_bytes(st, 1), x, why, sizeof why) != 0) {
            log_limited(&c->dbc->rl, LOG_LEVEL_WARN, LOG_MOD, "silence %lld: %s",
                        (long long)sqlite3_column_int64(st, 0), m == NULL ? "no matchers" : why);
            continue;
        }
        x->id = sqlite3_column_int64(st, 0);
        x->starts_at = sqlite3_column_double(st, 2);
        x->ends_at = sqlite3_column_double(st, 3);
        ss->n++;
    }
    stmt_done(st);
    if (rc != SQLITE_DONE) {
        silences_release(ss);
        http_reply_db_error(c, "active silences", rc);
        return -1;
    }
    return 0;
}

static const char *col_cstr(sqlite3_stmt *st, int i)
{
    const char *s = (const char *)sqlite3_column_text(st, i);
    return s != NULL ? s : "";
}

/* The ids of the silences of ss that match the alert in the current row
 * (ALERT_COLUMNS). */
static json_t *silenced_by_json(sqlite3_stmt *st, const struct silence_set *ss)
{
    json_t *a = json_array();
    if (a == NULL || ss == NULL || ss->n == 0)
        return a;
    static const struct {
        const char *name;
        int col;
        int64_t min;
    } scopes[] = {{"layer", AC_LAYER, 0}, {"head", AC_HEAD, 0}, {"window", AC_WINDOW, 1},
                  {"rank", AC_RANK, 0}};
    char num[4][24];
    struct silence_label l[PAGE_MAX_LABELS];
    size_t n = 0;
    l[n++] = (struct silence_label){"alertname", col_cstr(st, AC_RULE)};
    l[n++] = (struct silence_label){"run", col_cstr(st, AC_RUN)};
    l[n++] = (struct silence_label){"severity", col_cstr(st, AC_SEVERITY)};
    l[n++] = (struct silence_label){"family", col_cstr(st, AC_FAMILY)};
    l[n++] = (struct silence_label){"signature", col_cstr(st, AC_ATTRIBUTION)};
    l[n++] = (struct silence_label){"attribution", col_cstr(st, AC_ATTRIBUTION)};
    for (size_t i = 0; i < sizeof scopes / sizeof scopes[0]; i++) {
        int64_t v = sqlite3_column_int64(st, scopes[i].col);
        if (sqlite3_column_type(st, scopes[i].col) == SQLITE_NULL || v < scopes[i].min)
            continue;
        snprintf(num[i], sizeof num[i], "%" PRId64, v);
        l[n++] = (struct silence_label){scopes[i].name, num[i]};
    }
    for (size_t i = 0; i < ss->n; i++)
        if (silence_matches(&ss->v[i], l, n, ss->now) && aadd(a, json_integer(ss->v[i].id)) != 0) {
            json_decref(a);
            return NULL;
        }
    return a;
}

/* ALERT with "silenced_by". */
static json_t *alert_json_silenced(sqlite3_stmt *st, const struct silence_set *ss)
{
    json_t *o = alert_json(st);
    if (o != NULL && oset(o, "silenced_by", silenced_by_json(st, ss)) != 0) {
        json_decref(o);
        return NULL;
    }
    return o;
}

static json_t *alert_row(sqlite3_stmt *st, const void *arg)
{
    return alert_json_silenced(st, arg);
}

/* Accepted values of severity= and label= (the attribution column; see
 * alert_attribution_name and detect_severity_name). */
static const char *const severity_names[] = {"warning", "critical"};
static const char *const attribution_names[] = {
    "attention-numerics", "optimizer-hyperparameter", "combined", "router-balance",
    "non-finite",         "loss-spike",               "none"};

int http_alerts_list(struct ctx *c)
{
    const char *run, *severity, *label, *rule;
    unsigned states;
    int64_t layer, head, window, rank, from_step, to_step, limit, before;
    bool has_layer, has_head, has_window, has_rank, has_from, has_to, has_since, has_until;
    double since = 0, until = 0;
    if (http_param_text(c, "run", false, &run) != 0 || param_states(c, &states) != 0 ||
        http_param_enum(c, "severity", severity_names,
                        sizeof severity_names / sizeof severity_names[0], &severity) != 0 ||
        http_param_enum(c, "label", attribution_names,
                        sizeof attribution_names / sizeof attribution_names[0], &label) != 0 ||
        http_param_text(c, "rule", false, &rule) != 0 ||
        http_param_int(c, "layer", 0, INT32_MAX, -1, &layer, &has_layer) != 0 ||
        http_param_int(c, "head", 0, INT32_MAX, -1, &head, &has_head) != 0 ||
        http_param_int(c, "window", 1, INT32_MAX, 0, &window, &has_window) != 0 ||
        http_param_int(c, "rank", 0, INT32_MAX, -1, &rank, &has_rank) != 0 ||
        param_time(c, "since", &since, &has_since) != 0 ||
        param_time(c, "until", &until, &has_until) != 0 ||
        http_param_int(c, "from_step", 0, INT64_MAX, 0, &from_step, &has_from) != 0 ||
        http_param_int(c, "to_step", 0, INT64_MAX, INT64_MAX, &to_step, &has_to) != 0 ||
        http_param_limit(c, &limit) != 0 || http_param_before(c, &before) != 0)
        return 0;
    if (has_since && has_until && since > until)
        return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                "parameter 'since' must not be greater than 'until'");
    if (from_step > to_step)
        return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                "parameter 'from_step' must not be greater than 'to_step'");

    int64_t run_id = 0;
    if (run != NULL && http_runs_id_by_name(c, run, &run_id) != 0)
        return 0;

    /* The index decides the statement: a state filter walks one range per
     * state (alerts_by_state, or an index on (run_id, state) with run);
     * otherwise alerts_by_run or the table itself, newest first. Other
     * filters are checked on the rows walked. */
    enum stmt_id sid = states != 0 ? (run != NULL ? STMT_ALERTS_RUN_STATE : STMT_ALERTS_STATE)
                                   : (run != NULL ? STMT_ALERTS_RUN : STMT_ALERTS_ALL);
    sqlite3_stmt *st = c->dbc->st[sid];
    if (run != NULL)
        sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_int64(st, 2, before);
    /* ALERTS_ARMS has one arm per state: a new state needs a new arm */
    _Static_assert(ALERT_STATE_COUNT == HTTP_MAX_ALERT_STATE_ARMS, "one SQL arm per state");
    int arm = 0;
    for (unsigned k = 0; k < ALERT_STATE_COUNT && arm < HTTP_MAX_ALERT_STATE_ARMS; k++)
        if (states & (1u << k))
            sqlite3_bind_int64(st, 3 + arm++, (int64_t)k);
    if (severity != NULL)
        sqlite3_bind_text(st, 7, severity, -1, SQLITE_STATIC);
    if (label != NULL)
        sqlite3_bind_text(st, 8, label, -1, SQLITE_STATIC);
    if (rule != NULL)
        sqlite3_bind_text(st, 9, rule, -1, SQLITE_STATIC);
    if (has_layer)
        sqlite3_bind_int64(st, 10, layer);
    if (has_head)
        sqlite3_bind_int64(st, 11, head);
    if (has_window)
        sqlite3_bind_int64(st, 12, window);
    if (has_rank)
        sqlite3_bind_int64(st, 13, rank);
    if (has_since)
        sqlite3_bind_double(st, 14, since);
    if (has_until)
        sqlite3_bind_double(st, 15, until);
    if (has_from)
        sqlite3_bind_int64(st, 16, from_step);
    if (has_to)
        sqlite3_bind_int64(st, 17, to_step);
    sqlite3_bind_int64(st, 18, limit + 1);
    struct silence_set ss;
    if (silences_load(c, &ss) != 0) {
        stmt_done(st);
        return 0;
    }
    http_reply_page(c, st, limit, AC_ID, alert_row, &ss, "alerts", "alerts");
    silences_release(&ss);
    return 0;
}

/* The latest HTTP_MAX_ALERT_HISTORY transitions of alert id, oldest first,
 * into *out; *truncated when older ones exist. Returns 0, or a negative
 * code with the reply set. */
static int alert_history(struct ctx *c, int64_t id, json_t **out, bool *truncated)
{
    sqlite3_stmt *st = c->dbc->st[STMT_ALERT_HISTORY];
    json_t *newest_first = json_array();
    json_t *hist = json_array();
    if (newest_first == NULL || hist == NULL)
        goto oom;
    sqlite3_bind_int64(st, 1, id);
    sqlite3_bind_int64(st, 2, HTTP_MAX_ALERT_HISTORY + 1);
    *truncated = false;
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (json_array_size(newest_first) == HTTP_MAX_ALERT_HISTORY) {
            *truncated = true;
            break;
        }
        if (aadd(newest_first, event_json(st)) != 0)
            goto oom;
    }
    if (!*truncated && rc != SQLITE_DONE) {
        http_reply_db_error(c, "alert history", rc);
        stmt_done(st);
        json_decref(newest_first);
        json_decref(hist);
        return -EIO;
    }
    stmt_done(st);
    for (size_t i = json_array_size(newest_first); i-- > 0;)
        if (json_array_append(hist, json_array_get(newest_first, i)) != 0)
            goto oom;
    json_decref(newest_first);
    *out = hist;
    return 0;
oom:
    stmt_done(st);
    json_decref(newest_first);
    json_decref(hist);
    http_reply_oom(c);
    return -ENOMEM;
}

int http_alerts_get(struct ctx *c)
{
    int64_t id;
    if (http_parse_int64(c->cap[0], &id) != 0 || id < 1)
        return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                "alert 'id' in the path must be an integer in 1..%" PRId64,
                                (int64_t)INT64_MAX);
    sqlite3_stmt *st = c->dbc->st[STMT_ALERT_ONE];
    sqlite3_bind_int64(st, 1, id);
    int rc = sqlite3_step(st);
    if (rc != SQLITE_ROW) {
        if (rc == SQLITE_DONE)
            http_reply_error(c, MHD_HTTP_NOT_FOUND, "not_found", "unknown alert %" PRId64, id);
        else
            http_reply_db_error(c, "alert", rc);
        stmt_done(st);
        return 0;
    }
    struct silence_set ss;
    if (silences_load(c, &ss) != 0) {
        stmt_done(st);
        return 0;
    }
    json_t *alert = alert_json_silenced(st, &ss);
    silences_release(&ss);
    stmt_done(st);
    if (alert == NULL)
        return http_reply_oom(c);

    json_t *hist = NULL;
    bool truncated = false;
    if (alert_history(c, id, &hist, &truncated) != 0) {
        json_decref(alert);
        return 0;
    }
    int e = oset(alert, "history", hist);
    e |= oset(alert, "history_truncated", json_boolean(truncated));
    json_t *doc = e == 0 ? json_pack("{s:o}", "alert", alert) : NULL;
    if (e != 0)
        json_decref(alert);
    return doc != NULL ? http_reply_set(c, MHD_HTTP_OK, doc) : http_reply_oom(c);
}

/* --- silences --------------------------------------------------------------------------- */

static const char *const silence_state_names[] = {"active", "pending", "expired"};

static const char *silence_state(double starts, double ends, double now)
{
    if (ends <= now)
        return "expired";
    return starts <= now ? "active" : "pending";
}

/* An RFC 3339 UTC time; null where the value cannot be shown. */
static json_t *col_time(sqlite3_stmt *st, int i)
{
    char buf[48];
    if (sqlite3_column_type(st, i) == SQLITE_NULL ||
        http_time_format(sqlite3_column_double(st, i), buf, sizeof buf) != 0)
        return json_null();
    return json_string(buf);
}

/* SILENCE from a row of SILENCE_COLUMNS. */
static json_t *silence_json(sqlite3_stmt *st, double now)
{
    json_t *o = json_object();
    if (o == NULL)
        return NULL;
    json_error_t jerr;
    const char *m = (const char *)sqlite3_column_text(st, SLC_MATCHERS);
    json_t *matchers = m != NULL ? json_loadb(m, (size_t)sqlite3_column_bytes(st, SLC_MATCHERS),
                                              0, &jerr)
                                 : NULL;
    int rc = 0;
    rc |= oset(o, "id", col_int(st, SLC_ID));
    rc |= oset(o, "matchers", matchers != NULL ? matchers : json_array());
    rc |= oset(o, "startsAt", col_time(st, SLC_STARTS));
    rc |= oset(o, "endsAt", col_time(st, SLC_ENDS));
    rc |= oset(o, "createdBy", col_text(st, SLC_BY));
    rc |= oset(o, "comment", col_text(st, SLC_COMMENT));
    rc |= oset(o, "status",
               json_pack("{s:s}", "state",
                         silence_state(sqlite3_column_double(st, SLC_STARTS),
                                       sqlite3_column_double(st, SLC_ENDS), now)));
    rc |= oset(o, "createdAt", col_time(st, SLC_CREATED));
    rc |= oset(o, "updatedAt", col_time(st, SLC_UPDATED));
    if (rc != 0) {
        json_decref(o);
        return NULL;
    }
    return o;
}

static json_t *silence_row(sqlite3_stmt *st, const void *arg)
{
    return silence_json(st, *(const double *)arg);
}

static int silence_id_param(struct ctx *c, int64_t *id)
{
    if (http_parse_int64(c->cap[0], id) != 0 || *id < 1) {
        http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                         "silence 'id' in the path must be an integer in 1..%" PRId64,
                         (int64_t)INT64_MAX);
        return -EINVAL;
    }
    return 0;
}

/* {"silence": SILENCE} of c->wid with status c->wstatus (or 200). */
static int reply_silence(struct ctx *c)
{
    sqlite3_stmt *st = c->dbc->st[STMT_SILENCE_ONE];
    sqlite3_bind_int64(st, 1, c->wid);
    int rc = sqlite3_step(st);
    if (rc != SQLITE_ROW) {
        if (rc == SQLITE_DONE)
            http_reply_error(c, MHD_HTTP_NOT_FOUND, "not_found", "unknown silence %" PRId64,
                             c->wid);
        else
            http_reply_db_error(c, "silence", rc);
        stmt_done(st);
        return 0;
    }
    json_t *sil = silence_json(st, wall_now());
    stmt_done(st);
    json_t *doc = sil != NULL ? json_pack("{s:o}", "silence", sil) : NULL;
    return doc != NULL ? http_reply_set(c, c->wstatus ? c->wstatus : MHD_HTTP_OK, doc)
                       : http_reply_oom(c);
}

int http_silences_get(struct ctx *c)
{
    if (silence_id_param(c, &c->wid) != 0)
        return 0;
    return reply_silence(c);
}

/* state=active|pending|expired, repeated or comma-separated; absent: all. */
static int param_silence_states(struct ctx *c, bool want[3])
{
    bool any = false;
    want[0] = want[1] = want[2] = false;
    for (unsigned i = 0; i < c->nparams; i++) {
        if (strcmp(c->params[i].name, "state") != 0)
            continue;
        const char *p = c->params[i].value;
        for (;;) {
            size_t len = strcspn(p, ",");
            size_t k = 0;
            while (k < 3 && (strlen(silence_state_names[k]) != len ||
                             strncmp(p, silence_state_names[k], len) != 0))
                k++;
            if (k == 3)
                return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                        "parameter 'state' must be one of: active, pending, "
                                        "expired (repeated or comma-separated)"),
                       -EINVAL;
            want[k] = any = true;
            if (p[len] == '\0')
                break;
            p += len + 1;
        }
    }
    if (!any)
        want[0] = want[1] = want[2] = true;
    return 0;
}

int http_silences_list(struct ctx *c)
{
    bool want[3];
    int64_t limit, before;
    if (param_silence_states(c, want) != 0 || http_param_limit(c, &limit) != 0 ||
        http_param_before(c, &before) != 0)
        return 0;
    double now = wall_now();
    sqlite3_stmt *st = c->dbc->st[STMT_SILENCES_PAGE];
    sqlite3_bind_int64(st, 1, before);
    for (int k = 0; k < 3; k++)
        sqlite3_bind_int(st, 2 + k, want[k]);
    sqlite3_bind_double(st, 5, now);
    sqlite3_bind_int64(st, 6, limit + 1);
    return http_reply_page(c, st, limit, SLC_ID, silence_row, &now, "silences", "silences");
}

/* Hands a silence item to the writer and waits for the commit. Returns 0
 * with *id, -ENOENT / -EALREADY for the caller to answer, or another
 * negative code after setting the reply. Consumes it. */
static int silence_write(struct ctx *c, struct store_item *it, int64_t *id)
{
    struct store_waiter *w = store_waiter_new();
    if (w == NULL) {
        store_item_free(it);
        http_reply_oom(c);
        return -ENOMEM;
    }
    it->silence.waiter = store_waiter_ref(w);
    int rc = store_submit(c->h->store, it);
    if (rc != 0) {
        store_item_free(it); /* settles w with -ECANCELED, drops its reference */
        store_waiter_put(w);
        http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable",
                         "storage is not accepting writes (shutting down)");
        return rc;
    }
    /* The writer holds the item's reference; if we give up first it still
     * settles and frees the waiter safely. */
    rc = store_waiter_wait(w, HTTP_WRITE_WAIT_MS, id);
    store_waiter_put(w);
    switch (rc) {
    case 0:
    case -ENOENT:
    case -EALREADY:
        return rc;
    case -ETIMEDOUT:
        http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable",
                         "storage did not commit within %u s (it may still); check before retrying",
                         HTTP_WRITE_WAIT_MS / 1000);
        return rc;
    case -ECANCELED:
        http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable",
                         "the daemon is shutting down; nothing was written");
        return rc;
    default:
        http_reply_error(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "internal",
                         "storage refused the write (details in the daemon log)");
        return rc;
    }
}

/* POST body -> an INSERT item; run: maintenance silence of that run. */
static int silence_create(struct ctx *c, const char *run)
{
    struct silence_req *req = malloc(sizeof *req);
    if (req == NULL)
        return http_reply_oom(c);
    char why[512];
    if (http_silence_req_parse(c->req_body, c->req_len, run, wall_now(), req, why, sizeof why) !=
        0) {
        free(req);
        return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request", "%s", why);
    }
    struct store_item *it = store_item_new(STORE_ITEM_SILENCE);
    if (it == NULL) {
        free(req);
        return http_reply_oom(c);
    }
    it->silence.op = STORE_SILENCE_INSERT;
    it->silence.starts_at = req->starts_at;
    it->silence.ends_at = req->ends_at;
    it->silence.matchers_json = strdup(req->matchers_json);
    it->silence.created_by = strdup(req->created_by);
    it->silence.comment = strdup(req->comment);
    free(req);
    if (it->silence.matchers_json == NULL || it->silence.created_by == NULL ||
        it->silence.comment == NULL) {
        store_item_free(it);
        return http_reply_oom(c);
    }
    if (silence_write(c, it, &c->wid) != 0)
        return 0;
    c->wstatus = MHD_HTTP_CREATED;
    return http_db_read(c, reply_silence);
}

int http_silences_create(struct ctx *c)
{
    return silence_create(c, NULL);
}

int http_silences_maintenance(struct ctx *c)
{
    return silence_create(c, c->cap[0]);
}

int http_silences_expire(struct ctx *c)
{
    int64_t id;
    if (silence_id_param(c, &id) != 0)
        return 0;
    struct store_item *it = store_item_new(STORE_ITEM_SILENCE);
    if (it == NULL)
        return http_reply_oom(c);
    it->silence.op = STORE_SILENCE_EXPIRE;
    it->silence.id = id;
    int rc = silence_write(c, it, &c->wid);
    if (rc == -ENOENT)
        return http_reply_error(c, MHD_HTTP_NOT_FOUND, "not_found", "unknown silence %" PRId64, id);
    if (rc == -EALREADY)
        return http_reply_error(c, MHD_HTTP_CONFLICT, "conflict",
                                "silence %" PRId64 " has already expired", id);
    if (rc != 0)
        return 0;
    c->wstatus = MHD_HTTP_OK;
    return http_db_read(c, reply_silence);
}

/* --- /metrics ------------------------------------------------------------------------------ */

static int h_metrics(struct ctx *c)
{
    struct metrics_buf b = {0};
    char err[256] = "";
    int rc = metrics_write_stats(&b, c->h->stats, FORESHOCK_VERSION);
    if (rc == 0)
        rc = metrics_write_db(&b, c->dbc->db, &c->h->mopts, wall_now(), err, sizeof err);
    if (rc != 0) {
        metrics_buf_free(&b);
        if (rc > 0)
            return http_reply_db_error(c, "metrics", rc);
        return http_reply_error(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "internal",
                                "cannot render metrics (%s)",
                                rc == -E2BIG ? "too large" : "no memory");
    }
    return http_reply_raw(c, MHD_HTTP_OK, METRICS_CONTENT_TYPE, b.p, b.len, true);
}

/* --- route table ----------------------------------------------------------------------
 * The API (all JSON, GET or HEAD; other methods 405 with Allow):
 *   /healthz                 {"status":"ok"}
 *   /readyz                  {"status":"ready"} | 503 (not ready, storage failing, db unreadable)
 *   /api/v1/runs             ?limit=1..10000 (1000) &after=CURSOR
 *                            {"runs":[RUN...],"next":CURSOR|null}
 *   /api/v1/runs/{name}      {"run":RUN + "streams_detail":[...]} (attempt, rank order)
 *   /api/v1/series           ?run=NAME (required) &name= | &prefix= &layer= &head= &window=
 *                            &rank= &limit= &after=   {"series":[SERIES...],"next":...}
 *   /api/v1/series/{id}/points ?from=&to= (inclusive steps) &limit= | &max_points=1..5000
 *                            {"series":SERIES,"points":[[step,value|null]...],
 *                             "next_from":step|null,"downsampled":false}
 *     with max_points=N: the steps present in [from, to] (first lo, last hi)
 *     are split into N buckets of w = ceil((hi - lo + 1) / N) steps from lo;
 *     each non-empty bucket gives [first step, mean, min, max] (NULL and
 *     +-Inf values give null), "downsampled":true, "bucket_width":w,
 *     "next_from":null. limit and max_points exclude each other.
 *   /api/v1/runs/{name}/incomplete ?limit= &after=CURSOR
 *                            {"incomplete":[{"step","kind","layer","head","window","have",
 *                             "want","recorded_at"}...],"next":CURSOR|null}
 *     primary-key order (step, kind, layer, head, window); layer/head/window
 *     are null where they do not apply; CURSOR is "step:layer:head:window:kind".
 *   /api/v1/alerts           ?run= &state=inactive|pending|firing|resolved|open (repeated
 *                            or comma-separated: a union; open = pending or firing)
 *                            &severity=warning|critical &label=ATTRIBUTION &rule=
 *                            &layer= &head= &window= &rank= &since=&until= (updated_at,
 *                            inclusive, UNIX seconds) &from_step=&to_step= (first breach,
 *                            inclusive; alerts without one never match) &limit= &after=
 *                            {"alerts":[ALERT...],"next":CURSOR|null}, newest (highest id)
 *                            first; the next page holds ids below CURSOR
 *   /api/v1/alerts/{id}      {"alert":ALERT + "history":[{"id","change","from","to","step",
 *                             "at","attribution","evidence":{...}|null}...] (oldest first,
 *                             the latest 1000), "history_truncated":bool}
 *     ALERT = {"id","run","rule","state","severity","family","attribution","labels",
 *     "dedup_key","alert_key","evidence":{"value","median","mad","z",
 *     "first_breach_step","fired_step","resolved_step","last_step"},"incidents",
 *     "created_at","updated_at","series_id"}. /runs/{name} also carries
 *     "incomplete":n and "alerts":{"firing":n,"pending":n}.
 * Cursors are the last id of a page, as a string; "next" is null on the
 * last page (a page is only followed by another if a row exists beyond it).
 * Unknown, repeated, empty or malformed parameters are 400 naming the
 * parameter; unknown paths, runs and series 404.
 *
 *     ALERT also carries "silenced_by":[ids of the active silences matching it].
 *   GET /api/v1/silences     ?state=active|pending|expired (repeated or comma-separated)
 *                            &limit= &after=  {"silences":[SILENCE...],"next":CURSOR|null},
 *                            newest first
 *   GET /api/v1/silences/{id}      {"silence":SILENCE}
 *   POST /api/v1/silences          body (http_parse.h) -> 201 {"silence":SILENCE}
 *   DELETE /api/v1/silences/{id}   expire now -> 200 {"silence":SILENCE}; 404, 409 expired
 *   POST /api/v1/runs/{run}/maintenance {"duration","createdBy","comment"?,"startsAt"?}
 *                            -> 201 {"silence":SILENCE} with the one matcher run=<run>
 *     SILENCE = {"id","matchers":[{"name","value","isRegex","isEqual"}...],"startsAt",
 *     "endsAt","createdBy","comment","status":{"state"},"createdAt","updatedAt"}, times
 *     RFC 3339 UTC.
 *   GET /metrics             Prometheus text format 0.0.4 (metrics.c)
 * Auth: with http_read_token set, every route but /healthz and /readyz
 * needs "Authorization: Bearer <read or write token>"; writes need the
 * write token, and answer 403 while http_write_token is empty. 401 carries
 * WWW-Authenticate: Bearer. Writes go through the writer thread.
 *
 * A row without .methods answers GET and HEAD; a reply that is not JSON
 * uses http_reply_raw() (bytes + content type). The dashboard (/ and
 * /static/NAME, no token: the files hold no data) sets c->dash instead,
 * which send_reply sends with the file's content type and ETag. */

/* The dashboard's embedded files; 304 when If-None-Match has the ETag. */
static int h_dashboard(struct ctx *c)
{
    if (dashboard_lookup(c->url, &c->dash_file) != 0) {
        char echo[HTTP_MAX_URL_ECHO + 1];
        snprintf(echo, sizeof echo, "%s", c->url);
        return http_reply_error(c, MHD_HTTP_NOT_FOUND, "not_found", "no such asset: %s", echo);
    }
    const char *inm =
        MHD_lookup_connection_value(c->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_IF_NONE_MATCH);
    c->dash = &c->dash_file;
    c->status = dashboard_etag_match(inm, c->dash_file.etag) ? MHD_HTTP_NOT_MODIFIED : MHD_HTTP_OK;
    return 0;
}

static const struct route routes[] = {
    {.pattern = "/", .fn = h_dashboard, .db = false, .open = true},
    {.pattern = "/static/*", .fn = h_dashboard, .db = false, .open = true},
    {.pattern = "/healthz", .fn = h_healthz, .db = false, .open = true},
    {.pattern = "/readyz", .fn = h_readyz, .db = true, .open = true},
    {.pattern = "/api/v1/runs", .fn = http_runs_list, .db = true, .params = {"limit", "after"}},
    {.pattern = "/api/v1/runs/*", .fn = http_runs_get, .db = true},
    {.pattern = "/api/v1/series",
     .fn = http_runs_series,
     .db = true,
     .params = {"run", "name", "prefix", "layer", "head", "window", "rank", "limit", "after"}},
    {.pattern = "/api/v1/series/*/points",
     .fn = http_runs_points,
     .db = true,
     .params = {"from", "to", "limit", "max_points"}},
    {.pattern = "/api/v1/runs/*/incomplete",
     .fn = http_runs_incomplete,
     .db = true,
     .params = {"limit", "after"}},
    {.pattern = "/api/v1/alerts",
     .fn = http_alerts_list,
     .db = true,
     .params = {"run", "state", "severity", "label", "rule", "layer", "head", "window", "rank",
                "since", "until", "from_step", "to_step", "limit", "after"},
     .repeat = {"state"}},
    {.pattern = "/api/v1/alerts/*", .fn = http_alerts_get, .db = true},
    {.pattern = "/api/v1/silences",
     .fn = http_silences_list,
     .db = true,
     .params = {"state", "limit", "after"},
     .repeat = {"state"}},
    {.pattern = "/api/v1/silences", .fn = http_silences_create, .methods = M_POST, .write = true,
     .body = true},
    {.pattern = "/api/v1/silences/*", .fn = http_silences_get, .db = true},
    {.pattern = "/api/v1/silences/*", .fn = http_silences_expire, .methods = M_DELETE,
     .write = true},
    {.pattern = "/api/v1/runs/*/maintenance", .fn = http_silences_maintenance, .methods = M_POST,
     .write = true, .body = true},
    {.pattern = "/metrics", .fn = h_metrics, .db = true},
};

/* Matches path against pattern; copies '*' segments into c->cap. Returns
 * 1 on a match, 0 if not, -E2BIG if a captured segment is too long. */
static int route_match(const char *pattern, const char *path, struct ctx *c)
{
    const char *p = pattern, *u = path;
    unsigned n = 0;
    while (*p != '\0' && *u != '\0') {
        if (*p == '*') {
            size_t len = strcspn(u, "/");
            if (len == 0 || n >= HTTP_MAX_CAPTURES)
                return 0;
            if (len > HTTP_MAX_PARAM_LEN)
                return -E2BIG;
            memcpy(c->cap[n], u, len);
            c->cap[n][len] = '\0';
            n++;
            u += len;
            p++;
        } else if (*p == *u) {
            p++;
            u++;
        } else {
            return 0;
        }
    }
    if (*p != '\0' || *u != '\0')
        return 0;
    c->ncap = n;
    return 1;
}

/* --- read-connection pool ---------------------------------------------------------------- */

static struct dbconn *db_checkout(struct http *h)
{
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += HTTP_DB_CHECKOUT_TIMEOUT_MS / 1000;
    deadline.tv_nsec += (long)(HTTP_DB_CHECKOUT_TIMEOUT_MS % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    struct dbconn *d = NULL;
    pthread_mutex_lock(&h->mu);
    while (h->nfree == 0)
        if (pthread_cond_timedwait(&h->cv, &h->mu, &deadline) == ETIMEDOUT)
            break;
    if (h->nfree > 0)
        d = &h->conns[h->free_idx[--h->nfree]];
    pthread_mutex_unlock(&h->mu);
    return d;
}

static void db_return(struct http *h, struct dbconn *d)
{
    pthread_mutex_lock(&h->mu);
    h->free_idx[h->nfree++] = (unsigned)(d - h->conns);
    pthread_cond_signal(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

static void dbconn_close(struct dbconn *d)
{
    for (int i = 0; i < STMT__COUNT; i++) {
        sqlite3_finalize(d->st[i]);
        d->st[i] = NULL;
    }
    sqlite3_close(d->db); /* NULL is a no-op */
    d->db = NULL;
}

/* Opens one read-only connection and prepares every statement (which also
 * checks that the schema is there). */
static int dbconn_open(struct dbconn *d, const char *path, char *err, size_t errlen)
{
    /* NOMUTEX: a connection is only ever used by the one thread that checked
     * it out. */
    int rc = sqlite3_open_v2(path, &d->db, SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX, NULL);
    if (rc != SQLITE_OK) {
        snprintf(err, errlen, "open %s read-only: %s", path,
                 d->db != NULL ? sqlite3_errmsg(d->db) : sqlite3_errstr(rc));
        goto fail;
    }
    sqlite3_busy_timeout(d->db, HTTP_DB_BUSY_TIMEOUT_MS);
    for (int i = 0; i < STMT__COUNT; i++) {
        rc = sqlite3_prepare_v3(d->db, http_stmt_sql((enum stmt_id)i), -1,
                                SQLITE_PREPARE_PERSISTENT, &d->st[i], NULL);
        if (rc != SQLITE_OK) {
            snprintf(err, errlen, "%s: prepare failed (is the schema applied?): %s", path,
                     sqlite3_errmsg(d->db));
            goto fail;
        }
    }
    return 0;
fail:
    dbconn_close(d);
    return rc == SQLITE_NOMEM ? -ENOMEM : -EIO;
}

/* --- libmicrohttpd glue -------------------------------------------------------------------- */

static void free_body(void *p)
{
    free(p);
}

static const char fallback_body[] =
    "{\"error\":{\"code\":\"internal\",\"message\":\"out of memory\"}}";

/* A dashboard file: static bytes, never copied; a 304 has no body. */
static struct MHD_Response *dash_response(const struct ctx *c)
{
    const struct dashboard_file *f = c->dash;
    bool body = c->status != MHD_HTTP_NOT_MODIFIED;
    struct MHD_Response *resp = MHD_create_response_from_buffer(
        body ? f->len : 0, body ? (void *)f->data : NULL, MHD_RESPMEM_PERSISTENT);
    if (resp == NULL)
        return NULL;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, f->content_type);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_ETAG, f->etag);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, f->cache_control);
    MHD_add_response_header(resp, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(resp, "Content-Security-Policy", DASHBOARD_CSP);
    return resp;
}

static enum MHD_Result send_reply(struct ctx *c)
{
    struct http *h = c->h;
    unsigned status = c->status;
    if (c->dash != NULL) {
        struct MHD_Response *raw = dash_response(c);
        if (raw == NULL)
            return MHD_NO;
        atomic_fetch_add_explicit(&h->stats->http_requests, 1, memory_order_relaxed);
        enum MHD_Result rr = MHD_queue_response(c->conn, status, raw);
        MHD_destroy_response(raw);
        return rr;
    }
    char *text = c->raw == NULL && c->body != NULL ? json_dumps(c->body, JSON_COMPACT) : NULL;
    struct MHD_Response *resp;
    if (c->raw != NULL) {
        if (c->raw_owned) {
            resp = MHD_create_response_from_buffer_with_free_callback(
                c->raw_len, (void *)c->raw, free_body);
            if (resp == NULL)
                free((void *)c->raw);
        } else {
            resp = MHD_create_response_from_buffer(c->raw_len, (void *)c->raw,
                                                   MHD_RESPMEM_PERSISTENT);
        }
        c->raw = NULL; /* the response owns it now (or it is freed) */
    } else if (text != NULL) {
        resp = MHD_create_response_from_buffer_with_free_callback(strlen(text), text, free_body);
        if (resp == NULL)
            free(text);
    } else {
        status = MHD_HTTP_INTERNAL_SERVER_ERROR;
        resp = MHD_create_response_from_buffer(sizeof fallback_body - 1, (void *)fallback_body,
                                               MHD_RESPMEM_PERSISTENT);
    }
    if (resp == NULL)
        return MHD_NO; /* closes the connection */
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE,
                            c->content_type != NULL ? c->content_type : "application/json");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    if (c->allow[0] != '\0')
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, c->allow);
    if (c->www_auth)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE,
                                "Bearer realm=\"foreshock\"");

    atomic_fetch_add_explicit(&h->stats->http_requests, 1, memory_order_relaxed);
    if (status >= 400)
        atomic_fetch_add_explicit(&h->stats->http_errors, 1, memory_order_relaxed);
    enum MHD_Result r = MHD_queue_response(c->conn, status, resp);
    MHD_destroy_response(resp);
    return r;
}

static unsigned method_bit(const char *method)
{
    static const struct {
        const char *name;
        unsigned bit;
    } m[] = {{MHD_HTTP_METHOD_GET, M_GET},
             {MHD_HTTP_METHOD_HEAD, M_HEAD},
             {MHD_HTTP_METHOD_POST, M_POST},
             {MHD_HTTP_METHOD_DELETE, M_DELETE}};
    for (size_t i = 0; i < sizeof m / sizeof m[0]; i++)
        if (strcmp(method, m[i].name) == 0)
            return m[i].bit;
    return 0;
}

static void allow_text(unsigned bits, char *out, size_t len)
{
    static const char *const names[] = {"GET", "HEAD", "POST", "DELETE"};
    const char *list[4];
    size_t n = 0;
    for (unsigned i = 0; i < 4; i++)
        if (bits & (1u << i))
            list[n++] = names[i];
    http_join_names(list, n, out, len);
}

/* 401 unless the request carries "Authorization: Bearer <token>" with one
 * of the tokens given (NULL or "" entries are skipped). Returns 0 when
 * allowed, -EACCES after setting the reply. The token is never logged. */
static int auth_check(struct ctx *c, const char *t1, const char *t2)
{
    const char *hdr =
        MHD_lookup_connection_value(c->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    const char *tok = NULL;
    size_t len = 0;
    bool okay = false;
    if (hdr != NULL && strlen(hdr) <= HTTP_MAX_AUTH_HEADER &&
        http_bearer_parse(hdr, &tok, &len) == 0) {
        /* both compared, whichever matches: the time says nothing */
        bool a = t1 != NULL && t1[0] != '\0' && http_token_equal(tok, len, t1);
        bool b = t2 != NULL && t2[0] != '\0' && http_token_equal(tok, len, t2);
        okay = a || b;
    }
    if (okay)
        return 0;
    c->www_auth = true;
    http_reply_error(c, MHD_HTTP_UNAUTHORIZED, "unauthorized",
                     hdr == NULL ? "this endpoint needs Authorization: Bearer <token>"
                                 : "the bearer token is missing, malformed or wrong");
    return -EACCES;
}

/* Checks out a read connection and runs fn inside one read transaction
 * (every statement sees the same committed snapshot). Sets the reply;
 * returns 0. */
int http_db_read(struct ctx *c, route_fn fn)
{
    c->dbc = db_checkout(c->h);
    if (c->dbc == NULL)
        return http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable",
                                "no database connection free; try again");
    int rc = sqlite3_step(c->dbc->st[STMT_BEGIN]);
    stmt_done(c->dbc->st[STMT_BEGIN]);
    if (rc != SQLITE_DONE) {
        http_reply_db_error(c, "begin", rc);
    } else {
        fn(c);
        rc = sqlite3_step(c->dbc->st[STMT_COMMIT]);
        stmt_done(c->dbc->st[STMT_COMMIT]);
        if (rc != SQLITE_DONE) {
            log_limited(&c->dbc->rl, LOG_LEVEL_ERROR, LOG_MOD, "end of a read transaction: %s",
                        sqlite3_errmsg(c->dbc->db));
            sqlite3_step(c->dbc->st[STMT_ROLLBACK]);
            stmt_done(c->dbc->st[STMT_ROLLBACK]);
        }
    }
    db_return(c->h, c->dbc);
    c->dbc = NULL;
    return 0;
}

/* Routes, checks method, auth and parameters, runs the handler (inside a
 * read transaction on a checked-out connection when the route reads).
 * Sets c->status and c->body (or c->raw); returns 0. */
static int dispatch(struct ctx *c, const char *method)
{
    const struct route *r = NULL;
    unsigned bit = method_bit(method), allowed = 0;
    bool path_known = false;
    for (size_t i = 0; i < sizeof routes / sizeof routes[0] && r == NULL; i++) {
        int m = route_match(routes[i].pattern, c->url, c);
        if (m < 0)
            return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                    "a path segment is longer than %u bytes", HTTP_MAX_PARAM_LEN);
        if (m == 0)
            continue;
        path_known = true;
        unsigned rm = routes[i].methods != 0 ? routes[i].methods : (M_GET | M_HEAD);
        allowed |= rm;
        if (bit & rm)
            r = &routes[i];
    }
    if (!path_known) {
        char echo[HTTP_MAX_URL_ECHO + 1];
        snprintf(echo, sizeof echo, "%s", c->url);
        return http_reply_error(c, MHD_HTTP_NOT_FOUND, "not_found", "no such resource: %s", echo);
    }
    if (r == NULL) {
        /* the rest of the table may list other methods for this path */
        for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
            if (route_match(routes[i].pattern, c->url, c) > 0)
                allowed |= routes[i].methods != 0 ? routes[i].methods : (M_GET | M_HEAD);
        allow_text(allowed, c->allow, sizeof c->allow);
        char echo[16];
        snprintf(echo, sizeof echo, "%s", method);
        return http_reply_error(c, MHD_HTTP_METHOD_NOT_ALLOWED, "method_not_allowed",
                                "method %s is not allowed here; use %s", echo, c->allow);
    }
    /* the matching row's captures (a later non-matching row may have
     * overwritten them above) */
    route_match(r->pattern, c->url, c);

    struct http *h = c->h;
    if (!r->open && h->read_token[0] != '\0' &&
        auth_check(c, h->read_token, h->write_token) != 0)
        return 0;
    if (r->write) {
        if (h->write_token[0] == '\0')
            return http_reply_error(c, MHD_HTTP_FORBIDDEN, "forbidden",
                                    "writes disabled: set http_write_token");
        if (auth_check(c, h->write_token, NULL) != 0)
            return 0;
        if (h->store == NULL)
            return http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable",
                                    "writes are not available in this process");
    }
    if (params_collect(c, r) != 0)
        return 0;
    if (r->body && (c->req_body == NULL || c->req_len == 0))
        return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                "body: a JSON object is required");
    if (!r->db)
        return r->fn(c);
    return http_db_read(c, r->fn);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_data_size,
                                  void **con_cls)
{
    struct http *h = cls;
    struct request *rq = *con_cls;
    (void)version;

    struct ctx c = {.h = h, .conn = conn, .url = url};

    /* First call: headers only. Queuing a response now would make
     * libmicrohttpd close the connection after it (no keep-alive, measured
     * about 5x slower); answer on a later call. The one exception is a body
     * announced too large: refuse it before reading it (the connection
     * closes, which suits that error). */
    if (rq == NULL) {
        rq = calloc(1, sizeof *rq);
        if (rq == NULL)
            return MHD_NO;
        *con_cls = rq;
        const char *cl =
            MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        int64_t announced = 0;
        if (cl != NULL &&
            (http_parse_int64(cl, &announced) != 0 || announced > HTTP_MAX_BODY_BYTES)) {
            rq->replied = true;
            http_reply_error(&c, MHD_HTTP_CONTENT_TOO_LARGE, "payload_too_large",
                             "request body larger than %u bytes", HTTP_MAX_BODY_BYTES);
            enum MHD_Result r = send_reply(&c);
            json_decref(c.body);
            return r;
        }
        return MHD_YES;
    }

    if (*upload_data_size > 0) {
        /* Body bytes, up to the bound: kept for POST (the routes that take
         * a body), discarded otherwise. A chunked body that grows past it
         * closes the connection (libmicrohttpd takes no response while a
         * body is arriving). */
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        if (n > HTTP_MAX_BODY_BYTES - rq->body_bytes)
            return MHD_NO;
        if (strcmp(method, MHD_HTTP_METHOD_POST) == 0) {
            char *b = realloc(rq->body, rq->body_bytes + n + 1);
            if (b == NULL)
                return MHD_NO;
            memcpy(b + rq->body_bytes, upload_data, n);
            b[rq->body_bytes + n] = '\0';
            rq->body = b;
        }
        rq->body_bytes += n;
        return MHD_YES;
    }
    if (rq->replied)
        return MHD_YES;

    rq->replied = true;
    c.req_body = rq->body;
    c.req_len = rq->body != NULL ? rq->body_bytes : 0;
    dispatch(&c, method);
    enum MHD_Result r = send_reply(&c);
    json_decref(c.body);
    return r;
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void)cls;
    (void)conn;
    (void)toe;
    struct request *rq = *con_cls;
    if (rq != NULL)
        free(rq->body);
    free(rq);
    *con_cls = NULL;
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    struct http *h = cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r'))
        msg[--n] = '\0';
    /* a misbehaving client can make libmicrohttpd complain per connection */
    pthread_mutex_lock(&h->log_mu);
    log_limited(&h->log_rl, LOG_LEVEL_WARN, LOG_MOD, "libmicrohttpd: %s", msg);
    pthread_mutex_unlock(&h->log_mu);
}

/* --- public ---------------------------------------------------------------------------- */

static void http_free(struct http *h)
{
    if (h == NULL)
        return;
    if (h->mhd != NULL)
        MHD_stop_daemon(h->mhd);
    if (h->conns != NULL)
        for (unsigned i = 0; i < h->nconns; i++)
            dbconn_close(&h->conns[i]);
    free(h->conns);
    free(h->free_idx);
    free(h->read_token);
    free(h->write_token);
    if (h->sync_init) {
        pthread_cond_destroy(&h->cv);
        pthread_mutex_destroy(&h->mu);
        pthread_mutex_destroy(&h->log_mu);
    }
    free(h);
}

/* Main thread. On success *out owns the daemon, its threads and the read
 * connections until http_stop(). On failure nothing is left running. */
int http_start(const struct http_opts *opts, struct http **out, char *err, size_t errlen)
{
    struct http *h = NULL;
    struct addrinfo *ai = NULL;
    int rc = 0;
    *out = NULL;
    if (errlen > 0)
        err[0] = '\0';

    if (opts == NULL || opts->host == NULL || opts->db_path == NULL || opts->stats == NULL) {
        snprintf(err, errlen, "http: host, db_path and stats are required");
        return -EINVAL;
    }
    if (opts->threads < 1 || opts->threads > HTTP_MAX_THREADS) {
        snprintf(err, errlen, "http: threads must be in 1..%d, not %u", HTTP_MAX_THREADS,
                 opts->threads);
        return -EINVAL;
    }
    if (sqlite3_threadsafe() == 0) {
        snprintf(err, errlen, "http: SQLite is built without thread support");
        return -ENOTSUP;
    }

    h = calloc(1, sizeof *h);
    if (h == NULL) {
        rc = -ENOMEM;
        snprintf(err, errlen, "http: out of memory");
        goto fail;
    }
    h->stats = opts->stats;
    h->store = opts->store;
    h->read_token = strdup(opts->read_token != NULL ? opts->read_token : "");
    h->write_token = strdup(opts->write_token != NULL ? opts->write_token : "");
    if (h->read_token == NULL || h->write_token == NULL) {
        rc = -ENOMEM;
        snprintf(err, errlen, "http: out of memory");
        goto fail;
    }
    h->mopts.max_runs = opts->metrics_max_runs;
    h->mopts.run_max_age = opts->metrics_run_max_age > 0 ? opts->metrics_run_max_age
                                                          : HTTP_DEFAULT_METRICS_RUN_MAX_AGE;

    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0) {
        rc = -ENOMEM;
        snprintf(err, errlen, "http: pthread_condattr_init failed");
        goto fail;
    }
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int e1 = pthread_mutex_init(&h->mu, NULL);
    int e2 = e1 == 0 ? pthread_cond_init(&h->cv, &ca) : -1;
    int e3 = e2 == 0 ? pthread_mutex_init(&h->log_mu, NULL) : -1;
    pthread_condattr_destroy(&ca);
    if (e1 != 0 || e2 != 0 || e3 != 0) {
        if (e2 == 0)
            pthread_cond_destroy(&h->cv);
        if (e1 == 0)
            pthread_mutex_destroy(&h->mu);
        rc = -ENOMEM;
        snprintf(err, errlen, "http: mutex/cond init failed");
        goto fail;
    }
    h->sync_init = true;

    /* One read connection per server thread: a request never waits for one
     * unless a handler is stuck. */
    h->conns = calloc(opts->threads, sizeof *h->conns);
    h->free_idx = calloc(opts->threads, sizeof *h->free_idx);
    if (h->conns == NULL || h->free_idx == NULL) {
        rc = -ENOMEM;
        snprintf(err, errlen, "http: out of memory");
        goto fail;
    }
    h->nconns = opts->threads;
    for (unsigned i = 0; i < h->nconns; i++) {
        rc = dbconn_open(&h->conns[i], opts->db_path, err, errlen);
        if (rc != 0)
            goto fail;
        h->free_idx[h->nfree++] = i;
    }

    char port[8];
    snprintf(port, sizeof port, "%u", (unsigned)opts->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    int gai = getaddrinfo(opts->host, port, &hints, &ai);
    if (gai != 0) {
        rc = -EINVAL;
        snprintf(err, errlen, "http: bad bind address '%s': %s", opts->host, gai_strerror(gai));
        goto fail;
    }

    json_object_seed(0); /* before any server thread builds a JSON object */

    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO | MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    /* The logger goes first so that libmicrohttpd reports nothing through its
     * own. One thread is plain internal polling: libmicrohttpd complains
     * about a pool size of 1, so the option is only given for more. */
    struct MHD_OptionItem pool[] = {
        {.option = MHD_OPTION_THREAD_POOL_SIZE, .value = (intptr_t)opts->threads},
        {.option = MHD_OPTION_END},
    };
    errno = 0;
    h->mhd = MHD_start_daemon(
        flags, opts->port, NULL, NULL, on_request, h,
        MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h,
        MHD_OPTION_SOCK_ADDR, ai->ai_addr,
        MHD_OPTION_ARRAY, opts->threads > 1 ? pool : &pool[1],
        MHD_OPTION_CONNECTION_LIMIT, (unsigned)HTTP_MAX_CONNECTIONS,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)HTTP_CONNECTION_TIMEOUT_S,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)HTTP_CONNECTION_MEMORY_BYTES,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
        MHD_OPTION_END);
    if (h->mhd == NULL) {
        int e = errno;
        rc = e != 0 ? -e : -EIO;
        snprintf(err, errlen, "http: cannot listen on %s:%u%s%s", opts->host,
                 (unsigned)opts->port, e != 0 ? ": " : "", e != 0 ? strerror(e) : "");
        goto fail;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->mhd, MHD_DAEMON_INFO_BIND_PORT);
    h->port = info != NULL ? info->port : opts->port;
    freeaddrinfo(ai);
    *out = h;
    return 0;

fail:
    if (ai != NULL)
        freeaddrinfo(ai);
    http_free(h);
    return rc;
}

/* Any thread, while h is alive. */
uint16_t http_port(const struct http *h)
{
    return h != NULL ? h->port : 0;
}

/* Main thread. Waits for in-flight requests (libmicrohttpd joins its
 * threads), then closes the read connections. */
void http_stop(struct http *h)
{
    http_free(h);
}
