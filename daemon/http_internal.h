#ifndef FORESHOCK_HTTP_INTERNAL_H
#define FORESHOCK_HTTP_INTERNAL_H

/* What the files of the HTTP API share; not for use outside fs_http
 * (http.h is the public API). The files:
 *   http.c           server lifecycle, read-connection pool, the request state
 *                    machine (libmicrohttpd callbacks) and sending the reply
 *   http_routes.c    the route table (the API index), path matching, methods,
 *                    auth, query parameters, dispatch to the handler
 *   http_ops.c       the small routes: /healthz, /readyz, /metrics, dashboard
 *   http_sql.c       the SQL of every prepared statement
 *   http_reply.c     replies (JSON, raw, errors), keyset pages, shared JSON builders
 *   http_params.c    query parameters: lookup and strict parsing into 400s
 *   http_runs.c      runs, series, points, incomplete
 *   http_alerts.c    alerts, alert history, silenced_by
 *   http_silences.c  the silences API and maintenance (the write path)
 *   http_write.c     writes parked off the server threads until the writer
 *                    settles them (suspend, wait, resume)
 * Here: the limits, prepared-statement ids and the columns they select,
 * the server state (struct http), the per-request state (struct ctx), small
 * inline JSON/column helpers, and what each file offers the others.
 *
 * Threads: unless a comment says otherwise, everything here runs on one
 * libmicrohttpd pool thread, inside one request: struct ctx lives on that
 * thread's stack, and c->dbc is the read connection it has checked out. */

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>
#include <microhttpd.h>
#include <sqlite3.h>

#include "dashboard.h"
#include "fs_clock.h"
#include "fs_limits.h"
#include "http.h"
#include "log.h"
#include "metrics.h"
#include "ranks.h"
#include "schema.h"
#include "silence_set.h"

/* --- limits ---------------------------------------------------------------- */
#define HTTP_CONNECTION_TIMEOUT_S 10u /* idle connections (silent or keep-alive) closed after */
#define HTTP_CONNECTION_MEMORY_BYTES (32u * 1024u) /* per connection: request line + headers */
/* Request bodies: POST bodies are kept up to this (routes that take one
 * parse them as JSON), others are read and discarded up to it. A larger
 * Content-Length gets 413 before the body is read; a chunked body that grows
 * past it closes the connection. */
#define HTTP_MAX_BODY_BYTES (16u * 1024u)
#define HTTP_WRITE_WAIT_MS 10000u       /* a write's wait for the writer's commit; then 503 */
#define HTTP_WRITE_STOP_ANSWER_MS 2000u /* at stop: resumed writes' time to be answered */
/* active silences matched against alerts: as many as the pager holds */
#define HTTP_MAX_ACTIVE_SILENCES FS_STORE_MAX_LIVE_SILENCES
#define HTTP_MAX_AUTH_HEADER 1024u       /* Authorization header bytes looked at */
#define HTTP_MAX_PARAM_LEN 256u          /* bytes of one query value or path segment */
#define HTTP_MAX_PARAMS 16u              /* query parameters accepted by one route */
#define HTTP_MAX_CAPTURES 2u             /* '*' segments in one route pattern */
#define HTTP_DB_BUSY_TIMEOUT_MS 5000     /* sqlite3_busy_timeout on read connections */
#define HTTP_DB_CHECKOUT_TIMEOUT_MS 5000 /* waiting for a free read connection; then 503 */
#define HTTP_MAX_MODEL_JSON_BYTES                                                                  \
    (64u * 1024u)                     /* runs.model_json larger than this is shown as null */
#define HTTP_MAX_STREAMS_DETAIL 65536 /* streams listed in /runs/{run}; "streams" has the count */
#define HTTP_MAX_URL_ECHO 128u        /* bytes of a path echoed in a 404 message */
#define HTTP_MAX_QUERY_VALUES 32u     /* query values kept per request, repeats included */
#define HTTP_MAX_REPEATABLE 2u        /* parameters of one route that may be repeated */
#define HTTP_MAX_ALERT_HISTORY 1000   /* latest transitions shown in /alerts/{id} */
#define HTTP_MAX_ALERT_ADVICE 4096    /* advice deliveries shown in /alerts/{id}, latest */
#define HTTP_MAX_EVIDENCE_JSON_BYTES 4096u /* alert_events.evidence_json larger: shown as null */
#define HTTP_MAX_ALERT_STATE_ARMS 5        /* one index range per state in a state filter */
#define HTTP_MAX_ATTEMPTS 65536            /* attempts listed in /runs/{run} */

#define LOG_MOD "http"

/* --- prepared statements, cached per read connection (SQL: http_sql.c) ------------- */

enum stmt_id {
    STMT_BEGIN,
    STMT_COMMIT,
    STMT_ROLLBACK,
    STMT_READY,
    STMT_RUNS_PAGE,
    STMT_RUN_BY_NAME,
    STMT_RUN_STREAMS,
    STMT_RUN_ID,
    STMT_RUN_ATTEMPTS,
    STMT_SERIES_BY_NAME,
    STMT_SERIES_FILTER,
    STMT_SERIES_ONE,
    STMT_POINTS_PAGE,
    STMT_POINTS_SPAN,
    STMT_POINTS_BUCKETS,
    STMT_RUN_COUNTS,
    STMT_ALERTS_ALL,
    STMT_ALERTS_RUN,
    STMT_ALERTS_STATE,
    STMT_ALERTS_RUN_STATE,
    STMT_ALERT_ONE,
    STMT_ALERT_HISTORY,
    STMT_ALERT_ADVICE,
    STMT_INCOMPLETE_FIRST,
    STMT_INCOMPLETE_AFTER,
    STMT_SILENCE_ONE,
    STMT_SILENCES_PAGE,
    STMT_SILENCES_ACTIVE,
    STMT__COUNT
};

/* Column lists selected first by several statements, each with its column
 * positions right below it (keep the two in step). */
#define RUN_COLUMNS                                                                                \
    "r.id, r.name, r.created_at, r.last_seen_at, r.world_size, r.detect_from_step, "               \
    "r.last_step, r.reports, r.model_json, "                                                       \
    "(SELECT count(*) FROM streams s WHERE s.run_id = r.id), "                                     \
    "(SELECT count(*) FROM series x WHERE x.run_id = r.id), " SCHEMA_RUN_LOCAL_RANKS_SQL("r.id")

#define SERIES_COLUMNS                                                                             \
    "s.id, s.name, s.layer, s.head, s.\"window\", s.rank, s.points, s.first_step, "                \
    "s.last_step"

/* Column positions shared by every statement that selects RUN_COLUMNS or
 * SERIES_COLUMNS first. */
enum {
    RC_ID,
    RC_NAME,
    RC_CREATED,
    RC_SEEN,
    RC_WORLD,
    RC_DETECT,
    RC_LAST_STEP,
    RC_REPORTS,
    RC_MODEL,
    RC_STREAMS,
    RC_SERIES,
    RC_LOCAL
};
enum {
    SC_ID,
    SC_NAME,
    SC_LAYER,
    SC_HEAD,
    SC_WINDOW,
    SC_RANK,
    SC_POINTS,
    SC_FIRST,
    SC_LAST,
    SC_RUN_NAME
};

#define ALERT_COLUMNS                                                                              \
    "a.id, r.name, a.rule, a.state, a.severity, a.family, a.attribution, a.layer, "                \
    "a.head, a.\"window\", a.rank, a.dedup_key, a.alert_key, a.value, a.median, a.mad, "           \
    "a.z, a.first_breach_step, a.fired_step, a.resolved_step, a.last_step, a.incidents, "          \
    "a.created_at, a.updated_at, a.series_id"

enum {
    AC_ID,
    AC_RUN,
    AC_RULE,
    AC_STATE,
    AC_SEVERITY,
    AC_FAMILY,
    AC_ATTRIBUTION,
    AC_LAYER,
    AC_HEAD,
    AC_WINDOW,
    AC_RANK,
    AC_DEDUP,
    AC_KEY,
    AC_VALUE,
    AC_MEDIAN,
    AC_MAD,
    AC_Z,
    AC_FIRST_BREACH,
    AC_FIRED,
    AC_RESOLVED,
    AC_LAST_STEP,
    AC_INCIDENTS,
    AC_CREATED,
    AC_UPDATED,
    AC_SERIES
};

#define SILENCE_COLUMNS                                                                            \
    "id, matchers_json, starts_at, ends_at, created_by, comment, created_at, updated_at"
enum { SLC_ID, SLC_MATCHERS, SLC_STARTS, SLC_ENDS, SLC_BY, SLC_COMMENT, SLC_CREATED, SLC_UPDATED };

#define INCOMPLETE_COLUMNS "step, kind, layer, head, \"window\", have, want, recorded_at"
enum { IC_STEP, IC_KIND, IC_LAYER, IC_HEAD, IC_WINDOW, IC_HAVE, IC_WANT, IC_RECORDED };

/* --- server state --------------------------------------------------------------------- */

struct http_write;

/* Writes waiting for the writer's outcome with their connection suspended,
 * oldest first, and the thread that waits for them (http_write.c). */
struct http_writes {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct http_write *head, *tail; /* under mu: waiting for their outcome, oldest first */
    unsigned parked;                /* under mu: parked and not yet answered or closed */
    bool stop;                      /* under mu: park no more; the thread drains and exits */
    bool started, joined;           /* main thread only */
    pthread_t thread;
};

struct dbconn {
    sqlite3 *db;
    sqlite3_stmt *st[STMT__COUNT];
    /* complaints about this connection; used only by the thread that has
     * it checked out (the pool mutex orders the hand-overs) */
    struct log_ratelimit rl;
};

struct http {
    struct MHD_Daemon *mhd;
    uint16_t port;
    struct fs_stats *stats;

    /* Read-connection pool: free[0..nfree) are indices into conns. */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned nconns;
    unsigned nfree;
    struct dbconn *conns;
    unsigned *free_idx;
    bool sync_init; /* mu, cv and log_mu initialised */

    /* libmicrohttpd's own messages arrive on any of its threads */
    pthread_mutex_t log_mu;
    struct log_ratelimit log_rl;
    char mhd_last[256]; /* its last message, under log_mu: why a start failed */

    /* The active silences, compiled, as the last handler that read them
     * left them (http_alerts.c): its own mutex, any handler thread. Set up
     * with mu (sync_init). */
    struct silence_cache silences;

    /* writes and auth (read-only once started) */
    struct store *store;
    bool read_only;           /* serving an archive: write routes answer 403 read_only */
    char *read_token;         /* "" = reads need no token */
    char *write_token;        /* "" = writes disabled */
    char *tls_cert, *tls_key; /* HTTPS: PEM text libmicrohttpd reads until it stops */
    struct metrics_opts mopts;
    struct http_writes writes; /* set up with mu (sync_init) */
};

/* --- per-request state -------------------------------------------------------- */

struct param {
    const char *name;
    const char *value; /* NULL: absent */
};

struct ctx {
    struct http *h;
    struct MHD_Connection *conn;
    struct dbconn *dbc;
    const char *url;

    /* captured path segments, NUL-terminated copies */
    char cap[HTTP_MAX_CAPTURES][HTTP_MAX_PARAM_LEN + 1];
    unsigned ncap;

    struct param params[HTTP_MAX_QUERY_VALUES]; /* a repeated parameter: one entry each */
    unsigned nparams;

    /* the request body (POST), NUL-terminated; NULL when none */
    const char *req_body;
    size_t req_len;

    /* the reply: a JSON body, or raw bytes with their content type */
    unsigned status;
    json_t *body;
    char allow[64];  /* Allow header (405); "" = none */
    bool www_auth;   /* WWW-Authenticate: Bearer (401) */
    const void *raw; /* raw reply bytes, when set */
    size_t raw_len;
    bool raw_owned;           /* raw is malloc'd and freed with the response */
    const char *content_type; /* of raw (a static string) */

    /* a write handed to the writer (http_write_submit): set instead of a
     * reply, the request is answered once the writer has settled it */
    struct http_write *write;
    /* a write's outcome, for the read that answers it */
    int64_t wid;
    unsigned wstatus;
    /* a dashboard file (/, /static/NAME): sent with its ETag instead of body */
    const struct dashboard_file *dash;
    struct dashboard_file dash_file;
};

/* Sets the reply (status and body) in c; returns 0. */
typedef int (*route_fn)(struct ctx *c);

/* --- small helpers (inline: every file uses them) ----------------------------------- */

/* A JSON string of s; bytes that are not valid UTF-8 become '?' so that
 * whatever the database or the URL holds, the document stays valid. */
static inline json_t *jstr_n(const char *s, size_t n)
{
    json_t *v = json_stringn(s, n);
    if (v)
        return v;
    char *copy = malloc(n + 1);
    if (!copy)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        copy[i] = (ch == 0 || ch >= 0x80) ? '?' : (char)ch;
    }
    v = json_stringn(copy, n);
    free(copy);
    return v;
}

static inline json_t *jstr(const char *s)
{
    return jstr_n(s, strlen(s));
}

/* json_object_set_new / json_array_append_new consume v even on failure; a
 * NULL v (failed allocation) is reported the same way. */
static inline int oset(json_t *o, const char *key, json_t *v)
{
    if (!v)
        return -ENOMEM;
    return json_object_set_new(o, key, v) == 0 ? 0 : -ENOMEM;
}

static inline int aadd(json_t *a, json_t *v)
{
    if (!v)
        return -ENOMEM;
    return json_array_append_new(a, v) == 0 ? 0 : -ENOMEM;
}

/* Doubles: NULL, NaN and +-Inf all become JSON null (JSON has no NaN). */
static inline json_t *jreal_or_null(double x)
{
    return isfinite(x) ? json_real(x) : json_null();
}

static inline json_t *col_real(sqlite3_stmt *st, int i)
{
    if (sqlite3_column_type(st, i) == SQLITE_NULL)
        return json_null();
    return jreal_or_null(sqlite3_column_double(st, i));
}

static inline json_t *col_int(sqlite3_stmt *st, int i)
{
    if (sqlite3_column_type(st, i) == SQLITE_NULL)
        return json_null();
    return json_integer((json_int_t)sqlite3_column_int64(st, i));
}

static inline json_t *col_text(sqlite3_stmt *st, int i)
{
    const unsigned char *s = sqlite3_column_text(st, i);
    if (!s)
        return sqlite3_column_type(st, i) == SQLITE_NULL ? json_null() : NULL;
    return jstr_n((const char *)s, (size_t)sqlite3_column_bytes(st, i));
}

static inline void stmt_done(sqlite3_stmt *st)
{
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
}

/* Wall-clock time, UNIX seconds. Any thread. */
static inline double wall_now(void)
{
    return fs_clock_unix();
}

/* --- http_sql.c ---------------------------------------------------------------------- */

/* The SQL of statement id, a static string. Any thread. */
const char *http_stmt_sql(enum stmt_id id);

/* --- http_reply.c: replies and JSON builders -------------------------------------------
 * A handler sets exactly one reply in c (a later one replaces an earlier
 * one); send_reply (http.c) sends it. */

/* Sets the reply to status and a JSON body; takes body (NULL: the reply
 * becomes a static 500 document). Drops any earlier reply. Returns 0. */
int http_reply_set(struct ctx *c, unsigned status, json_t *body);

/* Raw bytes with a content type (a reply that is not JSON: /metrics, the
 * dashboard's files). owned: data is malloc'd and the response frees it;
 * otherwise it must outlive the response (static). content_type is a
 * static string. Returns 0. */
int http_reply_raw(struct ctx *c, unsigned status, const char *content_type, const void *data,
                   size_t len, bool owned);

/* {"error":{"code":code,"message":printf(fmt, ...)}} with status. Returns 0. */
int http_reply_error(struct ctx *c, unsigned status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* 500 "out of memory". Returns 0. */
int http_reply_oom(struct ctx *c);

/* A SQLite failure rc while doing `what`: logged with detail (rate-limited
 * on c->dbc), answered without it (503 when busy or locked, else 500).
 * Needs a checked-out connection. Returns 0. */
int http_reply_db_error(struct ctx *c, const char *what, int rc);

/* Builds one JSON item from the current row; NULL on allocation failure. */
typedef json_t *(*row_fn)(sqlite3_stmt *st, const void *arg);

/* Steps st (bound with LIMIT limit + 1) into a keyset page of up to limit
 * items fn(st, arg), "next" = column id_col of the last item when one more
 * row exists; sets the reply to {key: [...], "next": ...} (or an error,
 * naming `what` in the log). Resets st. Returns 0. */
int http_reply_page(struct ctx *c, sqlite3_stmt *st, int64_t limit, int id_col, row_fn fn,
                    const void *arg, const char *key, const char *what);

/* Document {"<key>": items, "next": next}; takes items and next (also on
 * failure, which returns NULL). */
json_t *http_page_doc(const char *key, json_t *items, json_t *next);

/* Column i holding a JSON object written by the daemon: a new reference to
 * the parsed object, or JSON null when it is NULL, longer than max bytes,
 * not JSON or not an object. */
json_t *http_col_json_object(sqlite3_stmt *st, int i, size_t max);

/* Columns of the four labels in a row: layer, head, window, rank. */
struct label_cols {
    int layer, head, window, rank;
};

/* A new {"layer":..,"head":..,"window":..,"rank":..} of the current row,
 * with only the labels that apply (-1 and window 0 mean "none"); NULL on
 * allocation failure. */
json_t *http_labels_json(sqlite3_stmt *st, const struct label_cols *lc);

/* --- http_params.c: query parameters ---------------------------------------------------
 * The parameters were collected and checked against the route's list by
 * http_dispatch (http_routes.c). The http_param_* readers set a 400 reply
 * naming the parameter and return -EINVAL on garbage; the caller then
 * returns 0. */

/* The value of parameter name (its first one), or NULL when absent. The
 * string belongs to libmicrohttpd and lives as long as the request. */
const char *http_param_get(const struct ctx *c, const char *name);

/* Strict integer: optional '-', then digits only, no blanks, no '+'.
 * Returns 0, -EINVAL or -ERANGE. Any thread; sets no reply. */
int http_parse_int64(const char *s, int64_t *out);

/* Integer parameter in [min, max]; absent: *out = def and *present = false
 * (present may be NULL). */
int http_param_int(struct ctx *c, const char *name, int64_t min, int64_t max, int64_t def,
                   int64_t *out, bool *present);

/* ?limit=1..HTTP_MAX_LIMIT, HTTP_DEFAULT_LIMIT when absent. */
int http_param_limit(struct ctx *c, int64_t *out);

/* Oldest-first keyset cursor ?after= (the last id of the previous page);
 * absent: 0. */
int http_param_after(struct ctx *c, int64_t *out);

/* Newest-first keyset cursor ?after=; absent: INT64_MAX (no upper bound). */
int http_param_before(struct ctx *c, int64_t *out);

/* A text parameter; empty is garbage. Absent: *out = NULL, or a 400 when
 * required. */
int http_param_text(struct ctx *c, const char *name, bool required, const char **out);

/* A text parameter that must be one of names[0..n). Absent: *out = NULL. */
int http_param_enum(struct ctx *c, const char *name, const char *const *names, size_t n,
                    const char **out);

/* A parameter that may repeat and hold comma-separated values, each one of
 * names[0..n) (n <= 32): sets bit i of *set for each names[i] given; 0 when
 * the parameter is absent. Anything else is a 400 naming the choices. */
int http_param_enum_set(struct ctx *c, const char *name, const char *const *names, size_t n,
                        uint32_t *set);

/* Writes "a, b, c" of names[0..n) into buf (len bytes, truncated), for
 * messages. Any thread. */
void http_join_names(const char *const *names, size_t n, char *buf, size_t len);

/* --- http.c ---------------------------------------------------------------------------- */

/* Checks out a read connection and runs fn inside one read transaction
 * (every statement sees the same committed snapshot); the connection goes
 * back before it returns. For routes that read after they write. Sets the
 * reply; returns 0. */
int http_db_read(struct ctx *c, route_fn fn);

/* --- http_routes.c ---------------------------------------------------------------------- */

/* Routes c->url, checks method, auth and parameters, runs the handler
 * (inside a read transaction on a checked-out connection when the route
 * reads). Sets c->status and c->body (or c->raw, or c->dash); returns 0. */
int http_dispatch(struct ctx *c, const char *method);

/* --- http_write.c: writes that do not park a server thread -------------------------------- */

/* A write route's second half, on a server thread once the outcome is known:
 * rc is store_waiter_wait's (0 with id, -ENOENT, -EALREADY, -ENOSPC, -EIO,
 * -ECANCELED or -ETIMEDOUT), arg the route's own value. Sets the reply in c
 * (no connection is checked out; http_db_read takes one). Returns 0. */
typedef int (*http_write_done_fn)(struct ctx *c, int rc, int64_t id, int64_t arg);

struct store_item;

/* Main thread: sets q up and starts its thread. 0 or a negative errno. */
int http_writes_init(struct http_writes *q);
/* Main thread, before MHD_stop_daemon: parks no more writes, waits for the
 * queued ones (each until its deadline), resumes their connections and
 * joins the thread. Idempotent. */
void http_writes_stop(struct http_writes *q);
/* Main thread, after MHD_stop_daemon: stops (if needed) and frees q. */
void http_writes_destroy(struct http_writes *q);

/* Hands a STORE_ITEM_SILENCE or STORE_ITEM_RUN item (consumed) to the writer with a waiter for
 * its outcome; on success sets c->write (done(c, ...) answers the request
 * later) and returns 0. Otherwise sets the reply (500, or 503 when the
 * writer takes nothing more) and returns a negative code. */
int http_write_submit(struct ctx *c, struct store_item *it, http_write_done_fn done, int64_t arg);

/* Suspends conn and queues w for the waiter thread, which resumes conn once
 * w is settled; true when parked. False (stopping): nothing done, the
 * caller answers with http_write_finish, which then waits. */
bool http_write_park(struct http_writes *q, struct MHD_Connection *conn, struct http_write *w);

/* Sets the reply through w's done function (waiting for the outcome first
 * when w was not parked). Returns 0. */
int http_write_finish(struct ctx *c, struct http_write *w);

/* Frees w once its reply is queued, or its connection closed unanswered.
 * NULL is a no-op. */
void http_write_free(struct http_write *w);

/* --- handlers (route_fn, named in routes[] in http_routes.c) ---------------------------
 * Each sets the reply in c and returns 0. Those of routes with .db run
 * inside a read transaction on c->dbc. */

/* http_ops.c */
int http_ops_healthz(struct ctx *c);   /* /healthz */
int http_ops_readyz(struct ctx *c);    /* /readyz */
int http_ops_metrics(struct ctx *c);   /* /metrics */
int http_ops_dashboard(struct ctx *c); /* / and /static/NAME (no connection) */

/* http_runs.c */
int http_runs_list(struct ctx *c);       /* /api/v1/runs */
int http_runs_get(struct ctx *c);        /* /api/v1/runs/{name} */
int http_runs_series(struct ctx *c);     /* /api/v1/series */
int http_runs_points(struct ctx *c);     /* /api/v1/series/{id}/points */
int http_runs_incomplete(struct ctx *c); /* /api/v1/runs/{name}/incomplete */

/* The id of the run called name. Returns 0, or a negative code with the
 * reply set (404 for an unknown run). */
int http_runs_id_by_name(struct ctx *c, const char *name, int64_t *out);

/* http_alerts.c */
int http_alerts_list(struct ctx *c); /* /api/v1/alerts */
int http_alerts_get(struct ctx *c);  /* /api/v1/alerts/{id} */

/* http_advice.c: the advices of alert id with their deliveries (per
 * stream: attempt, rank, sent, acknowledged), oldest first, into *out;
 * *truncated when older deliveries were left out. Returns 0, or a negative
 * code with the reply set. */
int http_alert_advice(struct ctx *c, int64_t id, json_t **out, bool *truncated);

/* http_silences.c */
int http_silences_list(struct ctx *c);        /* GET /api/v1/silences */
int http_silences_get(struct ctx *c);         /* GET /api/v1/silences/{id} */
int http_silences_create(struct ctx *c);      /* POST /api/v1/silences (no connection) */
int http_silences_expire(struct ctx *c);      /* DELETE /api/v1/silences/{id} (no connection) */
int http_silences_maintenance(struct ctx *c); /* POST /api/v1/runs/{run}/maintenance (ditto) */
int http_runs_delete(struct ctx *c);          /* DELETE /api/v1/runs/{run} (no connection) */
int http_runs_end(struct ctx *c);             /* POST /api/v1/runs/{run}/end (no connection) */

#endif
