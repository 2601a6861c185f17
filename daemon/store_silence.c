/* Silences (STORE_ITEM_SILENCE): the HTTP API's writes, applied by the
 * writer, and the reference-counted waiters the HTTP threads block on for
 * the committed outcome. See store.h. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "fs_clock.h"
#include "log.h"
#include "store_internal.h"

/* --- silences (STORE_ITEM_SILENCE) ---------------------------------------------------
 * The HTTP API's writes. The outcome is kept in the item and published to
 * its waiter by store_silence_settle() once the batch has committed, so an
 * answer never reflects a rolled-back attempt. */
static const char *const sil_sql[SIL_COUNT] = {
    [SIL_INSERT] = "INSERT INTO silences (matchers_json, starts_at, ends_at, created_by, "
                   "comment, created_at, updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6) "
                   "RETURNING id",
    /* a pending silence expires with starts_at = ends_at = now */
    [SIL_EXPIRE] = "UPDATE silences SET starts_at = MIN(starts_at, ?2), ends_at = ?2, "
                   "updated_at = ?2 WHERE id = ?1 AND ends_at > ?2",
    [SIL_EXISTS] = "SELECT 1 FROM silences WHERE id = ?1",
    /* what the pager loads (PAGER_MAX_SILENCES): active or future */
    [SIL_LIVE] = "SELECT count(*) FROM silences WHERE ends_at > ?1",
};
_Static_assert(SIL_COUNT == sizeof(((struct store *)0)->sil_st) / sizeof(sqlite3_stmt *),
               "one prepared statement slot per silence statement");

struct store_waiter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    int done;
    int status;
    int64_t id;
};

static sqlite3_stmt *sil_stmt(struct store *s, int which)
{
    if (!s->sil_st[which] &&
        sqlite3_prepare_v3(s->db, sil_sql[which], -1, SQLITE_PREPARE_PERSISTENT, &s->sil_st[which],
                           NULL) != SQLITE_OK)
        return NULL;
    return s->sil_st[which];
}

int store_apply_silence(struct store *s, struct store_item *it, double now)
{
    struct store_silence *q = &it->silence;
    int64_t cols[1] = {0};
    int rc;
    sqlite3_stmt *st = sil_stmt(s, q->op == STORE_SILENCE_INSERT ? SIL_INSERT : SIL_EXPIRE);
    if (!st)
        return sqlite3_errcode(s->db) != SQLITE_OK ? sqlite3_errcode(s->db) : SQLITE_ERROR;
    if (q->op == STORE_SILENCE_INSERT) {
        /* The pager matches at most FS_STORE_MAX_LIVE_SILENCES: one more
         * would be stored and listed but hold nothing. Refuse it. */
        sqlite3_stmt *live = sil_stmt(s, SIL_LIVE);
        int64_t n = 0;
        if (!live)
            return sqlite3_errcode(s->db) != SQLITE_OK ? sqlite3_errcode(s->db) : SQLITE_ERROR;
        sqlite3_bind_double(live, 1, now);
        if ((rc = exec1(live, &n, 1)) != SQLITE_ROW)
            return ok(rc) ? SQLITE_ERROR : rc;
        if (q->ends_at > now && n >= (int64_t)FS_STORE_MAX_LIVE_SILENCES) {
            log_limited(&s->rl_fail, LOG_LEVEL_WARN, "store",
                        "refusing a silence: %lld are active or pending (at most %u)", (long long)n,
                        FS_STORE_MAX_LIVE_SILENCES);
            q->status = -ENOSPC;
            q->out_id = 0;
            return SQLITE_OK;
        }
        sqlite3_bind_text(st, 1, q->matchers_json ? q->matchers_json : "", -1, SQLITE_STATIC);
        sqlite3_bind_double(st, 2, q->starts_at);
        sqlite3_bind_double(st, 3, q->ends_at);
        sqlite3_bind_text(st, 4, q->created_by ? q->created_by : "", -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 5, q->comment ? q->comment : "", -1, SQLITE_STATIC);
        sqlite3_bind_double(st, 6, now);
        if ((rc = exec1(st, cols, 1)) != SQLITE_ROW)
            return ok(rc) ? SQLITE_ERROR : rc;
        q->status = 0;
        q->out_id = cols[0];
        return SQLITE_OK;
    }
    sqlite3_bind_int64(st, 1, q->id);
    sqlite3_bind_double(st, 2, now);
    if (!ok(rc = exec1(st, NULL, 0)))
        return rc;
    q->out_id = q->id;
    if (sqlite3_changes(s->db) == 1) {
        q->status = 0;
        return SQLITE_OK;
    }
    if (!(st = sil_stmt(s, SIL_EXISTS)))
        return SQLITE_ERROR;
    sqlite3_bind_int64(st, 1, q->id);
    rc = exec1(st, NULL, 0);
    if (!ok(rc))
        return rc;
    q->status = rc == SQLITE_ROW ? -EALREADY : -ENOENT;
    return SQLITE_OK;
}

void store_waiter_settle(struct store_waiter *w, int status, int64_t id)
{
    pthread_mutex_lock(&w->mu);
    if (!w->done) {
        w->done = 1;
        w->status = status;
        w->id = id;
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
}

/* After write_batch: the batch is committed, or refused[i] is set. */
void store_silence_settle(struct store *s, struct store_item **batch, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        struct store_item *it = batch[i];
        if (it->kind == STORE_ITEM_SILENCE && it->silence.waiter)
            store_waiter_settle(it->silence.waiter, s->refused[i] ? -EIO : it->silence.status,
                                it->silence.out_id);
    }
}

struct store_waiter *store_waiter_new(void)
{
    struct store_waiter *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    pthread_condattr_t ca;
    int ok_attr = pthread_condattr_init(&ca) == 0;
    if (ok_attr)
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (!ok_attr || pthread_mutex_init(&w->mu, NULL) != 0) {
        if (ok_attr)
            pthread_condattr_destroy(&ca);
        free(w);
        return NULL;
    }
    if (pthread_cond_init(&w->cv, &ca) != 0) {
        pthread_condattr_destroy(&ca);
        pthread_mutex_destroy(&w->mu);
        free(w);
        return NULL;
    }
    pthread_condattr_destroy(&ca);
    w->refs = 1;
    return w;
}

struct store_waiter *store_waiter_ref(struct store_waiter *w)
{
    pthread_mutex_lock(&w->mu);
    w->refs++;
    pthread_mutex_unlock(&w->mu);
    return w;
}

void store_waiter_put(struct store_waiter *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    int last = --w->refs == 0;
    pthread_mutex_unlock(&w->mu);
    if (last) {
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
        free(w);
    }
}

int store_waiter_wait(struct store_waiter *w, unsigned timeout_ms, int64_t *id)
{
    struct timespec dl = fs_clock_mono_after(timeout_ms / 1000.0);
    pthread_mutex_lock(&w->mu);
    while (!w->done)
        if (pthread_cond_timedwait(&w->cv, &w->mu, &dl) == ETIMEDOUT)
            break;
    int rc = w->done ? w->status : -ETIMEDOUT;
    if (w->done && id)
        *id = w->id;
    pthread_mutex_unlock(&w->mu);
    return rc;
}
