/* The store's queue and writer thread: bounded queue in, batched
 * transactions, results out after COMMIT; the public API. See store.h for
 * the contract and store_internal.h for the other files of the store. */
#include "store.h"
#include "fs_clock.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "foreshock.pb-c.h"
#include "fs_grow.h"
#include "fs_index.h"
#include "log.h"
#include "spool.h"
#include "store_internal.h"

/* Upper bounds of the commit latency histogram, seconds. Counters are
 * cumulative (Prometheus style): bucket i counts commits <= le[i], and
 * bucket STATS_COMMIT_BUCKETS counts all of them (+Inf). */
const double stats_commit_bucket_le[STATS_COMMIT_BUCKETS] = {0.0005, 0.001, 0.0025, 0.005, 0.01,
                                                             0.025,  0.05,  0.1,    0.5,   5.0};

/* Storage trouble that may pass (disk full, I/O, locks, memory): retry the
 * whole batch. Anything else is a problem with one item: refuse that item. */
static int transient(int rc)
{
    switch (rc & 0xff) {
    case SQLITE_CONSTRAINT:
    case SQLITE_MISMATCH:
    case SQLITE_TOOBIG:
    case SQLITE_RANGE:
    case SQLITE_ERROR:
        return 0;
    default:
        return 1;
    }
}

/* --- the writer thread ------------------------------------------------------------- */

static void rollback(struct store *s)
{
    if (!sqlite3_get_autocommit(s->db))
        exec1(s->st[ST_ROLLBACK], NULL, 0);
    /* Cached ids may name rows that no longer exist, and the batch's point
     * counts are void. */
    store_cache_clear(&s->cache);
    s->nwres = 0;
    s->w_outbox_max = 0;
    s->nw_done = 0;
    /* Records appended for the rolled-back reports must not stay in the
     * log (a retry appends them again). A failure here is logged; the next
     * attempt rewinds again before it appends. */
    int e = spool_rewind(s->spool, &s->committed);
    if (e < 0)
        log_limited(&s->rl_fail, LOG_LEVEL_ERROR, "store", "spool: cutting back a failed batch: %s",
                    strerror(-e));
}

/* Appends the frames of the batch's reports to the spool log before its
 * transaction begins (the frame goes to the log, not into the database;
 * the transaction records only where the log ends): a 59 MB frame can take
 * seconds to write on a busy disk, and between its pieces the spool calls
 * store_hello_interlude, which can commit queued Hellos only while no
 * transaction is open. SQLite rc; *bad names a report the spool refuses
 * (too large: that item's problem, refused, not retried). Writer thread. */
static int spool_batch(struct store *s, struct store_item **batch, size_t n,
                       const unsigned char *refused, long *bad)
{
    int rc = SQLITE_OK;
    s->w_spooling = batch;
    s->nw_spooling = n;
    for (size_t i = 0; i < n && rc == SQLITE_OK; i++) {
        struct store_report *rp = &batch[i]->report;
        if (batch[i]->kind == STORE_ITEM_REPORT)
            rp->spooled = 0;
        if (refused[i] || batch[i]->kind != STORE_ITEM_REPORT || !rp->sketch_body ||
            !rp->sketch_len)
            continue;
        struct spool_rec rec = {.run_id = rp->run_id,
                                .stream_id = rp->stream_id,
                                .rank = rp->rank,
                                .seq = rp->seq,
                                .step = rp->step,
                                .len = (uint32_t)rp->sketch_len};
        int e = rp->sketch_len > FS_SPOOL_MAX_RECORD_BYTES
                    ? -EINVAL
                    : spool_append(s->spool, &rec, rp->sketch_body);
        if (e == -EINVAL) {
            *bad = (long)i;
            rc = SQLITE_TOOBIG;
        } else if (e < 0) {
            rc = store_spool_failed(s, "appending a report", e);
        } else {
            struct spool_pos at = spool_last(s->spool);
            rp->spooled = 1;
            rp->spool_seg = at.seg;
            rp->spool_off = at.off;
        }
    }
    s->w_spooling = NULL;
    s->nw_spooling = 0;
    return rc;
}

/* One attempt at the batch in one transaction. Returns SQLITE_OK, or the
 * error with *bad set to the failing item's index (-1 for BEGIN/COMMIT). */
static int write_once(struct store *s, struct store_item **batch, size_t n,
                      const unsigned char *refused, struct batch_counts *bc, long *bad)
{
    *bad = -1;
    memset(bc, 0, sizeof(*bc));
    s->nwres = 0;
    s->w_outbox_max = 0;
    s->nw_done = 0;
    s->w_spool_err[0] = '\0';
    /* A spool deleted or replaced under the daemon stops every commit: an
     * ack would promise what the log no longer keeps. */
    int fe = spool_check(s->spool);
    if (fe < 0)
        return store_spool_failed(s, "checking the log", fe);
    struct spool_pos at = spool_head(s->spool);
    if (at.seg != s->committed.seg || at.off != s->committed.off) {
        int e = spool_rewind(s->spool, &s->committed);
        if (e < 0)
            return store_spool_failed(s, "cutting back a failed batch", e);
    }
    int rc = spool_batch(s, batch, n, refused, bad);
    if (rc != SQLITE_OK)
        return rc;
    rc = exec1(s->st[ST_BEGIN], NULL, 0);
    if (!ok(rc))
        return rc;
    double now = fs_clock_unix();
    for (size_t i = 0; i < n; i++) {
        if (refused[i])
            continue;
        rc = store_apply_item(s, batch[i], now, bc);
        if (rc != SQLITE_OK) {
            *bad = (long)i;
            return rc;
        }
    }
    if ((rc = store_series_flush(s)) != SQLITE_OK)
        return rc;
    /* Spooled frames are durable (by the database's own sync policy)
     * before the commit that acks their reports records where they end. */
    struct spool_pos head = spool_head(s->spool);
    if (head.seg != s->committed.seg || head.off != s->committed.off) {
        int e = spool_sync(s->spool);
        if (e < 0)
            return store_spool_failed(s, "syncing", e);
        sqlite3_stmt *st = s->st[ST_SPOOL_HEAD];
        sqlite3_bind_int64(st, 1, (int64_t)head.seg);
        sqlite3_bind_int64(st, 2, (int64_t)head.off);
        if (!ok(rc = exec1(st, NULL, 0)))
            return rc;
    }
    rc = exec1(s->st[ST_COMMIT], NULL, 0);
    if (!ok(rc))
        return rc;
    s->committed = head;
    return SQLITE_OK;
}

/* After COMMIT: the evaluated steps the batch recorded let the spool drop
 * what they cover. Writer thread. */
static void spool_after_commit(struct store *s)
{
    int oom = 0;
    for (size_t i = 0; i < s->nw_done; i++) {
        const struct spool_done_step *d = &s->w_done[i];
        if (d->lower)
            spool_lower_done(s->spool, d->run_id, d->step);
        else
            oom |= spool_set_done(s->spool, d->run_id, d->step) < 0;
    }
    s->nw_done = 0;
    if (oom) /* the segments stay until the next release that remembers them, or a restart */
        log_limited(&s->rl_fail, LOG_LEVEL_ERROR, "store",
                    "spool: out of memory noting evaluated steps; their records stay on disk");
    spool_release(s->spool, &s->committed);
}

/* failing: 0, or the SQLite primary result code the commits fail with. */
static void set_failing(struct store *s, int failing)
{
    atomic_store(&s->stats->storage_failing, failing);
    if (failing)
        atomic_store(&s->stats->ready, 0);
    else if (atomic_load(&s->serving))
        atomic_store(&s->stats->ready, 1);
}

/* Under mu: appends an announced result (not tied to the open transaction). */
int store_res_push(struct store *s, const struct store_result *r)
{
    struct store_result *p = fs_grow(s->res, &s->capres, s->nres + 1, sizeof(*p), 64);
    if (!p)
        return -ENOMEM;
    s->res = p;
    s->res[s->nres++] = *r;
    return 0;
}

/* While commits fail nothing can be written for a Hello (its Welcome names
 * a stream row), and a Hello queued behind the failing batch would wait as
 * long as the failure lasts: the trainer would get no answer at all. Every
 * Hello of the batch and of the queue is answered now with ERROR_INTERNAL
 * naming the failure; the trainer retries later, and the next Hello that
 * commits is the first to be welcomed again. Writer thread. */
static void refuse_hellos(struct store *s, struct store_item **batch, size_t n,
                          unsigned char *refused, int code)
{
    struct store_result r = {.kind = STORE_RESULT_HELLO,
                             .items = 1,
                             .error_code = FORESHOCK__ERROR_CODE__ERROR_INTERNAL};
    int fault = atomic_load(&s->stats->spool_fault);
    if (fault)
        snprintf(r.message, sizeof(r.message),
                 "storage is failing (the spool log was deleted or replaced under the daemon: "
                 "%s); nothing is acknowledged until foreshockd restarts",
                 spool_fault_name(fault));
    else
        snprintf(r.message, sizeof(r.message), "storage is failing (%s); retry later",
                 store_failure_text(code));
    struct store_item *gone = NULL;
    size_t answered = 0;
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < n; i++) {
        if (refused[i] || batch[i]->kind != STORE_ITEM_HELLO)
            continue;
        refused[i] = 1; /* freed with the batch */
        r.conn_id = batch[i]->conn_id;
        if (r.conn_id && store_res_push(s, &r) == 0)
            answered++;
    }
    for (struct store_item *prev = NULL, *it = s->head, *next; it && s->q_hellos; it = next) {
        next = it->next;
        if (it->kind != STORE_ITEM_HELLO) {
            prev = it;
            continue;
        }
        if (prev)
            prev->next = next;
        else
            s->head = next;
        if (s->tail == it)
            s->tail = prev;
        s->q_hellos--;
        s->q_items--;
        s->q_bytes -= it->bytes;
        s->settled++;
        r.conn_id = it->conn_id;
        if (r.conn_id && store_res_push(s, &r) == 0)
            answered++;
        it->next = gone;
        gone = it;
    }
    atomic_store(&s->stats->writer_queue_items, s->q_items);
    atomic_store(&s->stats->writer_queue_bytes, s->q_bytes);
    if (answered && s->notify)
        s->notify(s->notify_ctx);
    pthread_cond_broadcast(&s->done_cv);
    pthread_mutex_unlock(&s->mu);
    while (gone) {
        struct store_item *it = gone;
        gone = it->next;
        store_item_free(it);
    }
    if (answered)
        log_limited(&s->rl_hello, LOG_LEVEL_WARN, "store",
                    "storage is failing (%s): %zu Hello(s) answered with an error",
                    store_failure_text(code), answered);
}

/* Has the stop deadline (store_set_stop_deadline) passed? Any thread. */
static int past_stop_deadline(struct store *s)
{
    pthread_mutex_lock(&s->mu);
    double d = s->stop_deadline;
    pthread_mutex_unlock(&s->mu);
    return d > 0 && fs_clock_mono() >= d;
}

/* Stopping while the spool log is gone (spool_check): no retry can
 * succeed, so the batch is given up at once, whatever the deadline. */
static int stopping_without_spool(struct store *s)
{
    pthread_mutex_lock(&s->mu);
    int asked = s->stop_asked;
    pthread_mutex_unlock(&s->mu);
    return asked && spool_fault(s->spool);
}

/* Waits ms between attempts at a failing batch, answering Hellos queued
 * meanwhile (refuse_hellos) and returning early at the stop deadline (or
 * at the stop, when the spool log is gone). */
static void failing_wait(struct store *s, unsigned ms, struct store_item **batch, size_t n,
                         unsigned char *refused, int code)
{
    double until = fs_clock_mono() + ms / 1000.0;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        double end = s->stop_deadline > 0 && s->stop_deadline < until ? s->stop_deadline : until;
        double now = fs_clock_mono();
        if (now >= end || (s->stop_asked && spool_fault(s->spool)))
            break;
        if (s->q_hellos) {
            pthread_mutex_unlock(&s->mu);
            refuse_hellos(s, batch, n, refused, code);
            pthread_mutex_lock(&s->mu);
            continue;
        }
        struct timespec ts = fs_clock_mono_after(end - now);
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
    pthread_mutex_unlock(&s->mu);
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
    }
}

static void record_commit(struct store *s, double seconds)
{
    struct fs_stats *st = s->stats;
    atomic_fetch_add(&st->commits, 1);
    atomic_fetch_add(&st->commit_seconds_sum_us, (uint64_t)(seconds * 1e6));
    for (int i = 0; i < STATS_COMMIT_BUCKETS; i++)
        if (seconds <= stats_commit_bucket_le[i])
            atomic_fetch_add(&st->commit_seconds_bucket[i], 1);
    atomic_fetch_add(&st->commit_seconds_bucket[STATS_COMMIT_BUCKETS], 1);
}

/* Marks every item of the batch not yet refused as given up, with one
 * ERROR_SHUTTING_DOWN result per item that has a submitter (so that ingest
 * can close the connection instead of waiting for an Ack). Returns the
 * count. Writer thread. */
static size_t give_up(struct store *s, struct store_item **batch, size_t n, unsigned char *refused,
                      struct store_result **errs, size_t *nerrs, int code)
{
    size_t lost = 0;
    for (size_t i = 0; i < n; i++) {
        if (refused[i])
            continue;
        refused[i] = 1;
        lost++;
        struct store_item *it = batch[i];
        if (!it->conn_id)
            continue;
        struct store_result *e = realloc(*errs, (*nerrs + 1) * sizeof(*e));
        if (!e)
            continue; /* the connection closes at ingest's own stop anyway */
        *errs = e;
        e = &e[(*nerrs)++];
        memset(e, 0, sizeof(*e));
        e->kind = it->kind == STORE_ITEM_HELLO ? STORE_RESULT_HELLO : STORE_RESULT_ACK;
        e->conn_id = it->conn_id;
        e->items = 1;
        e->error_code = FORESHOCK__ERROR_CODE__ERROR_SHUTTING_DOWN;
        snprintf(e->message, sizeof(e->message),
                 "daemon is stopping and storage is failing (%s): not stored; resend later",
                 store_failure_text(code));
    }
    s->abandoned += lost;
    return lost;
}

/* Writes the batch until it commits: transient failures are retried with
 * backoff; an item that fails on its own (a constraint, a bug) is refused
 * together with the later items of its connection in this batch, whose
 * submitter gets one ERROR_INTERNAL result, and the rest is retried at once.
 * Acks never cover a refused item. */
static void write_batch(struct store *s, struct store_item **batch, size_t n,
                        struct batch_counts *bc)
{
    unsigned char *refused = s->refused;
    memset(refused, 0, n);
    unsigned backoff = FS_STORE_RETRY_MIN_MS;
    struct store_result *errs = NULL;
    size_t nerrs = 0;
    for (;;) {
        long bad;
        size_t left = 0;
        for (size_t i = 0; i < n; i++)
            left += !refused[i];
        if (!left) { /* every item answered already: a commit of nothing proves nothing */
            memset(bc, 0, sizeof(*bc));
            break;
        }
        double t0 = fs_clock_mono();
        int rc = write_once(s, batch, n, refused, bc, &bad);
        if (rc == SQLITE_OK) {
            record_commit(s, fs_clock_mono() - t0);
            spool_after_commit(s);
            if (atomic_load(&s->stats->storage_failing)) {
                log_info("store", "commits succeed again");
                set_failing(s, 0);
            }
            break;
        }
        char msg[192];
        snprintf(msg, sizeof(msg), "%s",
                 s->w_spool_err[0] ? s->w_spool_err : sqlite3_errmsg(s->db));
        atomic_fetch_add(&s->stats->commit_errors, 1);
        rollback(s);
        if (!transient(rc) && bad >= 0) {
            struct store_item *it = batch[bad];
            log_error("store", "refusing a %s item of conn %llu: %s",
                      it->kind == STORE_ITEM_HELLO       ? "hello"
                      : it->kind == STORE_ITEM_REPORT    ? "report"
                      : it->kind == STORE_ITEM_OUTBOX    ? "outbox"
                      : it->kind == STORE_ITEM_SILENCE   ? "silence"
                      : it->kind == STORE_ITEM_ADVICE    ? "advice"
                      : it->kind == STORE_ITEM_RW_CURSOR ? "remote-write cursor"
                                                         : "monitor",
                      (unsigned long long)it->conn_id, msg);
            struct store_result *e = realloc(errs, (nerrs + 1) * sizeof(*e));
            if (!e) { /* cannot tell the submitter: retry as if transient */
                sleep_ms(backoff);
                continue;
            }
            errs = e;
            e = &errs[nerrs++];
            memset(e, 0, sizeof(*e));
            e->kind = it->kind == STORE_ITEM_HELLO ? STORE_RESULT_HELLO : STORE_RESULT_ACK;
            e->conn_id = it->conn_id;
            e->error_code = FORESHOCK__ERROR_CODE__ERROR_INTERNAL;
            snprintf(e->message, sizeof(e->message), "storage refused the frame: %.130s", msg);
            for (size_t i = (size_t)bad; i < n; i++) {
                if (!refused[i] &&
                    (i == (size_t)bad || (it->conn_id && batch[i]->conn_id == it->conn_id))) {
                    refused[i] = 1;
                    e->items++;
                }
            }
            continue;
        }
        int code = rc & 0xff ? rc & 0xff : SQLITE_ERROR;
        set_failing(s, code);
        refuse_hellos(s, batch, n, refused, code);
        if (past_stop_deadline(s) || stopping_without_spool(s)) {
            /* Stopping, and the disk does not take the batch: give it up,
             * as a crash at this point would. Nothing of it was acked;
             * clients resend it to the next start. */
            size_t lost = give_up(s, batch, n, refused, &errs, &nerrs, code);
            log_error("store",
                      "stopping: commit failed (%s) past the shutdown deadline; %zu items not "
                      "written (none was acknowledged; clients resend them)",
                      msg, lost);
            break;
        }
        log_limited(&s->rl_fail, LOG_LEVEL_ERROR, "store",
                    "commit of %zu items failed (%s); retrying in %u ms, nothing is acked until "
                    "it succeeds",
                    n, msg, backoff);
        failing_wait(s, backoff, batch, n, refused, code);
        backoff = backoff * 2 > FS_STORE_RETRY_MAX_MS ? FS_STORE_RETRY_MAX_MS : backoff * 2;
    }
    for (size_t i = 0; i < nerrs; i++) {
        struct store_result *r = store_wres_add(s);
        if (r)
            *r = errs[i];
    }
    free(errs);
}

static void announce(struct store *s)
{
    if (s->nwres) {
        struct store_result *r = fs_grow(s->res, &s->capres, s->nres + s->nwres, sizeof(*r), 64);
        if (!r) {
            log_error("store", "out of memory announcing %zu results", s->nwres);
            s->nwres = 0;
            return;
        }
        s->res = r;
        memcpy(s->res + s->nres, s->wres, s->nwres * sizeof(*s->wres));
        s->nres += s->nwres;
        s->nwres = 0;
    }
}

uint64_t store_stream_key(const char *run, uint32_t attempt, uint32_t rank)
{
    uint32_t nums[2] = {attempt, rank};
    uint64_t x = fs_fnv1a(FS_FNV1A_BASIS, run, strlen(run));
    return fs_fnv1a(x, nums, sizeof(nums)) | 1;
}

/* take_hellos' filter of streams with reports queued ahead: one bit a
 * stream key (a false positive only keeps a Hello in its place). */
static void reported_mark(struct store *s, uint64_t key)
{
    uint64_t bit = key % STORE_HELLO_FILTER_BITS;
    s->w_reported[bit / 8] |= (uint8_t)(1u << (bit % 8));
}

static bool reported_has(const struct store *s, uint64_t key)
{
    uint64_t bit = key % STORE_HELLO_FILTER_BITS;
    return s->w_reported[bit / 8] & (1u << (bit % 8));
}

/* Moves the queued HELLO items that may go first into batch (see store.h:
 * not one whose stream has a REPORT queued ahead of it). Returns how many;
 * adds their bytes. The reports of ahead (a batch being written) count as
 * queued ahead. Writer thread, under mu. */
static size_t take_hellos(struct store *s, struct store_item *const *ahead, size_t nahead,
                          struct store_item **out, size_t max, uint64_t *bytes)
{
    size_t n = 0;
    memset(s->w_reported, 0, sizeof(s->w_reported));
    for (size_t i = 0; i < nahead; i++)
        if (ahead[i]->kind == STORE_ITEM_REPORT)
            reported_mark(s, ahead[i]->report.stream_key);
    struct store_item **pp = &s->head, *prev = NULL;
    while (*pp && n < max) {
        struct store_item *it = *pp;
        if (it->kind == STORE_ITEM_REPORT) {
            reported_mark(s, it->report.stream_key);
        } else if (it->kind == STORE_ITEM_HELLO && it->hello.stream_key) {
            if (!reported_has(s, it->hello.stream_key)) {
                *pp = it->next;
                if (s->tail == it)
                    s->tail = prev;
                it->next = NULL;
                *bytes += it->bytes;
                s->q_hellos--;
                out[n++] = it;
                continue;
            }
        }
        prev = it;
        pp = &it->next;
    }
    return n;
}

/* After a batch of n items (bytes) was written: its results go to the
 * submitters, the queue shrinks, RESUME once it drained. Writer thread. */
static void settle(struct store *s, size_t n, uint64_t bytes)
{
    pthread_mutex_lock(&s->mu);
    announce(s);
    s->q_items -= n;
    s->q_bytes -= bytes;
    s->spool_bytes = spool_bytes(s->spool);
    s->settled += n;
    atomic_store(&s->stats->writer_queue_items, s->q_items);
    atomic_store(&s->stats->writer_queue_bytes, s->q_bytes);
    atomic_store(&s->stats->spool_bytes, s->spool_bytes);
    if (s->refusing && s->q_items <= s->opts.queue_max_items / 2 &&
        s->q_bytes <= s->opts.queue_max_bytes / 2) {
        s->refusing = 0;
        struct store_result *r = store_wres_add(s);
        if (r) {
            r->kind = STORE_RESULT_RESUME;
            announce(s);
        }
    }
    if (s->nres && s->notify)
        s->notify(s->notify_ctx);
    /* Persist first, then announce: the pager sees committed rows only. */
    if (s->w_outbox_max > 0 && s->announce)
        s->announce(s->announce_ctx, s->w_outbox_max);
    pthread_cond_broadcast(&s->done_cv);
    pthread_mutex_unlock(&s->mu);
}

/* The spool's yield hook (spool_set_yield), between the pieces of a record
 * that spool_batch writes before its batch's transaction begins: queued
 * Hellos commit now, in a transaction of their own, instead of after the
 * batch (writing 59 MB frames to a busy disk took seconds; a new trainer
 * waited that long for its Welcome). Not a Hello whose stream has reports
 * in the batch or queued (take_hellos). The spool's uncommitted tail is
 * left alone: this transaction neither records nor cuts it. On failure the
 * Hellos go back to the head of the queue, for the usual path (retries,
 * refuse_hellos while storage fails), and no interlude runs again until
 * the next batch. Writer thread. */
void store_hello_interlude(void *ctx)
{
    struct store *s = ctx;
    struct store_item *h[FS_STORE_INTERLUDE_HELLOS];
    uint64_t bytes = 0;
    if (!s->w_spooling)
        return;
    pthread_mutex_lock(&s->mu);
    size_t n = s->q_hellos ? take_hellos(s, s->w_spooling, s->nw_spooling, h,
                                         FS_STORE_INTERLUDE_HELLOS, &bytes)
                           : 0;
    pthread_mutex_unlock(&s->mu);
    if (!n)
        return;
    double t0 = fs_clock_mono(), now = fs_clock_unix();
    struct batch_counts bc;
    memset(&bc, 0, sizeof(bc));
    int rc = exec1(s->st[ST_BEGIN], NULL, 0);
    for (size_t i = 0; i < n && ok(rc); i++)
        rc = store_apply_item(s, h[i], now, &bc);
    if (ok(rc))
        rc = exec1(s->st[ST_COMMIT], NULL, 0);
    if (!ok(rc)) {
        if (!sqlite3_get_autocommit(s->db))
            exec1(s->st[ST_ROLLBACK], NULL, 0);
        store_cache_clear(&s->cache);
        s->nwres = 0;
        s->w_spooling = NULL;
        pthread_mutex_lock(&s->mu);
        for (size_t i = n; i-- > 0;) {
            h[i]->next = s->head;
            s->head = h[i];
            if (!s->tail)
                s->tail = h[i];
        }
        s->q_hellos += n;
        pthread_mutex_unlock(&s->mu);
        return;
    }
    record_commit(s, fs_clock_mono() - t0);
    settle(s, n, bytes);
    for (size_t i = 0; i < n; i++)
        store_item_free(h[i]);
}

void *store_writer_main(void *arg)
{
    struct store *s = arg;
    uint64_t max = s->opts.batch_max_items;
    int prune = s->opts.outbox_retention_s > 0 || s->opts.silence_retention_s > 0;
    double next_prune = fs_clock_mono(); /* once at start, then every prune_interval_s */
    double next_runs = next_prune;       /* the run lifecycle (store_runs.c): always on */
    for (;;) {
        if (prune)
            store_prune_if_due(s, &next_prune);
        store_runs_if_due(s, &next_runs);
        pthread_mutex_lock(&s->mu);
        while (!s->head && !s->stopping) {
            double due = prune && next_prune < next_runs ? next_prune : next_runs;
            double wait = due - fs_clock_mono();
            if (wait <= 0)
                break;
            struct timespec ts = fs_clock_mono_after(wait);
            if (pthread_cond_timedwait(&s->cv, &s->mu, &ts) == ETIMEDOUT)
                break;
        }
        if (!s->head) {
            int stop = s->stopping;
            pthread_mutex_unlock(&s->mu);
            if (stop)
                break;
            continue; /* retention is due */
        }
        size_t n = 0;
        uint64_t bytes = 0;
        /* Hellos first, in a transaction of their own: a new trainer's
         * Welcome waits for at most the commit in progress, not for
         * everything queued ahead of it (with 59 MB reports that was many
         * seconds). Safe to reorder: a connection sends reports only after
         * its Welcome, and a Hello whose stream has reports queued keeps its
         * place (take_hellos). */
        if (s->q_hellos)
            n = take_hellos(s, NULL, 0, s->batch, max, &bytes);
        /* Otherwise the queue in order (a Hello at its head alone).
         * FS_STORE_BATCH_MAX_BYTES keeps each commit, and so the wait of a
         * Hello behind it, short whatever the frame sizes. */
        while (s->head && n < max &&
               (n == 0 ||
                (bytes < FS_STORE_BATCH_MAX_BYTES && s->batch[0]->kind != STORE_ITEM_HELLO))) {
            struct store_item *it = s->head;
            s->head = it->next;
            it->next = NULL;
            bytes += it->bytes;
            s->q_hellos -= it->kind == STORE_ITEM_HELLO;
            s->batch[n++] = it;
        }
        if (!s->head)
            s->tail = NULL;
        s->w_ntargets = s->n_pager_targets;
        memcpy(s->w_targets, s->pager_targets, sizeof(s->w_targets));
        s->w_advice_policy = s->advice_policy;
        pthread_mutex_unlock(&s->mu);

        if (s->cache.n > FS_STORE_SERIES_CACHE_MAX)
            store_cache_clear(&s->cache);
        struct batch_counts bc;
        write_batch(s, s->batch, n, &bc);
        store_silence_settle(s, s->batch, n);
        store_runs_settle(s, s->batch, n);
        atomic_fetch_add(&s->stats->reports_committed, bc.reports);
        atomic_fetch_add(&s->stats->reports_duplicate, bc.duplicates);
        atomic_fetch_add(&s->stats->points_committed, bc.points);

        settle(s, n, bytes);

        for (size_t i = 0; i < n; i++)
            store_item_free(s->batch[i]);
    }
    return NULL;
}

/* --- public API ---------------------------------------------------------------------- */

struct store_item *store_item_new(enum store_item_kind kind)
{
    struct store_item *it = calloc(1, sizeof(*it));
    if (it)
        it->kind = kind;
    return it;
}

void store_item_free(struct store_item *it)
{
    if (!it)
        return;
    if (it->kind == STORE_ITEM_HELLO) {
        free(it->hello.model_json);
        free(it->hello.local_ranks);
    } else if (it->kind == STORE_ITEM_REPORT) {
        free(it->report.weight_norm);
        free(it->report.update_ratio);
        free(it->report.sketch_alloc ? it->report.sketch_alloc : it->report.sketch_body);
    } else if (it->kind == STORE_ITEM_MONITOR) {
        struct store_monitor *m = &it->monitor;
        for (size_t i = 0; i < m->n_alerts; i++)
            free(m->alerts[i].evidence_json);
        free(m->points);
        free(m->states);
        free(m->blobs);
        free(m->alerts);
        free(m->incomplete);
    } else if (it->kind == STORE_ITEM_SILENCE) {
        /* never written (refused at submit, or shutdown): tell the waiter */
        if (it->silence.waiter) {
            store_waiter_settle(it->silence.waiter, -ECANCELED, 0);
            store_waiter_put(it->silence.waiter);
        }
        free(it->silence.matchers_json);
        free(it->silence.created_by);
        free(it->silence.comment);
    } else if (it->kind == STORE_ITEM_RUN && it->run.waiter) {
        store_waiter_settle(it->run.waiter, -ECANCELED, 0); /* a no-op once settled */
        store_waiter_put(it->run.waiter);
    }
    free(it);
}

static size_t item_bytes(const struct store_item *it)
{
    size_t b = sizeof(*it);
    if (it->kind == STORE_ITEM_HELLO && it->hello.model_json)
        b += strlen(it->hello.model_json) + 1;
    if (it->kind == STORE_ITEM_HELLO && it->hello.local_ranks)
        b += strlen(it->hello.local_ranks) + 1;
    if (it->kind == STORE_ITEM_REPORT)
        b += it->report.sketch_len +
             sizeof(float) * ((size_t)it->report.n_weight_norm + it->report.n_update_ratio);
    if (it->kind == STORE_ITEM_MONITOR) {
        const struct store_monitor *m = &it->monitor;
        b += m->n_points * sizeof(*m->points) + m->n_states * sizeof(*m->states) +
             m->n_alerts * sizeof(*m->alerts) + m->n_incomplete * sizeof(*m->incomplete);
        for (size_t i = 0; i < m->n_states; i++)
            b += m->states[i].len;
    }
    return b;
}

int store_submit(struct store *s, struct store_item *it)
{
    size_t b = item_bytes(it);
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        rc = -ESHUTDOWN;
        goto out;
    }
    /* A Hello is never refused: a new trainer must be answered while the
     * queue is full (ingest reads Hellos of paused connections too). It is
     * bounded: one per connection (max_connections), each at most
     * FS_MAX_HELLO_FRAME_BYTES on the wire. */
    if (it->kind == STORE_ITEM_REPORT) {
        /* An item larger than the byte bound still goes into an empty
         * queue: max_frame_bytes may exceed writer_queue_max_bytes. */
        int full = s->q_items >= s->opts.queue_max_items ||
                   (s->q_items > 0 && s->q_bytes + b > s->opts.queue_max_bytes);
        if (s->refusing || full) {
            s->refusing = 1;
            rc = -EAGAIN;
            goto out;
        }
    }
    it->bytes = b;
    it->next = NULL;
    if (s->tail)
        s->tail->next = it;
    else
        s->head = it;
    s->tail = it;
    s->q_items++;
    s->q_bytes += b;
    s->q_hellos += it->kind == STORE_ITEM_HELLO;
    s->submitted++;
    atomic_store(&s->stats->writer_queue_items, s->q_items);
    atomic_store(&s->stats->writer_queue_bytes, s->q_bytes);
    pthread_cond_signal(&s->cv);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

size_t store_take_results(struct store *s, struct store_result **out)
{
    pthread_mutex_lock(&s->mu);
    size_t n = s->nres;
    *out = n ? s->res : NULL;
    if (n) {
        s->res = NULL;
        s->nres = s->capres = 0;
    }
    pthread_mutex_unlock(&s->mu);
    return n;
}

void store_set_notify(struct store *s, void (*notify)(void *ctx), void *ctx)
{
    /* The writer calls notify under mu, so after this returns the old
     * callback is neither running nor going to run. */
    pthread_mutex_lock(&s->mu);
    s->notify = notify;
    s->notify_ctx = ctx;
    pthread_mutex_unlock(&s->mu);
}

void store_set_pager(struct store *s, const char *const *targets, size_t n,
                     void (*announce_fn)(void *ctx, int64_t max_id), void *ctx)
{
    pthread_mutex_lock(&s->mu);
    if (n > STATS_MAX_TARGETS)
        n = STATS_MAX_TARGETS;
    memset(s->pager_targets, 0, sizeof(s->pager_targets));
    for (size_t i = 0; i < n; i++)
        snprintf(s->pager_targets[i], sizeof(s->pager_targets[i]), "%s", targets[i]);
    s->n_pager_targets = n;
    s->announce = announce_fn;
    s->announce_ctx = ctx;
    pthread_mutex_unlock(&s->mu);
}

void store_set_advice(struct store *s, const struct advice_policy *p)
{
    pthread_mutex_lock(&s->mu);
    s->advice_policy = p;
    pthread_mutex_unlock(&s->mu);
}

void store_set_serving(struct store *s, int serving)
{
    atomic_store(&s->serving, serving);
}

void store_set_stop_deadline(struct store *s, double timeout_s)
{
    pthread_mutex_lock(&s->mu);
    s->stop_deadline = timeout_s > 0 ? fs_clock_mono() + timeout_s : 0;
    s->stop_asked = 1;
    pthread_cond_signal(&s->cv); /* a failing_wait ends at the deadline */
    pthread_mutex_unlock(&s->mu);
}

const char *store_failure_text(int code)
{
    return sqlite3_errstr(code);
}

void store_flush(struct store *s)
{
    pthread_mutex_lock(&s->mu);
    uint64_t target = s->submitted;
    while (s->settled < target)
        pthread_cond_wait(&s->done_cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

uint64_t store_spool_bytes(struct store *s)
{
    pthread_mutex_lock(&s->mu);
    uint64_t b = s->spool_bytes;
    pthread_mutex_unlock(&s->mu);
    return b;
}
