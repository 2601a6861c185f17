/* The HTTP API's routing: the route table (the index of the API), path
 * matching, methods (405 with Allow), auth (401/403), query parameters
 * (collected and checked against the route's list) and dispatch to the
 * handler, inside a read transaction when the route reads. The handlers
 * are in http_ops.c, http_runs.c, http_alerts.c and http_silences.c
 * (http_internal.h lists the files). One libmicrohttpd pool thread, inside
 * one request. */

#include "http_internal.h"

#include "http_parse.h"

/* Methods a route row answers (0 in a row: GET and HEAD). */
enum { M_GET = 1, M_HEAD = 2, M_POST = 4, M_DELETE = 8 };

struct route {
    const char *pattern; /* '*' matches one non-empty path segment */
    route_fn fn;
    unsigned methods;                        /* M_*; 0 = M_GET | M_HEAD */
    bool db;                                 /* needs a read connection (and a read txn) */
    bool write;                              /* needs the write token; fn runs without a
                                                connection and takes one with http_db_read() */
    bool body;                               /* takes a JSON body (req_body) */
    bool open;                               /* no token needed, even with http_read_token */
    const char *params[HTTP_MAX_PARAMS];     /* accepted query parameters; others are 400 */
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
    for (unsigned i = 0; i < HTTP_MAX_PARAMS && col->r->params[i]; i++)
        if (strcmp(col->r->params[i], key) == 0)
            name = col->r->params[i];
    if (!name) {
        char echo[HTTP_MAX_PARAM_LEN + 1];
        snprintf(echo, sizeof echo, "%s", key);
        http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request", "unknown parameter '%s'", echo);
        col->err = -EINVAL;
        return MHD_NO;
    }
    bool repeatable = false;
    for (unsigned i = 0; i < HTTP_MAX_REPEATABLE && col->r->repeat[i]; i++)
        repeatable |= strcmp(col->r->repeat[i], name) == 0;
    if (!repeatable && http_param_get(c, name)) {
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
    if (value && strlen(value) > HTTP_MAX_PARAM_LEN) {
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

/* --- route table ----------------------------------------------------------------------
 * The API (all JSON, GET or HEAD; other methods 405 with Allow):
 *   /healthz                 {"status":"ok"}
 *   /readyz                  {"status":"ready"} | {"status":"degraded",...} (spool loss
 *                            found at start) | 503 (spool gone, not ready, storage failing,
 *                            db unreadable)
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
 *   DELETE /api/v1/runs/{run}      delete the run with all its data (write token) -> 200
 *                            {"id","status":"deleting"}; 404 unknown. Its connections are
 *                            closed; the rows go within a lifecycle pass (store_runs.c)
 *   POST /api/v1/runs/{run}/end    end it now (write token) -> 200 {"id","status":"ended"}
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

static const struct route routes[] = {
    {.pattern = "/", .fn = http_ops_dashboard, .db = false, .open = true},
    {.pattern = "/static/*", .fn = http_ops_dashboard, .db = false, .open = true},
    {.pattern = "/healthz", .fn = http_ops_healthz, .db = false, .open = true},
    {.pattern = "/readyz", .fn = http_ops_readyz, .db = true, .open = true},
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
                "since", "until", "from_step", "to_step", "limit", "after", "attempt"},
     .repeat = {"state"}},
    {.pattern = "/api/v1/alerts/*", .fn = http_alerts_get, .db = true},
    {.pattern = "/api/v1/silences",
     .fn = http_silences_list,
     .db = true,
     .params = {"state", "limit", "after"},
     .repeat = {"state"}},
    {.pattern = "/api/v1/silences",
     .fn = http_silences_create,
     .methods = M_POST,
     .write = true,
     .body = true},
    {.pattern = "/api/v1/silences/*", .fn = http_silences_get, .db = true},
    {.pattern = "/api/v1/silences/*",
     .fn = http_silences_expire,
     .methods = M_DELETE,
     .write = true},
    {.pattern = "/api/v1/runs/*/maintenance",
     .fn = http_silences_maintenance,
     .methods = M_POST,
     .write = true,
     .body = true},
    {.pattern = "/api/v1/runs/*", .fn = http_runs_delete, .methods = M_DELETE, .write = true},
    {.pattern = "/api/v1/runs/*/end", .fn = http_runs_end, .methods = M_POST, .write = true},
    {.pattern = "/metrics", .fn = http_ops_metrics, .db = true},
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
    if (hdr && strlen(hdr) <= HTTP_MAX_AUTH_HEADER && http_bearer_parse(hdr, &tok, &len) == 0) {
        /* both compared, whichever matches: the time says nothing */
        bool a = t1 != NULL && t1[0] != '\0' && http_token_equal(tok, len, t1);
        bool b = t2 != NULL && t2[0] != '\0' && http_token_equal(tok, len, t2);
        okay = a || b;
    }
    if (okay)
        return 0;
    c->www_auth = true;
    http_reply_error(c, MHD_HTTP_UNAUTHORIZED, "unauthorized",
                     !hdr ? "this endpoint needs Authorization: Bearer <token>"
                          : "the bearer token is missing, malformed or wrong");
    return -EACCES;
}

/* Routes, checks method, auth and parameters, runs the handler (inside a
 * read transaction on a checked-out connection when the route reads).
 * Sets c->status and c->body (or c->raw); returns 0. */
int http_dispatch(struct ctx *c, const char *method)
{
    const struct route *r = NULL;
    unsigned bit = method_bit(method), allowed = 0;
    bool path_known = false;
    for (size_t i = 0; i < sizeof routes / sizeof routes[0] && !r; i++) {
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
    if (!r) {
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
    if (!r->open && h->read_token[0] != '\0' && auth_check(c, h->read_token, h->write_token) != 0)
        return 0;
    if (r->write) {
        /* Before the token: no token makes an archive writable. */
        if (h->read_only)
            return http_reply_error(c, MHD_HTTP_FORBIDDEN, "read_only",
                                    "this daemon serves a read-only archive (foreshockd "
                                    "--read-only): silences are written on the live daemon");
        if (h->write_token[0] == '\0')
            return http_reply_error(c, MHD_HTTP_FORBIDDEN, "forbidden",
                                    "writes disabled: set http_write_token");
        if (auth_check(c, h->write_token, NULL) != 0)
            return 0;
        if (!h->store)
            return http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable",
                                    "writes are not available in this process");
    }
    if (params_collect(c, r) != 0)
        return 0;
    if (r->body && (!c->req_body || c->req_len == 0))
        return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                "body: a JSON object is required");
    if (!r->db)
        return r->fn(c);
    return http_db_read(c, r->fn);
}
