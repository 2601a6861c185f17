/* The pager thread: outbox -> route -> silences -> libcurl -> outcome
 * through the writer. See pager.h for the contract and pager_internal.h
 * for the other files of the pager. */
#include "pager.h"
#include "detect.h"
#include "fs_clock.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "pager_internal.h"
#include "silence_set.h"

/* xorshift64*: jitter only. */
static double rand01(struct pager *p)
{
    uint64_t x = p->rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    p->rng = x;
    return (double)((x * 0x2545F4914F6CDD1Dull) >> 11) * 0x1.0p-53;
}

static struct fs_target_stats *tstats(struct pager *p, int target)
{
    return target >= 0 && target < STATS_MAX_TARGETS ? &p->stats->targets[target] : NULL;
}

/* --- delivery --------------------------------------------------------------------------------- */

static const char *kind_name(const struct page_alert *a)
{
    return a->kind == PAGE_RESOLVE ? "resolve" : "trigger";
}

static void finish(struct pager *p, struct prow *r, int state, int status, const char *err)
{
    pager_record(p, r, state, status, err);
    r->done = 1;
}

/* One attempt at row r (due, pending). */
static void attempt(struct pager *p, struct prow *r)
{
    const struct pager_target_cfg *t = &p->cfg.t[r->target];
    struct fs_target_stats *ts = tstats(p, r->target);
    long status = 0;
    char err[PAGE_ERROR_MAX];
    enum page_verdict v = pager_send_page(p, t, &r->a, &status, err, sizeof(err));
    double now = fs_clock_unix();
    /* Cut short by pager_stop: not a failure of the target; the row stays
     * as it is in the outbox for the next start. */
    if (v != PAGE_DELIVERED && atomic_load(&p->stopping))
        return;
    if (v == PAGE_DELIVERED) {
        atomic_fetch_add(&ts->sent, 1);
        if (r->attempts)
            log_info("pager",
                     "target %s: %s of %s (run %s, alert %lld) delivered after %u failed "
                     "attempts",
                     t->name, kind_name(&r->a), r->a.rule, r->a.run, (long long)r->a.alert_id,
                     r->attempts);
        finish(p, r, STORE_OUTBOX_DELIVERED, (int)status, NULL);
        if (r->a.kind == PAGE_TRIGGER)
            pager_open_add(p, &r->a, r->target, fs_clock_mono() + t->resend_interval);
        else {
            struct popen *o = pager_open_find(p, r->a.alert_id, r->target);
            if (o)
                pager_open_remove(p, o);
        }
        return;
    }
    r->attempts++;
    if (v == PAGE_RETRY && now - r->created_at < t->give_up_after) {
        atomic_fetch_add(&ts->failed, 1);
        double wait = page_backoff(t->backoff_initial, t->backoff_max, r->attempts, rand01(p));
        r->next_at = now + wait;
        p->down[r->target] = 1;
        p->down_until[r->target] = r->next_at;
        if (!r->logged) {
            r->logged = 1;
            log_limited(&p->rl_fail, LOG_LEVEL_WARN, "pager",
                        "target %s: %s of %s (run %s, alert %lld) failed: %s; retrying with "
                        "backoff (next in %.1f s)",
                        t->name, kind_name(&r->a), r->a.rule, r->a.run, (long long)r->a.alert_id,
                        err, wait);
        }
        pager_record(p, r, STORE_OUTBOX_PENDING, (int)status, err);
        return;
    }
    atomic_fetch_add(&ts->dropped, 1);
    log_limited(&p->rl_giveup, LOG_LEVEL_ERROR, "pager",
                "target %s: giving up the %s of %s (run %s, alert %lld) after %u attempts: %s",
                t->name, kind_name(&r->a), r->a.rule, r->a.run, (long long)r->a.alert_id,
                r->attempts, v == PAGE_GIVE_UP ? err : "too old (give_up_after)");
    char why[PAGE_ERROR_MAX + 32];
    snprintf(why, sizeof(why), "%s%s", v == PAGE_GIVE_UP ? "" : "give_up_after passed: ", err);
    finish(p, r, STORE_OUTBOX_GIVEN_UP, (int)status, why);
    /* A given-up trigger still gets its resolve (harmless, and the receiver
     * may have seen it after all); a given-up resolve closes the incident. */
    if (r->a.kind == PAGE_TRIGGER)
        pager_open_add(p, &r->a, r->target, INFINITY);
    else {
        struct popen *o = pager_open_find(p, r->a.alert_id, r->target);
        if (o)
            pager_open_remove(p, o);
    }
}

/* The earliest undone row before r of the same alert and target, or NULL. */
static struct prow *blocker(struct pager *p, const struct prow *r)
{
    for (struct prow *x = p->rows; x < r; x++)
        if (!x->done && x->target == r->target && x->a.alert_id == r->a.alert_id)
            return x;
    return NULL;
}

static void handle(struct pager *p, struct prow *r, double now)
{
    if (r->target < 0) {
        finish(p, r, STORE_OUTBOX_GIVEN_UP, 0, "target no longer configured");
        return;
    }
    struct prow *b = blocker(p, r);
    r->blocked = b != NULL;
    if (b) {
        /* A resolve behind a trigger held by a silence: the incident ended
         * silenced, so nothing of it is sent. */
        if (b->state == STORE_OUTBOX_SILENCED && b->a.kind == PAGE_TRIGGER &&
            r->a.kind == PAGE_RESOLVE) {
            finish(p, b, STORE_OUTBOX_SKIPPED, 0, "resolved while silenced");
            finish(p, r, STORE_OUTBOX_SKIPPED, 0, "resolved while silenced");
        }
        return; /* wait for it */
    }
    const struct pager_target_cfg *t = &p->cfg.t[r->target];
    /* Retry times are unix time (they outlive the process): one further
     * ahead than any backoff means the clock stepped back (or the row came
     * from elsewhere); wait no longer than backoff_max for it. */
    if (r->next_at > now + t->backoff_max)
        r->next_at = now + t->backoff_max;
    if (r->state == STORE_OUTBOX_SILENCED || r->next_at > now)
        return;
    if (p->down[r->target]) { /* failed a moment ago: not an attempt, no record */
        r->next_at = p->down_until[r->target];
        return;
    }
    if (!page_route_matches(&p->routes[r->target], &r->a)) {
        finish(p, r, STORE_OUTBOX_SKIPPED, 0, "not routed to this target (min_severity, match)");
        return;
    }
    if (r->a.kind == PAGE_TRIGGER) {
        /* A silence committed before the transition always holds its
         * trigger: read them afresh (triggers are rare; one query a pass). */
        if (!p->sil_fresh) {
            pager_load_silences(p, now);
            p->sil_fresh = 1;
        }
        if (!p->sil_ok) { /* cannot tell whether a silence holds it: later */
            r->next_at = now + PAGER_SILENCE_RELOAD_S;
            return;
        }
        if (pager_silenced(p, &r->a, now)) {
            r->state = STORE_OUTBOX_SILENCED;
            atomic_fetch_add(&tstats(p, r->target)->silenced, 1);
            log_info("pager",
                     "target %s: trigger of %s (run %s, alert %lld) silenced; held "
                     "until the silence ends",
                     t->name, r->a.rule, r->a.run, (long long)r->a.alert_id);
            pager_record(p, r, STORE_OUTBOX_SILENCED, 0, "silenced");
            return;
        }
    } else if (!pager_open_find(p, r->a.alert_id, r->target)) {
        finish(p, r, STORE_OUTBOX_SKIPPED, 0, "its trigger was not sent to this target");
        return;
    }
    attempt(p, r);
}

/* Held triggers whose silence ended: sent if the alert still fires in
 * that incident, else closed. */
static void release_held(struct pager *p, double now)
{
    for (size_t i = 0; i < p->nrows; i++) {
        struct prow *r = &p->rows[i];
        if (r->done || r->state != STORE_OUTBOX_SILENCED || pager_silenced(p, &r->a, now))
            continue;
        int f = pager_still_firing(p, r->a.alert_id, r->event_id);
        if (f < 0)
            continue;
        if (f) {
            log_info("pager",
                     "target %s: silence over, sending the trigger of %s (run %s, "
                     "alert %lld)",
                     p->cfg.t[r->target].name, r->a.rule, r->a.run, (long long)r->a.alert_id);
            r->state = STORE_OUTBOX_PENDING;
            r->next_at = now;
        } else if (!blocker(p, r)) {
            finish(p, r, STORE_OUTBOX_SKIPPED, 0, "resolved while silenced");
        }
    }
}

/* Alertmanager re-sends of open incidents; now is monotonic, wall the
 * unix time (silences). */
static void resend_due(struct pager *p, double now, double wall)
{
    for (size_t i = 0; i < p->nopen && !atomic_load(&p->stopping); i++) {
        struct popen *o = &p->open[i];
        const struct pager_target_cfg *t = &p->cfg.t[o->target];
        if (t->type != PAGER_ALERTMANAGER || o->resolving || o->next_resend > now)
            continue;
        o->next_resend = now + t->resend_interval;
        if (p->down[o->target])
            continue; /* failed during this pass: one timeout per pass is enough */
        if (!p->sil_ok)
            continue; /* silences unreadable: send nothing they might hold */
        if (pager_silenced(p, &o->a, wall)) {
            if (!o->silenced)
                atomic_fetch_add(&tstats(p, o->target)->silenced, 1);
            o->silenced = 1;
            continue;
        }
        o->silenced = 0;
        long status;
        char err[PAGE_ERROR_MAX];
        if (pager_send_page(p, t, &o->a, &status, err, sizeof(err)) == PAGE_DELIVERED) {
            atomic_fetch_add(&tstats(p, o->target)->sent, 1);
            o->failing = 0;
            continue;
        }
        if (atomic_load(&p->stopping))
            break;
        p->down[o->target] = 1;
        atomic_fetch_add(&tstats(p, o->target)->failed, 1);
        if (!o->failing)
            log_limited(&p->rl_resend, LOG_LEVEL_WARN, "pager",
                        "target %s: re-send of %s (run %s, alert %lld) failed: %s; next in %g s",
                        t->name, o->a.rule, o->a.run, (long long)o->a.alert_id, err,
                        t->resend_interval);
        o->failing = 1;
    }
}

static void compact(struct pager *p)
{
    size_t j = 0;
    for (size_t i = 0; i < p->nrows; i++) {
        if (!p->rows[i].done)
            p->rows[j++] = p->rows[i];
        else if (p->rows[i].target >= 0)
            p->count[p->rows[i].target]--;
    }
    p->nrows = j;
    atomic_store(&p->stats->outbox_pending, (uint64_t)p->nrows);
}

/* Seconds until the next timer: a retry (unix time), a re-send
 * (monotonic) or a silence reload. */
static double next_wait(struct pager *p)
{
    double now = fs_clock_unix(), mono = fs_clock_mono(), w = PAGER_SILENCE_RELOAD_S;
    for (size_t i = 0; i < p->nrows; i++)
        if (p->rows[i].state == STORE_OUTBOX_PENDING && !p->rows[i].blocked &&
            p->rows[i].next_at - now < w)
            w = p->rows[i].next_at - now;
    for (size_t i = 0; i < p->nopen; i++)
        if (!p->open[i].resolving && p->cfg.t[p->open[i].target].type == PAGER_ALERTMANAGER &&
            p->open[i].next_resend - mono < w)
            w = p->open[i].next_resend - mono;
    return w;
}

static void *pager_main(void *arg)
{
    struct pager *p = arg;
    pager_close_unconfigured(p);
    pager_load_open(p);
    int64_t seen = -1;
    while (!atomic_load(&p->stopping)) {
        pthread_mutex_lock(&p->mu);
        int64_t ann = p->announced;
        pthread_mutex_unlock(&p->mu);
        if (ann != seen || p->load_error || pager_more_to_load(p)) {
            seen = ann;
            pager_load_rows(p);
        }
        double now = fs_clock_unix();
        p->sil_fresh = 0;
        memset(p->down, 0, sizeof(p->down));
        if (fs_clock_mono() >= p->sil_next) {
            pager_load_silences(p, now);
            p->sil_next = fs_clock_mono() + PAGER_SILENCE_RELOAD_S;
            if (p->sil_ok)
                release_held(p, now);
        }
        for (size_t i = 0; i < p->nrows && !atomic_load(&p->stopping); i++)
            if (!p->rows[i].done)
                handle(p, &p->rows[i], fs_clock_unix());
        resend_due(p, fs_clock_mono(), fs_clock_unix());
        compact(p);
        if (pager_more_to_load(p))
            continue;
        double wait = next_wait(p);
        if (wait <= 0)
            continue;
        struct timespec ts = fs_clock_mono_after(wait);
        pthread_mutex_lock(&p->mu);
        while (!atomic_load(&p->stopping) && p->announced == seen &&
               pthread_cond_timedwait(&p->cv, &p->mu, &ts) == 0) {
        }
        pthread_mutex_unlock(&p->mu);
    }
    return NULL;
}

/* --- lifecycle -------------------------------------------------------------------------------- */

void pager_announce(void *ctx, int64_t max_id)
{
    struct pager *p = ctx;
    pthread_mutex_lock(&p->mu);
    if (max_id > p->announced)
        p->announced = max_id;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void pager_free(struct pager *p)
{
    for (size_t i = 0; i < p->cfg.n; i++)
        silence_free(&p->routes[i].match);
    silence_set_unref(p->sils);
    free(p->rows);
    free(p->open);
    if (p->curl)
        curl_easy_cleanup(p->curl);
    if (p->curl_global)
        curl_global_cleanup();
    sqlite3_close(p->db);
    free(p);
}

int pager_start(const struct pager_opts *opts, struct pager **out, struct fs_err *err)
{
    *out = NULL;
    if (opts->cfg->n == 0)
        return 0;
    struct pager *p = calloc(1, sizeof(*p));
    if (!p)
        return fs_err_set(err, -ENOMEM, "out of memory");
    int rc = -ENOMEM, mu = 0, cv = 0;
    p->cfg = *opts->cfg;
    snprintf(p->public_url, sizeof(p->public_url), "%s", opts->public_url);
    p->store = opts->store;
    p->stats = opts->stats;
    p->rng = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull ^ (uint64_t)getpid() ^ 1;
    p->quota = PAGER_MAX_ROWS / p->cfg.n;
    p->rows = calloc(PAGER_MAX_ROWS, sizeof(*p->rows));
    if (!p->rows) {
        fs_err_set(err, rc, "out of memory");
        goto fail;
    }
    for (size_t i = 0; i < p->cfg.n; i++) {
        p->routes[i].min_critical = p->cfg.t[i].min_severity == DETECT_SEVERITY_CRITICAL;
        struct fs_err why = {0};
        if (page_parse_match(p->cfg.t[i].match, &p->routes[i].match, &why) < 0) {
            rc = fs_err_set(err, -EINVAL, "target %s: %s", p->cfg.t[i].name, why.msg);
            goto fail;
        }
    }
    if ((rc = store_open_readonly(opts->db_path, &p->db, err)) < 0)
        goto fail;
    rc = -EIO;
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        fs_err_set(err, rc, "cannot initialise libcurl");
        goto fail;
    }
    p->curl_global = 1;
    if (!(p->curl = curl_easy_init())) {
        fs_err_set(err, rc, "cannot create a libcurl handle");
        goto fail;
    }
    pthread_condattr_t ca;
    rc = -ENOMEM;
    if (pthread_condattr_init(&ca) != 0) {
        fs_err_set(err, rc, "cannot create the pager's locks");
        goto fail;
    }
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    mu = pthread_mutex_init(&p->mu, NULL) == 0;
    cv = mu && pthread_cond_init(&p->cv, &ca) == 0;
    pthread_condattr_destroy(&ca);
    if (!cv) {
        fs_err_set(err, rc, "cannot create the pager's locks");
        goto fail;
    }
    const char *names[STATS_MAX_TARGETS];
    for (size_t i = 0; i < p->cfg.n; i++)
        names[i] = p->cfg.t[i].name;
    /* Announcements start now; rows committed before are found by the
     * thread's first load (its watermark starts at 0). */
    store_set_pager(p->store, names, p->cfg.n, pager_announce, p);
    if (pthread_create(&p->thread, NULL, pager_main, p) != 0) {
        store_set_pager(p->store, names, p->cfg.n, NULL, NULL);
        rc = fs_err_set(err, -EAGAIN, "cannot start the pager thread");
        goto fail;
    }
    p->started = 1;
    log_info("pager", "%zu targets; public_url %s", p->cfg.n, p->public_url);
    *out = p;
    return 0;
fail:
    if (cv)
        pthread_cond_destroy(&p->cv);
    if (mu)
        pthread_mutex_destroy(&p->mu);
    pager_free(p);
    return rc;
}

void pager_stop(struct pager *p)
{
    if (!p)
        return;
    /* No more announcements into a pager that is going away. */
    const char *names[STATS_MAX_TARGETS];
    for (size_t i = 0; i < p->cfg.n; i++)
        names[i] = p->cfg.t[i].name;
    store_set_pager(p->store, names, p->cfg.n, NULL, NULL);
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stopping, 1);
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    if (p->started)
        pthread_join(p->thread, NULL);
    log_info("pager", "stopped; %zu deliveries wait in the outbox for the next start", p->nrows);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    pager_free(p);
}
