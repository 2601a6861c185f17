/* Runs, series, points and incomplete steps: the read-only handlers of
 * /api/v1/runs, /api/v1/runs/{name}, /api/v1/series,
 * /api/v1/series/{id}/points and /api/v1/runs/{name}/incomplete. Every
 * handler runs inside the request's read transaction (c->dbc). */

#include "http_internal.h"

#include "alert.h" /* pinned state numbers */
#include "store.h" /* the lifecycle writes */

/* What a run's monitors cover, from its stored local group (RC_LOCAL):
 * null when its daemon heard the whole job; else the group, the rank whose
 * loss/grad_norm/lr were detected, and the series computed over the group
 * only (router token statistics: a node's tokens, not the job's). */
static json_t *topology_json(sqlite3_stmt *st, int64_t world)
{
    static const char *const node_local[] = {
        "router.entropy",      "router.entropy_norm", "router.entropy_spread", "router.maxvio",
        "router.load_entropy", "router.dead_experts", "router.balance",        "router.zloss"};
    const char *text = (const char *)sqlite3_column_text(st, RC_LOCAL);
    uint32_t *v = NULL;
    size_t n = 0;
    if (!text || world < 1 || world > FS_MAX_WORLD_SIZE ||
        ranks_parse(text, (uint32_t)world, (size_t)FS_MAX_WORLD_SIZE, &v, &n) < 0 || !n) {
        free(v);
        return json_null();
    }
    char *ranks = ranks_format(v, n);
    json_t *o = json_object(), *series = json_array();
    int rc = !ranks || !o || !series;
    if (!rc) {
        rc |= oset(o, "local_ranks", json_string(ranks));
        rc |= oset(o, "ranks", json_integer((json_int_t)n));
        rc |= oset(o, "lead_rank", json_integer(v[0]));
        for (size_t i = 0; i < sizeof(node_local) / sizeof(node_local[0]); i++)
            rc |= aadd(series, json_string(node_local[i]));
        rc |= oset(o, "group_only_series", series);
        series = NULL;
    }
    free(ranks);
    free(v);
    json_decref(series);
    if (rc) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* RUN object from a row of RUN_COLUMNS. */
static json_t *run_json(sqlite3_stmt *st)
{
    json_t *o = json_object();
    if (!o)
        return NULL;
    int rc = 0;
    rc |= oset(o, "id", col_text(st, RC_NAME));
    rc |= oset(o, "created_at", col_real(st, RC_CREATED));
    rc |= oset(o, "last_seen_at", col_real(st, RC_SEEN));
    rc |= oset(o, "world_size", col_int(st, RC_WORLD));
    rc |= oset(o, "detect_from_step", col_int(st, RC_DETECT));
    rc |= oset(o, "last_step", col_int(st, RC_LAST_STEP));
    rc |= oset(o, "reports", col_int(st, RC_REPORTS));
    rc |= oset(o, "streams", col_int(st, RC_STREAMS));
    rc |= oset(o, "series", col_int(st, RC_SERIES));
    rc |= oset(o, "model", http_col_json_object(st, RC_MODEL, HTTP_MAX_MODEL_JSON_BYTES));
    rc |= oset(o, "topology", topology_json(st, sqlite3_column_int64(st, RC_WORLD)));
    if (rc != 0) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* Series object from a row of SERIES_COLUMNS; run is the run's name. Labels
 * that do not apply (-1; window 0) are left out. */
static json_t *series_json(sqlite3_stmt *st, json_t *run)
{
    static const struct label_cols lc = {
        .layer = SC_LAYER, .head = SC_HEAD, .window = SC_WINDOW, .rank = SC_RANK};
    json_t *o = json_object();
    if (!o) {
        json_decref(run);
        return NULL;
    }
    int rc = 0;
    rc |= oset(o, "id", col_int(st, SC_ID));
    rc |= oset(o, "run", run);
    rc |= oset(o, "name", col_text(st, SC_NAME));
    rc |= oset(o, "labels", http_labels_json(st, &lc));
    rc |= oset(o, "points", col_int(st, SC_POINTS));
    rc |= oset(o, "first_step", col_int(st, SC_FIRST));
    rc |= oset(o, "last_step", col_int(st, SC_LAST));
    if (rc != 0) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* A label column of incomplete as a value, null where it does not apply. */
static json_t *col_label(sqlite3_stmt *st, int i, int64_t min)
{
    if (sqlite3_column_type(st, i) == SQLITE_NULL || sqlite3_column_int64(st, i) < min)
        return json_null();
    return col_int(st, i);
}

/* One incomplete row (INCOMPLETE_COLUMNS). */
static json_t *incomplete_json(sqlite3_stmt *st)
{
    json_t *o = json_object();
    if (!o)
        return NULL;
    int rc = 0;
    rc |= oset(o, "step", col_int(st, IC_STEP));
    rc |= oset(o, "kind", col_text(st, IC_KIND));
    rc |= oset(o, "layer", col_label(st, IC_LAYER, 0));
    rc |= oset(o, "head", col_label(st, IC_HEAD, 0));
    rc |= oset(o, "window", col_label(st, IC_WINDOW, 1));
    rc |= oset(o, "have", col_int(st, IC_HAVE));
    rc |= oset(o, "want", col_int(st, IC_WANT));
    rc |= oset(o, "recorded_at", col_real(st, IC_RECORDED));
    if (rc != 0) {
        json_decref(o);
        return NULL;
    }
    return o;
}

static json_t *run_row(sqlite3_stmt *st, const void *arg)
{
    (void)arg;
    return run_json(st);
}

static json_t *series_row(sqlite3_stmt *st, const void *run_name)
{
    return series_json(st, jstr(run_name));
}

int http_runs_list(struct ctx *c)
{
    int64_t limit, after;
    if (http_param_limit(c, &limit) != 0 || http_param_after(c, &after) != 0)
        return 0;
    sqlite3_stmt *st = c->dbc->st[STMT_RUNS_PAGE];
    sqlite3_bind_int64(st, 1, after);
    sqlite3_bind_int64(st, 2, limit + 1);
    return http_reply_page(c, st, limit, RC_ID, run_row, NULL, "runs", "runs");
}

static json_t *stream_row(sqlite3_stmt *st)
{
    json_t *o = json_object();
    if (!o)
        return NULL;
    int e = oset(o, "attempt", col_int(st, 0));
    e |= oset(o, "rank", col_int(st, 1));
    e |= oset(o, "last_seq", col_int(st, 2));
    e |= oset(o, "reports", col_int(st, 3));
    e |= oset(o, "created_at", col_real(st, 4));
    e |= oset(o, "last_seen_at", col_real(st, 5));
    if (e != 0) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* streams_detail of one run, (attempt, rank) order. Returns 0 and *out, or
 * a negative code with the reply set. */
static int streams_detail(struct ctx *c, int64_t run_id, json_t **out)
{
    sqlite3_stmt *st = c->dbc->st[STMT_RUN_STREAMS];
    json_t *arr = json_array();
    if (!arr) {
        http_reply_oom(c);
        return -ENOMEM;
    }
    sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_int64(st, 2, HTTP_MAX_STREAMS_DETAIL);
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (aadd(arr, stream_row(st)) != 0) {
            stmt_done(st);
            json_decref(arr);
            http_reply_oom(c);
            return -ENOMEM;
        }
    }
    if (rc != SQLITE_DONE) {
        http_reply_db_error(c, "run streams", rc);
        stmt_done(st);
        json_decref(arr);
        return -EIO;
    }
    stmt_done(st);
    *out = arr;
    return 0;
}

/* "attempts" of one run in attempt order: {attempt, resume_step (null: a
 * plain restart), started_at, rebuilt_at (a rewind's state rebuilt; null:
 * not a rewind, or not yet)}. Returns 0 and *out, or a negative code with
 * the reply set. */
static int run_attempts(struct ctx *c, int64_t run_id, json_t **out)
{
    sqlite3_stmt *st = c->dbc->st[STMT_RUN_ATTEMPTS];
    json_t *arr = json_array();
    if (!arr) {
        http_reply_oom(c);
        return -ENOMEM;
    }
    sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_int64(st, 2, HTTP_MAX_ATTEMPTS);
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        json_t *o = json_object();
        int e = !o;
        if (o) {
            e |= oset(o, "attempt", col_int(st, 0));
            e |= oset(o, "resume_step", col_int(st, 1));
            e |= oset(o, "started_at", col_real(st, 2));
            e |= oset(o, "rebuilt_at", col_real(st, 3));
        }
        if (e != 0 || aadd(arr, o) != 0) {
            if (e != 0)
                json_decref(o);
            stmt_done(st);
            json_decref(arr);
            http_reply_oom(c);
            return -ENOMEM;
        }
    }
    if (rc != SQLITE_DONE) {
        http_reply_db_error(c, "run attempts", rc);
        stmt_done(st);
        json_decref(arr);
        return -EIO;
    }
    stmt_done(st);
    *out = arr;
    return 0;
}

/* Adds "incomplete": n and "alerts": {"firing": n, "pending": n} to run.
 * Returns 0, or a negative code with the reply set. */
static int run_counts(struct ctx *c, int64_t run_id, json_t *run)
{
    sqlite3_stmt *st = c->dbc->st[STMT_RUN_COUNTS];
    sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_int64(st, 2, ALERT_FIRING);
    sqlite3_bind_int64(st, 3, ALERT_PENDING);
    int rc = sqlite3_step(st);
    if (rc != SQLITE_ROW) {
        http_reply_db_error(c, "run counts", rc);
        stmt_done(st);
        return -EIO;
    }
    json_t *alerts = json_pack("{s:o,s:o}", "firing", col_int(st, 0), "pending", col_int(st, 1));
    int e = oset(run, "alerts", alerts);
    e |= oset(run, "incomplete", col_int(st, 2));
    stmt_done(st);
    if (e != 0) {
        http_reply_oom(c);
        return -ENOMEM;
    }
    return 0;
}

int http_runs_get(struct ctx *c)
{
    const char *name = c->cap[0];
    sqlite3_stmt *st = c->dbc->st[STMT_RUN_BY_NAME];
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    int rc = sqlite3_step(st);
    if (rc != SQLITE_ROW) {
        if (rc == SQLITE_DONE)
            http_reply_error(c, MHD_HTTP_NOT_FOUND, "not_found", "unknown run '%s'", name);
        else
            http_reply_db_error(c, "run", rc);
        stmt_done(st);
        return 0;
    }
    int64_t run_id = sqlite3_column_int64(st, RC_ID);
    json_t *run = run_json(st);
    stmt_done(st);
    if (!run)
        return http_reply_oom(c);

    json_t *streams = NULL;
    if (streams_detail(c, run_id, &streams) != 0) {
        json_decref(run);
        return 0;
    }
    if (oset(run, "streams_detail", streams) != 0) { /* consumed streams */
        json_decref(run);
        return http_reply_oom(c);
    }
    json_t *attempts = NULL;
    if (run_attempts(c, run_id, &attempts) != 0) {
        json_decref(run);
        return 0;
    }
    if (oset(run, "attempts", attempts) != 0) { /* consumed attempts */
        json_decref(run);
        return http_reply_oom(c);
    }
    if (run_counts(c, run_id, run) != 0) {
        json_decref(run);
        return 0;
    }
    json_t *doc = json_object();
    if (!doc) {
        json_decref(run);
        return http_reply_oom(c);
    }
    if (oset(doc, "run", run) != 0) { /* consumed run */
        json_decref(doc);
        return http_reply_oom(c);
    }
    return http_reply_set(c, MHD_HTTP_OK, doc);
}

/* Looks up a run id by name. Returns 0, or a negative code with the reply
 * set (404 for an unknown run). */
int http_runs_id_by_name(struct ctx *c, const char *name, int64_t *out)
{
    sqlite3_stmt *st = c->dbc->st[STMT_RUN_ID];
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    int rc = sqlite3_step(st);
    if (rc == SQLITE_ROW) {
        *out = sqlite3_column_int64(st, 0);
        stmt_done(st);
        return 0;
    }
    if (rc == SQLITE_DONE)
        http_reply_error(c, MHD_HTTP_NOT_FOUND, "not_found", "unknown run '%s'", name);
    else
        http_reply_db_error(c, "run id", rc);
    stmt_done(st);
    return rc == SQLITE_DONE ? -ENOENT : -EIO;
}

int http_runs_series(struct ctx *c)
{
    const char *run, *name, *prefix;
    int64_t layer, head, window, rank, limit, after;
    bool has_layer, has_head, has_window, has_rank;
    if (http_param_text(c, "run", true, &run) != 0 ||
        http_param_text(c, "name", false, &name) != 0 ||
        http_param_text(c, "prefix", false, &prefix) != 0 ||
        http_param_int(c, "layer", 0, INT32_MAX, -1, &layer, &has_layer) != 0 ||
        http_param_int(c, "head", 0, INT32_MAX, -1, &head, &has_head) != 0 ||
        http_param_int(c, "window", 1, INT32_MAX, 0, &window, &has_window) != 0 ||
        http_param_int(c, "rank", 0, INT32_MAX, -1, &rank, &has_rank) != 0 ||
        http_param_limit(c, &limit) != 0 || http_param_after(c, &after) != 0)
        return 0;
    if (name && prefix)
        return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                "parameters 'name' and 'prefix' cannot be combined");

    int64_t run_id;
    if (http_runs_id_by_name(c, run, &run_id) != 0)
        return 0;

    /* prefix upper bound: prefix followed by byte 0xFF (see STMT_SERIES_FILTER);
     * strlen(prefix) <= HTTP_MAX_PARAM_LEN was checked when collecting. */
    char upper[HTTP_MAX_PARAM_LEN + 2];
    sqlite3_stmt *st;
    if (name) {
        st = c->dbc->st[STMT_SERIES_BY_NAME];
        sqlite3_bind_text(st, 2, name, -1, SQLITE_STATIC);
    } else {
        st = c->dbc->st[STMT_SERIES_FILTER];
        if (prefix) {
            size_t n = strlen(prefix);
            memcpy(upper, prefix, n);
            upper[n] = (char)0xFF;
            sqlite3_bind_text(st, 2, prefix, -1, SQLITE_STATIC);
            sqlite3_bind_text(st, 9, upper, (int)(n + 1), SQLITE_STATIC);
        }
    }
    sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_int64(st, 3, after);
    if (has_layer)
        sqlite3_bind_int64(st, 4, layer);
    if (has_head)
        sqlite3_bind_int64(st, 5, head);
    if (has_window)
        sqlite3_bind_int64(st, 6, window);
    if (has_rank)
        sqlite3_bind_int64(st, 7, rank);
    sqlite3_bind_int64(st, 8, limit + 1);
    return http_reply_page(c, st, limit, SC_ID, series_row, run, "series", "series");
}

/* Plain points: [step, value|null] from `from` on, at most limit; *next_from
 * is the step of the first point not returned, or JSON null. Returns 0, or a
 * negative code with the reply set. */
static int points_page(struct ctx *c, int64_t id, int64_t from, int64_t to, int64_t limit,
                       json_t *points, json_t **next_from)
{
    sqlite3_stmt *st = c->dbc->st[STMT_POINTS_PAGE];
    sqlite3_bind_int64(st, 1, id);
    sqlite3_bind_int64(st, 2, from);
    sqlite3_bind_int64(st, 3, to);
    sqlite3_bind_int64(st, 4, limit + 1);
    int64_t n = 0, next = -1;
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (n == limit) { /* the extra row: where the next page starts */
            next = sqlite3_column_int64(st, 0);
            break;
        }
        /* json_pack's "o" steals its references, also when it fails */
        if (aadd(points, json_pack("[o,o]", col_int(st, 0), col_real(st, 1))) != 0) {
            stmt_done(st);
            http_reply_oom(c);
            return -ENOMEM;
        }
        n++;
    }
    if (next < 0 && rc != SQLITE_DONE) {
        http_reply_db_error(c, "points", rc);
        stmt_done(st);
        return -EIO;
    }
    stmt_done(st);
    *next_from = next >= 0 ? json_integer((json_int_t)next) : json_null();
    if (!*next_from) {
        http_reply_oom(c);
        return -ENOMEM;
    }
    return 0;
}

/* Downsampled points over the steps present in [from, to]: lo, hi = the
 * first and last present step; nb buckets of w = ceil((hi - lo + 1) / nb)
 * steps from lo; one [first step, mean, min, max] per non-empty bucket
 * (SQL NULL and +-Inf do not become numbers: avg/min/max skip NULL, and a
 * non-finite result is null). Returns 0, or a negative code with the reply
 * set. */
static int points_buckets(struct ctx *c, int64_t id, int64_t from, int64_t to, int64_t nb,
                          json_t *points, int64_t *width)
{
    *width = 0;
    sqlite3_stmt *st = c->dbc->st[STMT_POINTS_SPAN];
    sqlite3_bind_int64(st, 1, id);
    sqlite3_bind_int64(st, 2, from);
    sqlite3_bind_int64(st, 3, to);
    int rc = sqlite3_step(st);
    if (rc != SQLITE_ROW) {
        http_reply_db_error(c, "points span", rc);
        stmt_done(st);
        return -EIO;
    }
    bool empty = sqlite3_column_type(st, 0) == SQLITE_NULL;
    int64_t lo = sqlite3_column_int64(st, 0), hi = sqlite3_column_int64(st, 1);
    stmt_done(st);
    if (empty)
        return 0;

    /* lo, hi lie in [from, to] with from >= 0, so hi - lo cannot overflow.
     * w > INT64_MAX only when nb == 1, where min(.., nb - 1) in the query
     * makes one bucket anyway. */
    uint64_t w = (uint64_t)(hi - lo) / (uint64_t)nb + 1u;
    if (w > (uint64_t)INT64_MAX)
        w = (uint64_t)INT64_MAX;
    *width = (int64_t)w;

    st = c->dbc->st[STMT_POINTS_BUCKETS];
    sqlite3_bind_int64(st, 1, id);
    sqlite3_bind_int64(st, 2, lo);
    sqlite3_bind_int64(st, 3, hi);
    sqlite3_bind_int64(st, 4, (int64_t)w);
    sqlite3_bind_int64(st, 5, nb - 1);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        json_t *p = json_pack("[o,o,o,o]", col_int(st, 0), col_real(st, 1), col_real(st, 2),
                              col_real(st, 3));
        if (aadd(points, p) != 0) {
            stmt_done(st);
            http_reply_oom(c);
            return -ENOMEM;
        }
    }
    if (rc != SQLITE_DONE) {
        http_reply_db_error(c, "points buckets", rc);
        stmt_done(st);
        return -EIO;
    }
    stmt_done(st);
    return 0;
}

int http_runs_points(struct ctx *c)
{
    int64_t id, from, to, limit, nb;
    bool has_limit, has_nb;
    if (http_parse_int64(c->cap[0], &id) != 0 || id < 1)
        return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                "series 'id' in the path must be an integer in 1..%" PRId64,
                                (int64_t)INT64_MAX);
    if (http_param_int(c, "from", 0, INT64_MAX, 0, &from, NULL) != 0 ||
        http_param_int(c, "to", 0, INT64_MAX, INT64_MAX, &to, NULL) != 0 ||
        http_param_int(c, "limit", 1, HTTP_MAX_LIMIT, HTTP_DEFAULT_LIMIT, &limit, &has_limit) !=
            0 ||
        http_param_int(c, "max_points", 1, HTTP_MAX_POINTS_BUCKETS, 0, &nb, &has_nb) != 0)
        return 0;
    if (from > to)
        return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                "parameter 'from' must not be greater than 'to'");
    if (has_limit && has_nb)
        return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                "parameters 'limit' and 'max_points' cannot be combined");

    sqlite3_stmt *st = c->dbc->st[STMT_SERIES_ONE];
    sqlite3_bind_int64(st, 1, id);
    int rc = sqlite3_step(st);
    if (rc != SQLITE_ROW) {
        if (rc == SQLITE_DONE)
            http_reply_error(c, MHD_HTTP_NOT_FOUND, "not_found", "unknown series %" PRId64, id);
        else
            http_reply_db_error(c, "series", rc);
        stmt_done(st);
        return 0;
    }
    json_t *series = series_json(st, col_text(st, SC_RUN_NAME));
    stmt_done(st);
    json_t *points = json_array();
    if (!series || !points) {
        json_decref(series);
        json_decref(points);
        return http_reply_oom(c);
    }

    json_t *next_from = NULL;
    int64_t width = 0;
    int e = has_nb ? points_buckets(c, id, from, to, nb, points, &width)
                   : points_page(c, id, from, to, limit, points, &next_from);
    if (e != 0) {
        json_decref(series);
        json_decref(points);
        return 0;
    }
    json_t *doc;
    if (has_nb)
        doc = json_pack("{s:o,s:o,s:n,s:b,s:I}", "series", series, "points", points, "next_from",
                        "downsampled", 1, "bucket_width", (json_int_t)width);
    else
        doc = json_pack("{s:o,s:o,s:o,s:b}", "series", series, "points", points, "next_from",
                        next_from, "downsampled", 0);
    /* json_pack's "o" steals its references even when it fails */
    return doc != NULL ? http_reply_set(c, MHD_HTTP_OK, doc) : http_reply_oom(c);
}

/* Position in incomplete's primary-key order: the last row of a page. The
 * cursor text is "step:layer:head:window:kind" (kind last: it is the only
 * text part, so it may hold any byte). */
struct incomplete_key {
    int64_t step, layer, head, window;
    char kind[HTTP_MAX_PARAM_LEN + 1];
};

static int incomplete_cursor_parse(const char *s, struct incomplete_key *k)
{
    char buf[HTTP_MAX_PARAM_LEN + 1];
    int64_t *nums[] = {&k->step, &k->layer, &k->head, &k->window};
    if (strlen(s) > HTTP_MAX_PARAM_LEN)
        return -EINVAL;
    snprintf(buf, sizeof buf, "%s", s);
    char *p = buf;
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) {
        char *colon = strchr(p, ':');
        if (!colon)
            return -EINVAL;
        *colon = '\0';
        if (http_parse_int64(p, nums[i]) != 0)
            return -EINVAL;
        p = colon + 1;
    }
    if (*p == '\0')
        return -EINVAL;
    snprintf(k->kind, sizeof k->kind, "%s", p);
    return 0;
}

int http_runs_incomplete(struct ctx *c)
{
    const char *name = c->cap[0];
    const char *after = http_param_get(c, "after");
    struct incomplete_key key;
    int64_t limit;
    if (http_param_limit(c, &limit) != 0)
        return 0;
    if (after && incomplete_cursor_parse(after, &key) != 0)
        return http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                "parameter 'after' must be a cursor returned as 'next' by an "
                                "earlier page");
    int64_t run_id;
    if (http_runs_id_by_name(c, name, &run_id) != 0)
        return 0;

    sqlite3_stmt *st = c->dbc->st[after ? STMT_INCOMPLETE_AFTER : STMT_INCOMPLETE_FIRST];
    sqlite3_bind_int64(st, 1, run_id);
    if (after) {
        sqlite3_bind_int64(st, 2, key.step);
        sqlite3_bind_text(st, 3, key.kind, -1, SQLITE_STATIC);
        sqlite3_bind_int64(st, 4, key.layer);
        sqlite3_bind_int64(st, 5, key.head);
        sqlite3_bind_int64(st, 6, key.window);
    }
    sqlite3_bind_int64(st, 7, limit + 1);

    json_t *items = json_array();
    if (!items) {
        stmt_done(st);
        return http_reply_oom(c);
    }
    /* cursor of the last row returned; built before the extra row is read */
    char cursor[HTTP_MAX_PARAM_LEN + 1] = "";
    int cursor_len = 0;
    int64_t n = 0;
    bool more = false;
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (n == limit) {
            more = true;
            break;
        }
        if (aadd(items, incomplete_json(st)) != 0) {
            stmt_done(st);
            json_decref(items);
            return http_reply_oom(c);
        }
        const unsigned char *kind = sqlite3_column_text(st, IC_KIND);
        cursor_len = snprintf(
            cursor, sizeof cursor, "%" PRId64 ":%" PRId64 ":%" PRId64 ":%" PRId64 ":%s",
            (int64_t)sqlite3_column_int64(st, IC_STEP), (int64_t)sqlite3_column_int64(st, IC_LAYER),
            (int64_t)sqlite3_column_int64(st, IC_HEAD),
            (int64_t)sqlite3_column_int64(st, IC_WINDOW), kind ? (const char *)kind : "");
        n++;
    }
    if (!more && rc != SQLITE_DONE) {
        http_reply_db_error(c, "incomplete", rc);
        stmt_done(st);
        json_decref(items);
        return 0;
    }
    stmt_done(st);
    if (more && (cursor_len < 0 || (size_t)cursor_len >= sizeof cursor)) {
        /* a kind too long to be passed back as a parameter: the writer
         * never stores one */
        json_decref(items);
        log_limited(&c->dbc->rl, LOG_LEVEL_ERROR, LOG_MOD,
                    "incomplete: a cursor would exceed %u bytes", HTTP_MAX_PARAM_LEN);
        return http_reply_error(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "internal",
                                "cannot build a cursor for this page");
    }
    json_t *doc = http_page_doc("incomplete", items, more ? jstr(cursor) : json_null());
    return doc != NULL ? http_reply_set(c, MHD_HTTP_OK, doc) : http_reply_oom(c);
}

/* --- the run lifecycle (store_runs.c): DELETE /api/v1/runs/{run}, POST .../end ----- */

/* http_write_done_fn of a STORE_ITEM_RUN; arg is its op, id the run's id
 * (the request's captures are gone by now). */
static int run_written(struct ctx *c, int rc, int64_t id, int64_t arg)
{
    switch (rc) {
    case 0:
        break;
    case -ENOENT:
        return http_reply_error(c, MHD_HTTP_NOT_FOUND, "not_found", "unknown run");
    case -ETIMEDOUT:
        return http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable",
                                "storage did not commit within %u s (it may still)",
                                HTTP_WRITE_WAIT_MS / 1000);
    case -ECANCELED:
        return http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable",
                                "the daemon is shutting down; nothing was written");
    default:
        return http_reply_error(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "internal",
                                "storage refused the write (details in the daemon log)");
    }
    json_t *doc = json_pack("{s:I, s:s}", "id", (json_int_t)id, "status",
                            arg == STORE_RUN_DELETE ? "deleting" : "ended");
    return doc ? http_reply_set(c, MHD_HTTP_OK, doc) : http_reply_oom(c);
}

static int run_op(struct ctx *c, enum store_run_op op)
{
    const char *name = c->cap[0];
    if (strlen(name) > FS_MAX_RUN_ID_LEN)
        return http_reply_error(c, MHD_HTTP_NOT_FOUND, "not_found", "unknown run '%s'", name);
    struct store_item *it = store_item_new(STORE_ITEM_RUN);
    if (!it)
        return http_reply_oom(c);
    it->run.op = op;
    /* Fits: its length was checked against FS_MAX_RUN_ID_LEN above. */
    size_t len = strlen(name);
    memcpy(it->run.run, name, len + 1);
    http_write_submit(c, it, run_written, op); /* sets the reply on failure */
    return 0;
}

int http_runs_delete(struct ctx *c)
{
    return run_op(c, STORE_RUN_DELETE);
}

int http_runs_end(struct ctx *c)
{
    return run_op(c, STORE_RUN_END);
}
