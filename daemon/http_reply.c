/* Replies of the HTTP API: setting the one reply of a request (JSON,
 * raw bytes, error documents), keyset pages, and the JSON builders that
 * more than one handler file uses. send_reply (http.c) turns the reply
 * into a libmicrohttpd response. */

#include "http_internal.h"

#include <stdarg.h>

/* --- replies ------------------------------------------------------------------------ */

/* Drops a raw reply set earlier (a later error replaces it). */
static void raw_drop(struct ctx *c)
{
    if (c->raw && c->raw_owned)
        free((void *)c->raw);
    c->raw = NULL;
    c->content_type = NULL;
}

int http_reply_set(struct ctx *c, unsigned status, json_t *body)
{
    raw_drop(c);
    json_decref(c->body);
    c->status = status;
    c->body = body;
    return 0;
}

/* Raw bytes with a content type (a reply that is not JSON: /metrics, the
 * dashboard's files). owned: data is malloc'd and freed with the
 * response; otherwise it must outlive the response (static). */
int http_reply_raw(struct ctx *c, unsigned status, const char *content_type, const void *data,
                   size_t len, bool owned)
{
    raw_drop(c);
    json_decref(c->body);
    c->body = NULL;
    c->status = status;
    c->raw = data;
    c->raw_len = len;
    c->raw_owned = owned;
    c->content_type = content_type;
    return 0;
}

/* Error documents: {"error":{"code":...,"message":...}}. If building it
 * fails, body stays NULL and send_reply falls back to a static document. */
int http_reply_error(struct ctx *c, unsigned status, const char *code, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);

    json_t *err = json_object();
    if (err &&
        (oset(err, "code", json_string(code)) != 0 || oset(err, "message", jstr(msg)) != 0)) {
        json_decref(err);
        err = NULL;
    }
    json_t *doc = err != NULL ? json_object() : NULL;
    if (!doc)
        json_decref(err);
    else if (oset(doc, "error", err) != 0) { /* consumed err */
        json_decref(doc);
        doc = NULL;
    }
    return http_reply_set(c, status, doc);
}

int http_reply_oom(struct ctx *c)
{
    return http_reply_error(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "internal", "out of memory");
}

/* SQLite failure: logged with detail, answered without it. */
int http_reply_db_error(struct ctx *c, const char *what, int rc)
{
    /* handlers run with a checked-out connection: c->dbc is set */
    log_limited(&c->dbc->rl, LOG_LEVEL_ERROR, LOG_MOD, "%s: sqlite error %d: %s", what, rc,
                sqlite3_errmsg(c->dbc->db));
    if (rc == SQLITE_BUSY || rc == SQLITE_LOCKED)
        return http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable", "database busy");
    return http_reply_error(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "internal",
                            "database error (details in the daemon log)");
}

/* Document {"<key>": items, "next": next}; consumes items and next. */
json_t *http_page_doc(const char *key, json_t *items, json_t *next)
{
    json_t *doc = json_object();
    if (!doc) {
        json_decref(items);
        json_decref(next);
        return NULL;
    }
    int rc = oset(doc, key, items);
    rc |= oset(doc, "next", next);
    if (rc != 0) {
        json_decref(doc);
        return NULL;
    }
    return doc;
}

/* A keyset cursor: the id as a decimal string. */
static json_t *cursor_json(int64_t id)
{
    char buf[32];
    snprintf(buf, sizeof buf, "%" PRId64, id);
    return json_string(buf);
}

/* Steps st (bound with LIMIT limit + 1) into a keyset page: up to limit
 * items, and "next" = the id (column id_col) of the last item when one more
 * row exists. Resets st. On success sets the reply to {key: [...], "next": ...}. */
int http_reply_page(struct ctx *c, sqlite3_stmt *st, int64_t limit, int id_col, row_fn fn,
                    const void *arg, const char *key, const char *what)
{
    json_t *items = json_array();
    if (!items) {
        stmt_done(st);
        return http_reply_oom(c);
    }
    int64_t n = 0, last_id = 0;
    bool more = false;
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (n == limit) { /* the extra row: a next page exists */
            more = true;
            break;
        }
        if (aadd(items, fn(st, arg)) != 0) {
            stmt_done(st);
            json_decref(items);
            return http_reply_oom(c);
        }
        last_id = sqlite3_column_int64(st, id_col);
        n++;
    }
    if (!more && rc != SQLITE_DONE) {
        http_reply_db_error(c, what, rc);
        stmt_done(st);
        json_decref(items);
        return 0;
    }
    stmt_done(st);
    json_t *doc = http_page_doc(key, items, more ? cursor_json(last_id) : json_null());
    return doc != NULL ? http_reply_set(c, MHD_HTTP_OK, doc) : http_reply_oom(c);
}

/* A column holding a JSON object (written by the daemon): the parsed object,
 * or null when it is NULL, longer than max bytes, not JSON or not an object
 * (a reader shows what it can rather than failing the request). */
json_t *http_col_json_object(sqlite3_stmt *st, int i, size_t max)
{
    if (sqlite3_column_type(st, i) == SQLITE_NULL)
        return json_null();
    const char *text = (const char *)sqlite3_column_text(st, i);
    int n = sqlite3_column_bytes(st, i);
    if (!text || n <= 0 || (size_t)n > max)
        return json_null();
    json_error_t jerr;
    json_t *v = json_loadb(text, (size_t)n, 0, &jerr);
    if (!v || !json_is_object(v)) {
        json_decref(v);
        return json_null();
    }
    return v;
}

/* {"layer":..,"head":..,"window":..,"rank":..} with only the labels that
 * apply (-1 and window 0 mean "none"); NULL on allocation failure. */
json_t *http_labels_json(sqlite3_stmt *st, const struct label_cols *lc)
{
    const struct {
        const char *name;
        int col;
        int64_t min; /* applies when >= min */
    } labels[] = {
        {.name = "layer", .col = lc->layer, .min = 0},
        {.name = "head", .col = lc->head, .min = 0},
        {.name = "window", .col = lc->window, .min = 1},
        {.name = "rank", .col = lc->rank, .min = 0},
    };
    json_t *o = json_object();
    if (!o)
        return NULL;
    int rc = 0;
    for (size_t i = 0; i < sizeof labels / sizeof labels[0]; i++) {
        int64_t v = sqlite3_column_int64(st, labels[i].col);
        if (sqlite3_column_type(st, labels[i].col) != SQLITE_NULL && v >= labels[i].min)
            rc |= oset(o, labels[i].name, json_integer((json_int_t)v));
    }
    if (rc != 0) {
        json_decref(o);
        return NULL;
    }
    return o;
}
