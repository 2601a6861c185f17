/* The HTTP API: libmicrohttpd in front of read-only SQLite connections.
 * This file: server lifecycle (start, stop, TLS, options), the
 * read-connection pool, and the request state machine that feeds
 * http_dispatch() (http_routes.c) and sends the reply it sets. The route
 * table is in http_routes.c, the handlers in http_ops.c, http_runs.c,
 * http_alerts.c and http_silences.c (http_internal.h lists the files).
 *
 * Shape of a request (all on one libmicrohttpd pool thread):
 *   on_request (1st call: allocate per-request state only)
 *   on_request (body chunks: read and discard, bounded)
 *   on_request (last call) -> http_dispatch: route table -> params -> db
 *     checkout -> BEGIN -> handler builds a jansson document -> COMMIT -> db
 *     return -> JSON response queued.
 * A write (silences) hands its item to the writer instead and the
 * connection is suspended (http_write.c); once the writer has settled it,
 * the connection is resumed and on_request is called once more, on any pool
 * thread, to answer it.
 *
 * Handlers never write: the daemon core owns the only read-write
 * connection. */

#include "http.h"

#include <netdb.h>
#include <stdarg.h>
#include <sys/socket.h>

#include "http_internal.h"
#include "tls.h"

/* --- per-request state -------------------------------------------------------- */

struct request {
    size_t body_bytes;
    char *body;               /* POST: the body so far (malloc'd, NUL-terminated), else NULL */
    bool replied;             /* a response was queued (early: announced body too large) */
    struct http_write *write; /* parked: the connection is suspended until it settles */
};

/* --- read-connection pool ---------------------------------------------------------------- */

static struct dbconn *db_checkout(struct http *h)
{
    struct timespec deadline = fs_clock_mono_after(HTTP_DB_CHECKOUT_TIMEOUT_MS / 1000.0);
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
static int dbconn_open(struct dbconn *d, const char *path, struct fs_err *err)
{
    /* NOMUTEX: a connection is only ever used by the one thread that checked
     * it out. */
    int rc = sqlite3_open_v2(path, &d->db, SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX, NULL);
    if (rc != SQLITE_OK) {
        fs_err_set(err, rc, "open %s read-only: %s", path,
                   d->db ? sqlite3_errmsg(d->db) : sqlite3_errstr(rc));
        goto fail;
    }
    sqlite3_busy_timeout(d->db, HTTP_DB_BUSY_TIMEOUT_MS);
    for (int i = 0; i < STMT__COUNT; i++) {
        rc = sqlite3_prepare_v3(d->db, http_stmt_sql((enum stmt_id)i), -1,
                                SQLITE_PREPARE_PERSISTENT, &d->st[i], NULL);
        if (rc != SQLITE_OK) {
            fs_err_set(err, rc, "%s: prepare failed (is the schema applied?): %s", path,
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
    if (!resp)
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
    if (c->dash) {
        struct MHD_Response *raw = dash_response(c);
        if (!raw)
            return MHD_NO;
        atomic_fetch_add_explicit(&h->stats->http_requests, 1, memory_order_relaxed);
        enum MHD_Result rr = MHD_queue_response(c->conn, status, raw);
        MHD_destroy_response(raw);
        return rr;
    }
    char *text = !c->raw && c->body ? json_dumps(c->body, JSON_COMPACT) : NULL;
    struct MHD_Response *resp;
    if (c->raw) {
        if (c->raw_owned) {
            resp = MHD_create_response_from_buffer_with_free_callback(c->raw_len, (void *)c->raw,
                                                                      free_body);
            if (!resp)
                free((void *)c->raw);
        } else {
            resp =
                MHD_create_response_from_buffer(c->raw_len, (void *)c->raw, MHD_RESPMEM_PERSISTENT);
        }
        c->raw = NULL; /* the response owns it now (or it is freed) */
    } else if (text) {
        resp = MHD_create_response_from_buffer_with_free_callback(strlen(text), text, free_body);
        if (!resp)
            free(text);
    } else {
        status = MHD_HTTP_INTERNAL_SERVER_ERROR;
        resp = MHD_create_response_from_buffer(sizeof fallback_body - 1, (void *)fallback_body,
                                               MHD_RESPMEM_PERSISTENT);
    }
    if (!resp)
        return MHD_NO; /* closes the connection */
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE,
                            c->content_type ? c->content_type : "application/json");
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

/* Checks out a read connection and runs fn inside one read transaction
 * (every statement sees the same committed snapshot). Sets the reply;
 * returns 0. */
int http_db_read(struct ctx *c, route_fn fn)
{
    c->dbc = db_checkout(c->h);
    if (!c->dbc)
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

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls)
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
    if (!rq) {
        rq = calloc(1, sizeof(*rq));
        if (!rq)
            return MHD_NO;
        *con_cls = rq;
        const char *cl =
            MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        int64_t announced = 0;
        if (cl && (http_parse_int64(cl, &announced) != 0 || announced > HTTP_MAX_BODY_BYTES)) {
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
            if (!b)
                return MHD_NO;
            memcpy(b + rq->body_bytes, upload_data, n);
            b[rq->body_bytes + n] = '\0';
            rq->body = b;
        }
        rq->body_bytes += n;
        return MHD_YES;
    }
    if (rq->write) {
        /* Resumed: the writer has settled the write parked below. */
        struct http_write *w = rq->write;
        rq->write = NULL;
        http_write_finish(&c, w);
        enum MHD_Result r = send_reply(&c);
        json_decref(c.body);
        http_write_free(w); /* after the reply is queued: http_writes_stop waits for it */
        return r;
    }
    if (rq->replied)
        return MHD_YES;

    rq->replied = true;
    c.req_body = rq->body;
    c.req_len = rq->body != NULL ? rq->body_bytes : 0;
    http_dispatch(&c, method);
    if (c.write) {
        /* A write: answered when the writer has settled it, without
         * holding this thread meanwhile (or here, when stopping). */
        if (http_write_park(&h->writes, conn, c.write)) {
            rq->write = c.write;
            return MHD_YES;
        }
        http_write_finish(&c, c.write);
        http_write_free(c.write);
    }
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
    if (rq) {
        free(rq->body);
        http_write_free(rq->write); /* resumed, but closed before it was answered */
    }
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
    /* Kept whole up to its size, cut short past it (said once here, so the
     * compiler's truncation warning does not need a snprintf of %s). */
    size_t keep = n < sizeof(h->mhd_last) - 1 ? n : sizeof(h->mhd_last) - 1;
    memcpy(h->mhd_last, msg, keep);
    h->mhd_last[keep] = '\0';
    log_limited(&h->log_rl, LOG_LEVEL_WARN, LOG_MOD, "libmicrohttpd: %s", msg);
    pthread_mutex_unlock(&h->log_mu);
}

/* --- public ---------------------------------------------------------------------------- */

static void http_free(struct http *h)
{
    if (!h)
        return;
    /* The parked writes first: libmicrohttpd must not stop with a
     * connection suspended. */
    if (h->sync_init)
        http_writes_stop(&h->writes);
    if (h->mhd)
        MHD_stop_daemon(h->mhd);
    if (h->conns)
        for (unsigned i = 0; i < h->nconns; i++)
            dbconn_close(&h->conns[i]);
    free(h->conns);
    free(h->free_idx);
    free(h->read_token);
    free(h->write_token);
    free(h->tls_cert);
    free(h->tls_key);
    if (h->sync_init) {
        pthread_cond_destroy(&h->cv);
        pthread_mutex_destroy(&h->mu);
        pthread_mutex_destroy(&h->log_mu);
        silence_cache_destroy(&h->silences); /* after MHD_stop_daemon: no handler left */
        http_writes_destroy(&h->writes);
    }
    free(h);
}

/* A PEM file for libmicrohttpd, whole (at most FS_TLS_MAX_PEM_BYTES), as a
 * NUL-terminated string the caller frees. 0 or a negative errno with err. */
static int read_pem(const char *path, char **out, struct fs_err *err)
{
    *out = NULL;
    if (!path || !path[0])
        return fs_err_set(err, -EINVAL, "http: http_tls_cert and http_tls_key are both needed");
    FILE *f = fopen(path, "rb");
    if (!f) {
        int e = errno;
        return fs_err_set(err, -e, "http: %s: %s", path, strerror(e));
    }
    char *buf = malloc(FS_TLS_MAX_PEM_BYTES + 1);
    size_t n = buf ? fread(buf, 1, FS_TLS_MAX_PEM_BYTES + 1, f) : 0;
    int bad = !buf || ferror(f) || n > FS_TLS_MAX_PEM_BYTES || n == 0;
    fclose(f);
    if (bad) {
        fs_err_set(err, -EINVAL, "http: %s: %s", path,
                   !buf     ? "out of memory"
                   : n == 0 ? "empty or unreadable"
                            : "larger than 1 MiB: not a PEM file");
        free(buf);
        return -EINVAL;
    }
    buf[n] = '\0';
    *out = buf;
    return 0;
}

/* The HTTPS certificate and key, checked as ingest's are (tls.h: each
 * parses, the key matches the certificate) so that a bad file fails the
 * start with its path and the reason, not libmicrohttpd's bare refusal to
 * start. 0 or a negative errno with err. */
static int check_pem_pair(const struct http_opts *opts, struct fs_err *err)
{
    struct tls_server_opts o = {.cert_file = opts->tls_cert_file, .key_file = opts->tls_key_file};
    struct tls_server *t = NULL;
    struct fs_err te = {0};
    int rc = tls_server_new(&o, &t, &te);
    tls_server_free(t);
    if (rc < 0) {
        const char *m = strncmp(te.msg, "tls: ", 5) == 0 ? te.msg + 5 : te.msg;
        return fs_err_set(err, rc, "http: http_tls_cert/http_tls_key: %s", m);
    }
    return 0;
}

/* Percent-decoding of paths and query values (MHD_OPTION_UNESCAPE_CALLBACK).
 * Decoded in place, a %00 would cut the C string short: /api/v1/runs/a%00b
 * answered for run "a". A text holding %00 stays undecoded instead, so it
 * names nothing that exists and fails every check of a name or a number.
 * Any MHD thread; touches only s. */
static size_t unescape(void *cls, struct MHD_Connection *c, char *s)
{
    (void)cls;
    (void)c;
    for (const char *p = s; (p = strchr(p, '%')); p++)
        if (p[1] == '0' && p[2] == '0')
            return strlen(s);
    return MHD_http_unescape(s);
}

/* The locks, the condition (on the monotonic clock), the silence cache and
 * the write queue; h->sync_init says they are there for http_free. */
static int http_init_sync(struct http *h, struct fs_err *err)
{
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0)
        return fs_err_set(err, -ENOMEM, "http: pthread_condattr_init failed");
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int e1 = pthread_mutex_init(&h->mu, NULL);
    int e2 = e1 == 0 ? pthread_cond_init(&h->cv, &ca) : -1;
    int e3 = e2 == 0 ? pthread_mutex_init(&h->log_mu, NULL) : -1;
    int e4 = e3 == 0 ? silence_cache_init(&h->silences) : -1;
    int e5 = e4 == 0 ? http_writes_init(&h->writes) : -1;
    pthread_condattr_destroy(&ca);
    if (e1 != 0 || e2 != 0 || e3 != 0 || e4 != 0 || e5 != 0) {
        if (e4 == 0)
            silence_cache_destroy(&h->silences);
        if (e3 == 0)
            pthread_mutex_destroy(&h->log_mu);
        if (e2 == 0)
            pthread_cond_destroy(&h->cv);
        if (e1 == 0)
            pthread_mutex_destroy(&h->mu);
        return fs_err_set(err, -ENOMEM, "http: mutex/cond/thread init failed");
    }
    h->sync_init = true;
    return 0;
}

/* One read connection per server thread: a request never waits for one
 * unless a handler is stuck. */
static int http_open_conns(struct http *h, const struct http_opts *opts, struct fs_err *err)
{
    h->conns = calloc(opts->threads, sizeof(*h->conns));
    h->free_idx = calloc(opts->threads, sizeof(*h->free_idx));
    if (!h->conns || !h->free_idx)
        return fs_err_set(err, -ENOMEM, "http: out of memory");
    h->nconns = opts->threads;
    for (unsigned i = 0; i < h->nconns; i++) {
        int rc = dbconn_open(&h->conns[i], opts->db_path, err);
        if (rc != 0)
            return rc;
        h->free_idx[h->nfree++] = i;
    }
    return 0;
}

/* Why MHD_start_daemon returned NULL, into err: libmicrohttpd's own message
 * says what it refused (TLS setup, the socket, ...); errno alone is often
 * unset or unrelated. Returns the code. */
static int http_listen_failed(struct http *h, const struct http_opts *opts, int e,
                              struct fs_err *err)
{
    char why[sizeof(h->mhd_last)];
    pthread_mutex_lock(&h->log_mu);
    snprintf(why, sizeof(why), "%s", h->mhd_last);
    pthread_mutex_unlock(&h->log_mu);
    return fs_err_set(err, e != 0 ? -e : -EIO, "http: cannot listen on %s:%u%s%s%s%s", opts->host,
                      (unsigned)opts->port, why[0] ? ": " : "", why, e != 0 ? ": " : "",
                      e != 0 ? strerror(e) : "");
}

/* Binds opts->host:port and starts libmicrohttpd's threads (HTTPS when a
 * certificate is configured); h->port is the bound port. */
static int http_listen(struct http *h, const struct http_opts *opts, struct fs_err *err)
{
    struct addrinfo *ai = NULL;
    int rc = 0;
    char port[8];
    snprintf(port, sizeof port, "%u", (unsigned)opts->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    int gai = getaddrinfo(opts->host, port, &hints, &ai);
    if (gai != 0)
        return fs_err_set(err, -EINVAL, "http: bad bind address '%s': %s", opts->host,
                          gai_strerror(gai));

    json_object_seed(0); /* before any server thread builds a JSON object */

    /* Suspend/resume: writes wait for the writer off the server threads
     * (http_write.c). poll(), not epoll (MHD_USE_AUTO's choice on Linux):
     * libmicrohttpd 0.9.75's epoll mode keeps a TLS connection whose
     * gnutls_handshake returned GNUTLS_E_AGAIN on its ready list, so one
     * client that sends part of a ClientHello made its worker alternate
     * epoll_wait(.., 0) and a recv returning EAGAIN until the idle timeout
     * (a core per worker; tests/integration/test_https_half_open.py). Each
     * worker polls its own connections, at most HTTP_MAX_CONNECTIONS. */
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL | MHD_USE_ERROR_LOG |
                     MHD_ALLOW_SUSPEND_RESUME;
    /* HTTPS: libmicrohttpd's own TLS (GnuTLS in Debian's build), with the
     * PEM files read here so that a bad path fails the start, named. */
    struct MHD_OptionItem tls[] = {
        {.option = MHD_OPTION_HTTPS_MEM_KEY},
        {.option = MHD_OPTION_HTTPS_MEM_CERT},
        {.option = MHD_OPTION_END},
    };
    bool https = opts->tls_cert_file && opts->tls_cert_file[0];
    if (https) {
        if (MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES) {
            rc = fs_err_set(err, -ENOTSUP,
                            "http: http_tls_cert is set but this libmicrohttpd has no TLS");
            goto out;
        }
        if ((rc = read_pem(opts->tls_key_file, &h->tls_key, err)) < 0 ||
            (rc = read_pem(opts->tls_cert_file, &h->tls_cert, err)) < 0 ||
            (rc = check_pem_pair(opts, err)) < 0)
            goto out;
        tls[0].ptr_value = h->tls_key;
        tls[1].ptr_value = h->tls_cert;
        flags |= MHD_USE_TLS;
    }
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
        flags, opts->port, NULL, NULL, on_request, h, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h,
        MHD_OPTION_SOCK_ADDR, ai->ai_addr, MHD_OPTION_ARRAY, opts->threads > 1 ? pool : &pool[1],
        MHD_OPTION_CONNECTION_LIMIT, (unsigned)HTTP_MAX_CONNECTIONS,
        MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)HTTP_MAX_CONNECTIONS_PER_IP,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)HTTP_CONNECTION_TIMEOUT_S,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)HTTP_CONNECTION_MEMORY_BYTES,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, h, MHD_OPTION_UNESCAPE_CALLBACK, unescape, NULL,
        MHD_OPTION_ARRAY, https ? tls : &tls[2], MHD_OPTION_END);
    if (!h->mhd) {
        rc = http_listen_failed(h, opts, errno, err);
        goto out;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->mhd, MHD_DAEMON_INFO_BIND_PORT);
    h->port = info != NULL ? info->port : opts->port;
out:
    freeaddrinfo(ai);
    return rc;
}

/* Main thread. On success *out owns the daemon, its threads and the read
 * connections until http_stop(). On failure nothing is left running. */
int http_start(const struct http_opts *opts, struct http **out, struct fs_err *err)
{
    struct http *h = NULL;
    int rc = 0;
    *out = NULL;
    if (err)
        err->msg[0] = '\0';

    if (!opts || !opts->host || !opts->db_path || !opts->stats)
        return fs_err_set(err, -EINVAL, "http: host, db_path and stats are required");
    if (opts->threads < 1 || opts->threads > HTTP_MAX_THREADS)
        return fs_err_set(err, -EINVAL, "http: threads must be in 1..%u, not %u", HTTP_MAX_THREADS,
                          opts->threads);
    if (sqlite3_threadsafe() == 0)
        return fs_err_set(err, -ENOTSUP, "http: SQLite is built without thread support");

    h = calloc(1, sizeof(*h));
    if (!h)
        return fs_err_set(err, -ENOMEM, "http: out of memory");
    h->stats = opts->stats;
    h->store = opts->store;
    h->read_only = opts->read_only;
    h->read_token = strdup(opts->read_token ? opts->read_token : "");
    h->write_token = strdup(opts->write_token ? opts->write_token : "");
    if (!h->read_token || !h->write_token) {
        rc = fs_err_set(err, -ENOMEM, "http: out of memory");
        goto fail;
    }
    h->mopts.max_runs = opts->metrics_max_runs;
    h->mopts.run_max_age = opts->metrics_run_max_age > 0 ? opts->metrics_run_max_age
                                                         : HTTP_DEFAULT_METRICS_RUN_MAX_AGE;
    if ((rc = http_init_sync(h, err)) < 0 || (rc = http_open_conns(h, opts, err)) != 0 ||
        (rc = http_listen(h, opts, err)) < 0)
        goto fail;
    *out = h;
    return 0;

fail:
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
