/* The HTTP API's operational routes, which need no handler file of their
 * own: the probes (/healthz, /readyz), the Prometheus exposition (/metrics,
 * rendered by metrics.c) and the dashboard's embedded files (/ and
 * /static/NAME, dashboard.c). Routed by routes[] in http_routes.c; one
 * libmicrohttpd pool thread, inside one request. */

#include "http_internal.h"

#include "spool.h"
#include "store.h"

/* --- the small routes ---------------------------------------------------------------- */

int http_ops_healthz(struct ctx *c)
{
    json_t *doc = json_pack("{s:s}", "status", "ok");
    return doc != NULL ? http_reply_set(c, MHD_HTTP_OK, doc) : http_reply_oom(c);
}

/* /readyz:
 *  - 503 while nothing new can be acknowledged: the spool log was deleted
 *    or replaced under the running daemon (until a restart), commits fail,
 *    or the daemon is starting or stopping;
 *  - 200 {"status": "degraded", "spool": {...}} when the start found
 *    acknowledged spooled frames lost or spool records damaged: the daemon
 *    acknowledges and evaluates new reports as it should (a 503 would only
 *    take a working daemon out of its load balancer), but some steps before
 *    the restart were evaluated without frames the trainers were told were
 *    kept. It stays until the next restart, which reports afresh;
 *  - 200 {"status": "ready"} otherwise. */
int http_ops_readyz(struct ctx *c)
{
    struct fs_stats *s = c->h->stats;
    int fault = atomic_load_explicit(&s->spool_fault, memory_order_relaxed);
    if (fault != 0)
        return http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable",
                                "spool: the log was deleted or replaced under the running daemon "
                                "(%s); nothing new is acknowledged until foreshockd restarts",
                                spool_fault_name(fault));
    /* The storage failure first: the writer clears `ready` while it lasts,
     * and "starting or shutting down" would hide the reason. */
    int failing = atomic_load_explicit(&s->storage_failing, memory_order_relaxed);
    if (failing != 0)
        return http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable",
                                "storage: %s (commits fail; nothing new is acknowledged)",
                                store_failure_text(failing));
    if (atomic_load_explicit(&s->ready, memory_order_relaxed) != 1)
        return http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable",
                                "daemon is not ready (starting or shutting down)");
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
    uint64_t missing = atomic_load_explicit(&s->spool_lost_missing, memory_order_relaxed),
             damaged = atomic_load_explicit(&s->spool_lost_damaged, memory_order_relaxed),
             records = atomic_load_explicit(&s->spool_damaged_records, memory_order_relaxed),
             skipped = atomic_load_explicit(&s->spool_skipped_bytes, memory_order_relaxed);
    json_t *doc;
    if (missing || damaged || records)
        doc = json_pack("{s:s, s:{s:I, s:I, s:I, s:I}, s:s}", "status", "degraded", "spool",
                        "lost_missing", (json_int_t)missing, "lost_damaged", (json_int_t)damaged,
                        "damaged_records", (json_int_t)records, "skipped_bytes",
                        (json_int_t)skipped, "message",
                        "the start found acknowledged spooled frames lost or spool records "
                        "damaged (see the log); new reports are acknowledged and evaluated");
    else
        doc = json_pack("{s:s}", "status", "ready");
    return doc != NULL ? http_reply_set(c, MHD_HTTP_OK, doc) : http_reply_oom(c);
}

/* --- /metrics ------------------------------------------------------------------------------ */

int http_ops_metrics(struct ctx *c)
{
    struct metrics_buf b = {0};
    struct fs_err err = {0};
    int rc = metrics_write_stats(&b, c->h->stats, FORESHOCK_VERSION);
    if (rc == 0)
        rc = metrics_write_db(&b, c->dbc->db, &c->h->mopts, wall_now(), &err);
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

/* The dashboard's embedded files; 304 when If-None-Match has the ETag. */
int http_ops_dashboard(struct ctx *c)
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
