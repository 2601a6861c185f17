/* Silences: GET /api/v1/silences and /api/v1/silences/{id} (read
 * transaction on c->dbc), and the write path: POST /api/v1/silences, DELETE
 * /api/v1/silences/{id} and POST /api/v1/runs/{run}/maintenance hand a
 * silence item to the writer thread (store.h) through http_write.c, which
 * suspends the request until the commit; the done functions here then read
 * the result back through http_db_read. */

#include "http_internal.h"

#include "http_parse.h"
#include "store.h"

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
    if (!o)
        return NULL;
    json_error_t jerr;
    const char *m = (const char *)sqlite3_column_text(st, SLC_MATCHERS);
    json_t *matchers =
        m != NULL ? json_loadb(m, (size_t)sqlite3_column_bytes(st, SLC_MATCHERS), 0, &jerr) : NULL;
    int rc = 0;
    rc |= oset(o, "id", col_int(st, SLC_ID));
    rc |= oset(o, "matchers", matchers ? matchers : json_array());
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
    uint32_t given;
    int rc = http_param_enum_set(c, "state", silence_state_names, 3, &given);
    if (given == 0)
        given = 7u; /* absent: every state */
    for (unsigned k = 0; k < 3; k++)
        want[k] = (given & (1u << k)) != 0;
    return rc;
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

/* The outcome rc of a silence write: 0, -ENOENT and -EALREADY are
 * returned for the caller to answer; anything else sets the reply and is
 * returned. */
static int silence_outcome(struct ctx *c, int rc)
{
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
    case -ENOSPC:
        http_reply_error(c, MHD_HTTP_CONFLICT, "limit",
                         "at most %u silences may be active or pending; expire one first",
                         FS_STORE_MAX_LIVE_SILENCES);
        return rc;
    default:
        http_reply_error(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "internal",
                         "storage refused the write (details in the daemon log)");
        return rc;
    }
}

/* http_write_done_fn of an INSERT: 201 with the new silence. */
static int created(struct ctx *c, int rc, int64_t id, int64_t arg)
{
    (void)arg;
    if (silence_outcome(c, rc) != 0)
        return 0;
    c->wid = id;
    c->wstatus = MHD_HTTP_CREATED;
    return http_db_read(c, reply_silence);
}

/* http_write_done_fn of an EXPIRE of silence arg: 200 with it, 404, 409. */
static int expired(struct ctx *c, int rc, int64_t id, int64_t arg)
{
    rc = silence_outcome(c, rc);
    if (rc == -ENOENT)
        return http_reply_error(c, MHD_HTTP_NOT_FOUND, "not_found", "unknown silence %" PRId64,
                                arg);
    if (rc == -EALREADY)
        return http_reply_error(c, MHD_HTTP_CONFLICT, "conflict",
                                "silence %" PRId64 " has already expired", arg);
    if (rc != 0)
        return 0;
    c->wid = id;
    c->wstatus = MHD_HTTP_OK;
    return http_db_read(c, reply_silence);
}

/* POST body -> an INSERT item; run: maintenance silence of that run. */
static int silence_create(struct ctx *c, const char *run)
{
    struct silence_req *req = malloc(sizeof(*req));
    if (!req)
        return http_reply_oom(c);
    struct fs_err why = {0};
    if (http_silence_req_parse(c->req_body, c->req_len, run, wall_now(), req, &why) != 0) {
        free(req);
        return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request", "%s", why.msg);
    }
    struct store_item *it = store_item_new(STORE_ITEM_SILENCE);
    if (!it) {
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
    if (!it->silence.matchers_json || !it->silence.created_by || !it->silence.comment) {
        store_item_free(it);
        return http_reply_oom(c);
    }
    http_write_submit(c, it, created, 0); /* sets the reply on failure */
    return 0;
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
    if (!it)
        return http_reply_oom(c);
    it->silence.op = STORE_SILENCE_EXPIRE;
    it->silence.id = id;
    http_write_submit(c, it, expired, id); /* sets the reply on failure */
    return 0;
}
