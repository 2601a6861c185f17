/* Alerts: the read-only handlers of /api/v1/alerts and /api/v1/alerts/{id}
 * (with the alert's history), the ALERT document, and its "silenced_by":
 * the active silences matched against the alert's label set. Every handler
 * runs inside the request's read transaction (c->dbc). */

#include "http_internal.h"

#include "alert.h"       /* pinned state and attribution numbers, and their names */
#include "detect.h"      /* severity names */
#include "page_format.h" /* PAGE_MAX_LABELS: the pager's label set */
#include "silence.h"

/* state=: names of alert states or "open" (pending or firing), repeated
 * and/or comma-separated; their union as a bit mask (bit = state number).
 * Absent: *mask = 0. Any empty or unknown item is a 400. */
static int param_states(struct ctx *c, unsigned *mask)
{
    /* the state names by number (alert_state_name), then "open" */
    const char *names[ALERT_STATE_COUNT + 1];
    for (unsigned k = 0; k < ALERT_STATE_COUNT; k++)
        names[k] = alert_state_name((enum alert_state_id)k);
    names[ALERT_STATE_COUNT] = "open";
    uint32_t given;
    int rc = http_param_enum_set(c, "state", names, ALERT_STATE_COUNT + 1, &given);
    *mask = 0;
    if (rc == 0)
        *mask =
            (given & ((1u << ALERT_STATE_COUNT) - 1)) |
            ((given >> ALERT_STATE_COUNT) & 1u ? (1u << ALERT_PENDING) | (1u << ALERT_FIRING) : 0u);
    return rc;
}

/* A UNIX time in seconds: digits with an optional fraction (no sign, no
 * exponent, no blanks). */
static int param_time(struct ctx *c, const char *name, double *out, bool *present)
{
    const char *s = http_param_get(c, name);
    *present = s != NULL;
    if (!s)
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
    if (!end || *end != '\0' || !isfinite(v)) {
        http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                         "parameter '%s' must be a UNIX time in seconds "
                         "(digits, optional fraction)",
                         name);
        return -EINVAL;
    }
    *out = v;
    return 0;
}

/* A pinned state number (alert.h) as its name in the API. */
static json_t *col_state(sqlite3_stmt *st, int i)
{
    if (sqlite3_column_type(st, i) == SQLITE_NULL)
        return json_null();
    int64_t v = sqlite3_column_int64(st, i);
    return json_string(v >= 0 && v < ALERT_STATE_COUNT ? alert_state_name((enum alert_state_id)v)
                                                       : "unknown");
}

/* ALERT object from a row of ALERT_COLUMNS. */
static json_t *alert_json(sqlite3_stmt *st)
{
    static const struct label_cols lc = {
        .layer = AC_LAYER, .head = AC_HEAD, .window = AC_WINDOW, .rank = AC_RANK};
    json_t *o = json_object();
    json_t *ev = json_object();
    if (!o || !ev) {
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
    if (!o)
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
    rc |= oset(o, "attempt", col_int(st, 8));
    rc |= oset(o, "severity", col_text(st, 9));
    if (rc != 0) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* --- silences of alerts ------------------------------------------------------------
 * "silenced_by" in ALERT documents: the ids of the active silences whose
 * matchers match the alert's label set (the one the pager sends):
 * alertname (the rule), run, severity, family, signature and attribution
 * (both the attribution), and layer, head, window, rank where the alert
 * has that scope (page_format.h, page_labels).
 *
 * The active silences are compiled once, not per request: each request
 * reads the active rows and compares them with the set in h->silences; a
 * set equal to its rows is used as it is, otherwise the request builds the
 * next one (compiling only the silences new to it) and leaves it there. */
struct active_silences {
    struct silence_set *set; /* a reference; NULL: none active */
    double now;
};

static void silences_release(struct active_silences *as)
{
    silence_set_unref(as->set);
    as->set = NULL;
}

/* Loads the active silences (at most HTTP_MAX_ACTIVE_SILENCES, oldest
 * first). Returns 0, or -1 after setting the reply. A row that does not
 * parse (written by another version, or over today's regex bounds) matches
 * nothing, with a complaint when it is compiled, not on every request. */
static int silences_load(struct ctx *c, struct active_silences *as)
{
    as->now = wall_now();
    struct silence_set *prev = silence_cache_get(&c->h->silences);
    struct silence_build b;
    silence_build_start(&b, prev, HTTP_MAX_ACTIVE_SILENCES);
    sqlite3_stmt *st = c->dbc->st[STMT_SILENCES_ACTIVE];
    sqlite3_bind_double(st, 1, as->now);
    sqlite3_bind_int(st, 2, HTTP_MAX_ACTIVE_SILENCES);
    int rc = SQLITE_DONE, brc = 0;
    while (brc >= 0 && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        const char *m = (const char *)sqlite3_column_text(st, 1);
        struct silence_row row = {
            .id = sqlite3_column_int64(st, 0),
            .starts_at = sqlite3_column_double(st, 2),
            .ends_at = sqlite3_column_double(st, 3),
            .json = m != NULL ? m : "",
            .len = m != NULL ? (size_t)sqlite3_column_bytes(st, 1) : 0,
        };
        struct fs_err why = {0};
        brc = silence_build_row(&b, &row, &why);
        if (brc == 1)
            log_limited(&c->dbc->rl, LOG_LEVEL_WARN, LOG_MOD, "silence %lld matches nothing: %s",
                        (long long)row.id, why.msg);
    }
    stmt_done(st);
    unsigned parsed = b.parsed;
    as->set = silence_build_finish(&b);
    if (parsed > 0)
        atomic_fetch_add_explicit(&c->h->stats->silence_compiles_http, parsed,
                                  memory_order_relaxed);
    if (as->set && as->set != prev)
        silence_cache_put(&c->h->silences, as->set);
    silence_set_unref(prev);
    if (brc >= 0 && rc != SQLITE_DONE) {
        silences_release(as);
        http_reply_db_error(c, "active silences", rc);
        return -1;
    }
    if (!as->set) {
        http_reply_oom(c);
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
static json_t *silenced_by_json(sqlite3_stmt *st, const struct active_silences *as)
{
    json_t *a = json_array();
    if (!a || !as || !as->set || as->set->n == 0)
        return a;
    const struct silence_set *ss = as->set;
    static const struct {
        const char *name;
        int col;
        int64_t min;
    } scopes[] = {{"layer", AC_LAYER, 0},
                  {"head", AC_HEAD, 0},
                  {"window", AC_WINDOW, 1},
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
        if (silence_matches(&ss->v[i], l, n, as->now) && aadd(a, json_integer(ss->v[i].id)) != 0) {
            json_decref(a);
            return NULL;
        }
    return a;
}

/* ALERT with "silenced_by". */
static json_t *alert_json_silenced(sqlite3_stmt *st, const struct active_silences *as)
{
    json_t *o = alert_json(st);
    if (o && oset(o, "silenced_by", silenced_by_json(st, as)) != 0) {
        json_decref(o);
        return NULL;
    }
    return o;
}

static json_t *alert_row(sqlite3_stmt *st, const void *arg)
{
    return alert_json_silenced(st, arg);
}

/* Accepted values of label= (the attribution column): alert.c's names in
 * value order with "none" last, the order a 400 lists them in. */
static void attribution_choices(const char *names[ALERT_ATTR_COUNT])
{
    for (unsigned k = 0; k < ALERT_ATTR_COUNT; k++)
        names[k] = alert_attribution_name((enum alert_attribution)((k + 1) % ALERT_ATTR_COUNT));
}

int http_alerts_list(struct ctx *c)
{
    const char *run, *severity, *label, *rule;
    unsigned states;
    int64_t layer, head, window, rank, from_step, to_step, limit, before, attempt;
    bool has_layer, has_head, has_window, has_rank, has_from, has_to, has_since, has_until,
        has_attempt;
    double since = 0, until = 0;
    const char *labels[ALERT_ATTR_COUNT];
    attribution_choices(labels);
    if (http_param_text(c, "run", false, &run) != 0 || param_states(c, &states) != 0 ||
        http_param_enum(c, "severity", detect_severity_names, DETECT_SEVERITY_CRITICAL + 1,
                        &severity) != 0 ||
        http_param_enum(c, "label", labels, ALERT_ATTR_COUNT, &label) != 0 ||
        http_param_text(c, "rule", false, &rule) != 0 ||
        http_param_int(c, "layer", 0, INT32_MAX, -1, &layer, &has_layer) != 0 ||
        http_param_int(c, "head", 0, INT32_MAX, -1, &head, &has_head) != 0 ||
        http_param_int(c, "window", 1, INT32_MAX, 0, &window, &has_window) != 0 ||
        http_param_int(c, "rank", 0, INT32_MAX, -1, &rank, &has_rank) != 0 ||
        param_time(c, "since", &since, &has_since) != 0 ||
        param_time(c, "until", &until, &has_until) != 0 ||
        http_param_int(c, "from_step", 0, INT64_MAX, 0, &from_step, &has_from) != 0 ||
        http_param_int(c, "to_step", 0, INT64_MAX, INT64_MAX, &to_step, &has_to) != 0 ||
        http_param_int(c, "attempt", 0, UINT32_MAX, 0, &attempt, &has_attempt) != 0 ||
        http_param_limit(c, &limit) != 0 || http_param_before(c, &before) != 0)
        return 0;
    if (has_since && has_until && since > until)
        return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                "parameter 'since' must not be greater than 'until'");
    if (from_step > to_step)
        return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                "parameter 'from_step' must not be greater than 'to_step'");

    int64_t run_id = 0;
    if (run && http_runs_id_by_name(c, run, &run_id) != 0)
        return 0;

    /* The index decides the statement: a state filter walks one range per
     * state (alerts_by_state, or an index on (run_id, state) with run);
     * otherwise alerts_by_run or the table itself, newest first. Other
     * filters are checked on the rows walked. */
    enum stmt_id sid = states != 0 ? (run ? STMT_ALERTS_RUN_STATE : STMT_ALERTS_STATE)
                                   : (run ? STMT_ALERTS_RUN : STMT_ALERTS_ALL);
    sqlite3_stmt *st = c->dbc->st[sid];
    if (run)
        sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_int64(st, 2, before);
    /* ALERTS_ARMS has one arm per state: a new state needs a new arm */
    _Static_assert(ALERT_STATE_COUNT == HTTP_MAX_ALERT_STATE_ARMS, "one SQL arm per state");
    static const int arm_param[HTTP_MAX_ALERT_STATE_ARMS] = {3, 4, 5, 6, 20};
    int arm = 0;
    for (unsigned k = 0; k < ALERT_STATE_COUNT && arm < HTTP_MAX_ALERT_STATE_ARMS; k++)
        if (states & (1u << k))
            sqlite3_bind_int64(st, arm_param[arm++], (int64_t)k);
    if (severity)
        sqlite3_bind_text(st, 7, severity, -1, SQLITE_STATIC);
    if (label)
        sqlite3_bind_text(st, 8, label, -1, SQLITE_STATIC);
    if (rule)
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
    if (has_attempt)
        sqlite3_bind_int64(st, 19, attempt);
    struct active_silences ss;
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
    if (!newest_first || !hist)
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
    struct active_silences ss;
    if (silences_load(c, &ss) != 0) {
        stmt_done(st);
        return 0;
    }
    json_t *alert = alert_json_silenced(st, &ss);
    silences_release(&ss);
    stmt_done(st);
    if (!alert)
        return http_reply_oom(c);

    json_t *hist = NULL;
    bool truncated = false;
    if (alert_history(c, id, &hist, &truncated) != 0) {
        json_decref(alert);
        return 0;
    }
    json_t *advice = NULL;
    bool advice_truncated = false;
    if (http_alert_advice(c, id, &advice, &advice_truncated) != 0) {
        json_decref(alert);
        json_decref(hist);
        return 0;
    }
    int e = oset(alert, "history", hist);
    e |= oset(alert, "history_truncated", json_boolean(truncated));
    e |= oset(alert, "advice", advice);
    e |= oset(alert, "advice_truncated", json_boolean(advice_truncated));
    json_t *doc = e == 0 ? json_pack("{s:o}", "alert", alert) : NULL;
    if (e != 0)
        json_decref(alert);
    return doc != NULL ? http_reply_set(c, MHD_HTTP_OK, doc) : http_reply_oom(c);
}
