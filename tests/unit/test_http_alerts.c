/* HTTP API tests for alerts and incomplete reductions: a temp database with
 * every migration, alert/alert_events/incomplete rows written by the test's
 * own read-write connection from a generated fixture, the server on
 * 127.0.0.1:0, requests through libcurl checked with jansson. Expected
 * answers are computed from the same fixture in C. */

#include <criterion/criterion.h>

#include <inttypes.h>
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include <curl/curl.h>
#include <jansson.h>
#include <sqlite3.h>

#include "alert.h"
#include "fstest.h"
#include "http.h"

/* --- fixture ---------------------------------------------------------------------------------- */

#define FX_ALERTS 60
#define FX_HISTORY_ALERT 1  /* fixture index whose alert has a small history */
#define FX_LONG_ALERT 2     /* fixture index whose alert has a history beyond the bound */
#define FX_LONG_EVENTS 1005 /* > the server's bound of 1000 */

static const char *const fx_rules[] = {"qk.d2.erank", "router.maxvio", "loss"};
static const char *const fx_attrs[] = {"attention-numerics",
                                       "optimizer-hyperparameter",
                                       "combined",
                                       "router-balance",
                                       "non-finite",
                                       "loss-spike",
                                       "none"};
static const char *const fx_runs[] = {NULL, "run-a", "run-b"}; /* by run id */

struct fx_alert {
    int64_t id;
    int run; /* 1 run-a, 2 run-b */
    const char *rule;
    int state;
    const char *severity;
    const char *attribution;
    int layer, head, window, rank;
    bool has_first;
    int64_t first_breach;
    double updated_at;
};

/* Alert i (0-based) of the fixture: attributes vary independently enough
 * for every filter to select a proper, non-empty subset. ids have gaps and
 * are not in insertion order. */
static struct fx_alert fx(int i)
{
    int k = i + 1;
    return (struct fx_alert){
        .id = 3 * k + 5,
        .run = (k / 2) % 3 == 0 ? 2 : 1,
        .rule = fx_rules[(k / 5) % 3],
        .state = (k / 4) % 4,
        .severity = k % 5 == 0 ? "critical" : "warning",
        .attribution = fx_attrs[k % 7],
        .layer = k % 4 == 3 ? -1 : k % 4,
        .head = k % 2 == 1 ? k % 3 : -1,
        .window = k % 5 == 1 ? 0 : 10,
        .rank = k % 6 == 0 ? 0 : -1,
        .has_first = k % 9 != 0,
        .first_breach = 100 * k,
        .updated_at = 1000 + ((k * 37) % FX_ALERTS) * 10,
    };
}

static void exec(const char *sql)
{
    db_exec(http_fx.rw, sql);
}

static sqlite3_stmt *prep(const char *sql)
{
    return db_prep(http_fx.rw, sql);
}

static void step_done(sqlite3_stmt *st)
{
    db_step_done(http_fx.rw, st);
}

static void insert_alerts(void)
{
    sqlite3_stmt *st = prep(
        "INSERT INTO alerts(id, run_id, rule, alert_key, dedup_key, layer, head, window, rank, "
        "series_id, state, severity, family, attribution, value, median, mad, z, "
        "first_breach_step, fired_step, resolved_step, last_step, incidents, created_at, "
        "updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, "
        "?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25)");
    /* insertion order scrambled (37 is prime to 60): order is the server's work */
    for (int j = 0; j < FX_ALERTS; j++) {
        int i = (j * 37) % FX_ALERTS;
        struct fx_alert a = fx(i);
        char key[128], dedup[32];
        snprintf(key, sizeof key, "run=%s,rule=%s,i=%d", fx_runs[a.run], a.rule, i);
        snprintf(dedup, sizeof dedup, "fs-%016x", (unsigned)(0xabc000 + i));
        sqlite3_bind_int64(st, 1, a.id);
        sqlite3_bind_int64(st, 2, a.run);
        sqlite3_bind_text(st, 3, a.rule, -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 4, key, -1, SQLITE_TRANSIENT);
        sqlite3_bind_text(st, 5, dedup, -1, SQLITE_TRANSIENT);
        sqlite3_bind_int(st, 6, a.layer);
        sqlite3_bind_int(st, 7, a.head);
        sqlite3_bind_int(st, 8, a.window);
        sqlite3_bind_int(st, 9, a.rank);
        if (i % 2 == 0)
            sqlite3_bind_int64(st, 10, 1 + i % 3); /* else NULL */
        sqlite3_bind_int(st, 11, a.state);
        sqlite3_bind_text(st, 12, a.severity, -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 13, "attention_d2", -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 14, a.attribution, -1, SQLITE_STATIC);
        /* fixture 6: an infinite value; fixture 7: no median */
        sqlite3_bind_double(st, 15, i == 6 ? INFINITY : 0.5 * i);
        if (i != 7)
            sqlite3_bind_double(st, 16, (double)i);
        sqlite3_bind_double(st, 17, 0.25);
        sqlite3_bind_double(st, 18, -(double)i - 0.5);
        if (a.has_first)
            sqlite3_bind_int64(st, 19, a.first_breach);
        if (a.state == ALERT_FIRING || a.state == ALERT_RESOLVED)
            sqlite3_bind_int64(st, 20, a.first_breach + 2);
        if (a.state == ALERT_RESOLVED)
            sqlite3_bind_int64(st, 21, a.first_breach + 7);
        sqlite3_bind_int64(st, 22, a.first_breach + 9);
        sqlite3_bind_int(st, 23, i % 4);
        sqlite3_bind_double(st, 24, 500.0 + i);
        sqlite3_bind_double(st, 25, a.updated_at);
        step_done(st);
    }
    sqlite3_finalize(st);
}

/* Small history of FX_HISTORY_ALERT: inserted interleaved with another
 * alert's, with evidence that is an object, garbage, and a non-object. */
static const struct {
    const char *change;
    int from, to;
    int64_t step;
    const char *evidence; /* as stored */
    bool object;          /* parses to an object */
} fx_history[] = {
    {"to_pending", ALERT_INACTIVE, ALERT_PENDING, 120,
     "{\"value\":1.5,\"median\":3,\"mad\":0.25,\"z\":-4.05,\"labels\":{\"layer\":1}}", true},
    {"to_firing", ALERT_PENDING, ALERT_FIRING, 122, "{\"value\":1.25,\"fired_step\":122}", true},
    {"to_resolved", ALERT_FIRING, ALERT_RESOLVED, 127, "not json {", false},
    {"to_pending", ALERT_RESOLVED, ALERT_PENDING, 140, "[1,2,3]", false},
};

static void insert_history(void)
{
    sqlite3_stmt *st = prep("INSERT INTO alert_events(alert_id, change, from_state, to_state, "
                            "step, at, attribution, evidence_json) "
                            "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)");
    int64_t small = fx(FX_HISTORY_ALERT).id, other = fx(FX_HISTORY_ALERT + 3).id;
    for (size_t i = 0; i < N(fx_history); i++) {
        for (int which = 0; which < 2; which++) {
            sqlite3_bind_int64(st, 1, which == 0 ? small : other);
            sqlite3_bind_text(st, 2, fx_history[i].change, -1, SQLITE_STATIC);
            sqlite3_bind_int(st, 3, fx_history[i].from);
            sqlite3_bind_int(st, 4, fx_history[i].to);
            sqlite3_bind_int64(st, 5, fx_history[i].step + (which == 0 ? 0 : 1000));
            sqlite3_bind_double(st, 6, 700.0 + (double)i);
            sqlite3_bind_text(st, 7, "combined", -1, SQLITE_STATIC);
            sqlite3_bind_text(st, 8, which == 0 ? fx_history[i].evidence : "{}", -1, SQLITE_STATIC);
            step_done(st);
        }
    }
    int64_t longid = fx(FX_LONG_ALERT).id;
    for (int64_t s = 1; s <= FX_LONG_EVENTS; s++) {
        char ev[64];
        snprintf(ev, sizeof ev, "{\"n\":%" PRId64 "}", s);
        sqlite3_bind_int64(st, 1, longid);
        sqlite3_bind_text(st, 2, s % 2 ? "to_pending" : "to_inactive", -1, SQLITE_STATIC);
        sqlite3_bind_int(st, 3, s % 2 ? ALERT_INACTIVE : ALERT_PENDING);
        sqlite3_bind_int(st, 4, s % 2 ? ALERT_PENDING : ALERT_INACTIVE);
        sqlite3_bind_int64(st, 5, s);
        sqlite3_bind_double(st, 6, (double)s);
        sqlite3_bind_text(st, 7, "loss-spike", -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 8, ev, -1, SQLITE_TRANSIENT);
        step_done(st);
    }
    sqlite3_finalize(st);
}

/* Incomplete rows of run-a, in primary-key order (step, kind, layer, head,
 * window): 10 steps x (attention: 2 layers x 2 heads; router_gram: 2 layers). */
#define FX_INCOMPLETE 60

struct fx_incomplete {
    int64_t step;
    const char *kind;
    int layer, head, window;
};

static struct fx_incomplete fx_inc(int i)
{
    int step = i / 6, r = i % 6;
    if (r < 4)
        return (struct fx_incomplete){
            .step = step, .kind = "attention", .layer = r / 2, .head = r % 2, .window = 10};
    return (struct fx_incomplete){
        .step = step, .kind = "router_gram", .layer = r - 4, .head = -1, .window = 0};
}

static void insert_incomplete(void)
{
    sqlite3_stmt *st = prep("INSERT INTO incomplete(run_id, step, kind, layer, head, window, "
                            "have, want, recorded_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 4, ?8)");
    for (int j = 0; j < FX_INCOMPLETE; j++) {
        int i = (j * 37) % FX_INCOMPLETE;
        struct fx_incomplete x = fx_inc(i);
        sqlite3_bind_int(st, 1, 1);
        sqlite3_bind_int64(st, 2, x.step);
        sqlite3_bind_text(st, 3, x.kind, -1, SQLITE_STATIC);
        sqlite3_bind_int(st, 4, x.layer);
        sqlite3_bind_int(st, 5, x.head);
        sqlite3_bind_int(st, 6, x.window);
        sqlite3_bind_int(st, 7, i % 4);
        sqlite3_bind_double(st, 8, 5000.0 + i);
        step_done(st);
    }
    /* run-b has its own, never listed under run-a */
    exec("INSERT INTO incomplete(run_id, step, kind, layer, have, want, recorded_at) VALUES "
         "(2, 0, 'attention', 0, 1, 2, 1), (2, 5, 'router_tokens', 3, 0, 8, 2)");
    sqlite3_finalize(st);
}

static void insert_data(void)
{
    exec("BEGIN");
    exec("INSERT INTO runs(id, name, created_at, last_seen_at, world_size) VALUES "
         "(1, 'run-a', 1, 2, 2), (2, 'run-b', 3, 4, 1), (3, 'run-empty', 5, 6, 1)");
    exec("INSERT INTO series(id, run_id, name, layer, head, window, rank) VALUES "
         "(1, 1, 'qk.d2.erank', 0, 0, 10, -1), (2, 1, 'loss', -1, -1, 0, 0), "
         "(3, 2, 'router.maxvio', 1, -1, 0, -1)");
    insert_alerts();
    insert_history();
    insert_incomplete();
    exec("COMMIT");
}

static void setup(void)
{
    http_fixture_open("httpa");
    insert_data();
    http_fixture_start(2);
}

TestSuite(http_alerts, .init = setup, .fini = http_fixture_close);

/* --- alert listing: every filter against the fixture ------------------------------------------ */

enum {
    F_RUN = 1 << 0,
    F_STATE = 1 << 1,
    F_SEVERITY = 1 << 2,
    F_LABEL = 1 << 3,
    F_RULE = 1 << 4,
    F_LAYER = 1 << 5,
    F_HEAD = 1 << 6,
    F_WINDOW = 1 << 7,
    F_RANK = 1 << 8,
    F_SINCE = 1 << 9,
    F_UNTIL = 1 << 10,
    F_FROM = 1 << 11,
    F_TO = 1 << 12,
};
#define S(x) (1u << (x))
#define S_OPEN (S(ALERT_PENDING) | S(ALERT_FIRING))

struct filter {
    const char *query; /* after "/api/v1/alerts?" */
    unsigned f;        /* F_* in use */
    int run;
    unsigned states;
    const char *severity, *label, *rule;
    int layer, head, window, rank;
    double since, until;
    int64_t from, to;
};

static bool matches(const struct filter *q, const struct fx_alert *a)
{
    return (!(q->f & F_RUN) || a->run == q->run) &&
           (!(q->f & F_STATE) || (q->states & S(a->state)) != 0) &&
           (!(q->f & F_SEVERITY) || strcmp(a->severity, q->severity) == 0) &&
           (!(q->f & F_LABEL) || strcmp(a->attribution, q->label) == 0) &&
           (!(q->f & F_RULE) || strcmp(a->rule, q->rule) == 0) &&
           (!(q->f & F_LAYER) || a->layer == q->layer) &&
           (!(q->f & F_HEAD) || a->head == q->head) &&
           (!(q->f & F_WINDOW) || a->window == q->window) &&
           (!(q->f & F_RANK) || a->rank == q->rank) &&
           (!(q->f & F_SINCE) || a->updated_at >= q->since) &&
           (!(q->f & F_UNTIL) || a->updated_at <= q->until) &&
           (!(q->f & F_FROM) || (a->has_first && a->first_breach >= q->from)) &&
           (!(q->f & F_TO) || (a->has_first && a->first_breach <= q->to));
}

/* ids of the fixture alerts matching q, newest (highest id) first */
static size_t expected_ids(const struct filter *q, int64_t *ids)
{
    size_t n = 0;
    for (int i = FX_ALERTS - 1; i >= 0; i--) { /* fx(i).id grows with i */
        struct fx_alert a = fx(i);
        if (matches(q, &a))
            ids[n++] = a.id;
    }
    return n;
}

/* Pages through /api/v1/alerts?query with limit; checks every page and
 * returns the ids in the order served. */
static size_t fetch_all(const char *query, int limit, int64_t *ids, size_t cap)
{
    size_t n = 0;
    char after[64] = "";
    for (int pages = 0;; pages++) {
        cr_assert_lt(pages, 200, "%s: pagination does not end", query);
        char path[1024];
        snprintf(path, sizeof path, "/api/v1/alerts?%s%slimit=%d%s%s", query, query[0] ? "&" : "",
                 limit, after[0] ? "&after=" : "", after);
        struct resp r;
        json_t *doc = get_json(path, 200, &r);
        json_t *alerts = json_object_get(doc, "alerts");
        cr_assert(json_is_array(alerts), "%s", path);
        cr_assert_leq(json_array_size(alerts), (size_t)limit, "%s", path);
        size_t i;
        json_t *a;
        json_array_foreach(alerts, i, a)
        {
            cr_assert_lt(n, cap, "%s: more alerts than exist", path);
            ids[n++] = jint(a, "id");
        }
        json_t *next = json_object_get(doc, "next");
        if (json_is_null(next)) {
            resp_free(&r);
            break;
        }
        cr_assert(json_is_string(next), "%s: next is neither a string nor null", path);
        cr_assert_eq(json_array_size(alerts), (size_t)limit, "%s: short page with a cursor", path);
        char want[32];
        snprintf(want, sizeof want, "%" PRId64, ids[n - 1]);
        cr_assert_str_eq(json_string_value(next), want, "%s: cursor is not the last id", path);
        snprintf(after, sizeof after, "%s", json_string_value(next));
        resp_free(&r);
    }
    return n;
}

static const struct filter filters[] = {
    {.query = ""},
    {.query = "run=run-a", .f = F_RUN, .run = 1},
    {.query = "run=run-b", .f = F_RUN, .run = 2},
    {.query = "run=run-empty", .f = F_RUN, .run = 3},
    {.query = "state=firing", .f = F_STATE, .states = S(ALERT_FIRING)},
    {.query = "state=inactive", .f = F_STATE, .states = S(ALERT_INACTIVE)},
    {.query = "state=open", .f = F_STATE, .states = S_OPEN},
    {.query = "state=pending,resolved",
     .f = F_STATE,
     .states = S(ALERT_PENDING) | S(ALERT_RESOLVED)},
    {.query = "state=firing&state=inactive",
     .f = F_STATE,
     .states = S(ALERT_FIRING) | S(ALERT_INACTIVE)},
    {.query = "state=open&state=firing", .f = F_STATE, .states = S_OPEN},
    {.query = "state=inactive,pending,firing,resolved", .f = F_STATE, .states = 0xf},
    {.query = "state=open,inactive&state=resolved", .f = F_STATE, .states = 0xf},
    {.query = "run=run-a&state=open", .f = F_RUN | F_STATE, .run = 1, .states = S_OPEN},
    {.query = "run=run-b&state=resolved&severity=warning",
     .f = F_RUN | F_STATE | F_SEVERITY,
     .run = 2,
     .states = S(ALERT_RESOLVED),
     .severity = "warning"},
    {.query = "severity=critical", .f = F_SEVERITY, .severity = "critical"},
    {.query = "label=combined", .f = F_LABEL, .label = "combined"},
    {.query = "label=none", .f = F_LABEL, .label = "none"},
    {.query = "label=loss-spike&run=run-a", .f = F_LABEL | F_RUN, .label = "loss-spike", .run = 1},
    {.query = "rule=qk.d2.erank", .f = F_RULE, .rule = "qk.d2.erank"},
    {.query = "rule=nosuch", .f = F_RULE, .rule = "nosuch"},
    {.query = "layer=0", .f = F_LAYER, .layer = 0},
    {.query = "layer=2", .f = F_LAYER, .layer = 2},
    {.query = "head=1", .f = F_HEAD, .head = 1},
    {.query = "window=10", .f = F_WINDOW, .window = 10},
    {.query = "rank=0", .f = F_RANK, .rank = 0},
    {.query = "since=1200&until=1400.5", .f = F_SINCE | F_UNTIL, .since = 1200, .until = 1400.5},
    {.query = "since=1300", .f = F_SINCE, .since = 1300},
    {.query = "until=1100.0", .f = F_UNTIL, .until = 1100},
    {.query = "since=1200&until=1200", .f = F_SINCE | F_UNTIL, .since = 1200, .until = 1200},
    {.query = "from_step=1000&to_step=3000", .f = F_FROM | F_TO, .from = 1000, .to = 3000},
    {.query = "from_step=2500", .f = F_FROM, .from = 2500},
    {.query = "to_step=500", .f = F_TO, .to = 500},
    {.query = "run=run-a&state=open&severity=warning&layer=1&from_step=100",
     .f = F_RUN | F_STATE | F_SEVERITY | F_LAYER | F_FROM,
     .run = 1,
     .states = S_OPEN,
     .severity = "warning",
     .layer = 1,
     .from = 100},
    {.query = "state=firing,pending&since=1000&until=1300&rule=loss",
     .f = F_STATE | F_SINCE | F_UNTIL | F_RULE,
     .states = S_OPEN,
     .since = 1000,
     .until = 1300,
     .rule = "loss"},
    {.query = "run=run-a&head=0&window=10&label=combined",
     .f = F_RUN | F_HEAD | F_WINDOW | F_LABEL,
     .run = 1,
     .head = 0,
     .window = 10,
     .label = "combined"},
};

Test(http_alerts, every_filter_every_page_size_newest_first)
{
    static const int limits[] = {1, 3, 7, 1000};
    int nonempty = 0, proper = 0;
    for (size_t fi = 0; fi < N(filters); fi++) {
        int64_t want[FX_ALERTS];
        size_t nwant = expected_ids(&filters[fi], want);
        nonempty += nwant > 0;
        proper += nwant > 0 && nwant < FX_ALERTS;
        for (size_t li = 0; li < N(limits); li++) {
            int64_t got[FX_ALERTS];
            size_t ngot = fetch_all(filters[fi].query, limits[li], got, N(got));
            cr_assert_eq(ngot, nwant, "'%s' limit %d: %zu alerts, expected %zu", filters[fi].query,
                         limits[li], ngot, nwant);
            for (size_t k = 0; k < nwant; k++)
                cr_assert_eq(got[k], want[k],
                             "'%s' limit %d: #%zu is %" PRId64 ", expected %" PRId64,
                             filters[fi].query, limits[li], k, got[k], want[k]);
        }
    }
    /* the fixture really exercises the filters: only run-empty and
     * rule=nosuch select nothing; only three select everything */
    cr_assert_eq(nonempty, (int)N(filters) - 2);
    cr_assert_eq(proper, (int)N(filters) - 2 - 3);
}

Test(http_alerts, after_cursor_is_exclusive_upper_bound)
{
    /* a cursor that is not an existing id works too: ids below it */
    struct resp r;
    json_t *doc = get_json("/api/v1/alerts?after=50&limit=1000", 200, &r);
    json_t *alerts = json_object_get(doc, "alerts");
    size_t i;
    json_t *a;
    int64_t prev = 50;
    json_array_foreach(alerts, i, a)
    {
        cr_assert_lt(jint(a, "id"), prev);
        prev = jint(a, "id");
    }
    cr_assert_eq(json_array_size(alerts), 14); /* ids 8, 11, ..., 47 */
    cr_assert(json_is_null(json_object_get(doc, "next")));
    resp_free(&r);

    doc = get_json("/api/v1/alerts?after=0", 200, &r);
    cr_assert_eq(json_array_size(json_object_get(doc, "alerts")), 0);
    resp_free(&r);
}

/* --- alert object shape ----------------------------------------------------------------------- */

static json_t *find_alert(json_t *alerts, int64_t id)
{
    size_t i;
    json_t *a;
    json_array_foreach(alerts, i, a) if (jint(a, "id") == id) return a;
    cr_assert_fail("alert %" PRId64 " not listed", id);
    return NULL;
}

/* Checks every field of alert object o against fixture index i. */
static void check_alert(json_t *o, int i)
{
    static const char *const state_names[] = {"inactive", "pending", "firing", "resolved"};
    struct fx_alert a = fx(i);
    cr_assert_eq(jint(o, "id"), a.id);
    cr_assert_str_eq(jstr(o, "run"), fx_runs[a.run]);
    cr_assert_str_eq(jstr(o, "rule"), a.rule);
    cr_assert_str_eq(jstr(o, "state"), state_names[a.state]);
    cr_assert_str_eq(jstr(o, "severity"), a.severity);
    cr_assert_str_eq(jstr(o, "family"), "attention_d2");
    cr_assert_str_eq(jstr(o, "attribution"), a.attribution);
    char key[128], dedup[32];
    snprintf(key, sizeof key, "run=%s,rule=%s,i=%d", fx_runs[a.run], a.rule, i);
    snprintf(dedup, sizeof dedup, "fs-%016x", (unsigned)(0xabc000 + i));
    cr_assert_str_eq(jstr(o, "alert_key"), key);
    cr_assert_str_eq(jstr(o, "dedup_key"), dedup);
    cr_assert_eq(jint(o, "incidents"), i % 4);
    cr_assert_float_eq(jnum(o, "created_at"), 500.0 + i, 1e-9);
    cr_assert_float_eq(jnum(o, "updated_at"), a.updated_at, 1e-9);
    if (i % 2 == 0)
        cr_assert_eq(jint(o, "series_id"), 1 + i % 3);
    else
        cr_assert(json_is_null(json_object_get(o, "series_id")));

    json_t *labels = json_object_get(o, "labels");
    cr_assert(json_is_object(labels));
    const struct {
        const char *name;
        int v, applies;
    } lab[] = {{"layer", a.layer, a.layer >= 0},
               {"head", a.head, a.head >= 0},
               {"window", a.window, a.window > 0},
               {"rank", a.rank, a.rank >= 0}};
    size_t nlab = 0;
    for (size_t k = 0; k < N(lab); k++) {
        if (lab[k].applies) {
            cr_assert_eq(jint(labels, lab[k].name), lab[k].v, "alert %d %s", i, lab[k].name);
            nlab++;
        }
    }
    cr_assert_eq(json_object_size(labels), nlab, "alert %d: labels that do not apply", i);

    json_t *ev = json_object_get(o, "evidence");
    cr_assert(json_is_object(ev));
    cr_assert_eq(json_object_size(ev), 8);
    if (i == 6)
        cr_assert(json_is_null(json_object_get(ev, "value")), "infinite value is null");
    else
        cr_assert_float_eq(jnum(ev, "value"), 0.5 * i, 1e-12);
    if (i == 7)
        cr_assert(json_is_null(json_object_get(ev, "median")));
    else
        cr_assert_float_eq(jnum(ev, "median"), (double)i, 1e-12);
    cr_assert_float_eq(jnum(ev, "mad"), 0.25, 1e-12);
    cr_assert_float_eq(jnum(ev, "z"), -(double)i - 0.5, 1e-12);
    if (a.has_first)
        cr_assert_eq(jint(ev, "first_breach_step"), a.first_breach);
    else
        cr_assert(json_is_null(json_object_get(ev, "first_breach_step")));
    if (a.state == ALERT_FIRING || a.state == ALERT_RESOLVED)
        cr_assert_eq(jint(ev, "fired_step"), a.first_breach + 2);
    else
        cr_assert(json_is_null(json_object_get(ev, "fired_step")));
    if (a.state == ALERT_RESOLVED)
        cr_assert_eq(jint(ev, "resolved_step"), a.first_breach + 7);
    else
        cr_assert(json_is_null(json_object_get(ev, "resolved_step")));
    cr_assert_eq(jint(ev, "last_step"), a.first_breach + 9);
}

Test(http_alerts, listed_alert_objects_carry_every_field)
{
    struct resp r;
    json_t *doc = get_json("/api/v1/alerts", 200, &r);
    json_t *alerts = json_object_get(doc, "alerts");
    cr_assert_eq(json_array_size(alerts), FX_ALERTS);
    cr_assert(json_is_null(json_object_get(doc, "next")));
    for (int i = 0; i < FX_ALERTS; i++) {
        json_t *a = find_alert(alerts, fx(i).id);
        check_alert(a, i);
        cr_assert_null(json_object_get(a, "history"), "the list carries no history");
    }
    resp_free(&r);
}

/* --- alert detail ----------------------------------------------------------------------------- */

Test(http_alerts, detail_has_history_oldest_first_with_parsed_evidence)
{
    char path[64];
    snprintf(path, sizeof path, "/api/v1/alerts/%" PRId64, fx(FX_HISTORY_ALERT).id);
    struct resp r;
    json_t *doc = get_json(path, 200, &r);
    json_t *a = json_object_get(doc, "alert");
    check_alert(a, FX_HISTORY_ALERT);
    cr_assert(json_is_false(json_object_get(a, "history_truncated")));
    json_t *h = json_object_get(a, "history");
    cr_assert_eq(json_array_size(h), N(fx_history), "only this alert's events");
    int64_t prev_id = 0;
    for (size_t i = 0; i < N(fx_history); i++) {
        json_t *e = json_array_get(h, i);
        cr_assert_gt(jint(e, "id"), prev_id, "oldest first");
        prev_id = jint(e, "id");
        cr_assert_str_eq(jstr(e, "change"), fx_history[i].change);
        static const char *const names[] = {"inactive", "pending", "firing", "resolved"};
        cr_assert_str_eq(jstr(e, "from"), names[fx_history[i].from]);
        cr_assert_str_eq(jstr(e, "to"), names[fx_history[i].to]);
        cr_assert_eq(jint(e, "step"), fx_history[i].step);
        cr_assert_float_eq(jnum(e, "at"), 700.0 + (double)i, 1e-9);
        cr_assert_str_eq(jstr(e, "attribution"), "combined");
        json_t *ev = json_object_get(e, "evidence");
        if (fx_history[i].object)
            cr_assert(json_is_object(ev), "event %zu: evidence not an object", i);
        else
            cr_assert(json_is_null(ev), "event %zu: unparseable evidence is null", i);
    }
    json_t *ev0 = json_object_get(json_array_get(h, 0), "evidence");
    cr_assert_float_eq(jnum(ev0, "value"), 1.5, 1e-12);
    cr_assert_float_eq(jnum(ev0, "z"), -4.05, 1e-12);
    cr_assert_eq(jint(json_object_get(ev0, "labels"), "layer"), 1);
    resp_free(&r);

    /* an alert without events: empty history */
    snprintf(path, sizeof path, "/api/v1/alerts/%" PRId64, fx(10).id);
    doc = get_json(path, 200, &r);
    a = json_object_get(doc, "alert");
    check_alert(a, 10);
    cr_assert_eq(json_array_size(json_object_get(a, "history")), 0);
    cr_assert(json_is_false(json_object_get(a, "history_truncated")));
    resp_free(&r);
}

Test(http_alerts, detail_history_is_bounded_to_the_latest)
{
    char path[64];
    snprintf(path, sizeof path, "/api/v1/alerts/%" PRId64, fx(FX_LONG_ALERT).id);
    struct resp r;
    json_t *doc = get_json(path, 200, &r);
    json_t *a = json_object_get(doc, "alert");
    cr_assert(json_is_true(json_object_get(a, "history_truncated")));
    json_t *h = json_object_get(a, "history");
    cr_assert_eq(json_array_size(h), 1000);
    /* the latest 1000 of 1..FX_LONG_EVENTS, oldest first */
    for (size_t i = 0; i < json_array_size(h); i++) {
        json_t *e = json_array_get(h, i);
        int64_t s = (int64_t)(FX_LONG_EVENTS - 1000 + 1 + i);
        cr_assert_eq(jint(e, "step"), s);
        cr_assert_eq(jint(json_object_get(e, "evidence"), "n"), s);
        cr_assert_str_eq(jstr(e, "change"), s % 2 ? "to_pending" : "to_inactive");
    }
    resp_free(&r);

    /* exactly at the bound: not truncated */
    exec("DELETE FROM alert_events WHERE step <= 5 AND attribution = 'loss-spike'");
    doc = get_json(path, 200, &r);
    a = json_object_get(doc, "alert");
    cr_assert(json_is_false(json_object_get(a, "history_truncated")));
    cr_assert_eq(json_array_size(json_object_get(a, "history")), 1000);
    cr_assert_eq(jint(json_array_get(json_object_get(a, "history"), 0), "step"), 6);
    resp_free(&r);
}

Test(http_alerts, unknown_state_number_is_named_unknown)
{
    exec("UPDATE alerts SET state = 9 WHERE id = 8");
    struct resp r;
    json_t *doc = get_json("/api/v1/alerts/8", 200, &r);
    cr_assert_str_eq(jstr(json_object_get(doc, "alert"), "state"), "unknown");
    resp_free(&r);
    /* not selected by any state filter, still listed without one */
    doc = get_json("/api/v1/alerts?state=inactive,pending,firing,resolved", 200, &r);
    cr_assert_eq(json_array_size(json_object_get(doc, "alerts")), FX_ALERTS - 1);
    resp_free(&r);
    doc = get_json("/api/v1/alerts", 200, &r);
    cr_assert_eq(json_array_size(json_object_get(doc, "alerts")), FX_ALERTS);
    resp_free(&r);
}

/* --- attempts (rewinds): superseded, the attempt filter, a run's attempts ------------------- */

Test(http_alerts, superseded_and_attempts)
{
    int64_t a8 = fx(8).id, a9 = fx(9).id;
    char sql[512];
    /* The alerts are critical now; a8's event was stored with the warning
     * it had then, a9's without one (a row from before schema 012). */
    snprintf(sql, sizeof sql,
             "UPDATE alerts SET state = %d, severity = 'critical' WHERE id = %lld; "
             "UPDATE alerts SET severity = 'critical' WHERE id = %lld",
             ALERT_SUPERSEDED, (long long)a8, (long long)a9);
    exec(sql);
    snprintf(sql, sizeof sql,
             "INSERT INTO alert_events(alert_id, change, from_state, to_state, step, at, "
             "attribution, evidence_json, attempt, severity) VALUES (%lld, 'to_superseded', 2, "
             "4, 300, 1, 'combined', '{}', 0, 'warning'), (%lld, 'to_firing', 1, 2, 320, 2, "
             "'combined', '{}', 1, NULL)",
             (long long)a8, (long long)a9);
    exec(sql);
    exec("INSERT INTO attempts(run_id, attempt, resume_step, started_at, rebuilt_at) VALUES "
         "(1, 1, 300, 10, 11)");
    struct resp r;
    char path[128];
    snprintf(path, sizeof path, "/api/v1/alerts/%lld", (long long)a8);
    json_t *doc = get_json(path, 200, &r);
    json_t *alert = json_object_get(doc, "alert");
    cr_assert_str_eq(jstr(alert, "state"), "superseded");
    json_t *hist = json_object_get(alert, "history");
    json_t *last = json_array_get(hist, json_array_size(hist) - 1);
    cr_expect_str_eq(jstr(last, "change"), "to_superseded");
    cr_expect_str_eq(jstr(last, "to"), "superseded");
    cr_expect_eq(json_integer_value(json_object_get(last, "attempt")), 0);
    cr_expect_str_eq(jstr(last, "severity"), "warning", "the event's own severity");
    resp_free(&r);
    snprintf(path, sizeof path, "/api/v1/alerts/%lld", (long long)a9);
    doc = get_json(path, 200, &r);
    hist = json_object_get(json_object_get(doc, "alert"), "history");
    last = json_array_get(hist, json_array_size(hist) - 1);
    cr_expect_str_eq(jstr(last, "severity"), "critical", "no stored severity: the alert's");
    resp_free(&r);
    /* the fifth state arm */
    doc = get_json("/api/v1/alerts?state=superseded", 200, &r);
    json_t *list = json_object_get(doc, "alerts");
    cr_assert_eq(json_array_size(list), 1);
    cr_expect_eq(json_integer_value(json_object_get(json_array_get(list, 0), "id")), a8);
    resp_free(&r);
    doc = get_json("/api/v1/alerts?state=superseded,firing", 200, &r);
    cr_expect_gt(json_array_size(json_object_get(doc, "alerts")), 1);
    resp_free(&r);
    /* attempt: alerts with a transition in that attempt */
    doc = get_json("/api/v1/alerts?attempt=1", 200, &r);
    list = json_object_get(doc, "alerts");
    cr_assert_eq(json_array_size(list), 1);
    cr_expect_eq(json_integer_value(json_object_get(json_array_get(list, 0), "id")), a9);
    resp_free(&r);
    doc = get_json("/api/v1/alerts?attempt=0&state=superseded", 200, &r);
    cr_expect_eq(json_array_size(json_object_get(doc, "alerts")), 1);
    resp_free(&r);
    doc = get_json("/api/v1/alerts?attempt=7", 200, &r);
    cr_expect_eq(json_array_size(json_object_get(doc, "alerts")), 0);
    resp_free(&r);
    expect_error("GET", "/api/v1/alerts?attempt=-1", 400, "bad_request", "attempt");
    /* the run's attempts */
    doc = get_json("/api/v1/runs/run-a", 200, &r);
    json_t *att = json_object_get(json_object_get(doc, "run"), "attempts");
    cr_assert(json_is_array(att));
    json_t *one = NULL;
    for (size_t i = 0; i < json_array_size(att); i++)
        if (json_integer_value(json_object_get(json_array_get(att, i), "attempt")) == 1)
            one = json_array_get(att, i);
    cr_assert_not_null(one, "no attempt 1 in %s", r.body);
    cr_expect_eq(json_integer_value(json_object_get(one, "resume_step")), 300);
    cr_expect(json_is_number(json_object_get(one, "rebuilt_at")));
    resp_free(&r);
}

/* --- run detail counts ------------------------------------------------------------------------ */

Test(http_alerts, run_detail_counts_alerts_and_incomplete)
{
    static const struct {
        const char *name;
        int run;
        int64_t incomplete;
    } cases[] = {{"run-a", 1, FX_INCOMPLETE}, {"run-b", 2, 2}, {"run-empty", 3, 0}};
    for (size_t c = 0; c < N(cases); c++) {
        int64_t firing = 0, pending = 0;
        for (int i = 0; i < FX_ALERTS; i++) {
            struct fx_alert a = fx(i);
            firing += a.run == cases[c].run && a.state == ALERT_FIRING;
            pending += a.run == cases[c].run && a.state == ALERT_PENDING;
        }
        char path[64];
        snprintf(path, sizeof path, "/api/v1/runs/%s", cases[c].name);
        struct resp r;
        json_t *doc = get_json(path, 200, &r);
        json_t *run = json_object_get(doc, "run");
        cr_assert_eq(jint(run, "incomplete"), cases[c].incomplete, "%s", cases[c].name);
        json_t *al = json_object_get(run, "alerts");
        cr_assert(json_is_object(al));
        cr_assert_eq(jint(al, "firing"), firing, "%s firing", cases[c].name);
        cr_assert_eq(jint(al, "pending"), pending, "%s pending", cases[c].name);
        if (cases[c].run != 3)
            cr_assert_gt(firing + pending, 0, "fixture: %s has open alerts", cases[c].name);
        resp_free(&r);
    }
}

/* --- incomplete ------------------------------------------------------------------------------- */

Test(http_alerts, incomplete_pages_in_key_order_exactly_once)
{
    static const int limits[] = {1, 4, 6, 59, 60, 61, 1000};
    for (size_t li = 0; li < N(limits); li++) {
        char after[300] = "";
        int seen = 0;
        for (int pages = 0;; pages++) {
            cr_assert_lt(pages, 100);
            char path[512];
            snprintf(path, sizeof path, "/api/v1/runs/run-a/incomplete?limit=%d%s%s", limits[li],
                     after[0] ? "&after=" : "", after);
            struct resp r;
            json_t *doc = get_json(path, 200, &r);
            json_t *items = json_object_get(doc, "incomplete");
            cr_assert_leq(json_array_size(items), (size_t)limits[li]);
            size_t i;
            json_t *o;
            json_array_foreach(items, i, o)
            {
                cr_assert_lt(seen, FX_INCOMPLETE, "%s: too many rows", path);
                struct fx_incomplete x = fx_inc(seen);
                cr_assert_eq(json_object_size(o), 8);
                cr_assert_eq(jint(o, "step"), x.step, "%s row %d", path, seen);
                cr_assert_str_eq(jstr(o, "kind"), x.kind, "%s row %d", path, seen);
                cr_assert_eq(jint(o, "layer"), x.layer, "%s row %d", path, seen);
                if (x.head >= 0)
                    cr_assert_eq(jint(o, "head"), x.head, "%s row %d", path, seen);
                else
                    cr_assert(json_is_null(json_object_get(o, "head")));
                if (x.window > 0)
                    cr_assert_eq(jint(o, "window"), x.window);
                else
                    cr_assert(json_is_null(json_object_get(o, "window")));
                cr_assert_eq(jint(o, "have"), seen % 4);
                cr_assert_eq(jint(o, "want"), 4);
                cr_assert_float_eq(jnum(o, "recorded_at"), 5000.0 + seen, 1e-9);
                seen++;
            }
            json_t *next = json_object_get(doc, "next");
            if (json_is_null(next)) {
                resp_free(&r);
                break;
            }
            cr_assert(json_is_string(next));
            cr_assert_eq(json_array_size(items), (size_t)limits[li], "short page with a cursor");
            snprintf(after, sizeof after, "%s", json_string_value(next));
            resp_free(&r);
        }
        cr_assert_eq(seen, FX_INCOMPLETE, "limit %d: %d rows", limits[li], seen);
    }
}

Test(http_alerts, incomplete_of_other_runs)
{
    struct resp r;
    json_t *doc = get_json("/api/v1/runs/run-b/incomplete", 200, &r);
    json_t *items = json_object_get(doc, "incomplete");
    cr_assert_eq(json_array_size(items), 2);
    json_t *o = json_array_get(items, 1);
    cr_assert_eq(jint(o, "step"), 5);
    cr_assert_str_eq(jstr(o, "kind"), "router_tokens");
    cr_assert_eq(jint(o, "layer"), 3);
    cr_assert(json_is_null(json_object_get(o, "head")));
    cr_assert(json_is_null(json_object_get(o, "window")));
    cr_assert_eq(jint(o, "have"), 0);
    cr_assert_eq(jint(o, "want"), 8);
    cr_assert(json_is_null(json_object_get(doc, "next")));
    resp_free(&r);

    doc = get_json("/api/v1/runs/run-empty/incomplete", 200, &r);
    cr_assert_eq(json_array_size(json_object_get(doc, "incomplete")), 0);
    cr_assert(json_is_null(json_object_get(doc, "next")));
    resp_free(&r);

    /* a hand-made cursor resumes after that key */
    doc = get_json("/api/v1/runs/run-a/incomplete?after=9:1:1:10:attention", 200, &r);
    items = json_object_get(doc, "incomplete");
    cr_assert_eq(json_array_size(items), 2);
    cr_assert_str_eq(jstr(json_array_get(items, 0), "kind"), "router_gram");
    resp_free(&r);
}

/* --- errors ----------------------------------------------------------------------------------- */

Test(http_alerts, garbage_parameters_are_400_naming_them)
{
    static const struct {
        const char *path;
        const char *mention;
    } cases[] = {
        {"/api/v1/alerts?state=bogus", "'state'"},
        {"/api/v1/alerts?state=bogus", "inactive, pending, firing, resolved, superseded, open"},
        {"/api/v1/alerts?state=", "'state'"},
        {"/api/v1/alerts?state", "'state'"},
        {"/api/v1/alerts?state=firing,", "'state'"},
        {"/api/v1/alerts?state=,firing", "'state'"},
        {"/api/v1/alerts?state=open,x", "'state'"},
        {"/api/v1/alerts?state=firing&state=FIRING", "'state'"},
        {"/api/v1/alerts?state=firing%20", "'state'"},
        {"/api/v1/alerts?severity=fatal", "'severity'"},
        {"/api/v1/alerts?severity=fatal", "warning, critical"},
        {"/api/v1/alerts?severity=warning&severity=critical", "'severity'"},
        {"/api/v1/alerts?label=nope", "'label'"},
        {"/api/v1/alerts?label=nope", "attention-numerics"},
        {"/api/v1/alerts?label=nope", "attention-numerics, optimizer-hyperparameter, combined, "
                                      "router-balance, non-finite, loss-spike, none"},
        {"/api/v1/alerts?label=", "'label'"},
        {"/api/v1/alerts?rule=", "'rule'"},
        {"/api/v1/alerts?run=", "'run'"},
        {"/api/v1/alerts?layer=-5", "'layer'"},
        {"/api/v1/alerts?layer=abc", "'layer'"},
        {"/api/v1/alerts?head=1.5", "'head'"},
        {"/api/v1/alerts?window=0", "'window'"},
        {"/api/v1/alerts?rank=99999999999", "'rank'"},
        {"/api/v1/alerts?since=abc", "'since'"},
        {"/api/v1/alerts?since=-1", "'since'"},
        {"/api/v1/alerts?since=1e9", "'since'"},
        {"/api/v1/alerts?since=1.", "'since'"},
        {"/api/v1/alerts?since=.5", "'since'"},
        {"/api/v1/alerts?since=%201", "'since'"},
        {"/api/v1/alerts?since=inf", "'since'"},
        {"/api/v1/alerts?until=", "'until'"},
        {"/api/v1/alerts?since=10&until=5", "'since'"},
        {"/api/v1/alerts?from_step=-1", "'from_step'"},
        {"/api/v1/alerts?to_step=x", "'to_step'"},
        {"/api/v1/alerts?from_step=10&to_step=5", "'from_step'"},
        {"/api/v1/alerts?limit=0", "'limit'"},
        {"/api/v1/alerts?limit=abc", "'limit'"},
        {"/api/v1/alerts?limit=99999999999999999999", "'limit'"},
        {"/api/v1/alerts?after=zz", "'after'"},
        {"/api/v1/alerts?after=-1", "'after'"},
        {"/api/v1/alerts?x=1", "'x'"},
        {"/api/v1/alerts/abc", "'id'"},
        {"/api/v1/alerts/0", "'id'"},
        {"/api/v1/alerts/-1", "'id'"},
        {"/api/v1/alerts/1x", "'id'"},
        {"/api/v1/alerts/99999999999999999999", "'id'"},
        {"/api/v1/alerts/8?x=1", "'x'"},
        {"/api/v1/runs/run-a/incomplete?limit=0", "'limit'"},
        {"/api/v1/runs/run-a/incomplete?after=zz", "'after'"},
        {"/api/v1/runs/run-a/incomplete?after=1:2:3", "'after'"},
        {"/api/v1/runs/run-a/incomplete?after=1:2:3:4:", "'after'"},
        {"/api/v1/runs/run-a/incomplete?after=a:0:0:0:attention", "'after'"},
        {"/api/v1/runs/run-a/incomplete?after=1:0:0:x:attention", "'after'"},
        {"/api/v1/runs/run-a/incomplete?after=", "'after'"},
        {"/api/v1/runs/run-a/incomplete?state=open", "'state'"},
    };
    for (size_t i = 0; i < N(cases); i++)
        expect_error(NULL, cases[i].path, 400, "bad_request", cases[i].mention);

    /* a state filter repeated past the bound on stored query values */
    char path[1024];
    int n = snprintf(path, sizeof path, "/api/v1/alerts?state=open");
    for (int i = 0; i < 40; i++)
        n += snprintf(path + n, sizeof path - (size_t)n, "&state=open");
    expect_error(NULL, path, 400, "bad_request", "query parameters");
}

Test(http_alerts, not_found)
{
    static const struct {
        const char *path;
        const char *mention;
    } cases[] = {
        {"/api/v1/alerts?run=nosuch", "nosuch"},
        {"/api/v1/alerts?run=nosuch&state=open", "nosuch"},
        {"/api/v1/alerts/999999", "999999"},
        {"/api/v1/alerts/8/history", NULL},
        {"/api/v1/alerts/", NULL},
        {"/api/v1/runs/nosuch/incomplete", "nosuch"},
        {"/api/v1/runs/run-a/incomplete/1", NULL},
    };
    for (size_t i = 0; i < N(cases); i++)
        expect_error(NULL, cases[i].path, 404, "not_found", cases[i].mention);
}

Test(http_alerts, other_methods_are_405)
{
    static const char *const paths[] = {"/api/v1/alerts", "/api/v1/alerts/8",
                                        "/api/v1/runs/run-a/incomplete"};
    for (size_t i = 0; i < N(paths); i++) {
        expect_error("POST", paths[i], 405, "method_not_allowed", "GET");
        expect_error("DELETE", paths[i], 405, "method_not_allowed", "GET");
    }
}

/* --- silenced_by: each silence compiled once ----------------------------------------------------
 */

static void insert_silence(int64_t id, const char *matchers)
{
    sqlite3_stmt *st = prep("INSERT INTO silences(id, matchers_json, starts_at, ends_at, "
                            "created_by, comment, created_at, updated_at) "
                            "VALUES (?1, ?2, 0, 4e9, 't', '', 0, 0)");
    sqlite3_bind_int64(st, 1, id);
    sqlite3_bind_text(st, 2, matchers, -1, SQLITE_STATIC);
    step_done(st);
    sqlite3_finalize(st);
}

/* The silences of the fixture: which alerts each holds. S_HOSTILE was
 * stored by the glibc version (8.5 s and 8 GB to compile there; a syntax
 * error to PCRE2): it matches nothing. */
#define S_QK 11      /* run-a, alertname =~ qk\..* */
#define S_HOSTILE 12 /* alertname = loss, run =~ a{1,1000}{1,1000} */
#define S_CRIT_B 13  /* run-b, severity !~ warn.* */
#define S_LOSS 14    /* alertname =~ loss|nothing */

static bool silence_holds(int64_t sid, const struct fx_alert *a)
{
    switch (sid) {
    case S_QK:
        return a->run == 1 && strncmp(a->rule, "qk.", 3) == 0;
    case S_CRIT_B:
        return a->run == 2 && strcmp(a->severity, "critical") == 0;
    case S_LOSS:
        return strcmp(a->rule, "loss") == 0;
    default:
        return false;
    }
}

/* GET /api/v1/alerts: every alert's silenced_by is the live silences of
 * live[0..n) (ascending) that hold it. */
static void expect_silenced_by(const int64_t *live, size_t n)
{
    struct resp r;
    json_t *alerts = json_object_get(get_json("/api/v1/alerts", 200, &r), "alerts");
    cr_assert_eq(json_array_size(alerts), FX_ALERTS);
    size_t silenced = 0;
    for (int i = 0; i < FX_ALERTS; i++) {
        struct fx_alert a = fx(i);
        json_t *by = json_object_get(find_alert(alerts, a.id), "silenced_by");
        size_t k = 0;
        for (size_t j = 0; j < n; j++) {
            if (!silence_holds(live[j], &a))
                continue;
            cr_assert_eq(json_integer_value(json_array_get(by, k)), live[j], "alert %" PRId64,
                         a.id);
            k++;
        }
        cr_assert_eq(json_array_size(by), k, "alert %" PRId64, a.id);
        silenced += k > 0;
    }
    cr_assert_gt(silenced, 0u);
    resp_free(&r);
}

static uint64_t compiles(void)
{
    return atomic_load(&http_fx.stats.silence_compiles_http);
}

Test(http_alerts, silenced_by_compiles_each_silence_once)
{
    insert_silence(S_QK, "[{\"name\":\"run\",\"value\":\"run-a\"},"
                         "{\"name\":\"alertname\",\"value\":\"qk\\\\..*\",\"isRegex\":true}]");
    insert_silence(S_HOSTILE, "[{\"name\":\"alertname\",\"value\":\"loss\"},"
                              "{\"name\":\"run\",\"value\":\"a{1,1000}{1,1000}\","
                              "\"isRegex\":true}]");
    insert_silence(S_CRIT_B, "[{\"name\":\"run\",\"value\":\"run-b\"},"
                             "{\"name\":\"severity\",\"value\":\"warn.*\",\"isRegex\":true,"
                             "\"isEqual\":false}]");
    cr_assert_eq(compiles(), 0u);
    const int64_t three[] = {S_QK, S_HOSTILE, S_CRIT_B};
    expect_silenced_by(three, N(three));
    cr_expect_eq(compiles(), 3u, "the first request compiles each silence");
    expect_silenced_by(three, N(three));
    struct resp r;
    char path[64];
    snprintf(path, sizeof path, "/api/v1/alerts/%" PRId64, fx(0).id);
    get_json(path, 200, &r);
    resp_free(&r);
    cr_expect_eq(compiles(), 3u, "nothing changed: nothing compiled");

    /* a new silence: only it is compiled */
    insert_silence(S_LOSS, "[{\"name\":\"alertname\",\"value\":\"loss|nothing\","
                           "\"isRegex\":true}]");
    const int64_t four[] = {S_QK, S_HOSTILE, S_CRIT_B, S_LOSS};
    expect_silenced_by(four, N(four));
    cr_expect_eq(compiles(), 4u);

    /* an expiry: nothing to compile */
    exec("UPDATE silences SET ends_at = 1 WHERE id = 11");
    const int64_t after[] = {S_HOSTILE, S_CRIT_B, S_LOSS};
    expect_silenced_by(after, N(after));
    expect_silenced_by(after, N(after));
    cr_expect_eq(compiles(), 4u);
}
