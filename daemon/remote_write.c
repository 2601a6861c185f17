/* Remote write: the sender thread. Reads what follows its cursors on its own
 * read-only connection, sends it, and hands the cursor to the writer after
 * a 2xx. See remote_write.h for what is sent and what is guaranteed. */
#include "remote_write.h"

#include <curl/curl.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fs_clock.h"
#include "log.h"
#include "store.h"
#include "store_rw.h"
#include "store_stmt.h"

#define RW_SPAN_START 16u      /* steps per batch at first; adapts to batch_samples */
#define RW_ERROR_BODY_MAX 256u /* bytes of a refusal's body that are logged */

#define RW_ALERT_FIRING 2 /* alerts.state / alert_events.to_state (alert.h) */

struct rw_cursor {
    int64_t run_id;
    int64_t step;
};

struct rw_sender {
    struct remote_write *all;
    struct rw_target cfg;
    char db_path[FS_CONFIG_MAX_PATH];
    struct store *store;
    struct fs_stats *stats;
    sqlite3 *db;
    sqlite3_stmt *st[RW_Q__COUNT];
    CURL *curl;
    struct curl_slist *headers;
    char token[RW_TOKEN_MAX];
    char password[RW_AUTH_MAX];
    struct rw_batch *batch;
    size_t ncur, capcur;
    struct rw_cursor *cur;
    int64_t alert_cursor;
    uint64_t span;
    char err_body[RW_ERROR_BODY_MAX];
    size_t err_len;
    pthread_t thread;
    int started;
    struct fs_rw_stats *ts; /* this target's slot in the daemon's stats */
};

struct remote_write {
    int curl_global; /* curl_global_init succeeded: cleanup owed */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_int stopping;
    struct fs_stats *stats;
    size_t n;
    struct rw_sender *s[RW_MAX_TARGETS];
};

/* --- small helpers ----------------------------------------------------------------------- */

static void set_stat(atomic_uint_fast64_t *a, uint64_t v)
{
    atomic_store_explicit(a, v, memory_order_relaxed);
}

static void add_stat(atomic_uint_fast64_t *a, uint64_t v)
{
    atomic_fetch_add_explicit(a, v, memory_order_relaxed);
}

/* Sleeps ms or until stopping; returns stopping. */
static int nap(struct rw_sender *rw, unsigned ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&rw->all->mu);
    while (!atomic_load(&rw->all->stopping))
        if (pthread_cond_timedwait(&rw->all->cv, &rw->all->mu, &ts) == ETIMEDOUT)
            break;
    pthread_mutex_unlock(&rw->all->mu);
    return atomic_load(&rw->all->stopping);
}

static int read_secret(const char *path, char *out, size_t len, struct fs_err *err)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return fs_err_set(err, -EIO, "remote_write: cannot read %s: %s", path, strerror(errno));
    size_t n = fread(out, 1, len - 1, f);
    int big = n == len - 1 && fgetc(f) != EOF;
    fclose(f);
    if (big)
        return fs_err_set(err, -EINVAL, "remote_write: %s: over %zu bytes", path, len - 1);
    out[n] = '\0';
    while (n > 0 && (out[n - 1] == '\n' || out[n - 1] == '\r' || out[n - 1] == ' '))
        out[--n] = '\0';
    if (n == 0)
        return fs_err_set(err, -EINVAL, "remote_write: %s is empty", path);
    return 0;
}

static int64_t *cursor_of(struct rw_sender *rw, int64_t run_id)
{
    for (size_t i = 0; i < rw->ncur; i++)
        if (rw->cur[i].run_id == run_id)
            return &rw->cur[i].step;
    if (rw->ncur == rw->capcur) {
        size_t cap = rw->capcur ? rw->capcur * 2 : 16;
        struct rw_cursor *c = realloc(rw->cur, cap * sizeof(*c));
        if (!c)
            return NULL;
        rw->cur = c;
        rw->capcur = cap;
    }
    rw->cur[rw->ncur] = (struct rw_cursor){.run_id = run_id, .step = -1};
    return &rw->cur[rw->ncur++].step;
}

/* Hands the writer a cursor position (kind 0: run_id's step; 1: alert event id). */
static void submit_cursor(struct rw_sender *rw, int kind, int64_t run_id, int64_t pos)
{
    struct store_item *it = store_item_new(STORE_ITEM_RW_CURSOR);
    if (!it) {
        log_warn("remote_write", "out of memory: the cursor is committed with the next batch");
        return;
    }
    snprintf(it->rw_cursor.target, sizeof(it->rw_cursor.target), "%s", rw->cfg.name);
    it->rw_cursor.kind = kind;
    it->rw_cursor.run_id = run_id;
    it->rw_cursor.pos = pos;
    if (store_submit(rw->store, it) < 0)
        store_item_free(it); /* shutting down: the batch is resent after the restart */
}

/* --- reading ------------------------------------------------------------------------------ */

static int db_open(struct rw_sender *rw, struct fs_err *err)
{
    if (store_open_readonly(rw->db_path, &rw->db, err) < 0)
        return -EIO;
    if (store_rw_prepare(rw->db, rw->st) != SQLITE_OK)
        return fs_err_set(err, -EIO, "remote_write: prepare: %s", sqlite3_errmsg(rw->db));
    sqlite3_stmt *q = rw->st[RW_Q_CURSORS];
    sqlite3_bind_text(q, 1, rw->cfg.name, -1, SQLITE_TRANSIENT);
    int rc;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        int64_t run = sqlite3_column_int64(q, 1), pos = sqlite3_column_int64(q, 2);
        if (sqlite3_column_int(q, 0) == 1) {
            rw->alert_cursor = pos;
        } else {
            int64_t *c = cursor_of(rw, run);
            if (!c) {
                sqlite3_reset(q);
                return fs_err_set(err, -ENOMEM, "remote_write: out of memory");
            }
            *c = pos;
        }
    }
    sqlite3_reset(q);
    if (rc != SQLITE_DONE)
        return fs_err_set(err, -EIO, "remote_write: reading cursors: %s", sqlite3_errmsg(rw->db));
    return 0;
}

static int64_t one_int(sqlite3_stmt *q, int64_t dflt)
{
    int64_t v = dflt;
    if (sqlite3_step(q) == SQLITE_ROW && sqlite3_column_type(q, 0) != SQLITE_NULL)
        v = sqlite3_column_int64(q, 0);
    sqlite3_reset(q);
    return v;
}

/* The settled step of a run (remote_write.h). */
static int64_t settled_step(struct rw_sender *rw, int64_t run_id, int64_t last_step)
{
    sqlite3_stmt *q = rw->st[RW_Q_LIVE_MIN];
    sqlite3_bind_int64(q, 1, run_id);
    sqlite3_bind_double(q, 2, fs_clock_unix());
    sqlite3_bind_double(q, 3, RW_LIVE_S);
    sqlite3_bind_double(q, 4, RW_LIVE_INTERVALS);
    int64_t live = one_int(q, INT64_MAX);
    int64_t h = live < last_step ? live : last_step;
    q = rw->st[RW_Q_SPOOL_MIN];
    sqlite3_bind_int64(q, 1, run_id);
    int64_t spooled = one_int(q, INT64_MAX);
    if (spooled != INT64_MAX && spooled - 1 < h)
        h = spooled - 1;
    return h;
}

struct rw_labels {
    size_t n;
    struct rw_label l[RW_JOB_LABELS_MAX + 12];
};

static void put(struct rw_labels *ls, const char *name, const char *value)
{
    struct rw_label *l = &ls->l[ls->n++];
    snprintf(l->name, sizeof(l->name), "%s", name);
    snprintf(l->value, sizeof(l->value), "%s", value);
}

static void put_int(struct rw_labels *ls, const char *name, int64_t v)
{
    char buf[24];
    snprintf(buf, sizeof(buf), "%lld", (long long)v);
    put(ls, name, buf);
}

/* The labels every series of a run carries: run, attempt, the job's. */
static void base_labels(struct rw_sender *rw, struct rw_labels *ls, const char *metric,
                        const char *run, sqlite3_stmt *q, int attempt_col)
{
    ls->n = 0;
    put(ls, "__name__", metric);
    put(ls, "run", run);
    put_int(ls, "attempt",
            sqlite3_column_type(q, attempt_col) == SQLITE_NULL
                ? 0
                : sqlite3_column_int64(q, attempt_col));
    for (size_t i = 0; i < rw->cfg.n_job_labels; i++)
        put(ls, rw->cfg.job_labels[i].name, rw->cfg.job_labels[i].value);
}

static int64_t ms_of(double t)
{
    return (int64_t)llround(t * 1000.0);
}

/* Adds the points of run's steps (lo, hi] to the batch. 0 or -errno. */
static int read_points(struct rw_sender *rw, int64_t run_id, const char *run, int64_t lo,
                       int64_t hi)
{
    static const int which[2] = {RW_Q_POINTS, RW_Q_HEADS};
    for (int w = 0; w < 2; w++) {
        if (which[w] == RW_Q_HEADS && !rw->cfg.per_head)
            continue;
        sqlite3_stmt *q = rw->st[which[w]];
        sqlite3_bind_int64(q, 1, run_id);
        sqlite3_bind_int64(q, 2, lo);
        sqlite3_bind_int64(q, 3, hi);
        int rc;
        while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
            const char *name = (const char *)sqlite3_column_text(q, 0);
            int64_t layer = sqlite3_column_int64(q, 1), window = sqlite3_column_int64(q, 2);
            struct rw_labels ls;
            char metric[RW_LABEL_VALUE_MAX];
            int err = 0;
            if (rw_metric_name(name, "", metric, sizeof(metric)) == 0) {
                int heads = which[w] == RW_Q_HEADS;
                base_labels(rw, &ls, metric, run, q, 7);
                if (layer >= 0)
                    put_int(&ls, "layer", layer);
                if (window > 0)
                    put_int(&ls, "window", window);
                if (heads)
                    put_int(&ls, "head", sqlite3_column_int64(q, 3));
                else if (sqlite3_column_int64(q, 3) >= 0)
                    put_int(&ls, "rank", sqlite3_column_int64(q, 3));
                err = rw_batch_add(rw->batch, ls.l, ls.n, ms_of(sqlite3_column_double(q, 6)),
                                   sqlite3_column_double(q, 5));
            }
            if (err < 0) {
                sqlite3_reset(q);
                return err;
            }
        }
        sqlite3_reset(q);
        if (rc != SQLITE_DONE) {
            log_warn("remote_write", "reading points of run %s: %s", run, sqlite3_errmsg(rw->db));
            return -EIO;
        }
    }
    return 0;
}

/* Adds up to batch_samples alert events after the cursor; *last: the last id read. */
static int read_alerts(struct rw_sender *rw, int64_t *last)
{
    sqlite3_stmt *q = rw->st[RW_Q_ALERTS];
    sqlite3_bind_int64(q, 1, rw->alert_cursor);
    sqlite3_bind_int64(q, 2, (int64_t)rw->cfg.batch_samples);
    int rc, err = 0;
    *last = rw->alert_cursor;
    while (!err && (rc = sqlite3_step(q)) == SQLITE_ROW) {
        struct rw_labels ls;
        ls.n = 0;
        put(&ls, "__name__", "foreshock_alert");
        put(&ls, "alertname", (const char *)sqlite3_column_text(q, 3));
        put(&ls, "severity", (const char *)sqlite3_column_text(q, 4));
        put(&ls, "family", (const char *)sqlite3_column_text(q, 5));
        put(&ls, "run", (const char *)sqlite3_column_text(q, 10));
        put_int(&ls, "attempt",
                sqlite3_column_type(q, 11) == SQLITE_NULL ? 0 : sqlite3_column_int64(q, 11));
        if (sqlite3_column_int64(q, 6) >= 0)
            put_int(&ls, "layer", sqlite3_column_int64(q, 6));
        if (sqlite3_column_int64(q, 7) >= 0)
            put_int(&ls, "head", sqlite3_column_int64(q, 7));
        if (sqlite3_column_int64(q, 8) > 0)
            put_int(&ls, "window", sqlite3_column_int64(q, 8));
        if (sqlite3_column_int64(q, 9) >= 0)
            put_int(&ls, "rank", sqlite3_column_int64(q, 9));
        for (size_t i = 0; i < rw->cfg.n_job_labels; i++)
            put(&ls, rw->cfg.job_labels[i].name, rw->cfg.job_labels[i].value);
        double v = sqlite3_column_int(q, 1) == RW_ALERT_FIRING ? 1.0 : 0.0;
        err = rw_batch_add(rw->batch, ls.l, ls.n, ms_of(sqlite3_column_double(q, 2)), v);
        *last = sqlite3_column_int64(q, 0);
    }
    sqlite3_reset(q);
    return err ? err : (rc == SQLITE_DONE || rc == SQLITE_ROW) ? 0 : -EIO;
}

/* --- sending ------------------------------------------------------------------------------- */

static size_t on_body(char *p, size_t size, size_t n, void *ctx)
{
    struct rw_sender *rw = ctx;
    size_t len = size * n, room = sizeof(rw->err_body) - 1 - rw->err_len;
    size_t take = len < room ? len : room;
    memcpy(rw->err_body + rw->err_len, p, take);
    rw->err_len += take;
    rw->err_body[rw->err_len] = '\0';
    return len;
}

static int on_progress(void *ctx, curl_off_t a, curl_off_t b, curl_off_t c, curl_off_t d)
{
    struct rw_sender *rw = ctx;
    return atomic_load(&rw->all->stopping) ? 1 : 0;
}

static int curl_setup(struct rw_sender *rw, struct fs_err *err)
{
    const struct rw_target *c = &rw->cfg;
    if (c->bearer_token_file[0] &&
        read_secret(c->bearer_token_file, rw->token, sizeof(rw->token), err) < 0)
        return -EINVAL;
    if (c->basic_password_file[0] &&
        read_secret(c->basic_password_file, rw->password, sizeof(rw->password), err) < 0)
        return -EINVAL;
    rw->curl = curl_easy_init();
    if (!rw->curl)
        return fs_err_set(err, -ENOMEM, "remote_write: curl_easy_init failed");
    const char *hdrs[] = {"Content-Encoding: snappy", "Content-Type: application/x-protobuf",
                          "X-Prometheus-Remote-Write-Version: 0.1.0",
                          "User-Agent: foreshockd/" FORESHOCK_VERSION};
    for (size_t i = 0; i < sizeof(hdrs) / sizeof(hdrs[0]); i++) {
        struct curl_slist *h = curl_slist_append(rw->headers, hdrs[i]);
        if (!h)
            return fs_err_set(err, -ENOMEM, "remote_write: out of memory");
        rw->headers = h;
    }
    if (c->tenant[0]) {
        char line[RW_AUTH_MAX + 32];
        snprintf(line, sizeof(line), "X-Scope-OrgID: %s", c->tenant);
        struct curl_slist *h = curl_slist_append(rw->headers, line);
        if (!h)
            return fs_err_set(err, -ENOMEM, "remote_write: out of memory");
        rw->headers = h;
    }
    if (rw->token[0]) {
        char line[RW_TOKEN_MAX + 32];
        snprintf(line, sizeof(line), "Authorization: Bearer %s", rw->token);
        struct curl_slist *h = curl_slist_append(rw->headers, line);
        if (!h)
            return fs_err_set(err, -ENOMEM, "remote_write: out of memory");
        rw->headers = h;
    }
    CURL *k = rw->curl;
    curl_easy_setopt(k, CURLOPT_URL, c->url);
    curl_easy_setopt(k, CURLOPT_HTTPHEADER, rw->headers);
    curl_easy_setopt(k, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(k, CURLOPT_TIMEOUT_MS, (long)(c->timeout_s * 1000));
    curl_easy_setopt(k, CURLOPT_CONNECTTIMEOUT_MS, (long)(c->timeout_s * 1000));
    curl_easy_setopt(k, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(k, CURLOPT_WRITEDATA, rw);
    curl_easy_setopt(k, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(k, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(k, CURLOPT_XFERINFODATA, rw);
    curl_easy_setopt(k, CURLOPT_PROTOCOLS_STR, "http,https");
    if (c->basic_user[0]) {
        curl_easy_setopt(k, CURLOPT_HTTPAUTH, CURLAUTH_BASIC);
        curl_easy_setopt(k, CURLOPT_USERNAME, c->basic_user);
        curl_easy_setopt(k, CURLOPT_PASSWORD, rw->password);
    }
    if (c->tls_ca[0])
        curl_easy_setopt(k, CURLOPT_CAINFO, c->tls_ca);
    if (c->tls_cert[0]) {
        curl_easy_setopt(k, CURLOPT_SSLCERT, c->tls_cert);
        curl_easy_setopt(k, CURLOPT_SSLKEY, c->tls_key);
    }
    return 0;
}

/* Sends the batch until a receiver settles it. Returns RW_SENT, RW_REJECTED,
 * or -ECANCELED when stopping. */
static int send_batch(struct rw_sender *rw)
{
    uint8_t *body = NULL;
    size_t len = 0;
    if (rw_batch_encode(rw->batch, &body, &len) < 0) {
        log_error("remote_write", "out of memory encoding %zu samples",
                  rw_batch_samples(rw->batch));
        nap(rw, RW_BACKOFF_MAX_MS);
        return -ECANCELED;
    }
    unsigned backoff = RW_BACKOFF_MIN_MS;
    int out = -ECANCELED;
    curl_easy_setopt(rw->curl, CURLOPT_POSTFIELDS, (const char *)body);
    curl_easy_setopt(rw->curl, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
    while (!atomic_load(&rw->all->stopping)) {
        rw->err_len = 0;
        rw->err_body[0] = '\0';
        CURLcode cc = curl_easy_perform(rw->curl);
        long status = 0;
        if (cc == CURLE_OK)
            curl_easy_getinfo(rw->curl, CURLINFO_RESPONSE_CODE, &status);
        enum rw_outcome o = rw_classify(cc == CURLE_OK ? status : 0);
        if (o == RW_SENT) {
            out = RW_SENT;
            break;
        }
        if (o == RW_REJECTED) {
            log_error("remote_write", "[%s] %s refused %zu samples with HTTP %ld (not retried): %s",
                      rw->cfg.name, rw->cfg.url, rw_batch_samples(rw->batch), status, rw->err_body);
            out = RW_REJECTED;
            break;
        }
        if (atomic_load(&rw->all->stopping))
            break;
        add_stat(&rw->ts->retries, 1);
        if (cc != CURLE_OK)
            log_warn("remote_write", "[%s] %s: %s; retrying in %u ms", rw->cfg.name, rw->cfg.url,
                     curl_easy_strerror(cc), backoff);
        else
            log_warn("remote_write", "[%s] %s: HTTP %ld; retrying in %u ms", rw->cfg.name,
                     rw->cfg.url, status, backoff);
        if (nap(rw, backoff))
            break;
        backoff = backoff * 2 > RW_BACKOFF_MAX_MS ? RW_BACKOFF_MAX_MS : backoff * 2;
    }
    free(body);
    return out;
}

/* Settles the batch just sent (or found empty) up to the given cursor. */
static int ship(struct rw_sender *rw, int kind, int64_t run_id, int64_t pos)
{
    size_t n = rw_batch_samples(rw->batch);
    if (n > 0) {
        int rc = send_batch(rw);
        if (rc < 0)
            return rc;
        if (rc == RW_SENT) {
            add_stat(&rw->ts->samples_sent, n);
            set_stat(&rw->ts->last_success, (uint64_t)fs_clock_unix());
        } else {
            add_stat(&rw->ts->samples_failed, n);
        }
    }
    submit_cursor(rw, kind, run_id, pos);
    return 0;
}

static int begin(struct rw_sender *rw)
{
    return store_rw_begin(rw->db) == SQLITE_OK ? 0 : -EIO;
}

static void end(struct rw_sender *rw)
{
    store_rw_end(rw->db);
}

/* One pass: a batch per run that has settled steps after its cursor, then a
 * batch of alert events. Returns the batches made, or -ECANCELED. */
static int pass(struct rw_sender *rw)
{
    struct work {
        int64_t id, last;
        char name[FS_MAX_RUN_ID_LEN + 1];
    } *runs = NULL;
    size_t nruns = 0, cap = 0;
    int made = 0;
    uint64_t pending = 0;
    if (begin(rw) < 0)
        return 0;
    sqlite3_stmt *q = rw->st[RW_Q_RUNS];
    while (sqlite3_step(q) == SQLITE_ROW) {
        if (nruns == cap) {
            cap = cap ? cap * 2 : 16;
            struct work *w = realloc(runs, cap * sizeof(*w));
            if (!w)
                break;
            runs = w;
        }
        runs[nruns].id = sqlite3_column_int64(q, 0);
        snprintf(runs[nruns].name, sizeof(runs[nruns].name), "%s", sqlite3_column_text(q, 1));
        runs[nruns].last = sqlite3_column_int64(q, 2);
        nruns++;
    }
    sqlite3_reset(q);
    int64_t alert_max = one_int(rw->st[RW_Q_ALERT_MAX], 0);
    end(rw);
    /* The lag as this pass begins (a receiver down holds the pass in its
     * first batch: the gauge must show it then). */
    for (size_t i = 0; i < nruns; i++) {
        int64_t *cur = cursor_of(rw, runs[i].id);
        if (cur && runs[i].last > *cur)
            pending += (uint64_t)(runs[i].last - *cur);
    }
    if (alert_max > rw->alert_cursor)
        pending += (uint64_t)(alert_max - rw->alert_cursor);
    set_stat(&rw->ts->pending, pending);
    for (size_t i = 0; i < nruns && !atomic_load(&rw->all->stopping); i++) {
        int64_t *cur = cursor_of(rw, runs[i].id);
        if (!cur)
            break;
        if (runs[i].last <= *cur)
            continue; /* all sent: no read for it */
        if (begin(rw) < 0)
            break;
        int64_t h = settled_step(rw, runs[i].id, runs[i].last);
        if (h <= *cur) {
            end(rw);
            continue;
        }
        int64_t hi = *cur + (int64_t)rw->span < h ? *cur + (int64_t)rw->span : h;
        rw_batch_clear(rw->batch);
        int rc = read_points(rw, runs[i].id, runs[i].name, *cur, hi);
        end(rw);
        if (rc < 0)
            break;
        size_t n = rw_batch_samples(rw->batch);
        if (n > rw->cfg.batch_samples && rw->span > 1)
            rw->span /= 2;
        else if (n * 2 < rw->cfg.batch_samples && rw->span < RW_MAX_STEP_SPAN)
            rw->span *= 2;
        if (ship(rw, 0, runs[i].id, hi) < 0) {
            free(runs);
            return -ECANCELED;
        }
        *cur = hi;
        made++;
    }
    free(runs);
    if (atomic_load(&rw->all->stopping))
        return -ECANCELED;
    rw_batch_clear(rw->batch);
    int64_t last = rw->alert_cursor;
    if (begin(rw) == 0) {
        int rc = read_alerts(rw, &last);
        end(rw);
        if (rc == 0 && last > rw->alert_cursor) {
            if (ship(rw, 1, 0, last) < 0)
                return -ECANCELED;
            rw->alert_cursor = last;
            made++;
        }
    }
    return made;
}

static void *sender_main(void *arg)
{
    struct rw_sender *rw = arg;
    while (!atomic_load(&rw->all->stopping)) {
        int made = pass(rw);
        if (made < 0)
            break;
        if (made == 0 && nap(rw, RW_IDLE_POLL_MS))
            break;
    }
    return NULL;
}

/* --- lifecycle ---------------------------------------------------------------------------- */

static void sender_free(struct rw_sender *rw)
{
    if (!rw)
        return;
    store_finalize_all(rw->st, RW_Q__COUNT);
    sqlite3_close(rw->db);
    if (rw->curl)
        curl_easy_cleanup(rw->curl);
    curl_slist_free_all(rw->headers);
    rw_batch_free(rw->batch);
    free(rw->cur);
    memset(rw->token, 0, sizeof(rw->token));
    memset(rw->password, 0, sizeof(rw->password));
    free(rw);
}

static int sender_new(struct remote_write *all, const struct rw_target *t, const char *db_path,
                      struct store *store, struct fs_rw_stats *st, struct rw_sender **out,
                      struct fs_err *err)
{
    struct rw_sender *rw = calloc(1, sizeof(*rw));
    *out = rw;
    if (!rw)
        return fs_err_set(err, -ENOMEM, "remote_write: out of memory");
    rw->all = all;
    rw->cfg = *t;
    snprintf(rw->db_path, sizeof(rw->db_path), "%s", db_path);
    rw->store = store;
    rw->stats = all->stats;
    rw->ts = st;
    snprintf(st->name, sizeof(st->name), "%s", t->name);
    rw->span = RW_SPAN_START;
    rw->batch = rw_batch_new();
    if (!rw->batch)
        return fs_err_set(err, -ENOMEM, "remote_write: out of memory");
    int rc = db_open(rw, err);
    if (rc == 0)
        rc = curl_setup(rw, err);
    return rc;
}

void remote_write_stop(struct remote_write *all)
{
    if (!all)
        return;
    pthread_mutex_lock(&all->mu);
    atomic_store(&all->stopping, 1);
    pthread_cond_broadcast(&all->cv);
    pthread_mutex_unlock(&all->mu);
    for (size_t i = 0; i < all->n; i++) {
        if (all->s[i] && all->s[i]->started)
            pthread_join(all->s[i]->thread, NULL);
        sender_free(all->s[i]);
    }
    if (all->curl_global) /* reference counted: the pager's use goes on */
        curl_global_cleanup();
    pthread_mutex_destroy(&all->mu);
    pthread_cond_destroy(&all->cv);
    free(all);
}

int remote_write_start(const struct rw_config *rc, const char *db_path, struct store *store,
                       struct fs_stats *stats, struct remote_write **out, struct fs_err *err)
{
    *out = NULL;
    if (rc->n == 0)
        return 0;
    struct remote_write *all = calloc(1, sizeof(*all));
    if (!all)
        return fs_err_set(err, -ENOMEM, "remote_write: out of memory");
    pthread_mutex_init(&all->mu, NULL);
    pthread_cond_init(&all->cv, NULL);
    all->stats = stats;
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        fs_err_set(err, -EIO, "remote_write: cannot initialise libcurl");
        goto fail;
    }
    all->curl_global = 1;
    stats->n_rw = (unsigned)rc->n; /* <= RW_MAX_TARGETS = STATS_MAX_RW_TARGETS */
    for (size_t i = 0; i < rc->n; i++) {
        all->n = i + 1;
        if (sender_new(all, &rc->t[i], db_path, store, &stats->rw[i], &all->s[i], err) < 0)
            goto fail;
    }
    for (size_t i = 0; i < all->n; i++) {
        struct rw_sender *rw = all->s[i];
        if (pthread_create(&rw->thread, NULL, sender_main, rw) != 0) {
            fs_err_set(err, -EAGAIN, "remote_write: cannot start a sender thread");
            goto fail;
        }
        rw->started = 1;
        log_info("remote_write", "[%s] sending to %s (alert cursor %lld, %zu run cursors)",
                 rw->cfg.name, rw->cfg.url, (long long)rw->alert_cursor, rw->ncur);
    }
    *out = all;
    return 0;
fail:
    remote_write_stop(all);
    return -EIO;
}
